//! `oxccl verbs-perf write_bw --provider tcp` between two network namespaces whose link is
//! shaped to 200 Mbit/s: `--server` in one host, `--connect` in the other, and the measured
//! rate must be the link's (85 % to 102 % of it; TCP payload over MTU 9000 carries at most
//! 99.3 %). Needs root (namespaces, veth, tc); prints `SKIPPED <name>: <reason>` and passes
//! where the machine cannot host a test bed, except under `CI=true`, where it fails.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use oxccl_testbed::{HostSpec, Testbed};

const BIN: &str = env!("CARGO_BIN_EXE_oxccl");
const SECRET: &str = "verbs-perf-netns-test-secret";
const RATE_MBIT: u64 = 200;

#[test]
fn tcp_write_bw_between_namespaces_fills_the_shaped_link() {
    if !oxccl_testbed::require(
        "tcp_write_bw_between_namespaces_fills_the_shaped_link",
        Testbed::available(),
    ) {
        return;
    }
    let start = Instant::now();
    let tb = Testbed::new(&[HostSpec::mbit(RATE_MBIT), HostSpec::mbit(RATE_MBIT)])
        .expect("creating the test bed");
    let server_addr = format!("{}:18515", tb.host_addr(0));
    let mut server = tb
        .command(0, BIN)
        .args(["verbs-perf", "write_bw", "--provider", "tcp", "--server"])
        .args(["--bind", &server_addr, "--wait", "10"])
        .env("OXCCL_SECRET", SECRET)
        .env_remove("OXCCL_SECRET_FILE")
        .env_remove("OXCCL_TCP_ADDR")
        .env_remove("OXCCL_TCP_POLL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the server in host 0");
    let mut line = String::new();
    BufReader::new(server.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the server's first line");
    assert!(line.contains("listening on"), "server said {line:?}");

    // 120 x 256 KiB = 31.5 MB: about 1.3 s at 200 Mbit/s, after a 4 MiB warm-up.
    let out = tb
        .command(1, BIN)
        .args(["verbs-perf", "write_bw", "--provider", "tcp"])
        .args([
            "-s",
            "256K",
            "-n",
            "120",
            "-t",
            "8",
            "--json",
            "--timeout",
            "10",
        ])
        .args(["--connect", &tb.host_addr(0).to_string(), "--wait", "10"])
        .env("OXCCL_SECRET", SECRET)
        .env_remove("OXCCL_SECRET_FILE")
        .env_remove("OXCCL_TCP_ADDR")
        .env_remove("OXCCL_TCP_POLL")
        .stdin(Stdio::null())
        .output()
        .expect("running the client in host 1");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(st) = server.try_wait().expect("try_wait") {
            break st;
        }
        assert!(Instant::now() < deadline, "the server did not exit");
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut server_err = String::new();
    if let Some(mut e) = server.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut server_err);
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "client failed: {}\nserver: {server_err}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(status.success(), "server failed: {server_err}");
    // The client reached the server over the link, from its own address.
    assert!(
        server_err.contains(&format!("client {}:", tb.host_addr(1))),
        "{server_err}"
    );
    let row: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON row");
    let gbps = row["bw_average_gb_per_sec"].as_f64().expect("bandwidth");
    let fraction = gbps * 8e9 / (RATE_MBIT as f64 * 1e6);
    println!(
        "write_bw over a {RATE_MBIT} Mbit/s link: {:.1} Mbit/s = {:.1} % of the link ({:.1} s \
         in all)",
        gbps * 8e3,
        fraction * 100.0,
        start.elapsed().as_secs_f64()
    );
    assert!(
        (0.85..=1.02).contains(&fraction),
        "measured {:.1} % of the {RATE_MBIT} Mbit/s link: {row}",
        fraction * 100.0
    );
}
