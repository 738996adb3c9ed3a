//! The client and the server over real loopback sockets, in one process.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use crate::wire::{self, Msg, NONCE_LEN, PROTOCOL_VERSION};
use crate::*;

const T: Duration = Duration::from_secs(5);

fn secret() -> Secret {
    Secret::new("net-tests").unwrap()
}

fn server() -> StoreServer {
    StoreServer::bind("127.0.0.1:0", secret()).unwrap()
}

fn client(s: &StoreServer) -> TcpStore {
    TcpStore::connect(&s.addr().to_string(), &secret(), T).unwrap()
}

#[test]
fn every_operation_over_tcp() {
    let s = server();
    let c = client(&s);
    c.set("a", b"1").unwrap();
    assert_eq!(c.get("a", T).unwrap(), b"1");
    let big = vec![7u8; 1 << 20];
    c.set("big", &big).unwrap();
    assert_eq!(
        c.multi_get(&["a", "big"], T).unwrap(),
        vec![b"1".to_vec(), big]
    );
    c.wait(&["a", "big"], T).unwrap();
    assert!(c.check(&["a"]).unwrap());
    assert!(!c.check(&["a", "nope"]).unwrap());
    assert_eq!(c.add("n", 3).unwrap(), 3);
    assert_eq!(c.add("n", -1).unwrap(), 2);
    match c.add("a", 1).and_then(|_| c.add("big", 1)) {
        Err(Error::Rejected { addr, message }) => {
            assert_eq!(addr, s.addr().to_string());
            assert!(message.contains("not an integer"), "{message}");
        }
        r => panic!("{r:?}"),
    }
    assert!(c.compare_set("c", None, b"x").unwrap().swapped);
    let o = c.compare_set("c", Some(b"y"), b"z").unwrap();
    assert_eq!(
        o,
        CasOutcome {
            swapped: false,
            current: Some(b"x".to_vec())
        }
    );
    assert!(c.delete("c").unwrap());
    assert!(!c.delete("c").unwrap());
    match c.multi_get(&["a", "p", "q"], Duration::from_millis(50)) {
        Err(Error::Timeout { addr, missing, .. }) => {
            assert_eq!(addr, s.addr().to_string());
            assert_eq!(missing, ["p", "q"]);
        }
        r => panic!("{r:?}"),
    }
    // Client-side argument checks.
    assert!(matches!(
        c.set(&"k".repeat(wire::MAX_KEY_LEN + 1), b""),
        Err(Error::InvalidArgument(_))
    ));
    // The connection is still good after all of that; the server sees one client.
    assert_eq!(c.get("n", T).unwrap(), b"2");
    assert_eq!(s.clients().len(), 1);
    assert!(s.clients()[0].starts_with("pid "));
}

#[test]
fn a_wait_is_woken_by_another_client() {
    let s = server();
    let (a, b) = (client(&s), client(&s));
    let t = thread::spawn(move || a.get("k", T));
    thread::sleep(Duration::from_millis(30));
    b.set("k", b"v").unwrap();
    assert_eq!(t.join().unwrap().unwrap(), b"v");
    // The server's own process sees the same store.
    assert_eq!(s.store().get("k", T).unwrap(), b"v");
}

/// Two hosts that share no home directory each make their own per-user secret: the store's
/// refusal tells the rank which file it used, on which host, and the two ways to agree.
#[test]
fn per_user_secrets_of_two_homes_are_refused_with_the_file_host_and_fixes() {
    let base = std::env::temp_dir().join(format!("oxccl-two-homes-{}", std::process::id()));
    let (a, b) = (base.join("a/secret"), base.join("b/secret"));
    let store_secret = Secret::user_default_at(&a).unwrap();
    let s = StoreServer::bind("127.0.0.1:0", store_secret).unwrap();
    let rank_secret = Secret::user_default_at(&b).unwrap();
    let e = TcpStore::connect(&s.addr().to_string(), &rank_secret, T).unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, Error::AuthRefused { .. }), "{m}");
    for want in [
        b.to_str().unwrap(),
        &crate::bootstrap::hostname(),
        "copy that file",
        "OXCCL_SECRET",
    ] {
        assert!(m.contains(want), "{want:?} not in {m}");
    }
    std::fs::remove_dir_all(&base).unwrap();
}

