//! Helpers shared by the test files that run `oxccl` as the ranks of jobs: clean
//! environments, jobs in a test bed's hosts, and the check of `oxccl perf -c 1` tables.
#![allow(dead_code)]

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use oxccl_testbed::Testbed;

/// The `oxccl` binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_oxccl");

/// One test of this file at a time: the jobs they start would otherwise share two cores.
/// (Under that load the launcher test has twice seen ranks 1 and 2 fail at init with "the
/// store went away" while rank 0 still ran: not understood yet; see the issue 6 note.)
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Variables of launchers and of oxccl that would change what `oxccl topo` does.
pub const CLEARED: [&str; 13] = [
    "RANK",
    "WORLD_SIZE",
    "OXCCL_RANK",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "OXCCL_TOPO_FILE",
    "OXCCL_HOST_ID",
    "OXCCL_PROVIDER",
    "OXCCL_SECRET_FILE",
    "OXCCL_TCP_ADDR",
    "OXCCL_STORE_ADDR",
    "OXCCL_STORE_STANDALONE",
];

/// No inherited launcher or oxccl variables; no stdin.
pub fn clean_cmd(cmd: &mut Command) {
    cmd.stdin(Stdio::null());
    for k in CLEARED {
        cmd.env_remove(k);
    }
    cmd.env("OXCCL_TIMEOUT", "60");
}

/// Kills and reaps the child when dropped.
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Every rank of an `oxccl perf -c 1` job succeeded, and rank 0's table has `sizes` rows,
/// each with no wrong element out of place or in place.
pub fn assert_exact(what: &str, outs: &[Output], sizes: usize) {
    for (rank, out) in outs.iter().enumerate() {
        assert!(
            out.status.success(),
            "{what}: rank {rank} failed ({}): {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let table = String::from_utf8_lossy(&outs[0].stdout);
    let rows: Vec<Vec<&str>> = table
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows.len(),
        sizes,
        "{what}: {sizes} sizes expected:\n{table}"
    );
    for row in &rows {
        // Out-of-place and in-place #wrong.
        assert_eq!((row[8], row[12]), ("0", "0"), "{what}:\n{table}");
    }
}

/// Runs `oxccl ARGS` as the ranks of one job in the test bed's hosts (rank `r` in host
/// `placement[r]`, with the torchrun variables and `env`); every rank's output, within 90 s.
pub fn run_in_bed(
    tb: &Testbed,
    placement: &[usize],
    args: &[&str],
    env: &[(&str, &str)],
    port: u16,
) -> Vec<Output> {
    run_in_bed_with(tb, placement, args, env, port, &|_, _| {})
}

/// [`run_in_bed`], with `each(rank, command)` called on every rank's command last.
pub fn run_in_bed_with(
    tb: &Testbed,
    placement: &[usize],
    args: &[&str],
    env: &[(&str, &str)],
    port: u16,
    each: &dyn Fn(usize, &mut Command),
) -> Vec<Output> {
    let master = tb.host_addr(0).to_string();
    let mut ranks: Vec<Killed> = placement
        .iter()
        .enumerate()
        .map(|(rank, &host)| {
            let mut cmd = tb.command(host, BIN);
            clean_cmd(&mut cmd);
            cmd.args(args);
            cmd.env("RANK", rank.to_string())
                .env("WORLD_SIZE", placement.len().to_string())
                .env("MASTER_ADDR", &master)
                .env("MASTER_PORT", port.to_string())
                .env("OXCCL_SECRET", "topo-netns-test-secret")
                .env("OXCCL_TIMEOUT", "30")
                .envs(env.iter().copied())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            each(rank, &mut cmd);
            Killed(cmd.spawn().expect("starting a rank"))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut late = false;
    while ranks
        .iter_mut()
        .any(|r| r.0.try_wait().expect("try_wait").is_none())
    {
        if Instant::now() >= deadline {
            // Stop them and say what they printed, so that a hang shows where.
            for r in &mut ranks {
                let _ = r.0.kill();
            }
            late = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let outs: Vec<Output> = ranks
        .iter_mut()
        .map(|r| {
            let mut out = Output {
                status: r.0.wait().expect("wait"),
                stdout: Vec::new(),
                stderr: Vec::new(),
            };
            if let Some(mut s) = r.0.stdout.take() {
                let _ = std::io::Read::read_to_end(&mut s, &mut out.stdout);
            }
            if let Some(mut s) = r.0.stderr.take() {
                let _ = std::io::Read::read_to_end(&mut s, &mut out.stderr);
            }
            out
        })
        .collect();
    if late {
        let said: Vec<String> = outs
            .iter()
            .enumerate()
            .map(|(r, o)| {
                format!(
                    "rank {r} ({}):\n{}",
                    o.status,
                    String::from_utf8_lossy(&o.stderr)
                )
            })
            .collect();
        panic!("the ranks did not finish in 90 s:\n{}", said.join("\n"));
    }
    outs
}
