//! A target process killed in the middle of a batch: every request that had not completed fails
//! within the peer timeout with an error naming the segment, nothing hangs, and the batch's
//! notification is never sent. Runs the target as a child process (this test binary again).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use oxccl_bootstrap::Secret;
use oxccl_kv::meta::P2pMetadata;
use oxccl_kv::*;

const CHILD: &str = "OXCCL_KV_TEST_CHILD";
const BUF: usize = 64 << 20;

fn secret() -> Secret {
    Secret::new("kv-failure-test-secret-42").unwrap()
}

fn config(protocol: Protocol) -> EngineConfig {
    let mut c = EngineConfig::new(secret());
    c.protocol = protocol;
    c.peer_timeout = Duration::from_secs(2);
    c.timeout = Duration::from_secs(4);
    c
}

/// The child: a target engine that says where it is and waits to be killed.
#[test]
fn child_target() {
    let Ok(p) = std::env::var(CHILD) else { return };
    let e = TransferEngine::new(
        config(p.parse().unwrap()),
        Arc::new(P2pMetadata::new(secret())),
    )
    .unwrap();
    let buf = e.allocate_managed_buffer(BUF).unwrap();
    println!("READY {} {buf}", e.name());
    std::thread::sleep(Duration::from_secs(60));
}

fn killed_target_fails_the_batch(protocol: &str) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_target", "--nocapture", "--test-threads=1"])
        .env(CHILD, protocol)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let (name, buf) = loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the target exited early"
        );
        // libtest prints "test child_target ... " on the same line.
        if let Some(rest) = line.trim().split("READY ").nth(1) {
            let (n, b) = rest.split_once(' ').unwrap();
            break (n.to_string(), b.parse::<u64>().unwrap());
        }
    };
    let cfg = config(protocol.parse().unwrap());
    let peer_timeout = cfg.peer_timeout;
    let e = TransferEngine::new(cfg, Arc::new(P2pMetadata::new(secret()))).unwrap();
    let local = e.allocate_managed_buffer(BUF).unwrap();
    let seg = e.open_segment(&name).unwrap();
    // A first batch goes through: the target is alive and the path works.
    let one = |off: u64, len: usize| TransferRequest {
        opcode: Opcode::Write,
        source: local + off,
        target_id: seg,
        target_offset: buf + off,
        length: len,
    };
    e.transfer_sync(&[one(0, 4096)], None).unwrap();
    // Many rounds of the whole buffer, so that the batch is still moving when the target dies.
    let reqs: Vec<TransferRequest> = (0..16)
        .flat_map(|_| (0..64u64).map(|k| one(k << 20, 1 << 20)))
        .collect();
    let b = e.submit(&reqs, Some(b"must-not-arrive")).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    child.kill().unwrap();
    let killed = Instant::now();
    let r = e.wait(b, Duration::from_secs(20));
    let took = killed.elapsed();
    let _ = child.wait();
    let err = r.expect_err("a batch to a killed target succeeded");
    assert!(
        matches!(&err, Error::PeerFailed { segment, .. } if *segment == name),
        "{protocol}: {err}"
    );
    assert!(
        took < peer_timeout + Duration::from_secs(3),
        "{protocol}: the failure took {took:?} (peer timeout {peer_timeout:?})"
    );
    let st = e.batch_status(b).unwrap();
    assert!(st.done);
    let failed: Vec<&String> = st
        .requests
        .iter()
        .filter_map(|s| match s {
            TransferStatus::Failed(m) => Some(m),
            _ => None,
        })
        .collect();
    assert!(
        !st.requests.contains(&TransferStatus::Pending),
        "{protocol}: requests left pending"
    );
    assert!(!failed.is_empty(), "{protocol}: no request failed");
    assert!(
        failed.iter().all(|m| m.contains(&name)),
        "{protocol}: {failed:?}"
    );
    eprintln!(
        "{protocol}: {} of {} requests failed, {took:?} after the kill: {err}",
        failed.len(),
        reqs.len()
    );
    e.free_batch(b).unwrap();
    // A later request to the dead segment fails promptly too, naming it.
    let t = Instant::now();
    let e2 = e.transfer_sync(&[one(0, 4096)], None).unwrap_err();
    assert!(e2.to_string().contains(&name), "{e2}");
    assert!(t.elapsed() < Duration::from_secs(8), "{:?}", t.elapsed());
}

#[test]
fn tcp_target_killed_mid_batch() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    killed_target_fails_the_batch("tcp");
}

#[test]
fn shm_target_killed_mid_batch() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    killed_target_fails_the_batch("shm");
}