#[test]
fn a_wrong_secret_is_refused_and_others_are_undisturbed() {
    let s = server();
    let good = client(&s);
    good.set("rkey", b"secret stuff").unwrap();
    let bad = Secret::new("not-it").unwrap();
    match TcpStore::connect(&s.addr().to_string(), &bad, T) {
        Err(e @ Error::AuthRefused { .. }) => {
            let m = e.to_string();
            assert!(
                m.contains(&s.addr().to_string()) && m.contains("wrong secret"),
                "{m}"
            );
        }
        r => panic!("{r:?}"),
    }
    assert_eq!(good.get("rkey", T).unwrap(), b"secret stuff");
    assert_eq!(s.clients().len(), 1);
}

#[test]
fn a_request_before_authenticating_gets_nothing() {
    let s = server();
    s.store().set("rkey", b"secret stuff").unwrap();
    let mut raw = TcpStream::connect(s.addr()).unwrap();
    raw.set_read_timeout(Some(T)).unwrap();
    let hello = wire::read_msg(&mut raw, 4096).unwrap();
    assert!(matches!(hello, Msg::Hello { .. }));
    wire::write_msg(
        &mut raw,
        &Msg::Get {
            keys: vec!["rkey".into()],
            timeout_ms: 0,
        },
    )
    .unwrap();
    let mut rest = Vec::new();
    let _ = raw.read_to_end(&mut rest);
    // Only a refusal, then the connection closes.
    let (msg, used) = wire::decode(&rest).unwrap();
    assert!(matches!(msg, Msg::AuthFail { .. }), "{msg:?}");
    assert_eq!(used, rest.len());
    assert!(!rest.windows(6).any(|w| w == b"secret"));
}

#[test]
fn garbage_and_broken_clients_do_not_disturb_the_store() {
    let s = server();
    let good = client(&s);
    good.set("k", b"v").unwrap();
    // Pending wait of a good client across all the abuse below.
    let waiter = client(&s);
    let t = thread::spawn(move || waiter.get("later", T));

    let abuse: Vec<Vec<u8>> = vec![
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        vec![0xff; 64],                           // 4 GiB announced
        vec![0, 1, 0, 0],                         // 256 bytes announced, none sent
        vec![5, 0, 0, 0, 2, 1, 2],                // an Auth cut short, then EOF
        wire::encode(&Msg::Done).unwrap(),        // a reply where Auth belongs
        (0..=255u8).cycle().take(5000).collect(), // noise
    ];
    for bytes in abuse {
        let mut raw = TcpStream::connect(s.addr()).unwrap();
        raw.set_read_timeout(Some(T)).unwrap();
        let _ = raw.write_all(&bytes);
        let _ = raw.shutdown(std::net::Shutdown::Write);
        // The server closes the connection (after a greeting, maybe a refusal).
        let mut sink = Vec::new();
        let _ = raw.read_to_end(&mut sink);
    }
    // Connect and vanish without a word.
    drop(TcpStream::connect(s.addr()).unwrap());

    // An authenticated client that then sends garbage is closed; nobody else notices.
    let bad = client(&s);
    {
        let mut conn = bad.conn_for_tests();
        conn.write_all(&[0xff, 0xff, 0xff, 0x7f, 1, 2, 3]).unwrap();
    }
    assert!(bad.get("k", T).is_err());

    assert_eq!(good.get("k", T).unwrap(), b"v");
    good.set("later", b"ok").unwrap();
    assert_eq!(t.join().unwrap().unwrap(), b"ok");
}

