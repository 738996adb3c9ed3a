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

/// Starts the target process (this test binary's `child_target`) over `protocol`: the child
/// (killed and reaped when dropped), its segment's name and its buffer's address.
fn spawn_target(protocol: &str) -> (Reap, String, u64) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_target", "--nocapture", "--test-threads=1"])
        .env(CHILD, protocol)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let child = Reap(child);
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the target exited early"
        );
        // libtest prints "test child_target ... " on the same line.
        if let Some(rest) = line.trim().split("READY ").nth(1) {
            let (n, b) = rest.split_once(' ').unwrap();
            return (child, n.to_string(), b.parse::<u64>().unwrap());
        }
    }
}

fn killed_target_fails_the_batch(protocol: &str) {
    let (mut child, name, buf) = spawn_target(protocol);
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
    child.0.kill().unwrap();
    let killed = Instant::now();
    let r = e.wait(b, Duration::from_secs(20));
    let took = killed.elapsed();
    let _ = child.0.wait();
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

/// Sends `sig` (`STOP`, `CONT`) to process `pid`.
fn signal(pid: u32, sig: &str) {
    let st = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success(), "kill -{sig} {pid} failed");
    if sig == "STOP" {
        // A signal stops the threads as each next runs: wait until all of them have.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !all_stopped(pid) {
            assert!(Instant::now() < deadline, "process {pid} did not stop");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Whether every thread of `pid` is stopped (state `T` in /proc).
fn all_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|t| {
        std::fs::read_to_string(t.path().join("stat"))
            .ok()
            .and_then(|s| s.rsplit_once(") ").map(|(_, r)| r.starts_with('T')))
            .unwrap_or(true)
    })
}

/// A target that stops serving (SIGSTOP: its sockets stay open and the kernel still
/// acknowledges the bytes, so nothing looks dead) bounds a transfer by the caller's timeout, not
/// the engine's: the error names the batch, the segment and what is outstanding; once the target
/// serves again (SIGCONT) the late WRITE lands, the batch waited for ends, and later transfers
/// work.
#[test]
fn tcp_stopped_target_bounds_the_wait_by_the_callers_timeout() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    // Killed however the test ends (SIGKILL ends a stopped process too).
    let (child, name, buf) = spawn_target("tcp");
    let mut cfg = config(Protocol::Tcp);
    // The engine's own timeout is long: only the caller's bound may end the waits below.
    cfg.timeout = Duration::from_secs(60);
    let e = TransferEngine::new(cfg, Arc::new(P2pMetadata::new(secret()))).unwrap();
    let local = e.allocate_managed_buffer(1 << 20).unwrap();
    let seg = e.open_segment(&name).unwrap();
    let req = |op: Opcode, local_off: u64, off: u64| TransferRequest {
        opcode: op,
        source: local + local_off,
        target_id: seg,
        target_offset: buf + off,
        length: 4096,
    };
    let pattern = |seed: u8| -> Vec<u8> { (0..4096u32).map(|i| (i as u8) ^ seed).collect() };
    e.write_local(local, &pattern(1)).unwrap();
    e.transfer_sync(&[req(Opcode::Write, 0, 0)], None).unwrap();

    signal(child.0.id(), "STOP");
    // A synchronous WRITE bounded at 300 ms.
    e.write_local(local + 4096, &pattern(2)).unwrap();
    let bound = Duration::from_millis(300);
    let t = Instant::now();
    let err = e
        .transfer_sync_within(&[req(Opcode::Write, 4096, 4096)], None, bound)
        .expect_err("a WRITE to a stopped target completed");
    let took = t.elapsed();
    let msg = err.to_string();
    assert!(matches!(err, Error::Timeout { .. }), "{msg}");
    assert!(
        took >= bound && took < bound + Duration::from_secs(2),
        "the bounded wait took {took:?}"
    );
    for part in [
        "batch ",
        &name,
        "1 of 1 requests (4096 B) outstanding",
        "#0 WRITE of 4096 B",
    ] {
        assert!(msg.contains(part), "{part:?} missing from: {msg}");
    }
    // A submitted batch of two, waited for with a bound: the same error, and it is still open.
    e.write_local(local + 8192, &pattern(3)).unwrap();
    let b = e
        .submit(
            &[
                req(Opcode::Write, 8192, 8192),
                req(Opcode::Write, 8192, 12288),
            ],
            None,
        )
        .unwrap();
    let err = e.wait(b, Duration::from_millis(200)).unwrap_err();
    assert!(
        err.to_string().contains(&format!(
            "batch {b} to segment(s) [\"{name}\"]: 2 of 2 requests"
        )),
        "{err}"
    );
    assert!(!e.batch_summary(b).unwrap().done);
    assert!(e.free_batch(b).is_err(), "a batch in flight was freed");

    signal(child.0.id(), "CONT");
    // The late completions land: the batch ends well and the timed-out WRITE's data is there.
    e.wait(b, Duration::from_secs(10)).unwrap();
    e.free_batch(b).unwrap();
    e.transfer_sync(
        &[
            req(Opcode::Read, 16384, 4096),
            req(Opcode::Read, 20480, 8192),
            req(Opcode::Read, 24576, 12288),
        ],
        None,
    )
    .unwrap();
    let mut got = vec![0u8; 4096];
    for (off, seed) in [(16384u64, 2u8), (20480, 3), (24576, 3)] {
        e.read_local(local + off, &mut got).unwrap();
        assert!(
            got == pattern(seed),
            "the data at {off} is not what was written"
        );
    }
    drop(child);
}

/// A child process killed and reaped when dropped.
struct Reap(std::process::Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
