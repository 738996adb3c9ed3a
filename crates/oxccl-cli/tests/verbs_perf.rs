//! Runs the built `oxccl verbs-perf` for every test type with few iterations and checks its
//! output: perftest's columns, sane numbers, JSON rows, clear errors on bad input and on a
//! server process that dies.
//!
//! The ping-pong tests spin on both sides, so the cases run one at a time (a lock), never two
//! spinning pairs on the machine's two cores.

use std::process::{Command, Output};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const LAT_COLUMNS: &str = "#bytes   #iterations   t_min[usec]   t_max[usec]   t_typical[usec]   \
t_avg[usec]   t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]";
const BW_COLUMNS: &str =
    "#bytes   #iterations   BW peak[GB/sec]   BW average[GB/sec]   MsgRate[Mpps]";

fn oxccl(args: &[&str], env: &[(&str, &str)]) -> Output {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_oxccl"));
    cmd.arg("verbs-perf")
        .args(args)
        .env_remove("OXCCL_PERF_FAULT");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("running oxccl")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn ok(args: &[&str]) -> String {
    let o = oxccl(args, &[]);
    assert!(
        o.status.success(),
        "oxccl verbs-perf {args:?} failed: {}\n{}",
        stderr(&o),
        stdout(&o)
    );
    stdout(&o)
}

/// The data rows of a table: the lines after the column header, before the closing rule.
fn rows(out: &str, columns: &str) -> Vec<Vec<f64>> {
    let mut lines = out.lines();
    let header = lines
        .by_ref()
        .find(|l| l.trim_start().starts_with("#bytes"))
        .unwrap_or_else(|| panic!("no column header in:\n{out}"));
    assert_eq!(header.trim(), columns, "columns differ");
    lines
        .take_while(|l| !l.starts_with("---"))
        .map(|l| {
            l.split_whitespace()
                .map(|v| {
                    v.parse::<f64>()
                        .unwrap_or_else(|_| panic!("not a number {v:?} in row {l:?}"))
                })
                .collect()
        })
        .collect()
}

fn check_lat(out: &str, bytes: f64, iters: f64) {
    let rows = rows(out, LAT_COLUMNS);
    assert_eq!(rows.len(), 1, "{out}");
    let r = &rows[0];
    assert_eq!(r.len(), 9, "{out}");
    assert_eq!((r[0], r[1]), (bytes, iters), "{out}");
    for v in &r[2..] {
        assert!(v.is_finite() && *v > 0.0, "latency {v} in {out}");
    }
    let (min, max, typ, avg, p99, p999) = (r[2], r[3], r[4], r[5], r[7], r[8]);
    assert!(
        min <= typ && typ <= max && min <= avg && avg <= max,
        "{out}"
    );
    assert!(typ <= p99 && p99 <= p999 && p999 <= max, "{out}");
}

fn check_bw(out: &str, bytes: f64, iters: f64) {
    let rows = rows(out, BW_COLUMNS);
    assert_eq!(rows.len(), 1, "{out}");
    let r = &rows[0];
    assert_eq!(r.len(), 5, "{out}");
    assert_eq!((r[0], r[1]), (bytes, iters), "{out}");
    for v in &r[2..] {
        assert!(v.is_finite() && *v > 0.0, "bandwidth {v} in {out}");
    }
    let (peak, avg, rate) = (r[2], r[3], r[4]);
    assert!(peak >= avg * 0.999, "peak {peak} below average {avg}");
    let implied = rate * 1e6 * bytes / 1e9;
    assert!(
        (implied - avg).abs() <= avg * 1e-3 + 1e-3,
        "{implied} vs {avg}: {out}"
    );
}

#[test]
fn latency_tests_print_perftest_columns() {
    for (test, size) in [
        ("write_lat", "64"),
        ("read_lat", "64"),
        ("send_lat", "64"),
        ("atomic_lat", "8"),
        ("flag_lat", "8"),
        ("tcp_lat", "64"),
    ] {
        let out = ok(&[test, "-s", size, "-n", "200"]);
        assert!(
            out.contains("Latency Test") || out.contains("Latency Baseline"),
            "{out}"
        );
        check_lat(&out, size.parse().unwrap(), 200.0);
    }
}

#[test]
fn bandwidth_tests_print_perftest_columns() {
    for test in ["write_bw", "read_bw", "send_bw", "memcpy_bw", "tcp_bw"] {
        let out = ok(&[test, "-s", "4K", "-n", "500", "--tx-depth", "32"]);
        assert!(
            out.contains("BW Test") || out.contains("BW Baseline"),
            "{out}"
        );
        check_bw(&out, 4096.0, 500.0);
    }
}

#[test]
fn default_sizes_follow_perftest() {
    check_lat(&ok(&["write_lat", "-n", "100"]), 2.0, 100.0);
    check_bw(&ok(&["write_bw", "-n", "100"]), 65536.0, 100.0);
}

#[test]
fn json_rows_parse() {
    let out = ok(&["write_lat", "-s", "8", "-n", "100", "--json", "--cpu"]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON row");
    assert_eq!(v["test"], "write_lat");
    assert_eq!(v["provider"], "shm");
    assert_eq!(v["bytes"], 8);
    assert_eq!(v["iterations"], 100);
    for f in [
        "t_min_usec",
        "t_max_usec",
        "t_typical_usec",
        "t_avg_usec",
        "t_stdev_usec",
        "p99_usec",
        "p99_9_usec",
        "cpu_init_s_per_gb",
        "cpu_target_s_per_gb",
    ] {
        let x = v[f]
            .as_f64()
            .unwrap_or_else(|| panic!("{f} missing in {out}"));
        assert!(x.is_finite() && x >= 0.0, "{f} = {x}");
    }

    // -a: one row per power of two from 2 B to 8 MiB.
    let out = ok(&["write_bw", "-a", "-n", "20", "--tx-depth", "8", "--json"]);
    let sizes: Vec<u64> = out
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("JSON row");
            for f in [
                "bw_peak_gb_per_sec",
                "bw_average_gb_per_sec",
                "msg_rate_mpps",
            ] {
                let x = v[f].as_f64().expect(f);
                assert!(x.is_finite() && x > 0.0, "{f} = {x} in {l}");
            }
            v["bytes"].as_u64().expect("bytes")
        })
        .collect();
    let want: Vec<u64> = (1..=23).map(|b| 1u64 << b).collect();
    assert_eq!(sizes, want);
}