#[test]
fn a_stopped_store_fails_pending_and_later_calls_quickly() {
    let s = server();
    let addr = s.addr().to_string();
    let c = client(&s);
    let t = thread::spawn(move || {
        let start = Instant::now();
        let pending = c.get("never", Duration::from_secs(60));
        let later = c.set("x", b"y");
        (pending, later, start.elapsed())
    });
    thread::sleep(Duration::from_millis(50));
    drop(s);
    let (pending, later, elapsed) = t.join().unwrap();
    assert!(elapsed < Duration::from_secs(3), "{elapsed:?}");
    for r in [pending.map(drop), later] {
        let e = r.unwrap_err();
        assert!(e.is_store_gone(), "{e}");
        assert!(e.to_string().contains(&addr), "{e}");
    }
}

#[test]
fn clients_retry_until_the_store_starts() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let a = addr.clone();
    let t = thread::spawn(move || TcpStore::connect(&a, &secret(), T));
    thread::sleep(Duration::from_millis(100));
    // Another test may have taken the port meanwhile: then there is nothing to check.
    let Ok(s) = StoreServer::bind(&addr, secret()) else {
        return;
    };
    let c = t.join().unwrap().unwrap();
    c.set("k", b"v").unwrap();
    assert_eq!(s.store().get("k", T).unwrap(), b"v");
}

#[test]
fn connect_timeout_names_the_address() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let start = Instant::now();
    let e = TcpStore::connect(&addr, &secret(), Duration::from_millis(200)).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(3));
    assert!(matches!(e, Error::Connect { .. }), "{e}");
    assert!(e.to_string().contains(&addr), "{e}");
}

#[test]
fn port_in_use_names_the_address() {
    let held = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = held.local_addr().unwrap().to_string();
    let e = StoreServer::bind(&addr, secret()).unwrap_err();
    assert!(matches!(e, Error::AddrInUse { .. }), "{e}");
    let m = e.to_string();
    assert!(m.contains(&addr) && m.contains("already in use"), "{m}");
}

/// A fake store: greets, accepts any answer, proves nothing; records what the client sends
/// after that.
fn fake_store(
    reply: impl FnOnce(&mut TcpStream) + Send + 'static,
) -> (String, thread::JoinHandle<Vec<u8>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let t = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        reply(&mut s);
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        rest
    });
    (addr, t)
}

#[test]
fn a_server_without_the_secret_gets_nothing() {
    let (addr, t) = fake_store(|s| {
        wire::write_msg(
            s,
            &Msg::Hello {
                version: PROTOCOL_VERSION,
                nonce: [1; NONCE_LEN],
            },
        )
        .unwrap();
        let auth = wire::read_msg(s, 4096).unwrap();
        assert!(matches!(auth, Msg::Auth { .. }));
        wire::write_msg(
            s,
            &Msg::AuthOk {
                mac: [0; NONCE_LEN],
            },
        )
        .unwrap();
    });
    let e = TcpStore::connect(&addr, &secret(), T).unwrap_err();
    assert!(matches!(e, Error::StoreNotAuthentic { .. }), "{e}");
    assert!(e.to_string().contains(&addr));
    // The client closed without sending a request.
    assert!(t.join().unwrap().is_empty());
}

#[test]
fn a_server_that_is_not_a_store_is_named() {
    let (addr, t) = fake_store(|s| {
        s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").unwrap();
    });
    let e = TcpStore::connect(&addr, &secret(), T).unwrap_err();
    assert!(matches!(e, Error::Protocol { .. }), "{e}");
    assert!(e.to_string().contains("not an oxccl store"), "{e}");
    drop(t.join());
}

