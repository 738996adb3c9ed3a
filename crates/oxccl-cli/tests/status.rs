//! `oxccl status` against real jobs: a 4-rank job with one rank stopped (SIGSTOP) in the
//! middle of an all-reduce must be diagnosed within 1 s, naming that rank; a healthy idle
//! job must answer in full with nothing flagged; a wrong secret must be refused clearly.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_oxccl");
/// Set in the ranks of the idle job: they run [`rank_entry`].
const ROLE_ENV: &str = "OXCCL_STATUS_TEST_ROLE";
/// The file whose existence ends the idle job.
const DONE_ENV: &str = "OXCCL_STATUS_TEST_DONE";

/// One test at a time: the jobs share two cores.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port()
}

/// The ranks of a job; resumed (if stopped) and killed when dropped.
struct Job(Vec<Child>);

impl Drop for Job {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = Command::new("kill")
                .args(["-CONT", &c.id().to_string()])
                .stderr(Stdio::null())
                .status();
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `cmd` as rank `rank` of `n` over the store at 127.0.0.1:`port`, without inherited
/// launcher or oxccl variables.
fn as_rank(cmd: &mut Command, rank: usize, n: usize, port: u16, secret: &str) {
    for (k, _) in std::env::vars() {
        if k.starts_with("OXCCL_") || k.starts_with("MASTER_") || k == "RANK" || k == "WORLD_SIZE" {
            cmd.env_remove(k);
        }
    }
    cmd.stdin(Stdio::null())
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", n.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("OXCCL_SECRET", secret)
        .env("OXCCL_TIMEOUT", "60");
}

/// `oxccl status --store 127.0.0.1:PORT ARGS` with `secret`; its output and how long it took.
fn status(port: u16, secret: &str, args: &[&str]) -> (Output, Duration) {
    let mut cmd = Command::new(BIN);
    for (k, _) in std::env::vars() {
        if k.starts_with("OXCCL_") {
            cmd.env_remove(k);
        }
    }
    cmd.arg("status")
        .arg("--store")
        .arg(format!("127.0.0.1:{port}"))
        .args(args)
        .env("OXCCL_SECRET", secret)
        .stdin(Stdio::null());
    let t = Instant::now();
    let out = cmd.output().unwrap();
    (out, t.elapsed())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The state letter of process `pid` (`T`: stopped), from /proc.
fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')').next()?.trim().chars().next()
}

