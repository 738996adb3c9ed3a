//! `oxccl run`: the ranks get torchrun's environment and the job's secret, their output comes
//! out prefixed line by line, and a failing rank, a timeout or a signal to the launcher stops
//! the whole job with the right exit code and leaves no process behind.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Longest any launcher in these tests may run before the test fails.
const LIMIT: Duration = Duration::from_secs(20);

/// `oxccl run ARGS...` with none of the job's variables inherited from the test's environment.
fn oxccl_run(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_oxccl"));
    cmd.arg("run").args(args);
    for var in [
        "OXCCL_SECRET",
        "OXCCL_SECRET_FILE",
        "OXCCL_JOB_ID",
        "OXCCL_STORE_ADDR",
        "OXCCL_RANK",
        "OXCCL_WORLD_SIZE",
    ] {
        cmd.env_remove(var);
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// A started launcher: its stdout arrives line by line, its stderr all at the end.
struct Running {
    child: Child,
    started: Instant,
    lines: mpsc::Receiver<Vec<u8>>,
    stderr: Option<JoinHandle<Vec<u8>>>,
}

/// A finished launcher.
struct Done {
    code: Option<i32>,
    elapsed: Duration,
    /// The stdout lines not taken with [`Running::line`], without their newlines.
    lines: Vec<Vec<u8>>,
    stderr: String,
}

impl Running {
    fn start(mut cmd: Command) -> Running {
        let started = Instant::now();
        let mut child = cmd.spawn().expect("start oxccl run");
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            loop {
                let mut line = Vec::new();
                match out.read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        assert_eq!(line.pop(), Some(b'\n'), "a line without its newline");
                        if tx.send(line).is_err() {
                            break;
                        }
                    }
                }
            }
        });
        let mut err = child.stderr.take().unwrap();
        let stderr = Some(std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = err.read_to_end(&mut v);
            v
        }));
        Running {
            child,
            started,
            lines,
            stderr,
        }
    }

    /// The next line of stdout, as text.
    fn line(&self) -> String {
        let line = self
            .lines
            .recv_timeout(LIMIT)
            .expect("a line from oxccl run");
        String::from_utf8(line).unwrap()
    }

    fn finish(mut self) -> Done {
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(
                self.started.elapsed() < LIMIT,
                "oxccl run still running after {LIMIT:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        let elapsed = self.started.elapsed();
        let mut lines = Vec::new();
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(5)) {
            lines.push(line);
        }
        let stderr = self.stderr.take().unwrap().join().unwrap();
        Done {
            code: status.code(),
            elapsed,
            lines,
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.stderr.is_some() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn run(cmd: Command) -> Done {
    Running::start(cmd).finish()
}

/// `[R] rest` → (R, rest).
fn split_rank(line: &[u8]) -> (usize, Vec<u8>) {
    let text = String::from_utf8_lossy(line);
    let close = text
        .find("] ")
        .unwrap_or_else(|| panic!("no rank prefix: {text:?}"));
    assert!(text.starts_with('['), "no rank prefix: {text:?}");
    let rank = text[1..close].parse().unwrap();
    (rank, line[close + 2..].to_vec())
}

/// The lines of each rank, in order.
fn by_rank(lines: &[Vec<u8>]) -> BTreeMap<usize, Vec<Vec<u8>>> {
    let mut m: BTreeMap<usize, Vec<Vec<u8>>> = BTreeMap::new();
    for l in lines {
        let (rank, rest) = split_rank(l);
        m.entry(rank).or_default().push(rest);
    }
    m
}

/// The numbers after each `pid=` in the lines.
fn pids(lines: &[String]) -> Vec<i32> {
    lines
        .iter()
        .flat_map(|l| l.split_whitespace())
        .filter_map(|w| w.strip_prefix("pid="))
        .map(|p| p.parse().unwrap())
        .collect()
}

/// Whether the process exists (a zombie waiting for its parent counts as gone).
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        // SAFETY: signal 0 only checks that the process exists.
        Err(_) if !Path::new("/proc/self").exists() => unsafe { libc::kill(pid, 0) == 0 },
        Err(_) => false,
    }
}

