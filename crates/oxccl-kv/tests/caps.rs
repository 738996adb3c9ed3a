//! What one authenticated peer can take from an engine: queue pairs and lanes per peer address
//! (refused over the cap, naming it and its knob, while other peers are still served), a
//! bounded notification queue (the oldest dropped and counted), and a peer-to-peer lookup of an
//! address where nobody listens (fails in about a second, naming it).

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::{Duration, Instant};

use oxccl_bootstrap::{MemoryStore, Secret};
use oxccl_kv::meta::{P2pMetadata, StoreMetadata};
use oxccl_kv::*;

fn secret() -> Secret {
    Secret::new("kv-caps-test-secret-0123456").unwrap()
}

/// A tcp engine named `name` at `ip` with `lanes` lanes.
fn config(name: &str, ip: [u8; 4], lanes: usize) -> EngineConfig {
    let mut c = EngineConfig::new(secret());
    c.protocol = Protocol::Tcp;
    c.name = Some(name.into());
    c.local_addr = SocketAddr::from((ip, 0));
    c.lanes = lanes;
    c.timeout = Duration::from_secs(10);
    c.peer_timeout = Duration::from_secs(2);
    c
}

fn store() -> Arc<dyn Metadata> {
    Arc::new(StoreMetadata::new(Arc::new(MemoryStore::new())))
}

const LEN: usize = 64 << 10;

/// Writes `fill` from `e` into segment `seg` (the target's buffer `tbuf`) and checks that
/// `target` holds it.
fn write_and_check(
    e: &TransferEngine,
    seg: SegmentId,
    target: &TransferEngine,
    tbuf: u64,
    fill: u8,
) {
    let src = e.allocate_managed_buffer(LEN).unwrap();
    e.write_local(src, &vec![fill; LEN]).unwrap();
    let w = TransferRequest {
        opcode: Opcode::Write,
        source: src,
        target_id: seg,
        target_offset: tbuf,
        length: LEN,
    };
    e.transfer_sync(&[w], None).unwrap();
    let mut got = vec![0; LEN];
    target.read_local(tbuf, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == fill), "{} wrote {fill}", e.name());
    e.free_managed_buffer(src).unwrap();
}

/// Opens `name` from `e` until it succeeds (a cap freed when a peer left), or panics after 10 s.
fn open_eventually(e: &TransferEngine, name: &str) -> SegmentId {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match e.open_segment(name) {
            Ok(s) => return s,
            Err(err) if Instant::now() < deadline => {
                let _ = err;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(err) => panic!("{name} still refuses {}: {err}", e.name()),
        }
    }
}

/// A target engine on 127.0.0.1 with `lanes` lanes and `cap` applied to its configuration,
/// over a fresh store: the store, the target and a buffer of it.
fn capped_target(
    lanes: usize,
    cap: impl FnOnce(&mut EngineConfig),
) -> (Arc<dyn Metadata>, TransferEngine, u64) {
    let meta = store();
    let mut tc = config("target", [127, 0, 0, 1], lanes);
    cap(&mut tc);
    let target = TransferEngine::new(tc, meta.clone()).unwrap();
    let tbuf = target.allocate_managed_buffer(LEN).unwrap();
    (meta, target, tbuf)
}

/// Asserts that `err` names each of `want`.
fn assert_names(err: &str, want: &[&str]) {
    for w in want {
        assert!(err.contains(w), "{w:?} not in: {err}");
    }
}

/// Engines "a", "b" and "c" on 127.0.0.1 (one peer address) with `lanes` lanes open the
/// target's segment in turn: the first two get in, the third is refused with an error naming
/// each of `want`. Returns the engines and the two open segments.
fn third_refused(
    meta: &Arc<dyn Metadata>,
    lanes: usize,
    want: &[&str],
) -> ([TransferEngine; 3], SegmentId, SegmentId) {
    let [a, b, c] = ["a", "b", "c"]
        .map(|n| TransferEngine::new(config(n, [127, 0, 0, 1], lanes), meta.clone()).unwrap());
    let sa = a.open_segment("target").unwrap();
    let sb = b.open_segment("target").unwrap();
    assert_names(&c.open_segment("target").unwrap_err().to_string(), want);
    ([a, b, c], sa, sb)
}

