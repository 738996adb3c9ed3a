//! Real launchers: Open MPI's `mpirun` and Slurm's `srun` start `oxccl perf` and the
//! collective test program (`crates/oxccl/examples/check_collectives.rs`), with nothing set
//! but `OXCCL_SECRET` and what the launcher sets itself: the store's address comes from the
//! launcher's own variables (Slurm's node list, Open MPI's `OMPI_MCA_orte_hnp_uri`).
//!
//! One test puts mpirun's ranks on two hosts (network namespaces, `oxccl-testbed`).
//! Slurm runs as a one-node cluster that `scripts/slurm-local.sh` configures, starts and
//! stops around the test. Needs Debian's `openmpi-bin`, and for Slurm root, `slurmctld`,
//! `slurmd` and `slurm-client`; without them each test prints `SKIPPED <name>: <reason>` and
//! passes, except under `CI=true`, where it fails.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One launcher at a time: 4 ranks already share this machine's 2 cores.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// How long one launcher run may take before it is stopped.
const RUN_LIMIT: Duration = Duration::from_secs(120);

/// A missing prerequisite: skipped with the reason on a laptop, a failure under `CI=true`.
fn skip_or_fail(test: &str, reason: &str) {
    oxccl_testbed::require(test, Err(reason.to_owned()));
}

/// Why the test cannot run here, if it cannot: not root (when `root`), or a program missing.
fn missing(root: bool, programs: &[&str]) -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if root && unsafe { libc::geteuid() } != 0 {
        return Some("needs root (slurmd starts each task as the user who submitted it)".into());
    }
    let absent: Vec<&str> = programs
        .iter()
        .copied()
        .filter(|p| {
            Command::new("sh")
                .args(["-c", &format!("command -v {p}")])
                .stdout(Stdio::null())
                .status()
                .map_or(true, |s| !s.success())
        })
        .collect();
    (!absent.is_empty()).then(|| {
        format!(
            "{} not found (apt-get install openmpi-bin slurmctld slurmd slurm-client)",
            absent.join(", ")
        )
    })
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The `oxccl` binary under test.
fn oxccl() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_oxccl"))
}

/// The collective test program, built (or found up to date) in this test's target directory
/// and profile.
fn check_collectives() -> PathBuf {
    static BUILT: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = &*built {
        return p.clone();
    }
    let profile_dir = oxccl().parent().expect("oxccl has a directory").to_owned();
    let target_dir = profile_dir.parent().expect("a target directory").to_owned();
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => "dev".to_owned(),
        Some(p) => p.to_owned(),
        None => panic!("cannot tell the profile from {}", profile_dir.display()),
    };
    let out = Command::new(env!("CARGO"))
        .args([
            "build",
            "--quiet",
            "-p",
            "oxccl",
            "--example",
            "check_collectives",
        ])
        // The ofi feature as this test was built (the example shares the suite's libraries).
        .args(if oxccl_verbs::OFI_BUILT_IN {
            &["--features", "oxccl-verbs/ofi"][..]
        } else {
            &[]
        })
        .arg("--profile")
        .arg(&profile)
        .arg("--target-dir")
        .arg(&target_dir)
        .current_dir(repo_root())
        .output()
        .expect("running cargo build");
    assert!(
        out.status.success(),
        "cargo build --example check_collectives failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let exe = profile_dir.join("examples/check_collectives");
    assert!(exe.exists(), "{} was not built", exe.display());
    *built = Some(exe.clone());
    exe
}