/// Fails unless every process is gone within a second (an orphan may wait briefly to be
/// reaped).
fn assert_gone(pids: &[i32]) {
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        let left: Vec<i32> = pids.iter().copied().filter(|&p| alive(p)).collect();
        if left.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "processes left behind: {left:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A fresh directory for one test.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("oxccl-run-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Shell code that waits (at most 10 s) until the file exists.
fn wait_for_file(path: &str) -> String {
    format!("i=0; while [ ! -e {path} ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done")
}

#[test]
fn ranks_get_the_environment_and_prefixed_output() {
    let mut cmd = oxccl_run(&[
        "-n",
        "3",
        "sh",
        "-c",
        "echo rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK/$LOCAL_WORLD_SIZE \
         group=$GROUP_RANK master=$MASTER_ADDR explicit=${OXCCL_RANK:-unset}; \
         echo err >&2; printf 'bin\\377\\n'; printf 'no newline'",
    ]);
    // An explicit rank in the launcher's environment would give every rank the same one.
    cmd.env("OXCCL_RANK", "7");
    let done = run(cmd);
    assert_eq!(done.code, Some(0), "stderr: {}", done.stderr);
    let out = by_rank(&done.lines);
    assert_eq!(out.keys().copied().collect::<Vec<_>>(), [0, 1, 2]);
    for (rank, lines) in out {
        let env =
            format!("rank={rank} world=3 local={rank}/3 group=0 master=127.0.0.1 explicit=unset");
        assert_eq!(
            lines,
            [env.as_bytes(), b"bin\xff", b"no newline"],
            "rank {rank}"
        );
    }
    let mut err: Vec<&str> = done.stderr.lines().collect();
    err.sort();
    assert_eq!(err, ["[0] err", "[1] err", "[2] err"]);
}

#[test]
fn no_prefix_leaves_the_output_alone() {
    let done = run(oxccl_run(&[
        "--no-prefix",
        "-n",
        "2",
        "--",
        "sh",
        "-c",
        "echo out$RANK; echo err$RANK >&2",
    ]));
    assert_eq!(done.code, Some(0), "stderr: {}", done.stderr);
    let mut out: Vec<String> = done
        .lines
        .iter()
        .map(|l| String::from_utf8_lossy(l).into_owned())
        .collect();
    out.sort();
    assert_eq!(out, ["out0", "out1"]);
    let mut err: Vec<&str> = done.stderr.lines().collect();
    err.sort();
    assert_eq!(err, ["err0", "err1"]);
}

#[test]
fn a_failing_rank_stops_the_others() {
    let dir = temp_dir("fail");
    let d = dir.to_str().unwrap();
    // Every rank starts a background child and prints both pids; rank 1 fails once every rank
    // has done so, while the others wait.
    let script = format!(
        "sleep 30 & echo pid=$$ pid=$!; touch {d}/$RANK; \
         if [ $RANK = 1 ]; then \
           i=0; while [ $(ls {d} | wc -l) -lt 4 ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; \
           exit 3; \
         fi; wait"
    );
    let done = run(oxccl_run(&["-n", "4", "--", "sh", "-c", &script]));
    assert_eq!(done.code, Some(3), "stderr: {}", done.stderr);
    assert!(done.elapsed < Duration::from_secs(10), "{:?}", done.elapsed);
    assert!(
        done.stderr
            .contains("oxccl run: rank 1 exited with status 3; stopping the other 3 ranks"),
        "{}",
        done.stderr
    );
    let lines: Vec<String> = done
        .lines
        .iter()
        .map(|l| String::from_utf8(split_rank(l).1).unwrap())
        .collect();
    let pids = pids(&lines);
    assert_eq!(pids.len(), 8, "{lines:?}");
    assert_gone(&pids);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_rank_killed_by_a_signal() {
    let done = run(oxccl_run(&[
        "-n",
        "2",
        "sh",
        "-c",
        "if [ $RANK = 0 ]; then kill -9 $$; fi; exec sleep 30",
    ]));
    assert_eq!(done.code, Some(128 + 9), "stderr: {}", done.stderr);
    assert!(
        done.stderr
            .contains("rank 0 was killed by signal 9 (SIGKILL)"),
        "{}",
        done.stderr
    );
    assert!(done.elapsed < Duration::from_secs(10), "{:?}", done.elapsed);
}

#[test]
fn the_secret_job_id_and_a_free_port_reach_the_ranks() {
    let dir = temp_dir("secret");
    let d = dir.to_str().unwrap();
    // A generated secret: the same for every rank, never printed.
    let script = format!(
        "echo secret=${{#OXCCL_SECRET}}:$(printf %s \"$OXCCL_SECRET\" | cksum | cut -d' ' -f1) \
         file=${{OXCCL_SECRET_FILE:-unset}} job=$OXCCL_JOB_ID port=$MASTER_PORT; {}",
        wait_for_file(&format!("{d}/go"))
    );
    let job = Running::start(oxccl_run(&["-n", "2", "sh", "-c", &script]));
    let lines: Vec<String> = (0..2).map(|_| job.line()).collect();
    let fields: Vec<BTreeMap<String, String>> = lines
        .iter()
        .map(|l| {
            String::from_utf8(split_rank(l.as_bytes()).1)
                .unwrap()
                .split_whitespace()
                .map(|kv| {
                    let (k, v) = kv.split_once('=').unwrap();
                    (k.to_owned(), v.to_owned())
                })
                .collect()
        })
        .collect();
    assert_eq!(fields[0], fields[1], "{lines:?}");
    let f = &fields[0];
    assert!(f["secret"].starts_with("64:"), "{lines:?}");
    assert_eq!(f["file"], "unset");
    assert!(!f["job"].is_empty(), "{lines:?}");
    // While the ranks run (and none of them serves the store), nothing listens on the port.
    let port: u16 = f["port"].parse().unwrap();
    assert_ne!(port, 0);
    let e = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
    std::fs::write(dir.join("go"), "").unwrap();
    let done = job.finish();
    assert_eq!(done.code, Some(0), "stderr: {}", done.stderr);

    // The launcher's own secret and job id pass through.
    let mut cmd = oxccl_run(&[
        "-n",
        "2",
        "sh",
        "-c",
        "[ \"$OXCCL_SECRET\" = given-secret ] && echo same || echo different; \
         echo file=${OXCCL_SECRET_FILE:-unset} job=$OXCCL_JOB_ID",
    ]);
    cmd.env("OXCCL_SECRET", "given-secret")
        .env("OXCCL_JOB_ID", "my-job");
    let done = run(cmd);
    assert_eq!(done.code, Some(0), "stderr: {}", done.stderr);
    for (rank, lines) in by_rank(&done.lines) {
        assert_eq!(
            lines,
            [&b"same"[..], b"file=unset job=my-job"],
            "rank {rank}"
        );
    }

    // A secret file is passed as the file, not as its value.
    let file = dir.join("secret");
    std::fs::write(&file, "from-a-file\n").unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let mut cmd = oxccl_run(&[
        "-n",
        "1",
        "sh",
        "-c",
        "echo file=$OXCCL_SECRET_FILE secret=${OXCCL_SECRET:-unset}",
    ]);
    cmd.env("OXCCL_SECRET_FILE", &file);
    let done = run(cmd);
    assert_eq!(done.code, Some(0), "stderr: {}", done.stderr);
    assert_eq!(
        done.lines,
        [format!("[0] file={} secret=unset", file.display()).into_bytes()]
    );

    // Both set: the launcher refuses, before starting anything.
    let mut cmd = oxccl_run(&["-n", "1", "sh", "-c", "echo started"]);
    cmd.env("OXCCL_SECRET", "x").env("OXCCL_SECRET_FILE", &file);
    let done = run(cmd);
    assert_eq!(done.code, Some(1));
    assert!(done.lines.is_empty());
    assert!(done.stderr.contains("set only one"), "{}", done.stderr);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_program_that_cannot_start() {
    let done = run(oxccl_run(&["-n", "2", "oxccl-no-such-program", "arg"]));
    assert_eq!(done.code, Some(127), "stderr: {}", done.stderr);
    assert!(
        done.stderr
            .contains("cannot start rank 0: oxccl-no-such-program: No such file or directory"),
        "{}",
        done.stderr
    );

    for n in ["0", "x"] {
        let done = run(oxccl_run(&["-n", n, "true"]));
        assert_eq!(done.code, Some(2), "-n {n}: {}", done.stderr);
        assert!(done.stderr.contains("number of ranks"), "{}", done.stderr);
    }
    let done = run(oxccl_run(&["-n", "1"]));
    assert_eq!(done.code, Some(2), "{}", done.stderr);
}

#[test]
fn a_timeout_stops_everything_even_ranks_that_ignore_sigterm() {
    let done = run(oxccl_run(&[
        "-n",
        "2",
        "--timeout",
        "1",
        "--grace",
        "0.5",
        "--",
        "sh",
        "-c",
        "if [ $RANK = 1 ]; then trap '' TERM; fi; sleep 30 & echo pid=$$ pid=$!; wait",
    ]));
    assert_eq!(done.code, Some(124), "stderr: {}", done.stderr);
    assert!(
        done.elapsed >= Duration::from_secs(1) && done.elapsed < Duration::from_secs(5),
        "{:?}",
        done.elapsed
    );
    assert!(
        done.stderr.contains(
            "oxccl run: the job ran longer than its timeout of 1 s; stopping the 2 ranks"
        ),
        "{}",
        done.stderr
    );
    assert!(
        done.stderr
            .contains("still running after the grace period of 0.5 s; sending SIGKILL"),
        "{}",
        done.stderr
    );
    let lines: Vec<String> = done
        .lines
        .iter()
        .map(|l| String::from_utf8(split_rank(l).1).unwrap())
        .collect();
    let pids = pids(&lines);
    assert_eq!(pids.len(), 4, "{lines:?}");
    assert_gone(&pids);
}

#[test]
fn sigterm_to_the_launcher_stops_the_ranks() {
    let job = Running::start(oxccl_run(&[
        "-n",
        "2",
        "sh",
        "-c",
        "sleep 30 & echo pid=$$ pid=$!; wait",
    ]));
    let lines: Vec<String> = (0..2)
        .map(|_| String::from_utf8(split_rank(job.line().as_bytes()).1).unwrap())
        .collect();
    let pids = pids(&lines);
    assert_eq!(pids.len(), 4, "{lines:?}");
    // SAFETY: signalling our own child, not yet reaped.
    assert_eq!(
        unsafe { libc::kill(job.child.id() as i32, libc::SIGTERM) },
        0
    );
    let done = job.finish();
    assert_eq!(done.code, Some(128 + 15), "stderr: {}", done.stderr);
    assert!(
        done.stderr
            .contains("oxccl run: received SIGTERM; stopping the 2 ranks"),
        "{}",
        done.stderr
    );
    assert!(done.elapsed < Duration::from_secs(10), "{:?}", done.elapsed);
    assert_gone(&pids);
}
