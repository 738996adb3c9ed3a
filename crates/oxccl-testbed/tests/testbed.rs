//! The test bed end to end: reachability, shaped throughput in both directions, reshaping,
//! cleanup (after drop, after a panic, of beds whose owner died) and skipping when not root.
//!
//! Every test that needs root prints `SKIPPED <name>: <reason>` and passes where the machine
//! cannot host a test bed, except under `CI=true`, where it fails ([`oxccl_testbed::require`]).

use std::collections::HashSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use oxccl_testbed::{HostSpec, Testbed};

/// The crate's helper binary: TCP echo, sink and source run inside the hosts.
const BIN: &str = env!("CARGO_BIN_EXE_oxccl-testbed");

fn available(test: &str) -> bool {
    oxccl_testbed::require(test, Testbed::available())
}

fn namespaces() -> HashSet<String> {
    let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

fn namespaces_of(bed: &str) -> Vec<String> {
    let prefix = format!("{bed}-");
    let mut v: Vec<String> = namespaces()
        .into_iter()
        .filter(|n| n.starts_with(&prefix))
        .collect();
    v.sort();
    v
}

#[test]
fn hosts_reach_each_other_over_tcp() {
    if !available("hosts_reach_each_other_over_tcp") {
        return;
    }
    let tb = Testbed::new(&[
        HostSpec::mbit(1000),
        HostSpec::unshaped(),
        HostSpec::mbit(100),
    ])
    .unwrap();
    assert_eq!(tb.len(), 3);
    // Every ordered pair, the client inside one namespace, the echo server inside the other.
    for (server, client) in [(1, 0), (0, 1), (2, 1), (0, 2)] {
        let mut srv = tb.spawn(server, BIN, ["tcp-echo-server", "7000"]).unwrap();
        let msg = format!("hello from host {client} to host {server}");
        let out = tb
            .output(
                client,
                BIN,
                [
                    "tcp-echo-client",
                    &format!("{}:7000", tb.host_addr(server)),
                    &msg,
                ],
            )
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{client} -> {server}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // The connection came from the client's own test-bed address.
        assert!(
            stdout.contains(&format!("{}:", tb.host_addr(client))),
            "{stdout}"
        );
        assert!(srv.wait().unwrap().success());
    }
    // The helper's environment names the host and its peers.
    let out = tb.output(2, "sh", ["-c", "echo $OXCCL_TESTBED_HOST $OXCCL_TESTBED_HOSTS $OXCCL_TESTBED_ADDR $OXCCL_TESTBED_ADDRS"]).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "2 3 10.77.0.3 10.77.0.1,10.77.0.2,10.77.0.3"
    );
    // Only the bed's addresses and loopback exist inside a host.
    let out = tb.output(0, "ip", ["-4", "-o", "addr", "show"]).unwrap();
    let addrs = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = addrs.lines().collect();
    assert_eq!(lines.len(), 2, "{addrs}");
    assert!(
        addrs.contains("127.0.0.1/8") && addrs.contains("10.77.0.1/24"),
        "{addrs}"
    );
}