/// A fresh secret for one run.
fn secret() -> String {
    let mut b = [0u8; 16];
    urandom(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn urandom(b: &mut [u8]) {
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(b))
        .expect("reading /dev/urandom");
}

/// A command with a clean environment: `PATH`, `HOME` and `extra`, nothing else (no
/// `MASTER_ADDR`, no `OXCCL_*` from the developer's shell).
fn clean(program: &str, extra: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(program);
    cmd.env_clear();
    for k in ["PATH", "HOME"] {
        if let Ok(v) = std::env::var(k) {
            cmd.env(k, v);
        }
    }
    cmd.envs(extra.iter().copied());
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Runs `cmd`, stopping it (SIGTERM, then SIGKILL) if it outlives [`RUN_LIMIT`].
fn run_bounded(mut cmd: Command, what: &str) -> Output {
    let child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("starting {what}: {e}"));
    let pid = child.id() as libc::pid_t;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let t0 = Instant::now();
    let out = match rx.recv_timeout(RUN_LIMIT) {
        Ok(out) => out,
        Err(_) => {
            // SAFETY: signalling a child we started and have not reaped (its waiter holds it).
            unsafe { libc::kill(pid, libc::SIGTERM) };
            let out = rx
                .recv_timeout(Duration::from_secs(10))
                .unwrap_or_else(|_| {
                    // SAFETY: as above.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                    rx.recv().expect("the waiter thread")
                });
            let out = out.expect("waiting for the launcher");
            panic!(
                "{what} did not finish within {RUN_LIMIT:?}; stopped it.\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    };
    let out = out.unwrap_or_else(|e| panic!("waiting for {what}: {e}"));
    println!(
        "{what}: {} in {:.1} s",
        out.status,
        t0.elapsed().as_secs_f64()
    );
    out
}

/// Open MPI's own start-up failing (its daemons could not reach `mpirun` in time, which two
/// namespace hosts on a loaded 2-core machine sometimes see), before any rank ran.
fn open_mpi_did_not_start(out: &Output) -> bool {
    let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
    !text.contains("launcher-test: rank")
        && (text.contains("unable to complete a TCP connection")
            || text.contains("ORTE was unable to reliably start one or more daemons"))
}

/// [`run_bounded`], once more when Open MPI itself did not start the job (never when a rank
/// ran: what oxccl does is never retried).
fn run_mpirun(mk: impl Fn() -> Command, what: &str) -> Output {
    let out = run_bounded(mk(), what);
    if open_mpi_did_not_start(&out) {
        println!("{what}: Open MPI did not start its daemons; launching once more");
        return run_bounded(mk(), what);
    }
    out
}

/// The rank program wrapped so that each rank reports its own exit status:
/// `sh -c 'PROGRAM ARGS; report'`.
fn each_rank_reports(program: &Path, args: &[&str]) -> Vec<String> {
    let script = "\"$0\" \"$@\"; rc=$?; \
        echo \"launcher-test: rank ${OMPI_COMM_WORLD_RANK:-${SLURM_PROCID:-?}} exit $rc\"; \
        exit $rc";
    let mut v = vec![
        "sh".into(),
        "-c".into(),
        script.into(),
        program.display().to_string(),
    ];
    v.extend(args.iter().map(|a| a.to_string()));
    v
}

/// Every one of `n` ranks reported exit 0, and the launcher exited 0.
fn assert_all_ranks_succeeded(out: &Output, n: usize, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let context = || format!("{what}\nstdout:\n{stdout}\nstderr:\n{stderr}");
    let mut ranks: Vec<(usize, i32)> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("launcher-test: rank "))
        .map(|l| {
            let (r, rc) = l.split_once(" exit ").unwrap_or_else(|| panic!("{l}"));
            (
                r.parse().expect("a rank"),
                rc.parse().expect("an exit code"),
            )
        })
        .collect();
    ranks.sort_unstable();
    let want: Vec<(usize, i32)> = (0..n).map(|r| (r, 0)).collect();
    assert_eq!(ranks, want, "every rank must exit with 0: {}", context());
    assert!(out.status.success(), "the launcher failed: {}", context());
    stdout
}

const PERF_ARGS: &[&str] = &[
    "perf",
    "all_reduce",
    "-c",
    "1",
    "-b",
    "8",
    "-e",
    "2M",
    "-f",
    "8",
    "-w",
    "1",
    "-i",
    "3",
];

/// `oxccl perf`'s table: 7 sizes (8 B to 2 MiB), each checked and right in and out of place.
fn assert_perf_table(stdout: &str, n: usize) {
    assert!(
        stdout.contains(&format!("oxccl perf all_reduce: nranks {n} ")),
        "{stdout}"
    );
    assert!(stdout.contains("validation: 1"), "{stdout}");
    let header = stdout
        .lines()
        .find(|l| l.contains("#wrong"))
        .unwrap_or_else(|| panic!("no #wrong column: {stdout}"));
    let cols: Vec<&str> = header.trim_start_matches('#').split_whitespace().collect();
    let wrong_cols: Vec<usize> = (0..cols.len()).filter(|&i| cols[i] == "#wrong").collect();
    assert_eq!(wrong_cols.len(), 2, "{header}");
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty() && !l.starts_with("launcher-test"))
        .map(|l| l.split_whitespace().collect())
        .collect();
    let sizes: Vec<&str> = rows.iter().map(|r| r[0]).collect();
    assert_eq!(
        sizes,
        ["8", "64", "512", "4096", "32768", "262144", "2097152"],
        "{stdout}"
    );
    for r in &rows {
        assert_eq!(r.len(), cols.len(), "{r:?} under {header}");
        for &c in &wrong_cols {
            assert_eq!(r[c], "0", "wrong results in {r:?}:\n{stdout}");
        }
    }
    assert!(stdout.contains("# Out of bounds values : 0 OK"), "{stdout}");
}

/// The collective test program's report: one `ok` line per check, none failed.
fn assert_checks_passed(stdout: &str, n: usize) {
    let summary = stdout
        .lines()
        .find(|l| l.starts_with("check_collectives: ") && l.contains(" checks on "))
        .unwrap_or_else(|| panic!("no summary line: {stdout}"));
    let checks: usize = summary
        .trim_start_matches("check_collectives: ")
        .split_whitespace()
        .next()
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("{summary}"));
    assert!(
        summary.contains(&format!(" checks on {n} ranks ")) && summary.ends_with("all right"),
        "{summary}"
    );
    let ok = stdout.lines().filter(|l| l.starts_with("ok   ")).count();
    let failed: Vec<&str> = stdout.lines().filter(|l| l.starts_with("FAIL")).collect();
    assert!(failed.is_empty(), "{failed:?}");
    assert_eq!(ok, checks, "{stdout}");
    // Every collective was among them.
    for c in [
        "all_reduce",
        "reduce_scatter",
        "all_gather",
        "broadcast",
        "reduce ",
        "all_to_all ",
        "all_to_allv",
        "gather",
        "scatter",
        "send/recv",
        "barrier",
    ] {
        assert!(
            stdout.lines().any(|l| l.starts_with(&format!("ok   {c}"))),
            "no {c} check: {stdout}"
        );
    }
}

fn mpirun(n: usize, rank_program: &[String], secret: &str) -> Command {
    let mut cmd = clean("mpirun", &[("OXCCL_SECRET", secret)]);
    cmd.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &n.to_string(),
    ])
    .args(["-x", "OXCCL_SECRET"])
    .args(rank_program);
    cmd
}

