//! Back-to-back all-reduces that print each call's time, for watching the communicator follow
//! the network: rank 0 can run a command between two calls (reshape a link), and the lines
//! show the calls slow down, the learned rates change, and the calls speed up again.
//!
//! ```text
//! follow_rates [--calls N] [--bytes B] [--at K -- COMMAND ARGS..]
//! ```
//!
//! Run it under a launcher (torchrun's variables, Slurm, mpirun, `oxccl run`) with
//! `OXCCL_SECRET` set. Rank 0 prints how long init took, then one line per call: `call`,
//! milliseconds, busbw (GB/s,
//! as nccl-tests counts it for an all-reduce), and the link rates the tuner holds after the
//! call; after call K it runs COMMAND (and waits for it) before call K+1. Every result is
//! checked against the sum it must be; a wrong element fails the run.

use std::time::Instant;

use oxccl::{Communicator, ReduceOp};

fn main() {
    if let Err(e) = run() {
        eprintln!("follow_rates: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let (mut calls, mut bytes, mut at, mut command) = (40usize, 16usize << 20, None, Vec::new());
    while let Some(a) = args.next() {
        let mut num = |what: &str| -> Result<usize, String> {
            args.next()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("{what} needs a number"))
        };
        match a.as_str() {
            "--calls" => calls = num("--calls")?,
            "--bytes" => bytes = num("--bytes")?,
            "--at" => at = Some(num("--at")?),
            "--" => {
                command = args.by_ref().collect();
                break;
            }
            _ => return Err(format!("unknown argument {a:?} (see the source's header)")),
        }
    }
    if at.is_some() == command.is_empty() {
        return Err("--at K and -- COMMAND go together".into());
    }
    let t_init = Instant::now();
    let comm = Communicator::from_env().map_err(|e| e.to_string())?;
    let init_ms = t_init.elapsed().as_secs_f64() * 1e3;
    let (rank, world) = (comm.rank(), comm.world_size());
    let count = bytes / 4;
    // Rank r contributes r + 1 + i % 7 to element i: the sum is exact in f32.
    let input: Vec<f32> = (0..count).map(|i| (rank + 1 + i % 7) as f32).collect();
    let want = |i: usize| (world * (world + 1) / 2 + world * (i % 7)) as f32;
    let mut out = vec![0f32; count];
    let factor = 2.0 * (world as f64 - 1.0) / world as f64;
    if rank == 0 {
        println!("# init: {init_ms:.0} ms (the link probe included)");
        println!("# call  time_ms  busbw_GBps  link_gbps");
    }
    for call in 1..=calls {
        comm.barrier().map_err(|e| e.to_string())?;
        let t0 = Instant::now();
        comm.all_reduce(&input, &mut out, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        let secs = t0.elapsed().as_secs_f64();
        if let Some(i) = (0..count).find(|&i| out[i] != want(i)) {
            return Err(format!(
                "rank {rank}, call {call}: element {i} is {}, not {}",
                out[i],
                want(i)
            ));
        }
        if rank == 0 {
            let rates: Vec<String> = comm
                .topology()
                .hosts
                .iter()
                .map(|h| h.link_gbps.map_or("?".into(), |r| format!("{r}")))
                .collect();
            println!(
                "{call:6} {:8.1} {:11.4}  {}",
                secs * 1e3,
                bytes as f64 / secs / 1e9 * factor,
                rates.join(",")
            );
            if at == Some(call) {
                let out = std::process::Command::new(&command[0])
                    .args(&command[1..])
                    .output()
                    .map_err(|e| format!("running {command:?}: {e}"))?;
                if !out.status.success() {
                    return Err(format!(
                        "{command:?} failed: {}",
                        String::from_utf8_lossy(&out.stderr)
                    ));
                }
                println!("# after call {call}: ran {}", command.join(" "));
            }
        }
    }
    comm.destroy().map_err(|e| e.to_string())
}
