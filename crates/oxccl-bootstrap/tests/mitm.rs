//! The store's wire through a man in the middle (`oxccl_seal::Proxy`): a record flipped,
//! replayed, dropped or swapped, either way, fails that connection with an error that names
//! the peer and what went wrong; the server applies no tampered request (a clean client checks
//! the table afterwards); the untampered exchange through the proxy works, and the bytes it
//! carried show none of the keys or values set.

use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Mutex, Once};
use std::time::Duration;

use oxccl_bootstrap::wire::frame_len;
use oxccl_bootstrap::{ClientOptions, Error, Secret, Store, StoreServer, TcpStore};
use oxccl_seal::mitm::{Plan, Proxy, Tamper, Toward, holds};

const T: Duration = Duration::from_secs(10);
/// A value that spans two records (records carry at most 64 KiB).
const BIG: usize = 100 << 10;
/// What the values carry: an endpoint-like pattern a stranger must not see.
const PATTERN: &[u8] = b"tcp 10.77.0.3:41234 rkey=0x5eedf00d";
const KEY: &str = "oxccl/job/endpoint/rank-3-hidden-key-name";

/// Every log line of the test binary (the server logs why it closes a connection).
static LOG: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct LogWriter;
impl Write for LogWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        LOG.lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn logging() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        tracing_subscriber::fmt()
            .with_writer(|| LogWriter)
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .init();
    });
}

/// The log lines that mention `what`.
fn log_lines(what: &str) -> Vec<String> {
    let log = LOG.lock().unwrap_or_else(|p| p.into_inner());
    String::from_utf8_lossy(&log)
        .lines()
        .filter(|l| l.contains(what))
        .map(str::to_owned)
        .collect()
}

