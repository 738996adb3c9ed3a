//! Runs the built `oxccl kv-bench` briefly (a few iterations) over shm, tcp and raw-tcp, in
//! batches and in the synchronous mode, and checks that its output parses and that its figures
//! are positive. Nothing here is timed: the machine is shared.
//!
//! One case at a time (a lock): each starts two processes that may spin.

use std::process::{Command, Output, Stdio};
use std::sync::Mutex;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const COLUMNS: &str = "#block   #batch   #threads   #lanes   #iterations   BW[GB/sec]   Req/sec   \
p50[usec]   p90[usec]   p99[usec]   p99.9[usec]   CPU_init[s/GB]   CPU_target[s/GB]   \
wait_cpu[%]   init_cpu[%]";

fn kv_bench(args: &[&str]) -> Output {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .arg("kv-bench")
        .args(args)
        .env_remove("OXCCL_SECRET")
        .env_remove("OXCCL_SECRET_FILE")
        .stdin(Stdio::null())
        .output()
        .expect("running oxccl kv-bench")
}

fn ok(args: &[&str]) -> String {
    let o = kv_bench(args);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "oxccl kv-bench {args:?} failed ({}): {}\n{out}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

/// The one data row after the column header, as numbers (`-` as None).
fn row(out: &str) -> Vec<Option<f64>> {
    let mut lines = out.lines();
    let header = lines
        .by_ref()
        .find(|l| l.trim_start().starts_with("#block"))
        .unwrap_or_else(|| panic!("no column header in:\n{out}"));
    assert_eq!(header.trim(), COLUMNS, "columns differ");
    let data: Vec<&str> = lines.take_while(|l| !l.starts_with("---")).collect();
    assert_eq!(data.len(), 1, "one result row expected:\n{out}");
    data[0]
        .split_whitespace()
        .map(|v| {
            (v != "-").then(|| {
                v.parse::<f64>()
                    .unwrap_or_else(|_| panic!("not a number {v:?} in {out}"))
            })
        })
        .collect()
}

/// Checks a table row: the echoed parameters, and positive figures.
fn check(out: &str, block: f64, batch: f64, threads: f64, iters: f64, has_lat: bool) {
    let r = row(out);
    assert_eq!(r.len(), 15, "{out}");
    let v = |i: usize| r[i].unwrap_or_else(|| panic!("column {i} is empty in {out}"));
    assert_eq!(
        (v(0), v(1), v(2), v(4)),
        (block, batch, threads, iters),
        "{out}"
    );
    assert!(v(3) >= 1.0, "lanes in {out}");
    for i in [5, 6, 11] {
        assert!(v(i).is_finite() && v(i) > 0.0, "column {i} in {out}");
    }
    if has_lat {
        let p: Vec<f64> = (7..=10).map(v).collect();
        assert!(p[0] > 0.0, "p50 in {out}");
        assert!(
            p.windows(2).all(|w| w[0] <= w[1]),
            "percentiles out of order: {out}"
        );
    } else {
        assert!((7..=10).all(|i| r[i].is_none()), "{out}");
    }
    // The target's CPU time came back (it may round to zero on shm, where it does nothing).
    assert!(v(12) >= 0.0, "{out}");
    for i in [13, 14] {
        assert!(v(i) >= 0.0 && v(i).is_finite(), "column {i} in {out}");
    }
}

#[test]
fn shm_batches_write_and_read() {
    for op in ["write", "read"] {
        let out = ok(&[
            "--protocol",
            "shm",
            "--op",
            op,
            "--block-size",
            "64K",
            "--batch-size",
            "8",
            "--iters",
            "20",
        ]);
        assert!(
            out.contains(&format!(
                "KV Transfer Engine {} Benchmark",
                op.to_uppercase()
            )),
            "{out}"
        );
        check(&out, 65536.0, 8.0, 1.0, 20.0, true);
    }
}

#[test]
fn tcp_batches_from_two_threads() {
    let out = ok(&[
        "--protocol",
        "tcp",
        "--op",
        "write",
        "--block-size",
        "1M",
        "--batch-size",
        "4",
        "--threads",
        "2",
        "--lanes",
        "2",
        "--slice-size",
        "256K",
        "--iters",
        "5",
    ]);
    // Two threads of 5 batches each.
    check(&out, 1048576.0, 4.0, 2.0, 10.0, true);
    let r = row(&out);
    assert_eq!(r[3], Some(2.0), "lanes: {out}");
}

#[test]
fn sync_round_trips_over_shm_and_tcp() {
    for (protocol, op) in [("shm", "write"), ("tcp", "read")] {
        let out = ok(&[
            "--protocol",
            protocol,
            "--op",
            op,
            "--sync",
            "--block-size",
            "4K",
            "--iters",
            "200",
        ]);
        // --sync: batches of one request.
        check(&out, 4096.0, 1.0, 1.0, 200.0, true);
    }
}

#[test]
fn raw_tcp_reference_and_json() {
    let out = ok(&[
        "--protocol",
        "raw-tcp",
        "--block-size",
        "256K",
        "--lanes",
        "2",
        "--iters",
        "20",
        "--json",
    ]);
    let line = out.lines().next().unwrap_or_default();
    let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(v["protocol"], "raw-tcp", "{out}");
    assert_eq!(v["lanes"], 2, "{out}");
    // Two streams of 20 writes of 256 KiB.
    assert_eq!(v["iterations"], 40, "{out}");
    assert_eq!(v["bytes"], 40 * 256 * 1024, "{out}");
    for k in ["gb_per_sec", "req_per_sec", "cpu_init_s_per_gb"] {
        assert!(v[k].as_f64().is_some_and(|x| x > 0.0), "{k}: {out}");
    }
    assert!(v["p50_usec"].is_null(), "{out}");
}

#[test]
fn by_hand_roles_need_a_secret_and_a_segment() {
    let o = kv_bench(&["--role", "initiator", "--protocol", "tcp"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--segment"), "{err}");
    // No secret set and no home for the per-user secret file (with one, the target would
    // start and serve until killed).
    let o = Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .args(["kv-bench", "--role", "target", "--protocol", "tcp"])
        .env_remove("OXCCL_SECRET")
        .env_remove("OXCCL_SECRET_FILE")
        .env_remove("HOME")
        .env_remove("XDG_CONFIG_HOME")
        .stdin(Stdio::null())
        .output()
        .expect("running oxccl kv-bench");
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("OXCCL_SECRET") && err.contains("HOME"),
        "{err}"
    );
}

#[test]
fn by_hand_target_and_initiator() {
    use std::io::{BufRead, BufReader};
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let secret = "kv-bench-test-secret-0123456789";
    let mut target = Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .args(["kv-bench", "--role", "target", "--protocol", "tcp"])
        .args(["--listen", "127.0.0.1:0", "--buffer-size", "1M"])
        .env("OXCCL_SECRET", secret)
        .env_remove("OXCCL_SECRET_FILE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting the target");
    let mut line = String::new();
    BufReader::new(target.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the target's first line");
    let segment = line
        .trim()
        .strip_prefix("kv-bench target: segment ")
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    let o = Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .args(["kv-bench", "--role", "initiator", "--segment", &segment])
        .args(["--protocol", "tcp", "--op", "read", "--block-size", "64K"])
        .args(["--batch-size", "4", "--iters", "10"])
        .env("OXCCL_SECRET", secret)
        .env_remove("OXCCL_SECRET_FILE")
        .stdin(Stdio::null())
        .output()
        .expect("running the initiator");
    let _ = target.kill();
    let _ = target.wait();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "initiator failed: {}\n{out}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains(&format!("segment {segment}")), "{out}");
    check(&out, 65536.0, 4.0, 1.0, 10.0, true);
}