#[test]
fn queue_pairs_per_peer_are_capped_and_others_still_served() {
    // Three engines on 127.0.0.1: one peer address, two queue pairs allowed.
    let (meta, target, tbuf) = capped_target(2, |c| c.max_peer_qps = 2);
    let want = [
        "127.0.0.1",
        "\"c\"",
        "2 queue pairs",
        "cap of 2",
        "max_peer_qps",
        "OXCCL_KV_MAX_PEER_QPS",
    ];
    let ([a, b, c], sa, sb) = third_refused(&meta, 2, &want);
    // The engine still serves the peers within the cap, and another address.
    write_and_check(&a, sa, &target, tbuf, 1);
    write_and_check(&b, sb, &target, tbuf, 2);
    let d = TransferEngine::new(config("d", [127, 0, 0, 3], 2), meta.clone()).unwrap();
    let sd = d.open_segment("target").unwrap();
    write_and_check(&d, sd, &target, tbuf, 3);
    // A peer that leaves gives its queue pair back: the refused one gets in.
    drop(a);
    let sc = open_eventually(&c, "target");
    write_and_check(&c, sc, &target, tbuf, 4);
}

#[test]
fn lanes_per_peer_are_capped_and_counted_exactly() {
    let (meta, target, tbuf) = capped_target(4, |c| c.max_peer_lanes = 6);
    let a = TransferEngine::new(config("a", [127, 0, 0, 1], 4), meta.clone()).unwrap();
    let sa = a.open_segment("target").unwrap();
    // 4 + 4 > 6: refused, naming the lanes cap.
    let b = TransferEngine::new(config("b", [127, 0, 0, 1], 4), meta.clone()).unwrap();
    let err = b.open_segment("target").unwrap_err().to_string();
    assert_names(
        &err,
        &[
            "127.0.0.1",
            "4 lanes",
            "cap of 6",
            "max_peer_lanes",
            "OXCCL_KV_MAX_PEER_LANES",
        ],
    );
    // 4 + 2 = 6: the cap itself is allowed.
    let c = TransferEngine::new(config("c", [127, 0, 0, 1], 2), meta.clone()).unwrap();
    let sc = c.open_segment("target").unwrap();
    write_and_check(&a, sa, &target, tbuf, 5);
    write_and_check(&c, sc, &target, tbuf, 6);
    // Lanes count as the smaller wish of both sides: 16 asked, the target's 4 counted, so a
    // peer at another address still fits in 6.
    let d = TransferEngine::new(config("d", [127, 0, 0, 4], 16), meta.clone()).unwrap();
    let sd = d.open_segment("target").unwrap();
    write_and_check(&d, sd, &target, tbuf, 7);
}

