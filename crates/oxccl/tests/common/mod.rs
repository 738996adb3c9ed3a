//! Multi-process harness: the test binary re-executes itself as the ranks of a job.
//!
//! [`run_ranks`] spawns `n` copies of the current test executable that run only the test
//! [`ENTRY_TEST`] with `OXCCL_TEST_CHILD=<scenario>` and `OXCCL_TEST_ARGS=<json>` set, plus the
//! launcher environment a real job has (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`,
//! `OXCCL_SECRET`, `OXCCL_TIMEOUT`, ...). In the child, that test calls [`child_entry`], which
//! runs the scenario, prints its result as one JSON line prefixed with [`MARK`] and exits.
//! The parent collects every child's exit status, output and result, killing any child still
//! running after a deadline.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Every collective the tests exercise, send/recv as one ("send_recv").
pub const COLLECTIVES: [&str; 11] = [
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_allv",
    "gather",
    "scatter",
    "barrier",
    "send_recv",
];

/// Marks a child as a rank: the scenario to run.
pub const CHILD_ENV: &str = "OXCCL_TEST_CHILD";
/// The scenario's arguments, as JSON.
pub const ARGS_ENV: &str = "OXCCL_TEST_ARGS";
/// The test each child runs (every test binary using this harness defines it).
pub const ENTRY_TEST: &str = "child_entry";
/// A directory shared by the ranks of one launch (removed afterwards).
pub const DIR_ENV: &str = "OXCCL_TEST_DIR";
/// Prefix of a child's result line on stdout.
pub const MARK: &str = "@@oxccl-test-result@@";
/// A child still running after this long is killed and the test fails.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// What one rank did.
pub struct RankOutput {
    pub rank: usize,
    /// `None` when it was killed at the deadline.
    pub status: Option<ExitStatus>,
    pub stdout: String,
    pub stderr: String,
    /// Every result line it printed (normally one).
    pub results: Vec<Value>,
    /// From spawning to exit (or the kill).
    pub elapsed: Duration,
}

impl RankOutput {
    pub fn ok(&self) -> bool {
        self.status.is_some_and(|s| s.success()) && self.results.len() == 1
    }

    /// The single result (panics with every rank's output otherwise: use [`expect_results`]).
    pub fn result(&self) -> &Value {
        &self.results[0]
    }
}

/// The environment variables a launcher or an earlier test might have left that would change
/// what a child's `Communicator::from_env` does.
fn inherited_noise(name: &str) -> bool {
    name.starts_with("OXCCL_")
        || name.starts_with("SLURM_")
        || name.starts_with("OMPI_")
        || name.starts_with("PMI_")
        || name.starts_with("PMIX_")
        || name.starts_with("MPI_LOCAL")
        || name.starts_with("MASTER_")
        || name.starts_with("TORCHELASTIC_")
        || matches!(
            name,
            "RANK" | "WORLD_SIZE" | "LOCAL_RANK" | "LOCAL_WORLD_SIZE"
        )
}

/// A port nobody listens on now (the kernel's choice for 127.0.0.1:0).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("binding 127.0.0.1:0")
        .port()
}

/// 32 random bytes as hex.
pub fn random_hex() -> String {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).expect("getrandom");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn reader<R: Read + Send + 'static>(mut r: R) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = r.read_to_end(&mut v);
        String::from_utf8_lossy(&v).into_owned()
    })
}

/// Runs `scenario` with `args` on `n` ranks (child processes) with the bootstrap environment
/// and `env` (e.g. `[("OXCCL_PROVIDER", "tcp")]`; a value overrides the defaults
/// `OXCCL_TIMEOUT=30`); returns every rank's output, in rank order. Never panics on a child's
/// failure: check with [`expect_results`] or by hand.
pub fn run_ranks(n: usize, env: &[(&str, &str)], scenario: &str, args: &Value) -> Vec<RankOutput> {
    // Rank 0 binds the store on a port that was free a moment ago; if something took it
    // meanwhile, try again with another.
    let mut attempt = 0;
    loop {
        attempt += 1;
        let outs = run_ranks_once(n, env, scenario, args);
        let port_taken =
            outs[0].status.is_some_and(|s| !s.success()) && outs[0].stderr.contains("in use");
        if !port_taken || attempt == 3 {
            return outs;
        }
        eprintln!("{scenario}: the store's port was taken; launching again");
    }
}

