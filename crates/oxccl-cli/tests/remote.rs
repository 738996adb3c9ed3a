//! `oxccl verbs-perf --server` and `--connect` on loopback: the two sides started separately
//! meet through the bootstrap store (shm and tcp providers, the raw tcp baselines), and every
//! failure is a clear error within its timeout: no secret, a wrong secret, nothing to connect
//! to, a server started for another test, a peer that dies.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Ping-pong tests spin on both sides: one pair at a time on the machine's two cores.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const SECRET: &str = "verbs-perf-remote-test-secret";

/// Kills and reaps the child when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn oxccl(args: &[&str], secret: Option<&str>) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_oxccl"));
    cmd.arg("verbs-perf")
        .args(args)
        .env_remove("OXCCL_SECRET")
        .env_remove("OXCCL_SECRET_FILE")
        .env_remove("OXCCL_TCP_ADDR")
        .env_remove("OXCCL_TCP_POLL")
        .env_remove("OXCCL_PERF_FAULT")
        .stdin(Stdio::null());
    if let Some(s) = secret {
        cmd.env("OXCCL_SECRET", s);
    }
    cmd
}

/// Starts `verbs-perf ARGS --server --bind 127.0.0.1:0` and returns it with its store address.
fn server(args: &[&str]) -> (Killed, String) {
    let mut all = args.to_vec();
    all.extend(["--server", "--bind", "127.0.0.1:0", "--wait", "20"]);
    let mut child = Killed(
        oxccl(&all, Some(SECRET))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting the server"),
    );
    let mut line = String::new();
    BufReader::new(child.0.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("reading the server's address");
    let addr = line
        .trim()
        .strip_prefix("verbs-perf server: listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    (child, addr)
}

/// Waits for the server to exit (at most 10 s) and returns its status and stderr.
fn finish(mut server: Killed) -> (std::process::ExitStatus, String) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(st) = server.0.try_wait().expect("try_wait") {
            break st;
        }
        assert!(Instant::now() < deadline, "the server did not exit");
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    if let Some(mut e) = server.0.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut err);
    }
    (status, err)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn client(args: &[&str], secret: Option<&str>) -> Output {
    oxccl(args, secret).output().expect("running the client")
}

/// Runs one test across --server/--connect and returns the client's JSON row.
fn pair(server_args: &[&str], client_args: &[&str]) -> serde_json::Value {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (srv, addr) = server(server_args);
    let mut args = client_args.to_vec();
    args.extend(["--connect", &addr, "--json", "--timeout", "10"]);
    let out = client(&args, Some(SECRET));
    let (status, err) = finish(srv);
    assert!(
        out.status.success(),
        "client {args:?} failed: {}\nserver: {err}",
        text(&out.stderr)
    );
    assert!(status.success(), "server failed: {err}");
    assert!(err.contains("for client 127.0.0.1:"), "server said: {err}");
    serde_json::from_str(text(&out.stdout).trim()).expect("one JSON row")
}

#[test]
fn shm_and_tcp_run_across_server_and_connect() {
    for provider in ["shm", "tcp"] {
        let v = pair(
            &["write_bw", "--provider", provider],
            &[
                "write_bw",
                "--provider",
                provider,
                "-s",
                "64K",
                "-n",
                "300",
                "-t",
                "16",
                "--cpu",
            ],
        );
        assert_eq!(v["test"], "write_bw");
        assert_eq!(v["provider"], provider);
        assert_eq!(v["iterations"], 300);
        let bw = v["bw_average_gb_per_sec"].as_f64().expect("bw");
        assert!(bw.is_finite() && bw > 0.0, "{v}");
        assert!(v["cpu_target_s_per_gb"].as_f64().is_some(), "{v}");

        let v = pair(
            &["write_lat", "--provider", provider],
            &["write_lat", "--provider", provider, "-s", "8", "-n", "200"],
        );
        assert_eq!(
            (v["test"].as_str(), v["bytes"].as_u64()),
            (Some("write_lat"), Some(8))
        );
        assert!(v["t_typical_usec"].as_f64().is_some_and(|t| t > 0.0), "{v}");
    }
}

#[test]
fn raw_tcp_baselines_run_across_server_and_connect() {
    let v = pair(&["tcp_lat"], &["tcp_lat", "-s", "8", "-n", "300"]);
    assert_eq!(
        (v["test"].as_str(), v["bytes"].as_u64()),
        (Some("tcp_lat"), Some(8))
    );
    assert!(v["provider"].is_null(), "{v}");
    let v = pair(
        &["tcp_lat"],
        &["tcp_lat", "-s", "64", "-n", "300", "--busy"],
    );
    assert!(v["t_min_usec"].as_f64().is_some_and(|t| t > 0.0), "{v}");
    let v = pair(&["tcp_bw"], &["tcp_bw", "-n", "100", "--cpu"]);
    assert_eq!(
        (v["bytes"].as_u64(), v["iterations"].as_u64()),
        (Some(1 << 20), Some(100))
    );
    assert!(
        v["bw_average_gb_per_sec"].as_f64().is_some_and(|b| b > 0.0),
        "{v}"
    );
    assert!(
        v["cpu_init_s_per_gb"].as_f64().is_some_and(|c| c > 0.0),
        "{v}"
    );
}