#[test]
fn the_notification_queue_drops_the_oldest_and_counts() {
    for (cap, sent) in [(3usize, 8u8), (4096, 8)] {
        let meta = store();
        let mut tc = config("target", [127, 0, 0, 1], 1);
        tc.notify_queue = cap;
        let target = TransferEngine::new(tc, meta.clone()).unwrap();
        let tbuf = target.allocate_managed_buffer(LEN).unwrap();
        let a = TransferEngine::new(config("a", [127, 0, 0, 1], 1), meta).unwrap();
        let src = a.allocate_managed_buffer(LEN).unwrap();
        let seg = a.open_segment("target").unwrap();
        for i in 0..sent {
            a.write_local(src, &vec![i; LEN]).unwrap();
            let w = TransferRequest {
                opcode: Opcode::Write,
                source: src,
                target_id: seg,
                target_offset: tbuf,
                length: LEN,
            };
            a.transfer_sync(&[w], Some(format!("note-{i}").as_bytes()))
                .unwrap();
        }
        let kept = (sent as usize).min(cap);
        let dropped = sent as u64 - kept as u64;
        // Notifications go after the data, asynchronously: wait until all are accounted for.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut got = Vec::new();
        while got.len() < kept || target.notifies_dropped() < dropped {
            assert!(
                Instant::now() < deadline,
                "cap {cap}: {} taken, {} dropped",
                got.len(),
                target.notifies_dropped()
            );
            // Only once all arrived, so that the queue was full when they did.
            if target.notifies_dropped() == dropped {
                got.extend(target.wait_notifies(Duration::from_millis(100)));
            } else {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        assert_eq!(target.notifies_dropped(), dropped, "cap {cap}");
        let msgs: Vec<String> = got
            .iter()
            .map(|n| String::from_utf8(n.msg.clone()).unwrap())
            .collect();
        let want: Vec<String> = (sent as usize - kept..sent as usize)
            .map(|i| format!("note-{i}"))
            .collect();
        assert_eq!(msgs, want, "cap {cap}: the newest are kept, in order");
        assert!(got.iter().all(|n| n.from == "a"));
        // The data of the last batch is there (the queue drops notes, never data).
        let mut buf = vec![0; LEN];
        target.read_local(tbuf, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == sent - 1));
    }
}

/// An address where nobody listens: a port that was just free.
fn refused_addr() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

#[test]
fn a_p2p_lookup_of_a_refused_address_fails_in_about_a_second() {
    let addr = refused_addr();
    let meta = P2pMetadata::new(secret());
    let t = Instant::now();
    let err = meta
        .lookup(&addr.to_string(), Duration::from_secs(30))
        .unwrap_err();
    let took = t.elapsed();
    let text = err.to_string();
    eprintln!("a lookup of refused {addr} failed after {took:?}: {text}");
    assert!(
        took < Duration::from_secs(2) && took >= Duration::from_millis(900),
        "took {took:?}: {text}"
    );
    assert_names(
        &text,
        &[
            addr.to_string().as_str(),
            "nobody is listening",
            "refused",
            "OXCCL_KV_CONNECT_RETRY",
        ],
    );
    // Through an engine (30 s timeout) and its knob: as quickly, the same error.
    let mut c = config("x", [127, 0, 0, 1], 1);
    c.name = None;
    c.timeout = Duration::from_secs(30);
    c.connect_retry = Duration::from_millis(300);
    let meta = Arc::new(P2pMetadata::new(secret()).with_connect_retry(c.connect_retry));
    let e = TransferEngine::new(c, meta).unwrap();
    let t = Instant::now();
    let err = e.open_segment(&addr.to_string()).unwrap_err();
    eprintln!(
        "open_segment of refused {addr} (connect_retry 300 ms) failed after {:?}",
        t.elapsed()
    );
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert!(matches!(err, Error::SegmentNotFound { .. }), "{err}");
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
}

#[test]
fn a_p2p_lookup_waits_for_a_peer_that_is_starting() {
    let addr = refused_addr();
    let ip: IpAddr = addr.ip();
    // The peer starts 400 ms after the lookup began: within the retry of refused connections.
    let starter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(400));
        let mut c = config("ignored", [127, 0, 0, 1], 1);
        c.name = None;
        c.local_addr = SocketAddr::new(ip, addr.port());
        let e = TransferEngine::new(c, Arc::new(P2pMetadata::new(secret()))).unwrap();
        std::thread::sleep(Duration::from_secs(3));
        drop(e);
    });
    let meta = P2pMetadata::new(secret());
    let d = meta
        .lookup(&addr.to_string(), Duration::from_secs(10))
        .unwrap();
    assert_eq!(d.name, addr.to_string());
    assert_eq!(d.handshake, addr.to_string());
    starter.join().unwrap();
}

#[test]
fn handshake_connections_per_peer_are_capped() {
    // Each opened segment keeps its handshake connection: two from 127.0.0.1, the third
    // refused with the cap's name.
    let (meta, target, tbuf) = capped_target(1, |c| c.max_peer_conns = 2);
    let want = [
        "127.0.0.1",
        "\"c\"",
        "2 handshake connections",
        "max_peer_conns",
        "OXCCL_KV_MAX_PEER_CONNS",
    ];
    let ([a, _b, c], sa, _sb) = third_refused(&meta, 1, &want);
    // Others are served; and a peer that closes its segment gives the connection back.
    let d = TransferEngine::new(config("d", [127, 0, 0, 5], 1), meta.clone()).unwrap();
    let sd = d.open_segment("target").unwrap();
    write_and_check(&d, sd, &target, tbuf, 8);
    write_and_check(&a, sa, &target, tbuf, 9);
    a.close_segment(sa).unwrap();
    let sc = open_eventually(&c, "target");
    write_and_check(&c, sc, &target, tbuf, 10);
}