/// Starts `tcp-sink` on `dst` and `tcp-source` on `src` for `secs`; returns the sink.
fn start_stream(
    tb: &Testbed,
    src: usize,
    dst: usize,
    port: u16,
    secs: f64,
) -> [std::process::Child; 2] {
    let sink = tb
        .command(dst, BIN)
        .args(["tcp-sink", &port.to_string(), "0.2"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let source = tb
        .command(src, BIN)
        .args([
            "tcp-source",
            &format!("{}:{port}", tb.host_addr(dst)),
            &secs.to_string(),
        ])
        .spawn()
        .unwrap();
    [sink, source]
}

/// Waits for a stream started by [`start_stream`]; its throughput in Mbit/s.
fn finish_stream([sink, mut source]: [std::process::Child; 2]) -> f64 {
    assert!(source.wait().unwrap().success());
    let out = sink.wait_with_output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let mbit = text
        .split_whitespace()
        .find_map(|f| f.strip_prefix("mbit_per_s="))
        .unwrap_or_else(|| panic!("no rate in {text:?}"));
    mbit.parse().unwrap()
}

fn check_rate(what: &str, measured: f64, rate: u64) {
    let frac = measured / rate as f64;
    println!(
        "{what}: {measured:.1} Mbit/s of {rate} ({:.1} %)",
        frac * 100.0
    );
    assert!(
        (0.85..=1.02).contains(&frac),
        "{what}: {measured:.1} Mbit/s is {:.1} % of {rate} Mbit/s, want 85 to 102 %",
        frac * 100.0
    );
}

#[test]
fn shaped_link_carries_its_rate_in_each_direction() {
    if !available("shaped_link_carries_its_rate_in_each_direction") {
        return;
    }
    // Host 1's link is the bottleneck both ways: 0 -> 1 is limited where the bridge sends to
    // host 1, 1 -> 0 where host 1 sends. Both streams run at once, 1.5 s each.
    let tb = Testbed::new(&[HostSpec::mbit(400), HostSpec::mbit(200)]).unwrap();
    let t = Instant::now();
    let fwd = start_stream(&tb, 0, 1, 5000, 1.5);
    let back = start_stream(&tb, 1, 0, 5001, 1.5);
    let (fwd, back) = (finish_stream(fwd), finish_stream(back));
    println!("measured in {:.2} s", t.elapsed().as_secs_f64());
    check_rate("host 0 -> host 1 (into the 200 Mbit/s link)", fwd, 200);
    check_rate("host 1 -> host 0 (out of the 200 Mbit/s link)", back, 200);
}

#[test]
fn set_rate_reshapes_a_running_bed() {
    if !available("set_rate_reshapes_a_running_bed") {
        return;
    }
    let tb = Testbed::new(&[HostSpec::unshaped(), HostSpec::unshaped()]).unwrap();
    let qdisc = |ns: &str, dev: &str| {
        let out = Command::new("tc")
            .args(["-n", ns, "qdisc", "show", "dev", dev])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(!qdisc(&tb.host_netns(0), "eth0").contains("tbf"));
    tb.set_rate(0, Some(100)).unwrap();
    assert_eq!(tb.rate_mbit(0).unwrap(), Some(100));
    assert!(qdisc(&tb.host_netns(0), "eth0").contains("rate 100Mbit"));
    assert!(qdisc(&tb.bridge_netns(), "h0").contains("rate 100Mbit"));
    // Small packets first: a priority band under the shaper.
    assert!(qdisc(&tb.host_netns(0), "eth0").contains("qdisc htb 10:"));
    // Reshaping a shaped link changes it in place.
    tb.set_rate(0, Some(50)).unwrap();
    tb.set_rate(0, Some(100)).unwrap();
    assert!(qdisc(&tb.bridge_netns(), "h0").contains("rate 100Mbit"));
    assert!(qdisc(&tb.bridge_netns(), "h0").contains("bfifo 12: parent 10:2 limit 625000b"));
    let mbit = finish_stream(start_stream(&tb, 1, 0, 5000, 1.0));
    check_rate("host 1 -> host 0 after set_rate(0, 100)", mbit, 100);
    tb.set_rate(0, None).unwrap();
    assert_eq!(tb.rate_mbit(0).unwrap(), None);
    assert!(!qdisc(&tb.host_netns(0), "eth0").contains("tbf"));
    assert!(!qdisc(&tb.bridge_netns(), "h0").contains("tbf"));
    assert!(tb.set_rate(2, Some(1)).is_err());
    assert!(tb.set_rate(0, Some(0)).is_err());
    // A host outside the bed: errors that name it, not index panics.
    let e = tb.rate_mbit(2).unwrap_err().to_string();
    assert!(e.contains("host 2 of a 2-host test bed"), "{e}");
    let e = tb.output(7, "true", [""; 0]).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    assert!(e.to_string().contains("host 7 of a 2-host test bed"), "{e}");
    let e = tb.spawn(2, "true", [""; 0]).unwrap_err();
    assert!(e.to_string().contains("host 2 of a 2-host test bed"), "{e}");
    assert!(tb.try_command(2, "true").is_err());
    assert!(tb.output(1, "true", [""; 0]).unwrap().status.success());
}

#[test]
fn drop_kills_processes_and_deletes_namespaces() {
    if !available("drop_kills_processes_and_deletes_namespaces") {
        return;
    }
    let tb = Testbed::new(&[HostSpec::mbit(100), HostSpec::unshaped()]).unwrap();
    let name = tb.name().to_owned();
    assert_eq!(
        namespaces_of(&name),
        [
            format!("{name}-br"),
            format!("{name}-h0"),
            format!("{name}-h1")
        ]
    );
    let mut child = tb.spawn(1, "sleep", ["30"]).unwrap();
    let t = Instant::now();
    drop(tb);
    assert!(
        namespaces_of(&name).is_empty(),
        "{:?}",
        namespaces_of(&name)
    );
    // The process inside was killed, not left running in a nameless namespace.
    assert!(!child.wait().unwrap().success());
    assert!(t.elapsed() < Duration::from_secs(5));

    // The explicit teardown reports success.
    let tb = Testbed::new(&[HostSpec::unshaped()]).unwrap();
    let name = tb.name().to_owned();
    tb.teardown().unwrap();
    assert!(namespaces_of(&name).is_empty());
}

#[test]
fn panic_inside_a_test_still_cleans_up() {
    if !available("panic_inside_a_test_still_cleans_up") {
        return;
    }
    let name = std::sync::Mutex::new(String::new());
    let result = std::panic::catch_unwind(|| {
        let tb = Testbed::new(&[HostSpec::mbit(100), HostSpec::mbit(100)]).unwrap();
        *name.lock().unwrap() = tb.name().to_owned();
        assert_eq!(namespaces_of(tb.name()).len(), 3);
        panic!("simulated test failure with the bed up (expected: this test checks the cleanup)");
    });
    assert!(result.is_err());
    let name = name.into_inner().unwrap();
    assert!(!name.is_empty());
    assert!(
        namespaces_of(&name).is_empty(),
        "{:?}",
        namespaces_of(&name)
    );
}

#[test]
fn beds_of_dead_owners_are_deleted_on_creation() {
    if !available("beds_of_dead_owners_are_deleted_on_creation") {
        return;
    }
    // A crashed run: a bed whose owner process dies without tearing it down.
    let mut owner = Command::new("sleep").arg("1000").spawn().unwrap();
    let out = Command::new(BIN)
        .args([
            "up",
            "--rates",
            "100,none",
            "--owner-pid",
            &owner.id().to_string(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stale = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(
        stale.starts_with(&format!("oxtb{}-", owner.id())),
        "{stale}"
    );
    assert_eq!(namespaces_of(&stale).len(), 3);
    // While the owner lives, nobody deletes it.
    oxccl_testbed::cleanup_stale();
    assert_eq!(namespaces_of(&stale).len(), 3);
    owner.kill().unwrap();
    owner.wait().unwrap();
    let tb = Testbed::new(&[HostSpec::unshaped()]).unwrap();
    assert!(
        namespaces_of(&stale).is_empty(),
        "{:?}",
        namespaces_of(&stale)
    );
    drop(tb);
}

#[test]
fn skips_with_a_reason_when_not_root() {
    let uid = std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1).map(str::to_owned))
        .unwrap();
    if uid != "0" {
        // This process is the unprivileged case.
        let reason = Testbed::available().unwrap_err();
        println!("SKIPPED (as expected) skips_with_a_reason_when_not_root: {reason}");
        assert!(reason.contains("not root"), "{reason}");
        assert!(matches!(
            Testbed::new(&[HostSpec::unshaped()]),
            Err(oxccl_testbed::Error::Unavailable(_))
        ));
        return;
    }
    // As root, ask the helper binary again as `nobody`.
    let Ok(out) = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            BIN,
            "available",
        ])
        .output()
    else {
        oxccl_testbed::require(
            "skips_with_a_reason_when_not_root",
            Err("no setpriv to drop root with".into()),
        );
        return;
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stderr.contains("Permission denied") {
        oxccl_testbed::require(
            "skips_with_a_reason_when_not_root",
            Err(format!("`nobody` cannot run {BIN}")),
        );
        return;
    }
    assert!(!out.status.success());
    assert!(stderr.contains("not root (euid 65534)"), "{stderr}");
}
