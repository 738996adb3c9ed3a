//! Across hosts out of the box (issue 13): ranks in network namespaces of a test bed, started
//! with nothing but torchrun's variables and the secret, find the address their peers can
//! reach on their own (no `OXCCL_TCP_ADDR`), over IPv4 and IPv6, or where
//! `OXCCL_SOCKET_IFNAME` says; a peer that cannot be reached makes every rank fail within
//! seconds, naming it.
//!
//! Needs root (namespaces); prints `SKIPPED <name>: <reason>` elsewhere, and fails under
//! `CI=true`.

use std::process::Command;
use std::time::{Duration, Instant};

use oxccl_testbed::{HostSpec, Testbed};

mod common;
use common::{assert_exact, run_in_bed, run_in_bed_with, serial};

/// Every collective `oxccl perf` runs, 8 B to 64 MiB by factors of 2 (24 sizes), each result
/// checked, on 4 hosts with only `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
/// `MASTER_PORT` and `OXCCL_SECRET` set (the harness clears every other launcher and oxccl
/// variable).
#[test]
fn torchrun_variables_alone_run_every_collective_across_four_hosts() {
    let _serial = serial();
    let name = "torchrun_variables_alone_run_every_collective_across_four_hosts";
    if !oxccl_testbed::require(name, Testbed::available()) {
        return;
    }
    let tb = Testbed::new(&[HostSpec::unshaped(); 4]).expect("a test bed");
    let colls = [
        "all_reduce",
        "reduce_scatter",
        "all_gather",
        "broadcast",
        "reduce",
        "all_to_all",
        "gather",
        "scatter",
    ];
    for (i, coll) in colls.into_iter().enumerate() {
        let args = [
            "perf", coll, "-b", "8", "-e", "64M", "-f", "2", "-w", "0", "-i", "1", "-c", "1",
        ];
        let t = Instant::now();
        let outs = run_in_bed_with(&tb, &[0, 1, 2, 3], &args, &[], 29561 + i as u16, &|_, c| {
            c.env("LOCAL_RANK", "0");
        });
        assert_exact(coll, &outs, 24);
        println!(
            "{coll}: 24 sizes exact in {:.1} s",
            t.elapsed().as_secs_f64()
        );
    }
}

/// Lines `#   rank R: ADDR (IFACE: WHY)` of `oxccl topo`'s table, in rank order.
fn tcp_lines(topo_stdout: &str) -> Vec<String> {
    topo_stdout
        .lines()
        .filter(|l| l.starts_with("#   rank "))
        .map(str::to_owned)
        .collect()
}

/// Each rank says which address and interface it uses (`oxccl topo`): by default the one that
/// routes to the store; under `OXCCL_SOCKET_IFNAME`, the named interface; with an IPv6 store,
/// IPv6 addresses, and collectives run over them.
#[test]
fn each_rank_uses_the_interface_towards_the_store_ipv4_and_ipv6() {
    let _serial = serial();
    let name = "each_rank_uses_the_interface_towards_the_store_ipv4_and_ipv6";
    if !oxccl_testbed::require(name, Testbed::available()) {
        return;
    }
    let tb = Testbed::new(&[HostSpec::unshaped(); 3]).expect("a test bed");
    let topo = |env: &[(&str, &str)], port: u16| {
        let outs = run_in_bed(&tb, &[0, 1, 2], &["topo"], env, port);
        for (r, o) in outs.iter().enumerate() {
            assert!(
                o.status.success(),
                "rank {r}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        tcp_lines(&String::from_utf8_lossy(&outs[0].stdout))
    };
    let lines = topo(&[], 29571);
    assert_eq!(lines.len(), 3, "{lines:?}");
    for (r, l) in lines.iter().enumerate() {
        let want = format!("#   rank {r}: {}:", tb.host_addr(r));
        assert!(l.starts_with(&want), "{l}");
        assert!(l.ends_with("(eth0: routes to the store)"), "{l}");
    }
    let lines = topo(&[("OXCCL_SOCKET_IFNAME", "=eth0")], 29572);
    assert!(
        lines
            .iter()
            .all(|l| l.ends_with("(eth0: OXCCL_SOCKET_IFNAME==eth0)")),
        "{lines:?}"
    );
    // IPv6: give every host fd77::<i+1>/64 next to its IPv4 address (no duplicate-address
    // detection, so that it is usable at once) and put the store on host 0's IPv6 address.
    for h in 0..3 {
        let ns = tb.host_netns(h);
        let addr = format!("fd77::{}/64", h + 1);
        let out = Command::new("ip")
            .args([
                "-n", &ns, "-6", "addr", "add", &addr, "dev", "eth0", "nodad",
            ])
            .output()
            .expect("running ip");
        assert!(
            out.status.success(),
            "ip addr add {addr}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let v6 = [("MASTER_ADDR", "fd77::1")];
    let lines = topo(&v6, 29573);
    for (r, l) in lines.iter().enumerate() {
        let want = format!("#   rank {r}: [fd77::{}]:", r + 1);
        assert!(l.starts_with(&want), "{l}");
    }
    let args = [
        "perf",
        "all_reduce",
        "-b",
        "8",
        "-e",
        "4M",
        "-f",
        "64",
        "-w",
        "0",
        "-i",
        "1",
        "-c",
        "1",
    ];
    let outs = run_in_bed(&tb, &[0, 1, 2], &args, &v6, 29574);
    assert_exact("all_reduce over IPv6", &outs, 4);
}

/// One rank advertises an address nobody else can reach (its loopback, by
/// `OXCCL_SOCKET_IFNAME==lo`): every rank fails within seconds, not at the 30 s collective
/// timeout, naming it, its address and its interface. (The lower rank of a pair connects, so
/// rank 0 is the one that cannot reach rank 1; the others learn it from rank 0's notice.)
#[test]
fn an_unreachable_peer_fails_every_rank_within_seconds() {
    let _serial = serial();
    let name = "an_unreachable_peer_fails_every_rank_within_seconds";
    if !oxccl_testbed::require(name, Testbed::available()) {
        return;
    }
    let tb = Testbed::new(&[HostSpec::unshaped(); 4]).expect("a test bed");
    let t = Instant::now();
    let args = [
        "perf",
        "all_reduce",
        "-b",
        "8",
        "-e",
        "8",
        "-w",
        "0",
        "-i",
        "1",
    ];
    let outs = run_in_bed_with(&tb, &[0, 1, 2, 3], &args, &[], 29581, &|r, c| {
        if r == 1 {
            c.env("OXCCL_SOCKET_IFNAME", "=lo");
        }
    });
    let took = t.elapsed();
    assert!(took < Duration::from_secs(15), "the ranks took {took:?}");
    for (r, o) in outs.iter().enumerate() {
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "rank {r} succeeded: {err}");
        let want = if r == 0 {
            "rank 0 cannot reach rank 1: it listens on 127.0.0.1:"
        } else {
            "rank 0 failed: rank 0 cannot reach rank 1: it listens on 127.0.0.1:"
        };
        assert!(err.contains(want), "rank {r}: {err}");
        assert!(
            err.contains("127.0.0.1") && err.contains("(lo: "),
            "rank {r}: {err}"
        );
    }
    println!("{name}: every rank failed within {took:?}");
}
