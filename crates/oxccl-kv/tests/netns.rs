//! Two hosts (network namespaces on a bridge, links shaped to 1 Gbit/s with `tc tbf`): the
//! target in one, the initiator in the other, found peer to peer by the target's address; tcp
//! lanes carry batches both ways, checked byte for byte, encrypted (`OXCCL_ENCRYPT=auto`: the
//! lanes leave the host). Needs root; skips with the reason on a
//! developer's machine, fails under `CI=true` when it cannot run.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use oxccl_bootstrap::Secret;
use oxccl_kv::meta::P2pMetadata;
use oxccl_kv::*;
use oxccl_testbed::{HostSpec, Testbed};

const ROLE: &str = "OXCCL_KV_NETNS_ROLE";
const LEN: usize = 32 << 20;

fn secret() -> Secret {
    Secret::new("kv-netns-test-secret-7").unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(seed) ^ (i >> 12) as u8)
        .collect()
}

fn engine(addr: &str) -> TransferEngine {
    let mut c = EngineConfig::new(secret());
    c.protocol = Protocol::Tcp;
    c.local_addr = format!("{addr}:0").parse().unwrap();
    c.lanes = 2;
    c.timeout = Duration::from_secs(30);
    TransferEngine::new(c, Arc::new(P2pMetadata::new(secret()))).unwrap()
}

/// The children: `target ADDR` serves a buffer holding a pattern; `initiator SEGMENT BUF`
/// writes one pattern, reads the target's back, checks both, and prints the rate.
#[test]
fn child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let args: Vec<String> = role.split_whitespace().map(String::from).collect();
    match args[0].as_str() {
        "target" => {
            let e = engine(&args[1]);
            let buf = e.allocate_managed_buffer(2 * LEN).unwrap();
            e.write_local(buf + LEN as u64, &pattern(LEN, 7)).unwrap();
            println!("READY {} {buf}", e.name());
            // Serve until the initiator says it is done (a notification), at most a minute.
            let n = e.wait_notifies(Duration::from_secs(60));
            assert_eq!(n.len(), 1, "{n:?}");
            let mut got = vec![0; LEN];
            e.read_local(buf, &mut got).unwrap();
            assert!(
                got == pattern(LEN, 13),
                "the target holds other bytes than written"
            );
            println!("TARGET-OK");
        }
        "initiator" => {
            let e = engine(&args[1]);
            let buf: u64 = args[3].parse().unwrap();
            let local = e.allocate_managed_buffer(2 * LEN).unwrap();
            e.write_local(local, &pattern(LEN, 13)).unwrap();
            let seg = e.open_segment(&args[2]).unwrap();
            // OXCCL_ENCRYPT=auto (the default) on both hosts: lanes that leave the host are
            // encrypted, and both ends agreed (or the open was refused).
            assert!(e.config().encrypt == Encrypt::Auto);
            assert!(
                e.lanes_encrypted(seg).unwrap(),
                "auto left off-host lanes in clear"
            );
            let blocks = |op, from: u64| -> Vec<TransferRequest> {
                (0..(LEN >> 20) as u64)
                    .map(|k| TransferRequest {
                        opcode: op,
                        source: local + from + (k << 20),
                        target_id: seg,
                        target_offset: buf + from + (k << 20),
                        length: 1 << 20,
                    })
                    .collect()
            };
            let t = Instant::now();
            e.transfer_sync(&blocks(Opcode::Read, LEN as u64), None)
                .unwrap();
            let read = t.elapsed();
            let mut got = vec![0; LEN];
            e.read_local(local + LEN as u64, &mut got).unwrap();
            assert!(got == pattern(LEN, 7), "READ brought other bytes");
            let t = Instant::now();
            e.transfer_sync(&blocks(Opcode::Write, 0), Some(b"done"))
                .unwrap();
            let write = t.elapsed();
            let gbit = |d: Duration| LEN as f64 * 8.0 / d.as_secs_f64() / 1e9;
            println!(
                "INITIATOR-OK read {:.3} Gbit/s write {:.3} Gbit/s",
                gbit(read),
                gbit(write)
            );
        }
        r => panic!("unknown role {r}"),
    }
}

#[test]
fn two_hosts_over_a_shaped_link_tcp_netns() {
    let name = "two_hosts_over_a_shaped_link_tcp_netns";
    if std::env::var(ROLE).is_ok() || !oxccl_testbed::require(name, Testbed::available()) {
        return;
    }
    let tb = Testbed::new(&[HostSpec::mbit(1000), HostSpec::mbit(1000)]).expect("the test bed");
    let exe = std::env::current_exe().unwrap();
    let args = ["--exact", "child", "--nocapture", "--test-threads=1"];
    let a0 = tb.host_addr(0).to_string();
    let a1 = tb.host_addr(1).to_string();
    let mut target = tb
        .command(0, &exe)
        .args(args)
        .env(ROLE, format!("target {a0}"))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(target.stdout.take().unwrap());
    let mut line = String::new();
    let (seg, buf) = loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the target exited early"
        );
        if let Some(rest) = line.trim().split("READY ").nth(1) {
            let (s, b) = rest.split_once(' ').unwrap();
            break (s.to_string(), b.to_string());
        }
    };
    assert!(
        seg.starts_with(&a0),
        "the target advertises {seg}, not its host's address {a0}"
    );
    let init = tb
        .command(1, &exe)
        .args(args)
        .env(ROLE, format!("initiator {a1} {seg} {buf}"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&init.stdout);
    assert!(
        init.status.success() && text.contains("INITIATOR-OK"),
        "initiator: {text}{}",
        String::from_utf8_lossy(&init.stderr)
    );
    eprintln!(
        "{}",
        text.lines()
            .find(|l| l.contains("INITIATOR-OK"))
            .unwrap_or("")
    );
    let mut rest = String::new();
    for l in out.lines() {
        rest.push_str(&l.unwrap());
        rest.push('\n');
    }
    let st = target.wait().unwrap();
    assert!(st.success() && rest.contains("TARGET-OK"), "target: {rest}");
    tb.teardown().unwrap();
}