#[test]
fn names_a_stopped_rank_within_a_second() {
    let _serial = serial();
    let port = free_port();
    let secret = "status-test-secret-stopped";
    let (n, stopped, seq) = (4, 2, 30);
    let mut job = Job(Vec::new());
    for rank in 0..n {
        let mut cmd = Command::new(BIN);
        as_rank(&mut cmd, rank, n, port, secret);
        // 8-byte all-reduces, far more than the test waits for; rank 2 stops itself at #30.
        cmd.args(["perf", "all_reduce", "-b", "8", "-e", "8", "-w", "5"])
            .args(["-i", "10000000", "-c", "0"])
            .env("OXCCL_FAULT", format!("stop:rank={stopped},seq={seq}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        job.0.push(cmd.spawn().unwrap());
    }
    let stopped_pid = job.0[stopped].id();
    let deadline = Instant::now() + Duration::from_secs(60);
    while proc_state(stopped_pid) != Some('T') {
        for (r, c) in job.0.iter_mut().enumerate() {
            assert!(c.try_wait().unwrap().is_none(), "rank {r} ended early");
        }
        assert!(Instant::now() < deadline, "rank {stopped} never stopped");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The others reach #30 and wait there.
    std::thread::sleep(Duration::from_millis(500));

    let (out, took) = status(port, secret, &[]);
    let stdout = text(&out.stdout);
    println!("{stdout}{}", text(&out.stderr));
    assert!(
        took < Duration::from_secs(1),
        "oxccl status took {took:?} (1 s at most)"
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "a stopped rank is exit status 1"
    );
    assert!(
        stdout.contains(&format!("rank {stopped} holds everyone up")),
        "{stdout}"
    );
    assert!(stdout.contains("4 processes asked"), "{stdout}");
    assert!(stdout.contains("3 answered"), "{stdout}");
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|w| w.len() > 2 && w[0].parse::<usize>().is_ok())
        .collect();
    assert_eq!(rows.len(), n, "one row per rank:\n{stdout}");
    for row in &rows {
        let rank: usize = row[0].parse().unwrap();
        if rank == stopped {
            assert_eq!(row[2..4], ["NO", "ANSWER"], "{stdout}");
            assert!(row[1].ends_with(&format!(":{stopped_pid}")), "{stdout}");
        } else {
            // Waiting in the all-reduce rank 2 never joined, on some peer.
            assert_eq!(row[2], "waiting", "{stdout}");
            assert_eq!(row[3], "all_reduce", "{stdout}");
            assert_eq!(row[4], format!("#{seq}"), "{stdout}");
        }
    }

    // The same as JSON.
    let (out, took) = status(port, secret, &["--json"]);
    assert!(took < Duration::from_secs(1), "--json took {took:?}");
    assert_eq!(out.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["healthy"], false);
    assert_eq!(v["asked"], 4);
    assert_eq!(v["answered"], 3);
    let silent = v["silent"].as_array().unwrap();
    assert_eq!(silent.len(), 1, "{v:#}");
    assert_eq!(silent[0]["rank"], stopped as u64);
    assert_eq!(silent[0]["pid"], stopped_pid);
    let comm = &v["communicators"][0];
    assert_eq!(comm["holder"], stopped as u64, "{v:#}");
    assert_eq!(comm["missing_ranks"], serde_json::json!([stopped]));
    for r in comm["ranks"].as_array().unwrap() {
        assert_eq!(r["last_started"], seq, "{r:#}");
        assert_eq!(r["last_completed"], seq - 1, "{r:#}");
        assert!(r["waiting_on"].is_u64(), "each waits on a peer: {r:#}");
    }
    // The ranks next to the stopped one in the ring wait on it.
    let waiters: Vec<u64> = comm["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["waiting_on"] == stopped as u64)
        .map(|r| r["rank"].as_u64().unwrap())
        .collect();
    assert!(!waiters.is_empty(), "nobody waits on rank {stopped}: {v:#}");
    drop(job);
}

/// When rank 0 serves the store and is stopped, nobody can be asked: the command still ends
/// within its timeout and says why.
#[test]
fn a_stopped_store_is_reported_within_the_timeout() {
    let _serial = serial();
    let port = free_port();
    let secret = "status-test-secret-stopped-store";
    let n = 2;
    let mut job = Job(Vec::new());
    for rank in 0..n {
        let mut cmd = Command::new(BIN);
        as_rank(&mut cmd, rank, n, port, secret);
        cmd.args(["perf", "all_reduce", "-b", "8", "-e", "8", "-w", "5"])
            .args(["-i", "10000000", "-c", "0"])
            .env("OXCCL_FAULT", "stop:rank=0,seq=20")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        job.0.push(cmd.spawn().unwrap());
    }
    let pid = job.0[0].id();
    let deadline = Instant::now() + Duration::from_secs(60);
    while proc_state(pid) != Some('T') {
        assert!(Instant::now() < deadline, "rank 0 never stopped");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (out, took) = status(port, secret, &[]);
    let stderr = text(&out.stderr);
    assert!(took < Duration::from_millis(1200), "took {took:?}");
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("did not answer within 1.0 s") && stderr.contains("rank 0"),
        "{stderr}"
    );
    drop(job);
}

/// A rank that still answers but stalls inside a call (it sleeps before a send) is named too:
/// the others wait on it, directly or through each other, past `--stuck-after`.
#[test]
fn names_a_rank_that_answers_but_stalls() {
    let _serial = serial();
    let port = free_port();
    let secret = "status-test-secret-stalled";
    let (n, stalled) = (3, 1);
    let mut job = Job(Vec::new());
    for rank in 0..n {
        let mut cmd = Command::new(BIN);
        as_rank(&mut cmd, rank, n, port, secret);
        cmd.args(["perf", "all_reduce", "-b", "8", "-e", "8", "-w", "5"])
            .args(["-i", "10000000", "-c", "0"])
            .env(
                "OXCCL_FAULT",
                format!("delay:rank={stalled},seq=30,ms=8000"),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        job.0.push(cmd.spawn().unwrap());
    }
    // Ask until the stall shows (init, then 30 calls, then 500 ms of waiting).
    let deadline = Instant::now() + Duration::from_secs(30);
    let v = loop {
        assert!(Instant::now() < deadline, "the stall never showed");
        std::thread::sleep(Duration::from_millis(300));
        let (out, took) = status(port, secret, &["--json", "--stuck-after", "500ms"]);
        assert!(took < Duration::from_secs(1), "took {took:?}");
        match out.status.code() {
            Some(0) => continue,
            Some(1) => break serde_json::from_slice::<Value>(&out.stdout).unwrap(),
            // (The store is not up yet.)
            _ => continue,
        }
    };
    assert_eq!(
        (v["asked"].as_u64(), v["answered"].as_u64()),
        (Some(3), Some(3)),
        "{v:#}"
    );
    let comm = &v["communicators"][0];
    assert_eq!(comm["holder"], stalled as u64, "{v:#}");
    assert!(!comm["stuck"].as_array().unwrap().is_empty(), "{v:#}");
    let ranks = comm["ranks"].as_array().unwrap();
    let me = ranks.iter().find(|r| r["rank"] == stalled as u64).unwrap();
    assert_eq!(me["last_started"], 30, "{me:#}");
    assert!(
        me["waiting_on"].is_null(),
        "the stalled rank waits on nobody: {me:#}"
    );
    for r in ranks.iter().filter(|r| r["rank"] != stalled as u64) {
        assert_eq!(r["last_started"], 30, "{r:#}");
        assert!(r["waiting_on"].is_u64(), "{r:#}");
    }
    drop(job);
}

/// A rank of the idle job: one all-reduce (checked), then idle until the test says done.
#[test]
fn rank_entry() {
    if std::env::var(ROLE_ENV).as_deref() != Ok("rank") {
        return;
    }
    let comm = oxccl::Communicator::from_env().unwrap();
    let (rank, n) = (comm.rank(), comm.world_size());
    let input = vec![rank as f32 + 1.0; 100];
    let mut output = vec![0f32; 100];
    comm.all_reduce(&input, &mut output, oxccl::ReduceOp::Sum)
        .unwrap();
    let want = (n * (n + 1) / 2) as f32;
    assert!(output.iter().all(|&x| x == want), "{output:?} != {want}");
    println!("STATUS-TEST-READY");
    let done = std::path::PathBuf::from(std::env::var(DONE_ENV).unwrap());
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    comm.barrier().unwrap();
    // The service thread ends with the last communicator, at once.
    let threads = || -> usize {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|c| c.trim() == "oxccl-status")
            .count()
    };
    assert_eq!(threads(), 1, "one status service thread per process");
    let t = Instant::now();
    drop(comm);
    // (It waits a moment, 100 ms at most, for the service to mark this process gone.)
    assert!(
        t.elapsed() < Duration::from_millis(150),
        "drop took {:?}",
        t.elapsed()
    );
    while threads() > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "the service thread lingers"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    eprintln!(
        "rank {rank}: service thread gone {:?} after the drop",
        t.elapsed()
    );
}

/// Waits for the ready line of a rank of the idle job, then drains the rest of its output.
fn wait_ready(out: ChildStdout) {
    let mut lines = BufReader::new(out).lines();
    for line in lines.by_ref() {
        if line.unwrap().contains("STATUS-TEST-READY") {
            std::thread::spawn(move || lines.for_each(drop));
            return;
        }
    }
    panic!("a rank of the idle job ended before it was ready");
}

#[test]
fn a_healthy_idle_job_answers_in_full_and_a_wrong_secret_is_refused() {
    let _serial = serial();
    let port = free_port();
    let secret = "status-test-secret-idle";
    let n = 3;
    let done = std::env::temp_dir().join(format!("oxccl-status-test-{}", std::process::id()));
    let _ = std::fs::remove_file(&done);
    let mut job = Job(Vec::new());
    let exe = std::env::current_exe().unwrap();
    for rank in 0..n {
        let mut cmd = Command::new(&exe);
        as_rank(&mut cmd, rank, n, port, secret);
        cmd.args(["--exact", "rank_entry", "--nocapture", "--test-threads=1"])
            .env(ROLE_ENV, "rank")
            .env(DONE_ENV, &done)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        job.0.push(cmd.spawn().unwrap());
    }
    let outs: Vec<ChildStdout> = job.0.iter_mut().map(|c| c.stdout.take().unwrap()).collect();
    for out in outs {
        wait_ready(out);
    }
    // The idle ranks' service answers.
    let (out, took) = status(port, secret, &["--json"]);
    println!("{}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", text(&out.stdout)));
    assert!(took < Duration::from_secs(1), "took {took:?}");
    assert_eq!(out.status.code(), Some(0), "{v:#}");
    assert_eq!(v["healthy"], true, "{v:#}");
    assert_eq!(
        (v["asked"].as_u64(), v["answered"].as_u64()),
        (Some(3), Some(3))
    );
    assert!(v["silent"].as_array().unwrap().is_empty());
    let comms = v["communicators"].as_array().unwrap();
    assert_eq!(comms.len(), 1, "{v:#}");
    let comm = &comms[0];
    assert!(comm["holder"].is_null(), "{v:#}");
    assert_eq!(comm["ranks_with_dumps"], serde_json::json!([0, 1, 2]));
    for r in comm["ranks"].as_array().unwrap() {
        // Idle after init's barrier (#0) and the all-reduce (#1).
        assert_eq!(
            (r["last_started"].as_u64(), r["last_completed"].as_u64()),
            (Some(1), Some(1))
        );
        assert_eq!(r["last_completed_call"]["coll"], "all_reduce", "{r:#}");
        assert_eq!(r["last_completed_call"]["count"], 100, "{r:#}");
        assert!(r["waiting_on"].is_null(), "{r:#}");
    }
    // As text.
    let (out, _) = status(port, secret, &[]);
    let stdout = text(&out.stdout);
    println!("{stdout}");
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(stdout.contains("healthy: all 3 ranks answered"), "{stdout}");
    assert_eq!(stdout.matches(" idle ").count(), 3, "{stdout}");

    // A wrong secret: refused, saying so, exit 2, in well under the timeout's retries.
    let (out, took) = status(port, "not-the-job-secret", &[]);
    let stderr = text(&out.stderr);
    println!("{stderr}");
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("oxccl status: error:"), "{stderr}");
    assert!(stderr.to_lowercase().contains("secret"), "{stderr}");
    assert!(took < Duration::from_secs(2), "took {took:?}");

    std::fs::write(&done, b"").unwrap();
    for (rank, c) in job.0.iter_mut().enumerate() {
        let st = c.wait().unwrap();
        assert!(st.success(), "rank {rank}: {st}");
    }
    let _ = std::fs::remove_file(&done);
}

/// Against a standalone store (`oxccl store`) that outlives its jobs: the processes of a job
/// that ended are marked gone (not reported silent), and the answer says so.
#[test]
fn ended_jobs_on_a_standalone_store_are_not_silent() {
    let _serial = serial();
    let secret = "status-test-secret-standalone";
    let mut cmd = Command::new(BIN);
    as_rank(&mut cmd, 0, 1, 0, secret);
    let mut store = Job(vec![
        cmd.args(["store", "--bind", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    ]);
    let mut line = String::new();
    BufReader::new(store.0[0].stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("oxccl store: listening on ")
        .unwrap_or_else(|| panic!("{line:?}"))
        .to_owned();
    let port: u16 = addr.rsplit(':').next().unwrap().parse().unwrap();
    // A 2-rank job that runs to its end.
    let ranks: Vec<Child> = (0..2)
        .map(|rank| {
            let mut cmd = Command::new(BIN);
            as_rank(&mut cmd, rank, 2, port, secret);
            cmd.args([
                "perf",
                "all_reduce",
                "-b",
                "8",
                "-e",
                "8",
                "-w",
                "1",
                "-i",
                "10",
            ])
            .env("OXCCL_STORE_STANDALONE", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
        })
        .collect();
    for (rank, mut c) in ranks.into_iter().enumerate() {
        assert!(c.wait().unwrap().success(), "rank {rank}");
    }
    let (out, _) = status(port, secret, &["--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(0), "{v:#}");
    assert_eq!(
        (v["asked"].as_u64(), v["gone"].as_u64()),
        (Some(0), Some(2)),
        "{v:#}"
    );
    let (out, _) = status(port, secret, &[]);
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("the 2 that registered with this store have ended"),
        "{stdout}"
    );
    drop(store);
}