#[test]
fn rank_zero_serves_and_closes_after_the_others() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let threads: Vec<_> = (0..3)
        .map(|rank| {
            let mut config = Config::new(rank, 3, addr.clone(), secret());
            config.timeout = T;
            let addr = addr.clone();
            thread::spawn(move || -> Result<Vec<Vec<u8>>> {
                let b = Bootstrap::new(config)?;
                assert_eq!(b.server().is_some(), rank == 0);
                // Every rank's errors name the store by its address, rank 0's too.
                assert_eq!(b.store().location(), addr);
                assert_eq!(b.store_addr(), addr);
                let v = b.all_gather("x", &[rank as u8])?;
                if rank == 2 {
                    // The last rank lingers: rank 0's close waits for it.
                    thread::sleep(Duration::from_millis(200));
                    b.store().set("late", b"still served")?;
                }
                b.close()?;
                Ok(v)
            })
        })
        .collect();
    for t in threads {
        match t.join().unwrap() {
            Ok(v) => assert_eq!(v, vec![vec![0], vec![1], vec![2]]),
            // Another test took the port between our probe and rank 0's bind.
            Err(Error::AddrInUse { .. }) => return,
            Err(e) => panic!("{e}"),
        }
    }
}

/// A client blocked in a long wait is broken at once by its interrupter; rank 0 does not wait
/// for a service-labelled client to leave, and does wait for the others.
#[test]
fn an_interrupted_wait_ends_at_once_and_services_are_not_waited_for() {
    let s = server();
    let addr = s.addr().to_string();
    let opts = ClientOptions {
        connect_timeout: T,
        label: format!("{SERVICE_LABEL_PREFIX}test"),
        ..ClientOptions::default()
    };
    let service = std::sync::Arc::new(TcpStore::connect_with(&addr, &secret(), &opts).unwrap());
    let interrupter = service.interrupter().unwrap();
    let waiter = {
        let service = service.clone();
        thread::spawn(move || {
            let t = Instant::now();
            let r = service.wait(&["never"], Duration::from_secs(60));
            (r, t.elapsed())
        })
    };
    thread::sleep(Duration::from_millis(100));
    // The service is connected, yet nobody is waited for.
    assert_eq!(s.clients().len(), 1);
    let t = Instant::now();
    assert!(s.wait_for_clients_to_leave(T).is_empty());
    assert!(t.elapsed() < Duration::from_secs(1));
    interrupter.interrupt();
    let (r, took) = waiter.join().unwrap();
    assert!(matches!(r, Err(Error::StoreGone { .. })), "{r:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    // An ordinary client is waited for (until the timeout, then named).
    let _c = client(&s);
    // (The server labels a connection just after its side of the handshake.)
    let t = Instant::now();
    while !s.clients().iter().any(|l| l.starts_with("pid ")) && t.elapsed() < T {
        thread::sleep(Duration::from_millis(5));
    }
    let left = s.wait_for_clients_to_leave(Duration::from_millis(200));
    assert_eq!(left.len(), 1);
    assert!(left[0].starts_with("pid "), "{left:?}");
}

#[test]
fn a_capped_store_refuses_over_the_wire_naming_cap_knob_and_job() {
    let caps = StoreCaps {
        max_keys: 2,
        max_bytes: 1 << 10,
        job: StoreCaps::job_of(&secret()),
    };
    let s = StoreServer::bind_with("127.0.0.1:0", secret(), caps.clone()).unwrap();
    let c = client(&s);
    c.set("a", b"1").unwrap();
    c.set("b", b"2").unwrap();
    match c.set("c", b"3") {
        Err(Error::Rejected { addr, message }) => {
            assert_eq!(addr, s.addr().to_string());
            for part in [&caps.job as &str, "max_keys", STORE_MAX_KEYS_ENV, "\"c\""] {
                assert!(message.contains(part), "{part} missing from {message}");
            }
        }
        r => panic!("{r:?}"),
    }
    match c.set("a", &[0; 1 << 10]) {
        Err(Error::Rejected { message, .. }) => {
            assert!(message.contains(STORE_MAX_BYTES_ENV), "{message}")
        }
        r => panic!("{r:?}"),
    }
    // The connection still serves; nothing of the refused sets was stored (seen by another
    // client).
    let other = client(&s);
    assert!(!other.check(&["c"]).unwrap());
    assert_eq!(other.get("a", T).unwrap(), b"1");
    assert_eq!(s.store().len(), 2);
}
