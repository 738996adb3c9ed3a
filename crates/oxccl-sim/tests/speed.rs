//! Wall-clock figures of the issue's speed targets (run in release, one at a time):
//!
//! ```text
//! cargo test -p oxccl-sim --release --test speed -- --ignored --nocapture --test-threads 1
//! ```
//!
//! They use the example topologies when they parse, and fabrics built in code otherwise.

mod common;

use std::time::Instant;

use common::{Params, cluster};
use oxccl_core::schedule::{Algorithm, Collective};
use oxccl_sim::{Fabric, Spec, simulate};

fn fabric(file: &str, hosts: usize) -> Fabric {
    let path = format!(
        "{}/../../examples/topologies/{file}",
        env!("CARGO_MANIFEST_DIR")
    );
    match Fabric::from_file(&path) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("{path}: {e}; building in code");
            cluster(Params {
                hosts,
                per: 8,
                nic: 50e9,
                up: 900e9,
                lat: 1e-6,
                o: 2e-6,
                reduce: 200e9,
                core_reduce: None,
                symmetric: true,
            })
        }
    }
}

/// CPU seconds this process has used (user + system), from /proc (0 elsewhere): on a shared
/// machine, wall time alone overstates what the simulator needs.
fn cpu_s() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    // Fields 14 and 15 of the file (utime, stime), in clock ticks of 1/100 s.
    (tick(11) + tick(12)) / 100.0
}

fn run(f: &Fabric, algo: Algorithm, symmetry: bool) {
    let spec = Spec {
        algo: Some(algo),
        symmetry,
        ..Spec::new(Collective::AllReduce { count: 1 << 28 }, 4)
    };
    let (t, c) = (Instant::now(), cpu_s());
    let r = simulate(f, &spec).unwrap();
    let (wall, cpu) = (t.elapsed().as_secs_f64(), cpu_s() - c);
    println!(
        "{} ranks, 1 GiB all-reduce, {:?}: predicted {:.3} ms, wall {:.3} s, cpu {:.2} s ({} simulated ranks, symmetric {}, approximate {}, {} steps, {} flows)",
        f.world,
        r.algo,
        r.time_s * 1e3,
        wall,
        cpu,
        r.simulated_ranks,
        r.symmetric,
        r.approximate,
        r.steps,
        r.flows
    );
}

#[test]
#[ignore]
fn speed_1024_ranks() {
    let f = fabric("cluster-128x8.toml", 128);
    for algo in [Algorithm::Ring, Algorithm::Hierarchical] {
        run(&f, algo, true);
    }
}

#[test]
#[ignore]
fn speed_1024_ranks_without_symmetry() {
    let f = fabric("cluster-128x8.toml", 128);
    for algo in [Algorithm::Ring, Algorithm::Hierarchical] {
        run(&f, algo, false);
    }
}

#[test]
#[ignore]
fn speed_16k_ranks_ring() {
    run(&fabric("cluster-2048x8.toml", 2048), Algorithm::Ring, true);
}

#[test]
#[ignore]
fn speed_16k_ranks_hierarchical() {
    run(
        &fabric("cluster-2048x8.toml", 2048),
        Algorithm::Hierarchical,
        true,
    );
}