/// What a rank's environment is made of.
struct RankEnv<'a> {
    scenario: &'a str,
    args: &'a str,
    dir: &'a std::path::Path,
    rank: usize,
    n: usize,
    port: &'a str,
    secret: &'a str,
}

/// Gives `cmd` a rank's environment: the launcher's variables a real job has, the scenario, and
/// `env` on top. Inherited `OXCCL_*`/launcher variables are removed unless `cmd` sets them
/// itself (a wrapper such as `Testbed::command`).
fn rank_env(cmd: &mut Command, r: RankEnv<'_>, env: &[(&str, &str)]) {
    let own: Vec<std::ffi::OsString> = cmd.get_envs().map(|(k, _)| k.to_owned()).collect();
    for (k, _) in std::env::vars_os() {
        if k.to_str().is_some_and(inherited_noise) && !own.contains(&k) {
            cmd.env_remove(k);
        }
    }
    cmd.env(CHILD_ENV, r.scenario)
        .env(ARGS_ENV, r.args)
        .env(DIR_ENV, r.dir)
        .env("RANK", r.rank.to_string())
        .env("WORLD_SIZE", r.n.to_string())
        .env("LOCAL_RANK", r.rank.to_string())
        .env("LOCAL_WORLD_SIZE", r.n.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", r.port)
        .env("OXCCL_SECRET", r.secret)
        .env("OXCCL_JOB_ID", format!("test-{}", r.scenario))
        .env("OXCCL_TIMEOUT", "30")
        .env("OXCCL_BOOTSTRAP_TIMEOUT", "30")
        .env("RUST_BACKTRACE", "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
}

fn run_ranks_once(n: usize, env: &[(&str, &str)], scenario: &str, args: &Value) -> Vec<RankOutput> {
    let exe = std::env::current_exe().expect("current_exe");
    let port = free_port().to_string();
    let secret = random_hex();
    let args = args.to_string();
    let dir = TempDir::new(scenario);
    let start = Instant::now();
    let mut children: Vec<(Child, JoinHandle<String>, JoinHandle<String>)> = Vec::new();
    for rank in 0..n {
        let mut cmd = Command::new(&exe);
        cmd.args(["--exact", ENTRY_TEST, "--nocapture", "--test-threads=1"]);
        rank_env(
            &mut cmd,
            RankEnv {
                scenario,
                args: &args,
                dir: &dir.0,
                rank,
                n,
                port: &port,
                secret: &secret,
            },
            env,
        );
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                for (c, _, _) in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                panic!("{scenario}: spawning rank {rank}: {e}");
            }
        };
        let out = reader(child.stdout.take().unwrap());
        let err = reader(child.stderr.take().unwrap());
        children.push((child, out, err));
    }
    let mut done: Vec<Option<(Option<ExitStatus>, Duration)>> = vec![None; n];
    loop {
        for (rank, (child, _, _)) in children.iter_mut().enumerate() {
            if done[rank].is_none()
                && let Ok(Some(status)) = child.try_wait()
            {
                done[rank] = Some((Some(status), start.elapsed()));
            }
        }
        if done.iter().all(Option::is_some) {
            break;
        }
        if start.elapsed() > DEADLINE {
            for (rank, (child, _, _)) in children.iter_mut().enumerate() {
                if done[rank].is_none() {
                    let _ = child.kill();
                    let _ = child.wait();
                    done[rank] = Some((None, start.elapsed()));
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    children
        .into_iter()
        .zip(done)
        .enumerate()
        .map(|(rank, ((_, out, err), done))| {
            let (status, elapsed) = done.unwrap();
            let stdout = out.join().unwrap_or_default();
            let stderr = err.join().unwrap_or_default();
            let results = stdout
                .lines()
                .filter_map(|l| l.find(MARK).map(|at| &l[at + MARK.len()..]))
                .map(|j| {
                    serde_json::from_str(j)
                        .unwrap_or_else(|e| panic!("rank {rank}: bad result line {j:?}: {e}"))
                })
                .collect();
            RankOutput {
                rank,
                status,
                stdout,
                stderr,
                results,
                elapsed,
            }
        })
        .collect()
}

/// A directory removed on drop.
pub struct TempDir(pub std::path::PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("oxccl-test-{name}-{}", random_hex()));
        std::fs::create_dir_all(&p).expect("creating a temporary directory");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The launch's shared directory (in a child).
pub fn shared_dir() -> std::path::PathBuf {
    std::env::var_os(DIR_ENV)
        .expect("OXCCL_TEST_DIR is set in a child")
        .into()
}

/// Marks this rank as finished (a file in the shared directory).
pub fn mark_done() {
    let (rank, _) = env_rank();
    let _ = std::fs::write(shared_dir().join(format!("done-{rank}")), b"");
}

/// Waits (up to 40 s) until every rank has called [`mark_done`]. A rank's process stays alive
/// meanwhile, as in a job whose ranks handle errors: rank 0 serves the bootstrap store, and a
/// survivor that exits early is a new failure the others would see.
pub fn linger() {
    let (_, n) = env_rank();
    let dir = shared_dir();
    let start = Instant::now();
    while !(0..n).all(|r| dir.join(format!("done-{r}")).exists())
        && start.elapsed() < Duration::from_secs(40)
    {
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn tail(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut at = s.len() - max;
    while !s.is_char_boundary(at) {
        at += 1;
    }
    &s[at..]
}

/// Every rank's exit status and the end of its output, for a failure message.
pub fn report(outs: &[RankOutput]) -> String {
    let mut s = String::new();
    for o in outs {
        let status = match o.status {
            Some(st) => st.to_string(),
            None => format!(
                "KILLED after {:?} (still running at the deadline)",
                o.elapsed
            ),
        };
        s += &format!(
            "\n===== rank {}: {status}, {} result line(s), {:.1} s\n--- stdout (end):\n{}\n--- stderr (end):\n{}\n",
            o.rank,
            o.results.len(),
            o.elapsed.as_secs_f64(),
            tail(&o.stdout, 4000),
            tail(&o.stderr, 6000)
        );
    }
    s
}

/// Asserts that every rank exited successfully with exactly one result; returns the results.
pub fn expect_results(what: &str, outs: &[RankOutput]) -> Vec<Value> {
    let bad: Vec<String> = outs
        .iter()
        .filter(|o| !o.ok())
        .map(|o| match o.status {
            None => format!("rank {} hung (killed after {:?})", o.rank, o.elapsed),
            Some(s) if !s.success() => format!("rank {} failed ({s})", o.rank),
            Some(_) => format!("rank {} printed {} results", o.rank, o.results.len()),
        })
        .collect();
    assert!(bad.is_empty(), "{what}: {}{}", bad.join("; "), report(outs));
    outs.iter().map(|o| o.result().clone()).collect()
}

/// In a child (`OXCCL_TEST_CHILD` set): runs `dispatch(scenario, args)`, prints the value it
/// returns as the result line, waits for the other ranks to finish theirs ([`linger`]) and
/// exits with status 0. Elsewhere: returns at once.
pub fn child_entry(dispatch: fn(&str, &Value) -> Value) {
    let Ok(scenario) = std::env::var(CHILD_ENV) else {
        return;
    };
    let args: Value = std::env::var(ARGS_ENV)
        .ok()
        .map(|a| serde_json::from_str(&a).expect("OXCCL_TEST_ARGS is JSON"))
        .unwrap_or(Value::Null);
    let result = dispatch(&scenario, &args);
    emit(&result);
    mark_done();
    linger();
    std::process::exit(0);
}

/// Prints a result line.
pub fn emit(v: &Value) {
    let mut out = std::io::stdout().lock();
    // A fresh line: libtest may have printed "test child_entry ... " without a newline.
    let _ = writeln!(out, "\n{MARK}{v}");
    let _ = out.flush();
}

/// This child's rank and world size, from the environment [`run_ranks`] set.
pub fn env_rank() -> (usize, usize) {
    let get = |k: &str| std::env::var(k).unwrap().parse::<usize>().unwrap();
    (get("RANK"), get("WORLD_SIZE"))
}

/// The variant of an error, for reports.
pub fn error_kind(e: &oxccl::Error) -> &'static str {
    match e {
        oxccl::Error::InvalidArgument { .. } => "InvalidArgument",
        oxccl::Error::Bootstrap(_) => "Bootstrap",
        oxccl::Error::Verbs { .. } => "Verbs",
        oxccl::Error::Timeout { .. } => "Timeout",
        oxccl::Error::PeerFailed { .. } => "PeerFailed",
        oxccl::Error::Mismatch { .. } => "Mismatch",
        oxccl::Error::Aborted { .. } => "Aborted",
        oxccl::Error::WaitTimeout { .. } => "WaitTimeout",
        oxccl::Error::Poisoned { .. } => "Poisoned",
        oxccl::Error::Config(_) => "Config",
        oxccl::Error::Shrink { .. } => "Shrink",
        oxccl::Error::Grow { .. } => "Grow",
        _ => "other",
    }
}

/// A 64-bit mix (splitmix64's finaliser) for deterministic inputs.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

// ------------------------------------------------------------------------------------------
// Jobs a test drives while they run (chaos tests): each rank's pid, signals, files in the
// shared directory, and a deadline on every wait.

/// `CLOCK_REALTIME` now, in nanoseconds: comparable between processes, also across network
/// namespaces (they share the clock).
pub fn realtime_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// One rank of a [`Job`].
struct JobRank {
    child: Child,
    out: Option<JoinHandle<String>>,
    err: Option<JoinHandle<String>>,
    /// Its exit status and when it was seen (from the job's start).
    exit: Option<(ExitStatus, Duration)>,
}

/// A launch whose ranks run while the test watches them: [`spawn_job`] starts it, the test
/// signals ranks ([`Job::signal`]) and waits for files they write in the shared directory
/// ([`Job::wait_until`], always with a deadline), and [`Job::finish`] collects every rank's
/// output. Dropping a job kills every rank still running, so a failing test leaks no process.
pub struct Job {
    pub scenario: String,
    /// The ranks' shared directory (`OXCCL_TEST_DIR`), removed with the job.
    pub dir: TempDir,
    /// The store's port (`MASTER_PORT`).
    pub port: u16,
    pub start: Instant,
    ranks: Vec<JobRank>,
}

/// Starts `n` ranks running `scenario` with `args`, like [`run_ranks`] (the same environment
/// and defaults; `env` overrides them, e.g. `MASTER_ADDR`), without waiting for them.
/// `launch(rank, exe)` makes the command that runs the test executable `exe` for `rank`:
/// `Command::new(exe)` on this host, or a wrapper such as `Testbed::command(host, exe)`; the
/// variables it sets itself (e.g. `OXCCL_TCP_ADDR`) are kept.
pub fn spawn_job(
    n: usize,
    env: &[(&str, &str)],
    scenario: &str,
    args: &Value,
    launch: &dyn Fn(usize, &std::path::Path) -> Command,
) -> Job {
    let exe = std::env::current_exe().expect("current_exe");
    let port = free_port();
    let secret = random_hex();
    let args = args.to_string();
    let mut job = Job {
        scenario: scenario.to_string(),
        dir: TempDir::new(scenario),
        port,
        start: Instant::now(),
        ranks: Vec::new(),
    };
    for rank in 0..n {
        let mut cmd = launch(rank, &exe);
        cmd.args(["--exact", ENTRY_TEST, "--nocapture", "--test-threads=1"]);
        rank_env(
            &mut cmd,
            RankEnv {
                scenario,
                args: &args,
                dir: &job.dir.0,
                rank,
                n,
                port: &port.to_string(),
                secret: &secret,
            },
            env,
        );
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // On failure, dropping `job` kills the ranks already started.
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("{scenario}: spawning rank {rank}: {e}"));
        let out = Some(reader(child.stdout.take().unwrap()));
        let err = Some(reader(child.stderr.take().unwrap()));
        job.ranks.push(JobRank {
            child,
            out,
            err,
            exit: None,
        });
    }
    job
}

impl Job {
    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    pub fn pid(&self, rank: usize) -> u32 {
        self.ranks[rank].child.id()
    }

    /// Notes the ranks that have exited.
    pub fn poll(&mut self) {
        let start = self.start;
        for r in &mut self.ranks {
            if r.exit.is_none()
                && let Ok(Some(st)) = r.child.try_wait()
            {
                r.exit = Some((st, start.elapsed()));
            }
        }
    }

    /// The exit status of `rank`, if it has exited.
    pub fn exited(&mut self, rank: usize) -> Option<ExitStatus> {
        self.poll();
        self.ranks[rank].exit.map(|(s, _)| s)
    }

    /// Sends `sig` to `rank` (a child not yet reaped, so its pid cannot have been reused).
    pub fn signal(&mut self, rank: usize, sig: i32) -> std::io::Result<()> {
        self.poll();
        if self.ranks[rank].exit.is_some() {
            return Err(std::io::Error::other(format!("rank {rank} has exited")));
        }
        // SAFETY: kill(2) has no memory effects; the pid is our unreaped child's.
        if unsafe { libc::kill(self.pid(rank) as libc::pid_t, sig) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// A file in the shared directory.
    pub fn path(&self, name: &str) -> std::path::PathBuf {
        self.dir.0.join(name)
    }

    /// Creates a file in the shared directory (a signal to the ranks).
    pub fn touch(&self, name: &str) {
        std::fs::write(self.path(name), b"").expect("writing to the shared directory");
    }

    /// The JSON a rank wrote with [`write_json`], if it has.
    pub fn read_json(&self, name: &str) -> Option<Value> {
        let s = std::fs::read_to_string(self.path(name)).ok()?;
        serde_json::from_str(&s).ok()
    }

    /// Polls `cond` (every 2 ms) until it holds (`true`) or `deadline` passes (`false`).
    pub fn wait_until(
        &mut self,
        deadline: Instant,
        mut cond: impl FnMut(&mut Job) -> bool,
    ) -> bool {
        loop {
            self.poll();
            if cond(self) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Waits up to `grace` for every rank to exit, kills those still running (their status is
    /// then `None`), and returns every rank's output in rank order.
    pub fn finish(mut self, grace: Duration) -> Vec<RankOutput> {
        let deadline = Instant::now() + grace;
        self.wait_until(deadline, |j| j.ranks.iter().all(|r| r.exit.is_some()));
        let start = self.start;
        let ranks = std::mem::take(&mut self.ranks);
        ranks
            .into_iter()
            .enumerate()
            .map(|(rank, mut r)| {
                let (status, elapsed) = match r.exit {
                    Some((st, at)) => (Some(st), at),
                    None => {
                        let _ = r.child.kill();
                        let _ = r.child.wait();
                        (None, start.elapsed())
                    }
                };
                let stdout = r.out.take().and_then(|h| h.join().ok()).unwrap_or_default();
                let stderr = r.err.take().and_then(|h| h.join().ok()).unwrap_or_default();
                let results = stdout
                    .lines()
                    .filter_map(|l| l.find(MARK).map(|at| &l[at + MARK.len()..]))
                    .filter_map(|j| serde_json::from_str(j).ok())
                    .collect();
                RankOutput {
                    rank,
                    status,
                    stdout,
                    stderr,
                    results,
                    elapsed,
                }
            })
            .collect()
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for r in &mut self.ranks {
            if r.exit.is_none() {
                // A stopped process dies of SIGKILL too.
                let _ = r.child.kill();
                let _ = r.child.wait();
            }
        }
    }
}

/// In a child: writes `v` as the file `name` of the shared directory, atomically (the parent
/// never reads half of it).
pub fn write_json(name: &str, v: &Value) {
    let dir = shared_dir();
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, v.to_string()).expect("writing to the shared directory");
    std::fs::rename(&tmp, dir.join(name)).expect("renaming in the shared directory");
}

/// In a child: creates the file `name` of the shared directory.
pub fn touch(name: &str) {
    let _ = std::fs::write(shared_dir().join(name), b"");
}

/// In a child: waits up to `timeout` for the file `name` of the shared directory.
pub fn wait_file(name: &str, timeout: Duration) -> bool {
    let path = shared_dir().join(name);
    let start = Instant::now();
    while !path.exists() {
        if start.elapsed() > timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    true
}

/// A small deterministic generator (splitmix64) for test inputs and the randomised tests'
/// choices (from a seed that [`Rng::from_env`] prints, so that a run can be replayed).
pub struct Rng(pub u64);

impl Rng {
    /// From the seed in `var` when it is set, else a fresh one; prints which, for `test`.
    pub fn from_env(test: &str, var: &str) -> Rng {
        let seed = std::env::var(var)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or_else(|| {
                let mut b = [0u8; 8];
                getrandom::fill(&mut b).expect("getrandom");
                u64::from_le_bytes(b)
            });
        println!("{test}: seed {seed} (replay with {var}={seed})");
        Rng(seed)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// The secret of [`in_process`] jobs.
pub const IN_PROCESS_SECRET: &str = "an in-process test job";

/// `n` communicators of one job joined in this process (a thread each, with a store of their
/// own), rank `r` with the options `opts(r)`; panics naming `what` and the rank that failed.
pub fn in_process(
    n: usize,
    what: &str,
    opts: impl Fn(usize) -> oxccl::Options + Sync,
) -> Vec<oxccl::Communicator> {
    use oxccl_bootstrap::{Bootstrap, Config, Secret, StoreServer};
    let secret = Secret::new(IN_PROCESS_SECRET).expect("a secret");
    let server = StoreServer::bind("127.0.0.1:0", secret.clone()).expect("a store");
    let addr = server.addr().to_string();
    let opts = &opts;
    let comms: Vec<oxccl::Result<oxccl::Communicator>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let (addr, secret) = (addr.clone(), secret.clone());
                s.spawn(move || {
                    let mut config = Config::new(rank, n, addr, secret);
                    config.serve_store = false;
                    config.timeout = Duration::from_secs(60);
                    oxccl::Communicator::init(Bootstrap::new(config)?, opts(rank))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("init thread"))
            .collect()
    });
    comms
        .into_iter()
        .enumerate()
        .map(|(r, c)| c.unwrap_or_else(|e| panic!("{what}: init rank {r}: {e}")))
        .collect()
}

/// Runs `f(rank, item)` for every item of `items` (one per rank) on a thread each, at once, and
/// returns the results in rank order: a collective call on every rank of an in-process job.
pub fn per_rank<I: Sync, R: Send>(items: &[I], f: impl Fn(usize, &I) -> R + Sync) -> Vec<R> {
    let f = &f;
    std::thread::scope(|s| {
        let hs: Vec<_> = items
            .iter()
            .enumerate()
            .map(|(r, x)| s.spawn(move || f(r, x)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}