#[test]
fn a_wrong_or_missing_secret_is_refused_clearly() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (srv, addr) = server(&["write_bw"]);
    let out = client(
        &["write_bw", "--connect", &addr, "--wait", "3"],
        Some("not-the-secret"),
    );
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("refused this process") && err.contains("OXCCL_SECRET"),
        "{err}"
    );
    // No secret set: the client uses its per-user secret file (a fresh home here, as on a
    // host that shares no home directory with the server's), and the refusal names it.
    let home = std::env::temp_dir().join(format!("oxccl-remote-home-{}", std::process::id()));
    let out = oxccl(&["write_bw", "--connect", &addr, "--wait", "3"], None)
        .env("HOME", &home)
        .env_remove("XDG_CONFIG_HOME")
        .output()
        .expect("running the client");
    assert!(!out.status.success());
    let err = text(&out.stderr);
    let file = home.join(".config/oxccl/secret");
    assert!(
        err.contains("refused this process")
            && err.contains(file.to_str().unwrap())
            && err.contains("copy that file"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&home);
    // The server logged the stranger and still serves the right client.
    let out = client(
        &["write_bw", "-n", "50", "--connect", &addr, "--json"],
        Some(SECRET),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let (status, err) = finish(srv);
    assert!(status.success(), "{err}");
    assert!(err.contains("does not know the secret"), "{err}");

    // No secret set and no home for the per-user file: the error says what to set.
    let out = oxccl(&["write_bw", "--server", "--bind", "127.0.0.1:0"], None)
        .env_remove("HOME")
        .env_remove("XDG_CONFIG_HOME")
        .output()
        .expect("running the server");
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("OXCCL_SECRET") && err.contains("HOME"),
        "{err}"
    );
}

#[test]
fn connecting_to_nothing_fails_within_the_wait() {
    // A port that nothing listens on: bind one, then close it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let start = Instant::now();
    let out = client(
        &[
            "write_bw",
            "--connect",
            &format!("127.0.0.1:{port}"),
            "--wait",
            "1.5",
        ],
        Some(SECRET),
    );
    let took = start.elapsed();
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("cannot reach the store at 127.0.0.1:"),
        "{err}"
    );
    assert!(
        took >= Duration::from_millis(1400) && took < Duration::from_secs(5),
        "took {took:?}"
    );

    // A server nobody connects to gives up after its wait, saying so.
    let start = Instant::now();
    let out = oxccl(
        &[
            "write_bw",
            "--server",
            "--bind",
            "127.0.0.1:0",
            "--wait",
            "1",
        ],
        Some(SECRET),
    )
    .output()
    .expect("running the server");
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("no client joined the store"),
        "{}",
        text(&out.stderr)
    );
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn mismatched_tests_and_local_only_tests_are_refused() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (srv, addr) = server(&["write_bw", "--provider", "tcp"]);
    let out = client(&["write_lat", "--connect", &addr], Some(SECRET));
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains(
            "asked for write_lat over shm, but this server was started for write_bw over tcp"
        ),
        "{err}"
    );
    let (status, _) = finish(srv);
    assert!(!status.success());

    for test in ["flag_lat", "memcpy_bw"] {
        let out = client(&[test, "--connect", "127.0.0.1:1"], Some(SECRET));
        assert!(!out.status.success());
        assert!(
            text(&out.stderr).contains("cannot run with --server or --connect"),
            "{}",
            text(&out.stderr)
        );
    }
    let out = client(&["write_bw", "--bind", "127.0.0.1:0"], Some(SECRET));
    assert!(!out.status.success(), "--bind without --server");
    for (args, msg) in [
        (
            &["write_bw", "--connect", "127.0.0.1:99999"][..],
            "not a port number",
        ),
        (&["write_bw", "--connect", ""][..], "empty"),
        (
            &["write_bw", "--server", "--bind", "a:b:c"][..],
            "invalid address",
        ),
        (
            &["write_bw", "--connect", "x", "--wait", "0"][..],
            "invalid timeout",
        ),
    ] {
        let out = client(args, Some(SECRET));
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(
            text(&out.stderr).contains(msg),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
}

#[test]
fn a_dead_server_is_reported_not_waited_for() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    for provider in ["shm", "tcp"] {
        let (mut srv, addr) = server(&["write_bw", "--provider", provider]);
        let mut cl = Killed(
            oxccl(
                &[
                    "write_bw",
                    "--provider",
                    provider,
                    "-n",
                    "1000000000",
                    "--timeout",
                    "5",
                    "--connect",
                    &addr,
                ],
                Some(SECRET),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting the client"),
        );
        std::thread::sleep(Duration::from_millis(800));
        let _ = srv.0.kill();
        let killed = Instant::now();
        let status = loop {
            if let Some(st) = cl.0.try_wait().expect("try_wait") {
                break st;
            }
            assert!(
                killed.elapsed() < Duration::from_secs(8),
                "{provider}: the client still runs"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        let mut err = String::new();
        if let Some(mut e) = cl.0.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut err);
        }
        assert!(!status.success(), "{provider}: {err}");
        assert!(
            err.contains("server") || err.contains("peer"),
            "{provider}: {err}"
        );
    }
}
