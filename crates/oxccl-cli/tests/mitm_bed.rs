//! A man in the middle between namespace hosts (issue 31): rank 1 of a two-rank job reaches the
//! store on host 0 through a proxy on host 2 (`oxccl-testbed mitm`, oxccl-seal's proxy), which
//! keeps every byte it forwards. Untouched, the job runs exact, and the bytes show nothing of
//! the job (no host address, as text or as bytes; no key name). With one bit flipped on the
//! way, rank 1's init fails, saying the store's record did not authenticate, and nothing it
//! sent after the flip was applied.
//!
//! Needs root (namespaces); prints `SKIPPED <name>: <reason>` elsewhere, and fails under
//! `CI=true`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use oxccl_testbed::{HostSpec, Testbed};

mod common;
use common::{BIN, Killed, assert_exact, run_in_bed_with, serial};

/// The test bed's helper binary, built beside `oxccl` (`cargo test --workspace` builds it for
/// its own tests).
fn testbed_bin() -> PathBuf {
    let p = Path::new(BIN).with_file_name("oxccl-testbed");
    assert!(
        p.exists(),
        "{} is missing: cargo build -p oxccl-testbed",
        p.display()
    );
    p
}

/// Starts the proxy on host 2, in front of host 0's `port`, writing what it forwards to
/// `capture`; returns once it listens.
fn proxy(tb: &Testbed, port: u16, capture: &Path, flip_at: Option<u64>) -> Killed {
    let mut cmd = tb.command(2, testbed_bin());
    cmd.args([
        "mitm",
        &format!("{}:{port}", tb.host_addr(2)),
        &format!("{}:{port}", tb.host_addr(0)),
        &capture.display().to_string(),
    ]);
    if let Some(o) = flip_at {
        cmd.arg(o.to_string());
    }
    cmd.stdout(Stdio::piped()).stderr(Stdio::inherit());
    let mut child = Killed(cmd.spawn().expect("starting the proxy"));
    let mut line = String::new();
    let out = child.0.stdout.take().expect("stdout");
    BufReader::new(out)
        .read_line(&mut line)
        .expect("the proxy's first line");
    assert!(line.starts_with("mitm: listening"), "{line}");
    child
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn a_man_in_the_middle_between_hosts_learns_nothing_and_changes_nothing() {
    let _serial = serial();
    let name = "a_man_in_the_middle_between_hosts_learns_nothing_and_changes_nothing";
    if !oxccl_testbed::require(name, Testbed::available()) {
        return;
    }
    let tb = Testbed::new(&[HostSpec::unshaped(); 3]).expect("a test bed");
    let dir = std::env::temp_dir().join(format!("oxccl-mitm-bed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let args = [
        "perf",
        "all_reduce",
        "-b",
        "1M",
        "-e",
        "1M",
        "-w",
        "0",
        "-i",
        "2",
        "-c",
        "1",
    ];
    // Rank 1 reaches the store through the proxy; rank 0 serves it.
    let through = |tb: &Testbed| {
        let proxy_addr = tb.host_addr(2).to_string();
        move |rank: usize, c: &mut std::process::Command| {
            c.env("LOCAL_RANK", "0")
                .env("OXCCL_TIMEOUT", "15")
                .env("OXCCL_BOOTSTRAP_TIMEOUT", "15");
            if rank == 1 {
                c.env("MASTER_ADDR", &proxy_addr);
            }
        }
    };

    // Untouched: exact, and the bytes on the path say nothing.
    let capture = dir.join("clean");
    let port = 29581;
    let p = proxy(&tb, port, &capture, None);
    let outs = run_in_bed_with(&tb, &[0, 1], &args, &[], port, &through(&tb));
    assert_exact("all_reduce through the proxy", &outs, 1);
    std::thread::sleep(Duration::from_millis(300));
    drop(p);
    let bytes = std::fs::read(&capture).expect("the proxy's capture");
    assert!(
        bytes.len() > 500,
        "only {} bytes went through the proxy",
        bytes.len()
    );
    for h in 0..2 {
        let ip = tb.host_addr(h);
        assert!(
            !contains(&bytes, ip.to_string().as_bytes()),
            "{ip} in clear on the path"
        );
        assert!(!contains(&bytes, &ip.octets()), "{ip}'s bytes on the path");
    }
    for word in [&b"endpoint"[..], b"rank", b"tcp", b"addr"] {
        assert!(
            !contains(&bytes, word),
            "`{}` in clear on the path",
            String::from_utf8_lossy(word)
        );
    }

    // One bit flipped past the handshake, toward the store: rank 1 fails, naming the record.
    let capture = dir.join("flipped");
    let port = 29582;
    let p = proxy(&tb, port, &capture, Some(400));
    let t = Instant::now();
    let outs = run_in_bed_with(&tb, &[0, 1], &args, &[], port, &through(&tb));
    // The proxy marks the flip on its next 100 ms tick; the ranks may be done before it.
    std::thread::sleep(Duration::from_millis(300));
    drop(p);
    assert!(
        Path::new(&format!("{}.tampered", capture.display())).exists(),
        "the flip never happened: fewer than 400 bytes toward the store"
    );
    let err = |r: usize| String::from_utf8_lossy(&outs[r].stderr).into_owned();
    assert!(
        !outs[1].status.success(),
        "rank 1 ran through a flipped bit"
    );
    let all = format!("{}\n{}", err(0), err(1));
    assert!(all.contains("record"), "no rank named the record:\n{all}");
    assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
    let _ = std::fs::remove_dir_all(&dir);
}
