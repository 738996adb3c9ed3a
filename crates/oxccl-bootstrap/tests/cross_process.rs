//! Cross-process tests: every rank (and the standalone store) is a real process, re-executing
//! this test binary in a child role (the `child` test below, selected by an environment
//! variable). Loopback addresses only; ports are probed free, and a test whose probed port is
//! taken by the time rank 0 binds it tries again with another.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oxccl_bootstrap::{Bootstrap, Error, Secret, StoreServer, TcpStore};

const ROLE: &str = "OXCCL_BOOTSTRAP_TEST_ROLE";
const ACTION: &str = "OXCCL_BOOTSTRAP_TEST_ACTION";
const SECRET: &str = "cross-process-test-secret";
/// Opens every line a child reports.
const MARK: &str = "@@ ";
/// Generous bound on anything that should be quick (a loaded CI machine has 2 cores).
const QUICK: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------- child side

/// The entry point of child processes; does nothing when run as a test.
#[test]
fn child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    // Log to stderr, as a binary would (the library installs no subscriber).
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(tracing::Level::INFO)
        .init();
    let code = match role.as_str() {
        "rank" => rank_main(),
        "serve" => serve_main(),
        other => {
            println!("ERROR unknown role {other}");
            2
        }
    };
    std::process::exit(code);
}

fn say(line: impl AsRef<str>) {
    let mut out = std::io::stdout().lock();
    // The harness has printed "test child ... " without a newline: start a fresh line.
    let _ = writeln!(out, "\n{MARK}{}", line.as_ref());
    let _ = out.flush();
}

fn rank_main() -> i32 {
    let b = match Bootstrap::from_env() {
        Ok(b) => b,
        Err(e) => {
            say(format!("ERROR {e}"));
            return 1;
        }
    };
    say(format!("JOINED {}", b.rank()));
    let action = std::env::var(ACTION).unwrap_or_default();
    let result = match action.as_str() {
        "gather" => gather(&b),
        "hold-gather" => {
            // Wait for the test to say go (a line on stdin), then gather.
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
            gather(&b)
        }
        "qp" => connect_queue_pairs(&b),
        "hang" => {
            hang(&b);
            return 0;
        }
        other => {
            say(format!("ERROR unknown action {other}"));
            return 2;
        }
    };
    match result.and_then(|()| b.close()) {
        Ok(()) => 0,
        Err(e) => {
            say(format!("ERROR {e}"));
            1
        }
    }
}

fn gather(b: &Bootstrap) -> Result<(), Error> {
    let me = (
        b.rank(),
        std::process::id(),
        b.local_rank(),
        b.launcher().to_string(),
    );
    let first: Vec<(usize, u32, Option<usize>, String)> = b.all_gather_serde("who", &me)?;
    // A second round with the same tag, and raw bytes with another.
    let second: Vec<(usize, u32, Option<usize>, String)> = b.all_gather_serde("who", &me)?;
    let bytes = b.all_gather("bytes", format!("endpoint of rank {}", b.rank()).as_bytes())?;
    b.barrier("end", QUICK)?;
    let bytes: Vec<String> = bytes
        .into_iter()
        .map(|v| String::from_utf8_lossy(&v).into_owned())
        .collect();
    say(format!(
        "GATHERED {}",
        serde_json::to_string(&(first, second, bytes)).unwrap_or_default()
    ));
    Ok(())
}