#[test]
fn tcp_baselines_busy_poll_and_default_sizes() {
    let out = ok(&["tcp_lat", "-s", "8", "-n", "300", "--busy"]);
    assert!(out.contains("busy-polling"), "{out}");
    check_lat(&out, 8.0, 300.0);
    let out = oxccl(
        &["tcp_lat", "-s", "8", "-n", "300"],
        &[("OXCCL_TCP_POLL", "busy")],
    );
    assert!(stdout(&out).contains("busy-polling"), "{}", stdout(&out));
    // tcp_bw writes 1 MiB by default.
    check_bw(&ok(&["tcp_bw", "-n", "50"]), 1048576.0, 50.0);
}

#[test]
fn events_sleep_on_the_completion_queue() {
    for provider in ["shm", "tcp"] {
        for (test, size) in [("write_bw", "64K"), ("send_bw", "4K"), ("read_bw", "4K")] {
            let out = ok(&[
                test,
                "--provider",
                provider,
                "-e",
                "-s",
                size,
                "-n",
                "300",
                "-t",
                "16",
            ]);
            assert!(out.contains("sleep on the completion queue"), "{out}");
            check_bw(&out, parse_size(size), 300.0);
        }
        for test in ["send_lat", "read_lat", "write_lat"] {
            let out = ok(&[test, "--provider", provider, "-e", "-s", "64", "-n", "200"]);
            check_lat(&out, 64.0, 200.0);
        }
    }
}

fn parse_size(s: &str) -> f64 {
    let (n, m) = s.split_at(s.len() - 1);
    n.parse::<f64>().unwrap() * if m == "K" { 1024.0 } else { 1048576.0 }
}

#[test]
fn cpu_columns() {
    let out = ok(&["write_bw", "-s", "64K", "-n", "200", "--cpu"]);
    assert!(out.contains("CPU_init[s/GB]   CPU_target[s/GB]"), "{out}");
}

#[test]
fn bad_arguments_fail_clearly() {
    let cases: [(&[&str], &str); 6] = [
        (&["write_lat", "-s", "4X"], "invalid size '4X'"),
        (&["write_lat", "-s", "0"], "at least 1 byte"),
        (&["write_lat", "-s", "3G"], "too large"),
        (&["nosuch_test"], "possible values"),
        (
            &["write_lat", "--provider", "carrier-pigeon"],
            "unknown provider",
        ),
        (&["atomic_lat", "-s", "16"], "-s must be 8"),
    ];
    for (args, msg) in cases {
        let o = oxccl(args, &[]);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(stderr(&o).contains(msg), "{args:?}: {}", stderr(&o));
    }
    assert!(stdout(&oxccl(&["-s", "4K", "-n", "1", "write_lat"], &[])).contains("4096"));
}

#[test]
fn dead_server_is_reported_not_waited_for() {
    for (fault, test, msg) in [
        ("server-exit-at-run", "write_lat", "exit code 3"),
        ("server-abort-during-run", "write_lat", "SIGABRT"),
        ("server-abort-during-run", "write_bw", "SIGABRT"),
    ] {
        let start = Instant::now();
        let o = oxccl(
            &[test, "-s", "8", "-n", "1000000000", "--timeout", "5"],
            &[("OXCCL_PERF_FAULT", fault)],
        );
        assert!(!o.status.success(), "{fault}: succeeded");
        let err = stderr(&o);
        assert!(
            err.contains("server process") && err.contains(msg),
            "{fault}: {err}"
        );
        assert!(
            start.elapsed() < Duration::from_secs(4),
            "{fault}: took {:?}",
            start.elapsed()
        );
    }
}