fn mpirun_runs_perf_and_the_collective_checks(test: &str, n: usize) {
    if let Some(reason) = missing(false, &["mpirun"]) {
        return skip_or_fail(test, &reason);
    }
    let program = check_collectives();
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let secret = secret();
    let what = format!("mpirun -np {n} oxccl perf all_reduce");
    let out = run_bounded(
        mpirun(n, &each_rank_reports(&oxccl(), PERF_ARGS), &secret),
        &what,
    );
    assert_perf_table(&assert_all_ranks_succeeded(&out, n, &what), n);
    let what = format!("mpirun -np {n} check_collectives");
    let out = run_bounded(mpirun(n, &each_rank_reports(&program, &[]), &secret), &what);
    assert_checks_passed(&assert_all_ranks_succeeded(&out, n, &what), n);
}

#[test]
fn mpirun_np2_without_master_addr() {
    mpirun_runs_perf_and_the_collective_checks("mpirun_np2_without_master_addr", 2);
}

#[test]
fn mpirun_np4_without_master_addr() {
    mpirun_runs_perf_and_the_collective_checks("mpirun_np4_without_master_addr", 4);
}

/// Writes an executable shell script into a fresh file under the temporary directory.
fn script(name: &str, body: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::temp_dir().join(format!("oxccl-{name}-{}.sh", std::process::id()));
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("writing a script");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

/// mpirun in host 0 of a two-host test bed (network namespaces) starts 2 ranks on each host,
/// reaching host 1 through an rsh agent that enters its namespace, as ssh would enter a
/// node: the ranks on host 1 find the store at host 0's address in `OMPI_MCA_orte_hnp_uri`.
/// Then with rank 0 on host 1 (`--host h1,h0`): rank 0 refuses at once, saying why.
#[test]
fn mpirun_across_two_namespace_hosts_without_master_addr() {
    use oxccl_testbed::{HostSpec, Testbed};
    let test = "mpirun_across_two_namespace_hosts_without_master_addr";
    if let Some(reason) = missing(true, &["mpirun"]) {
        return skip_or_fail(test, &reason);
    }
    if let Err(reason) = Testbed::available() {
        return skip_or_fail(test, &reason);
    }
    let program = check_collectives();
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let tb = Testbed::new(&[HostSpec::unshaped(), HostSpec::unshaped()]).expect("a test bed");
    let agent = script(
        "rsh-netns",
        "# mpirun's rsh agent: `agent HOST COMMAND...` runs COMMAND in namespace HOST.\n\
         # The hosts share this machine's /tmp and host name: each daemon gets its own\n\
         # session directory, as on separate hosts (else their session files collide).\n\
         ns=$1; shift\nmkdir -p /tmp/oxccl-ompi-$ns\n\
         exec ip netns exec \"$ns\" env OMPI_MCA_orte_tmpdir_base=/tmp/oxccl-ompi-$ns sh -c \"$*\"",
    );
    let (h0, h1) = (tb.host_netns(0), tb.host_netns(1));
    let mpirun_tmp = format!("/tmp/oxccl-ompi-mpirun-{}", std::process::id());
    // Removed however the test ends.
    struct Dirs(Vec<String>);
    impl Drop for Dirs {
        fn drop(&mut self) {
            for d in &self.0 {
                let _ = std::fs::remove_dir_all(d);
            }
        }
    }
    let _dirs = Dirs(vec![
        mpirun_tmp.clone(),
        format!("/tmp/oxccl-ompi-{h0}"),
        format!("/tmp/oxccl-ompi-{h1}"),
    ]);
    let secret = secret();
    let mpirun = |hosts: &str, rank_program: &[String]| {
        let mut cmd = clean("ip", &[("OXCCL_SECRET", &secret)]);
        cmd.args([
            "netns",
            "exec",
            &h0,
            "mpirun",
            "--allow-run-as-root",
            "--oversubscribe",
        ])
        .args(["--mca", "plm_rsh_agent"])
        .arg(&agent)
        .args(["--mca", "orte_tmpdir_base", &mpirun_tmp])
        // Open MPI 4.1's daemons share their hwloc topology through a shared-memory
        // segment at a fixed address, whose writing crashes now and then when two daemons
        // of this machine do it together (hwloc_shmem_topology_write, SIGSEGV): off.
        .args(["--mca", "rtc", "^hwloc"])
        .args(["--host", hosts, "-np", "4", "-x", "OXCCL_SECRET"])
        .args(rank_program);
        cmd
    };
    let hosts = format!("{h0}:2,{h1}:2");
    let what = "mpirun -np 4 over two hosts: oxccl perf all_reduce";
    let out = run_mpirun(
        || mpirun(&hosts, &each_rank_reports(&oxccl(), PERF_ARGS)),
        what,
    );
    assert_perf_table(&assert_all_ranks_succeeded(&out, 4, what), 4);
    let what = "mpirun -np 4 over two hosts: check_collectives";
    let args = ["--counts", "0,7,1001"];
    let out = run_mpirun(|| mpirun(&hosts, &each_rank_reports(&program, &args)), what);
    assert_checks_passed(&assert_all_ranks_succeeded(&out, 4, what), 4);

    let what = "mpirun -np 4 with rank 0 on the other host";
    let t0 = Instant::now();
    let out = run_mpirun(
        || {
            mpirun(
                &format!("{h1}:2,{h0}:2"),
                &each_rank_reports(&oxccl(), PERF_ARGS),
            )
        },
        what,
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{what} succeeded: {stderr}");
    assert!(
        stderr.contains(&format!("not on mpirun's host {}", tb.host_addr(0)))
            && stderr.contains("-x MASTER_ADDR"),
        "{what}: rank 0 must say where the store should be and how to fix it: {stderr}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "{what} took {:?}",
        t0.elapsed()
    );
    let _ = std::fs::remove_file(agent);
}

/// A one-node Slurm cluster for the life of the value (`scripts/slurm-local.sh`).
struct Slurm {
    dir: PathBuf,
}

impl Slurm {
    fn script(&self, verb: &str) -> Output {
        Command::new("bash")
            .arg(repo_root().join("scripts/slurm-local.sh"))
            .arg(verb)
            .env("OXCCL_SLURM_DIR", &self.dir)
            .stdin(Stdio::null())
            .output()
            .expect("running scripts/slurm-local.sh")
    }

    fn start() -> Slurm {
        let dir = std::env::temp_dir().join(format!("oxccl-slurm-test-{}", std::process::id()));
        let s = Slurm { dir };
        let out = s.script("start");
        assert!(
            out.status.success(),
            "scripts/slurm-local.sh start failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        s
    }

    fn conf(&self) -> String {
        self.dir.join("slurm.conf").display().to_string()
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        let out = self.script("stop");
        if !out.status.success() {
            eprintln!(
                "scripts/slurm-local.sh stop failed:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

#[test]
fn srun_n4_without_master_addr() {
    let test = "srun_n4_without_master_addr";
    if let Some(reason) = missing(true, &["slurmctld", "slurmd", "srun", "sinfo", "scancel"]) {
        return skip_or_fail(test, &reason);
    }
    let program = check_collectives();
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let slurm = Slurm::start();
    let secret = secret();
    let conf = slurm.conf();
    let srun = |rank_program: &[String]| {
        let mut cmd = clean("srun", &[("SLURM_CONF", &conf), ("OXCCL_SECRET", &secret)]);
        // --overcommit: 4 tasks on this machine's 2 CPUs; --kill-on-bad-exit: a failed rank
        // ends the step at once.
        cmd.args([
            "--overcommit",
            "--kill-on-bad-exit=1",
            "-n",
            "4",
            "--time=2",
        ])
        .args(rank_program);
        cmd
    };
    let what = "srun -n 4 oxccl perf all_reduce";
    let out = run_bounded(srun(&each_rank_reports(&oxccl(), PERF_ARGS)), what);
    assert_perf_table(&assert_all_ranks_succeeded(&out, 4, what), 4);
    let what = "srun -n 4 check_collectives";
    let out = run_bounded(srun(&each_rank_reports(&program, &[])), what);
    assert_checks_passed(&assert_all_ranks_succeeded(&out, 4, what), 4);
    drop(slurm);
}