/// Waits (up to 10 s) for a log line that mentions `what`.
fn log_line(what: &str) -> String {
    let t = std::time::Instant::now();
    loop {
        if let Some(l) = log_lines(what).pop() {
            return l;
        }
        assert!(t.elapsed() < T, "no log line mentions {what:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn secret() -> Secret {
    Secret::new("mitm test secret").unwrap()
}

/// The store's cleartext handshake: toward the server, the client's `Auth` frame; toward the
/// client, the server's `Hello` and `AuthOk` frames. Frames are a 4-byte length and a body.
fn store_handshake(dir: Toward, seen: &[u8]) -> Option<usize> {
    let frames = match dir {
        Toward::Target => 1,
        Toward::Client => 2,
    };
    let mut at = 0;
    for _ in 0..frames {
        at += 4 + frame_len(seen.get(at..)?)?;
    }
    (seen.len() >= at).then_some(at)
}

fn proxy(server: &StoreServer, tamper: Tamper, toward: Toward) -> Proxy {
    Proxy::start(
        server.addr(),
        Plan {
            tamper,
            toward,
            connection: 0,
            handshake: store_handshake,
        },
    )
    .unwrap()
}

/// A client of `addr` named `label` (the server's log names it), failing fast.
fn client(addr: SocketAddr, label: &str) -> TcpStore {
    TcpStore::connect_with(
        &addr.to_string(),
        &secret(),
        &ClientOptions {
            connect_timeout: T,
            reply_timeout: Duration::from_secs(5),
            label: label.into(),
            abort: None,
        },
    )
    .unwrap()
}

/// A value of `len` bytes full of [`PATTERN`].
fn value(len: usize) -> Vec<u8> {
    PATTERN.iter().copied().cycle().take(len).collect()
}

/// Asserts that the client's error names the store (through the proxy) and says a reply
/// failed authentication.
fn assert_reply_rejected(e: &Error, proxy: &Proxy, what: &str) {
    let msg = e.to_string();
    assert!(matches!(e, Error::Protocol { .. }), "{what}: {msg}");
    assert!(msg.contains(&proxy.addr().to_string()), "{what}: {msg}");
    assert!(msg.contains("failed authentication"), "{what}: {msg}");
}

#[test]
fn the_untampered_exchange_works_and_shows_nothing_it_carried() {
    logging();
    let server = StoreServer::bind("127.0.0.1:0", secret()).unwrap();
    let p = proxy(&server, Tamper::None, Toward::Target);
    let c = client(p.addr(), "clean client");
    c.set(KEY, &value(64)).unwrap();
    c.set("big", &value(BIG)).unwrap();
    assert_eq!(c.get(KEY, T).unwrap(), value(64));
    assert_eq!(c.get("big", T).unwrap(), value(BIG));
    assert_eq!(c.add("counter", 5).unwrap(), 5);
    let o = c.compare_set("cas-key-name", None, PATTERN).unwrap();
    assert!(o.swapped);
    drop(c);
    let seen = p.captured();
    assert!(
        seen.len() > 2 * BIG,
        "the proxy carried {} bytes",
        seen.len()
    );
    for needle in [
        PATTERN,
        KEY.as_bytes(),
        b"cas-key-name",
        b"counter",
        b"rkey=",
    ] {
        assert!(
            !holds(&seen, needle),
            "{:?} crossed the wire in clear",
            String::from_utf8_lossy(needle)
        );
    }
    // Nor the client's name: it goes sealed, after the handshake.
    assert!(
        !holds(&seen, b"clean client"),
        "the client's name crossed in clear"
    );
}

#[test]
fn a_flipped_request_is_not_applied_and_both_ends_name_the_record() {
    logging();
    let server = StoreServer::bind("127.0.0.1:0", secret()).unwrap();
    // Record 0 toward the store is the client's name; record 1 its first request.
    let p = proxy(&server, Tamper::FlipBit { record: 1 }, Toward::Target);
    let c = client(p.addr(), "flip-target client");
    let e = c.set(KEY, &value(64)).unwrap_err();
    assert!(
        p.tampered_within(Duration::from_secs(2)),
        "the proxy did not flip a bit"
    );
    // The store says why, sealed, before it closes.
    assert!(matches!(e, Error::Rejected { .. }), "{e}");
    assert!(
        e.to_string().contains("record 1 failed authentication"),
        "{e}"
    );
    let line = log_line("flip-target client");
    assert!(line.contains("closing store connection"), "{line}");
    assert!(line.contains("record 1 failed authentication"), "{line}");
    // The server's table never saw the set.
    let clean = client(server.addr(), "checker");
    assert!(!clean.check(&[KEY]).unwrap());
    assert_eq!(server.store().len(), 0);
}

#[test]
fn a_replayed_request_is_applied_once() {
    logging();
    let server = StoreServer::bind("127.0.0.1:0", secret()).unwrap();
    let p = proxy(&server, Tamper::Replay { record: 1 }, Toward::Target);
    let c = client(p.addr(), "replay-target client");
    // The first copy is the client's own request (it may see its reply, or the connection
    // closed once the replay arrives); the replay is refused.
    let _ = c.add("counter", 1);
    assert!(
        p.tampered_within(Duration::from_secs(2)),
        "the proxy did not replay"
    );
    let line = log_line("replay-target client");
    assert!(line.contains("closing store connection"), "{line}");
    assert!(
        line.contains("record 1 arrived where record 2 was due"),
        "{line}"
    );
    let clean = client(server.addr(), "checker");
    assert_eq!(
        clean.add("counter", 0).unwrap(),
        1,
        "the replay was applied"
    );
}

#[test]
fn a_dropped_or_swapped_request_record_is_not_applied() {
    logging();
    for (tamper, label) in [
        (Tamper::Drop { record: 1 }, "drop-target client"),
        (Tamper::Swap { record: 1 }, "swap-target client"),
    ] {
        let server = StoreServer::bind("127.0.0.1:0", secret()).unwrap();
        let p = proxy(&server, tamper, Toward::Target);
        let c = client(p.addr(), label);
        // Two records (1 and 2: record 0 is the client's name): the first dropped (or sent
        // second), the other arrives out of order.
        let e = c.set(KEY, &value(BIG)).unwrap_err();
        assert!(
            p.tampered_within(Duration::from_secs(2)),
            "{label}: the proxy did not tamper"
        );
        assert!(
            e.to_string()
                .contains("record 2 arrived where record 1 was due"),
            "{label}: {e}"
        );
        let line = log_line(label);
        assert!(line.contains("closing store connection"), "{line}");
        assert!(
            line.contains("record 2 arrived where record 1 was due"),
            "{line}"
        );
        let clean = client(server.addr(), "checker");
        assert!(
            !clean.check(&[KEY]).unwrap(),
            "{label}: the set was applied"
        );
        assert_eq!(server.store().len(), 0, "{label}");
    }
}

#[test]
fn a_tampered_name_closes_the_connection_before_any_request() {
    logging();
    let server = StoreServer::bind("127.0.0.1:0", secret()).unwrap();
    let p = proxy(&server, Tamper::FlipBit { record: 0 }, Toward::Target);
    let c = client(p.addr(), "flip-name client");
    assert!(c.set(KEY, b"v").is_err());
    assert!(p.tampered_within(Duration::from_secs(2)));
    let line = log_line("no name");
    assert!(line.contains("record 0 failed authentication"), "{line}");
    assert!(server.clients().is_empty() || server.clients() == [""]);
    assert_eq!(server.store().len(), 0);
}

#[test]
fn a_tampered_reply_fails_the_client_naming_the_store() {
    logging();
    for tamper in [
        Tamper::FlipBit { record: 0 },
        Tamper::Replay { record: 0 },
        Tamper::Drop { record: 0 },
        Tamper::Swap { record: 0 },
    ] {
        let server = StoreServer::bind("127.0.0.1:0", secret()).unwrap();
        server.store().set(KEY, &value(BIG)).unwrap();
        let p = proxy(&server, tamper, Toward::Client);
        let c = client(p.addr(), "reply client");
        // The reply spans two records; nothing of a tampered one reaches the caller.
        let r = c.get(KEY, T);
        assert!(
            p.tampered_within(Duration::from_secs(2)),
            "{tamper:?}: the proxy did not tamper"
        );
        match (tamper, r) {
            // A replayed record after a complete reply: the next call sees it.
            (Tamper::Replay { .. }, Ok(v)) => {
                assert_eq!(v, value(BIG));
                let e = c.get(KEY, T).unwrap_err();
                assert_reply_rejected(&e, &p, &format!("{tamper:?}"));
            }
            (_, Ok(_)) => panic!("{tamper:?}: a tampered reply was accepted"),
            (_, Err(e)) => assert_reply_rejected(&e, &p, &format!("{tamper:?}")),
        }
        // The connection is not used again.
        assert!(c.get(KEY, T).is_err());
    }
}

/// A rank whose requests are tampered with on the way fails naming the record, and tells the
/// others over a fresh connection: they fail at once with its error instead of waiting out
/// their timeout for it.
#[test]
fn a_rank_whose_join_is_tampered_with_fails_and_the_others_learn_why() {
    use oxccl_bootstrap::{Bootstrap, Config};
    logging();
    let server = StoreServer::bind("127.0.0.1:0", secret()).unwrap();
    // Rank 1's record 2 (after its name and its first request) is flipped.
    let p = proxy(&server, Tamper::FlipBit { record: 2 }, Toward::Target);
    let timeout = Duration::from_secs(60);
    let rank = |rank: usize, addr: SocketAddr| {
        let mut config = Config::new(rank, 2, addr.to_string(), secret());
        config.serve_store = false;
        config.timeout = timeout;
        std::thread::spawn(move || Bootstrap::new(config).map(drop))
    };
    let t = std::time::Instant::now();
    let zero = rank(0, server.addr());
    let one = rank(1, p.addr());
    let e1 = one.join().unwrap().unwrap_err();
    let e0 = zero.join().unwrap().unwrap_err();
    assert!(p.tampered_within(Duration::from_secs(2)));
    assert!(
        e1.to_string().contains("record 2 failed authentication"),
        "{e1}"
    );
    match &e0 {
        Error::RankFailed { rank: 1, message } => {
            assert!(message.contains("record 2 failed authentication"), "{e0}")
        }
        e => panic!("rank 0: {e}"),
    }
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t.elapsed()
    );
}