/// What the bootstrap is for: every rank makes a queue pair per peer, the ranks all-gather
/// the endpoints and their receive buffers, connect, and each WRITEs its mark into every
/// peer's buffer.
fn connect_queue_pairs(b: &Bootstrap) -> Result<(), Error> {
    use oxccl_verbs::{
        AccessFlags, Device, QpConfig, QpEndpoint, RemoteBuffer, SendWr, Sge, WcStatus,
        WorkCompletion, WrOp,
    };
    let (rank, n) = (b.rank(), b.world_size());
    let verbs = |e: oxccl_verbs::Error| Error::Config(format!("verbs: {e}"));
    let ctx = Device::by_name("shm")
        .and_then(|d| d.open())
        .map_err(verbs)?;
    let pd = ctx.alloc_pd().map_err(verbs)?;
    let cq = ctx.create_cq(64).map_err(verbs)?;
    let qps = (0..n)
        .map(|p| {
            (p != rank)
                .then(|| pd.create_qp(&cq, &cq, &QpConfig::default()))
                .transpose()
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(verbs)?;
    let mine: Vec<Option<QpEndpoint>> = qps
        .iter()
        .map(|q| q.as_ref().map(|q| q.endpoint()))
        .collect();
    let all: Vec<Vec<Option<QpEndpoint>>> = b.all_gather_serde("qp-endpoints", &mine)?;
    for (p, qp) in qps.iter().enumerate() {
        if let (Some(qp), Some(Some(ep))) = (qp, all[p].get(rank)) {
            qp.connect(ep).map_err(verbs)?;
        }
    }
    let inbox = pd
        .alloc_mr(8 * n, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .map_err(verbs)?;
    let mark = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).map_err(verbs)?;
    mark.write(0, &(1000 + rank as u64).to_le_bytes())
        .map_err(verbs)?;
    let inboxes: Vec<RemoteBuffer> = b.all_gather_serde("inboxes", &inbox.remote())?;
    let sge = [Sge::new(&mark, 0, 8)];
    let mut posted = 0;
    for (p, qp) in qps.iter().enumerate() {
        if let Some(qp) = qp {
            let remote = inboxes[p].at(8 * rank as u64);
            qp.post_send(&[SendWr::new(p as u64, WrOp::Write { remote }, &sge)])
                .map_err(verbs)?;
            posted += 1;
        }
    }
    let mut wc = [WorkCompletion::default(); 16];
    let mut done = 0;
    while done < posted {
        let k = cq.wait(&mut wc, QUICK).map_err(verbs)?;
        for c in &wc[..k] {
            if c.status != WcStatus::Success {
                return Err(Error::Config(format!(
                    "WRITE to rank {}: {:?}",
                    c.wr_id, c.status
                )));
            }
        }
        done += k;
    }
    // Every WRITE has completed at its initiator: the marks are in place.
    b.barrier("written", QUICK)?;
    let got = inbox.to_vec();
    for p in (0..n).filter(|&p| p != rank) {
        let v = u64::from_le_bytes(got[8 * p..8 * p + 8].try_into().unwrap_or_default());
        if v != 1000 + p as u64 {
            return Err(Error::Config(format!("rank {p}'s mark is {v}")));
        }
    }
    say(format!("QP-OK {rank}"));
    b.barrier("end", QUICK)
}

/// Blocks on a key that never comes, then reports how that and a later call ended.
fn hang(b: &Bootstrap) {
    let start = Instant::now();
    let pending = b.store().get("never", Duration::from_secs(60));
    say(format!(
        "PENDING {} ms: {}",
        start.elapsed().as_millis(),
        pending.err().map(|e| e.to_string()).unwrap_or_default()
    ));
    let start = Instant::now();
    let later = b.store().set("after", b"x");
    say(format!(
        "LATER {} ms: {}",
        start.elapsed().as_millis(),
        later.err().map(|e| e.to_string()).unwrap_or_default()
    ));
}

fn serve_main() -> i32 {
    let secret = match Secret::from_env() {
        Ok(Some(s)) => s,
        other => {
            say(format!("ERROR no secret: {other:?}"));
            return 1;
        }
    };
    match StoreServer::bind("127.0.0.1:0", secret) {
        Ok(server) => {
            say(format!("SERVING {}", server.addr()));
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        Err(e) => {
            say(format!("ERROR {e}"));
            1
        }
    }
}

// ---------------------------------------------------------------- parent side

/// A child process, with its output collected as it comes.
struct Proc {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    seen: Vec<String>,
    stderr: Arc<Mutex<String>>,
    stderr_reader: Option<std::thread::JoinHandle<()>>,
}

fn spawn(name: &str, role: &str, env: &[(&str, String)]) -> Proc {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", "child", "--nocapture", "--test-threads=1"]);
    // Nothing from the environment of the test run may leak into the ranks.
    for (k, _) in std::env::vars() {
        let launcher = [
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "TORCHELASTIC_RUN_ID",
            "PMI_RANK",
            "PMI_SIZE",
            "MPI_LOCALRANKID",
            "MPI_LOCALNRANKS",
            "PMIX_NAMESPACE",
        ];
        if launcher.contains(&k.as_str())
            || ["OXCCL_", "SLURM_", "OMPI_"]
                .iter()
                .any(|p| k.starts_with(p))
        {
            cmd.env_remove(k);
        }
    }
    cmd.env(ROLE, role)
        .env("OXCCL_SECRET", SECRET)
        .env("RUST_BACKTRACE", "0");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, lines) = channel();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let stderr = Arc::new(Mutex::new(String::new()));
    let (mut err, sink) = (child.stderr.take().unwrap(), stderr.clone());
    let stderr_reader = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = err.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    Proc {
        name: name.to_owned(),
        stdin: child.stdin.take(),
        child,
        lines,
        seen: Vec::new(),
        stderr,
        stderr_reader: Some(stderr_reader),
    }
}

impl Proc {
    /// The first line starting with `prefix` (harness lines are skipped), within `timeout`.
    fn expect(&mut self, prefix: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    let Some(line) = line.strip_prefix(MARK) else {
                        continue;
                    };
                    if let Some(rest) = line.strip_prefix(prefix) {
                        return rest.trim().to_owned();
                    }
                }
                Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => panic!(
                    "{}: no {prefix:?} line within {timeout:?}; stdout: {:#?}\nstderr:\n{}",
                    self.name,
                    self.seen,
                    self.stderr()
                ),
            }
        }
    }

    /// The first line that starts with one of the prefixes.
    fn expect_any(&mut self, prefixes: &[&str], timeout: Duration) -> (String, String) {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    let Some(line) = line.strip_prefix(MARK) else {
                        continue;
                    };
                    for p in prefixes {
                        if let Some(rest) = line.strip_prefix(p) {
                            return ((*p).to_owned(), rest.trim().to_owned());
                        }
                    }
                }
                Err(_) => panic!(
                    "{}: none of {prefixes:?} within {timeout:?}; stdout: {:#?}\nstderr:\n{}",
                    self.name,
                    self.seen,
                    self.stderr()
                ),
            }
        }
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    fn go(&mut self) {
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = stdin.write_all(b"go\n");
            let _ = stdin.flush();
        }
    }

    /// Waits for the exit; returns the exit code.
    fn wait(&mut self, timeout: Duration) -> i32 {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // All of its stderr is in once the reader sees the end.
                if let Some(r) = self.stderr_reader.take() {
                    let _ = r.join();
                }
                return status.code().unwrap_or(-1);
            }
            if Instant::now() >= deadline {
                panic!(
                    "{} did not exit within {timeout:?}; stdout: {:#?}\nstderr:\n{}",
                    self.name,
                    self.seen,
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // Never leave a child behind, even when a test fails.
        self.kill();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// torchrun's variables for `rank` of `world`.
fn torchrun(rank: usize, world: usize, port: u16, action: &str) -> Vec<(&'static str, String)> {
    vec![
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.to_string()),
        ("OXCCL_BOOTSTRAP_TIMEOUT", "20".into()),
        (ACTION, action.into()),
    ]
}

/// Starts rank 0 on a free port (another if the probed one was taken meanwhile), then the
/// other ranks; `env` gives each rank's variables for a port.
fn start_job(
    ranks: usize,
    env: impl Fn(usize, u16) -> Vec<(&'static str, String)>,
) -> (u16, Vec<Proc>) {
    for _ in 0..5 {
        let port = free_port();
        let mut procs = vec![spawn("rank 0", "rank", &env(0, port))];
        // Rank 0 either serves (others can connect) or fails to bind at once.
        let addr = format!("127.0.0.1:{port}");
        let deadline = Instant::now() + QUICK;
        let mut serving = false;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = procs[0].child.try_wait() {
                break;
            }
            if TcpStream::connect(&addr).is_ok() {
                serving = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        if !serving {
            continue;
        }
        for r in 1..ranks {
            procs.push(spawn(&format!("rank {r}"), "rank", &env(r, port)));
        }
        return (port, procs);
    }
    panic!("no free port for rank 0 after 5 tries");
}

type Gathered = (
    Vec<(usize, u32, Option<usize>, String)>,
    Vec<(usize, u32, Option<usize>, String)>,
    Vec<String>,
);

fn check_gathered(procs: &mut [Proc]) {
    let n = procs.len();
    let all: Vec<Gathered> = procs
        .iter_mut()
        .map(|p| serde_json::from_str(&p.expect("GATHERED", QUICK)).unwrap())
        .collect();
    let pids: Vec<u32> = procs.iter().map(|p| p.child.id()).collect();
    for (first, second, bytes) in &all {
        assert_eq!(first, second);
        for (r, (rank, pid, local, launcher)) in first.iter().enumerate() {
            assert_eq!((*rank, *pid, *local), (r, pids[r], Some(r)));
            assert_eq!(launcher, "torchrun");
        }
        let expected: Vec<String> = (0..n).map(|r| format!("endpoint of rank {r}")).collect();
        assert_eq!(bytes, &expected);
    }
    for p in procs.iter_mut() {
        assert_eq!(p.wait(QUICK), 0, "{}: {}", p.name, p.stderr());
    }
}

// ---------------------------------------------------------------- tests

#[test]
fn four_ranks_all_gather_with_torchrun_variables() {
    let (_, mut procs) = start_job(4, |r, port| torchrun(r, 4, port, "gather"));
    check_gathered(&mut procs);
}

#[test]
fn three_ranks_connect_queue_pairs_through_the_store() {
    let (_, mut procs) = start_job(3, |r, port| torchrun(r, 3, port, "qp"));
    for (r, p) in procs.iter_mut().enumerate() {
        assert_eq!(p.expect("QP-OK", QUICK), r.to_string());
    }
    for p in &mut procs {
        assert_eq!(p.wait(QUICK), 0, "{}: {}", p.name, p.stderr());
    }
}

#[test]
fn world_sizes_that_disagree_fail_every_rank() {
    let start = Instant::now();
    let (_, mut procs) = start_job(2, |r, port| torchrun(r, 2 + r, port, "gather"));
    for p in &mut procs {
        let e = p.expect("ERROR", QUICK);
        assert!(e.contains("ranks disagree about the world size"), "{e}");
        // Whichever registered first is "the other rank".
        assert!(
            e.ends_with("was started with world size 3, but rank 0 with 2")
                || e.ends_with("was started with world size 2, but rank 1 with 3"),
            "{e}"
        );
        assert_eq!(p.wait(QUICK), 1);
    }
    assert!(start.elapsed() < Duration::from_secs(15), "not a timeout");
}

#[test]
fn a_duplicate_rank_fails_every_rank() {
    // Ranks 0, 1 and 1 of 3: rank 2 never comes, so all are still joining.
    let (_, mut procs) = start_job(3, |r, port| torchrun(r.min(1), 3, port, "gather"));
    for p in &mut procs {
        let e = p.expect("ERROR", QUICK);
        assert!(e.starts_with("rank 1 was claimed twice: by pid "), "{e}");
        assert_eq!(p.wait(QUICK), 1);
    }
}

#[test]
fn a_rank_out_of_range_fails_every_rank() {
    let (_, mut procs) = start_job(2, |r, port| torchrun(2 * r, 2, port, "gather"));
    for p in &mut procs {
        let e = p.expect("ERROR", QUICK);
        assert_eq!(
            e, "rank 2 is out of range for world size 2 (ranks are 0..2)",
            "{}",
            p.name
        );
        assert_eq!(p.wait(QUICK), 1);
    }
}

#[test]
fn a_join_timeout_lists_the_missing_ranks() {
    let (port, mut procs) = start_job(2, |r, port| {
        let mut env = torchrun(r, 4, port, "gather");
        env.push(("OXCCL_BOOTSTRAP_TIMEOUT", "1".into()));
        env
    });
    for p in &mut procs {
        let e = p.expect("ERROR", QUICK);
        assert_eq!(
            e,
            format!(
                "timed out after 1s waiting for ranks [2, 3] of 4 to join the store at \
                 127.0.0.1:{port}"
            )
        );
        assert_eq!(p.wait(QUICK), 1);
    }
}

#[test]
fn a_port_in_use_is_named() {
    let held = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();
    let mut p = spawn("rank 0", "rank", &torchrun(0, 2, port, "gather"));
    let e = p.expect("ERROR", QUICK);
    assert_eq!(
        e,
        format!(
            "cannot serve the store on 127.0.0.1:{port}: the address is already in use (another \
             process holds it; stop it or choose another port with MASTER_PORT or \
             OXCCL_STORE_ADDR)"
        )
    );
    assert_eq!(p.wait(QUICK), 1);
}

#[test]
fn a_wrong_secret_is_refused_and_logged_while_the_job_goes_on() {
    let (port, mut procs) = start_job(2, |r, port| torchrun(r, 2, port, "hold-gather"));
    for p in &mut procs {
        p.expect("JOINED", QUICK);
    }
    let addr = format!("127.0.0.1:{port}");
    let wrong = Secret::new("not the job's secret").unwrap();
    match TcpStore::connect(&addr, &wrong, QUICK) {
        Err(e @ Error::AuthRefused { .. }) => {
            assert!(e.to_string().contains(&addr), "{e}")
        }
        other => panic!("a stranger got {other:?}"),
    }
    // The job finishes as if nothing happened.
    for p in &mut procs {
        p.go();
    }
    check_gathered(&mut procs);
    // Rank 0, serving the store, logged the refusal.
    let log = procs[0].stderr();
    assert!(
        log.contains("WARN") && log.contains("refused store connection from 127.0.0.1:"),
        "{log}"
    );
    assert!(log.contains("does not know the secret"), "{log}");
}

#[test]
fn a_client_sending_garbage_is_refused_while_the_job_goes_on() {
    let (port, mut procs) = start_job(2, |r, port| torchrun(r, 2, port, "hold-gather"));
    for p in &mut procs {
        p.expect("JOINED", QUICK);
    }
    let addr = format!("127.0.0.1:{port}");
    let garbage: [&[u8]; 3] = [
        b"\xff\xff\xff\xffnot a frame",
        b"GET / HTTP/1.1\r\n\r\n",
        b"\x05\x00\x00", // cut short
    ];
    for g in garbage {
        let mut s = TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(QUICK)).unwrap();
        let _ = s.write_all(g);
        let _ = s.shutdown(std::net::Shutdown::Write);
        // The store answers with its greeting at most, then closes.
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        assert!(rest.len() < 200, "{} bytes", rest.len());
    }
    for p in &mut procs {
        p.go();
    }
    check_gathered(&mut procs);
    let log = procs[0].stderr();
    assert!(
        log.contains("refused store connection from 127.0.0.1:"),
        "{log}"
    );
    assert!(log.contains("exceeds the limit"), "{log}");
}

#[test]
fn a_killed_store_makes_clients_fail_quickly_naming_it() {
    let mut store = spawn("store", "serve", &[]);
    let addr = store.expect("SERVING", QUICK);
    let env = |rank: usize| {
        vec![
            ("OXCCL_RANK", rank.to_string()),
            ("OXCCL_WORLD_SIZE", "2".to_string()),
            ("OXCCL_STORE_ADDR", addr.clone()),
            ("OXCCL_STORE_STANDALONE", "1".to_string()),
            (ACTION, "hang".to_string()),
        ]
    };
    let mut ranks: Vec<Proc> = (0..2)
        .map(|r| spawn(&format!("rank {r}"), "rank", &env(r)))
        .collect();
    for p in &mut ranks {
        p.expect("JOINED", QUICK);
    }
    // Let both block in their get.
    std::thread::sleep(Duration::from_millis(200));
    store.kill();
    for p in &mut ranks {
        let (_, pending) = p.expect_any(&["PENDING"], QUICK);
        let (ms, msg) = pending.split_once(" ms: ").unwrap();
        assert!(ms.parse::<u64>().unwrap() < 5_000, "{pending}");
        assert!(
            msg.starts_with(&format!("the store at {addr} went away")),
            "{msg}"
        );
        let (_, later) = p.expect_any(&["LATER"], QUICK);
        let (ms, msg) = later.split_once(" ms: ").unwrap();
        assert!(ms.parse::<u64>().unwrap() < 1000, "{later}");
        assert!(msg.contains(&addr) && msg.contains("went away"), "{msg}");
        assert_eq!(p.wait(QUICK), 0);
    }
}
