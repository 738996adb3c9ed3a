//! Cross-process hammer tests: long streams through small receive rings in both directions at
//! once, immediates in order, and atomics from three processes on the same words. Each test body
//! is instantiated per provider by `hammer!` at the bottom, like the conformance suite.
//!
//! The loops themselves ([`common::run_stream`], [`common::atomic_hammer`]) are shared by the test
//! process and the peers, so both ends of a queue pair run the same checked code.

mod common;

use std::time::Instant;

use common::*;
use oxccl_verbs::*;

/// Entry point of the peer process (does nothing unless `OXCCL_TEST_PEER` is set).
#[test]
#[ignore = "the peer process of the hammer tests, started by the tests themselves"]
fn peer_process_entry() {
    peer_main();
}

/// Receives each end keeps posted: the receive rings are this deep, so they wrap thousands of
/// times, and the send window (4×) runs into RNR back-pressure whenever the receiver lags.
const DEPTH: usize = 64;

fn stream_spec() -> QpSpec {
    QpSpec {
        max_recv_wr: DEPTH as u32,
        timeout_ms: 10_000,
        ..QpSpec::default()
    }
}

fn check_stream(who: &str, r: &StreamReport, cfg: &StreamCfg) {
    assert!(
        r.errors == 0 && r.first_errors.is_empty(),
        "{who}: {} errors, first: {:#?}",
        r.errors,
        r.first_errors
    );
    assert_eq!((r.sent, r.received), (cfg.send, cfg.recv), "{who}: {r:?}");
}

/// Runs `local` here and its mirror in the peer at the same time, over one queue pair.
fn duplex(p: &str, local: StreamCfg) -> (StreamReport, StreamReport, std::time::Duration) {
    let mut peer = Peer::spawn(p);
    let l = Local::new(p);
    let qp = l.connect(&mut peer, 0, &stream_spec());
    let ring_len = local.slots * local.max_len;
    // WRITE_WITH_IMM lands in a ring of slots on each side.
    let (mine, theirs) = match local.mode {
        StreamMode::Send => (None, None),
        StreamMode::WriteImm => {
            let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
            let mine = l.pd.alloc_mr(ring_len, access).unwrap();
            let theirs = peer.alloc(ring_len, access);
            (Some(mine), Some(theirs))
        }
    };
    let local = StreamCfg {
        remote: theirs.map(|t| t.1),
        ..local
    };
    let remote_cfg = local.mirrored(mine.as_ref().map(|m| m.remote()));
    let t = Instant::now();
    let (a, b) = std::thread::scope(|s| {
        let h = s.spawn(|| peer.stream(0, theirs.map(|t| t.0), &remote_cfg));
        let a = run_stream(&qp, &l.cq, &l.pd, mine.as_ref(), &local);
        (a, h.join().expect("peer thread"))
    });
    let took = t.elapsed();
    check_stream("local end", &a, &local);
    check_stream("peer end", &b, &remote_cfg);
    assert_eq!(qp.state(), QpState::Rts);
    assert_eq!(peer.state(0), QpState::Rts);
    (a, b, took)
}

/// 200,000 SENDs of 1..=256 bytes from here to the peer and 100,000 back at the same time,
/// through 64-deep receive rings: every message arrives once, in order, intact; the sender's
/// window is four times the receive depth, so it keeps running into RNR back-pressure.
pub fn send_recv_duplex(p: &str) {
    let (n, back) = (200_000, 100_000);
    let cfg = StreamCfg {
        mode: StreamMode::Send,
        send: n,
        recv: back,
        depth: DEPTH,
        window: 4 * DEPTH,
        max_len: 256,
        tx_seed: 1,
        rx_seed: 2,
        remote: None,
        slots: 0,
        timeout_ms: 30_000,
    };
    let (a, b, took) = duplex(p, cfg);
    eprintln!(
        "send/recv duplex: {n} messages there, {back} back, in {took:?} (window full {} / {} \
         times)",
        a.window_full, b.window_full
    );
}

/// 100,000 WRITE_WITH_IMMs each way at once, immediate = sequence number: every immediate arrives
/// exactly once, in order, and its bytes are in place when it does.
pub fn write_imm_duplex(p: &str) {
    let n = 100_000;
    let cfg = StreamCfg {
        mode: StreamMode::WriteImm,
        send: n,
        recv: n,
        depth: DEPTH,
        window: 4 * DEPTH,
        max_len: 64,
        tx_seed: 3,
        rx_seed: 4,
        remote: None,
        slots: 2 * DEPTH,
        timeout_ms: 30_000,
    };
    let (a, b, took) = duplex(p, cfg);
    eprintln!(
        "write_imm duplex: {n} immediates each way in {took:?} (window full {} / {} times)",
        a.window_full, b.window_full
    );
}

/// Three processes (this one and two peers) each run fetch-and-adds on one word and
/// compare-and-swap increments on its neighbour, all at once. The word's owner is one of the
/// peers, which reaches its own memory through a loopback queue pair, so all three go through
/// the provider; they start together (a barrier on a third word). Checks: no update lost, and
/// the old values form one linear history.
pub fn atomics_three_processes(p: &str) {
    let (n_faa, n_cas) = (20_000u64, 4_000u64);
    // Addends in separate bit fields, so the final value counts each process's additions.
    let adds = [1u64, 1 << 21, 1 << 42];
    let mut owner = Peer::spawn(p);
    let mut other = Peer::spawn(p);
    let l = Local::new(p);
    let spec = QpSpec::default();
    let (id, rb) = owner.alloc(64, AccessFlags::ALL);
    // here -> owner (owner's qp 0)
    let qp = l.connect(&mut owner, 0, &spec);
    // other (qp 0) -> owner (qp 1)
    let ep_other = other.setup(0, &spec);
    let ep_owner = owner.setup(1, &spec);
    other.ok(Cmd::Connect {
        qp: 0,
        ep: ep_owner,
    });
    owner.ok(Cmd::Connect {
        qp: 1,
        ep: ep_other,
    });
    // owner's loopback: qp 2 <-> qp 3
    let ep2 = owner.setup(2, &spec);
    let ep3 = owner.setup(3, &spec);
    owner.ok(Cmd::Connect { qp: 2, ep: ep3 });
    owner.ok(Cmd::Connect { qp: 3, ep: ep2 });
    let cfg = |add| AtomicCfg {
        faa: rb.at(0),
        cas: rb.at(8),
        n_faa,
        n_cas,
        add,
        burst: 4,
        barrier: Some((rb.at(16), 3)),
        timeout_ms: 30_000,
    };
    let t = Instant::now();
    let (c1, c2) = (cfg(adds[1]), cfg(adds[2]));
    let reports = std::thread::scope(|s| {
        let h1 = s.spawn(|| owner.atomic_hammer(2, &c1));
        let h2 = s.spawn(|| other.atomic_hammer(0, &c2));
        let mine = atomic_hammer(&qp, &l.cq, &l.pd, &cfg(adds[0]));
        [mine, h1.join().unwrap(), h2.join().unwrap()]
    });
    let took = t.elapsed();
    for (k, r) in reports.iter().enumerate() {
        assert!(r.errors.is_empty(), "process {k}: {:?}", r.errors);
        assert_eq!(r.faa_old.len() as u64, n_faa, "process {k}");
        assert_eq!(r.cas_won.len() as u64, n_cas, "process {k}");
        assert!(
            r.faa_old.windows(2).all(|w| w[1] > w[0]),
            "process {k}: its fetch-and-add results do not increase"
        );
        assert!(
            r.cas_won.windows(2).all(|w| w[1] > w[0]),
            "process {k}: its compare-and-swap wins do not increase"
        );
    }
    // Fetch-and-add: sorted by old value, each result is the previous one plus the previous
    // request's addend, from 0 to the final value: one linear history, nothing lost or doubled.
    let mut history: Vec<(u64, u64)> = reports
        .iter()
        .zip(adds)
        .flat_map(|(r, add)| r.faa_old.iter().map(move |&o| (o, add)))
        .collect();
    history.sort_unstable();
    let mut value = 0u64;
    for (i, &(old, add)) in history.iter().enumerate() {
        assert_eq!(old, value, "fetch-and-add #{i} of the merged history");
        value = value.wrapping_add(add);
    }
    let total = n_faa * adds.iter().sum::<u64>();
    assert_eq!(value, total);
    assert_eq!(
        owner.read(id, 0, 8),
        total.to_ne_bytes(),
        "fetch-and-add word"
    );
    // Compare-and-swap: the winners replaced 0, 1, 2, … each exactly once.
    let mut won: Vec<u64> = reports.iter().flat_map(|r| r.cas_won.clone()).collect();
    won.sort_unstable();
    assert_eq!(
        won,
        (0..3 * n_cas).collect::<Vec<_>>(),
        "compare-and-swap wins"
    );
    assert_eq!(
        owner.read(id, 8, 8),
        (3 * n_cas).to_ne_bytes(),
        "compare-and-swap word"
    );
    let retries: Vec<u64> = reports.iter().map(|r| r.cas_retries).collect();
    // How interleaved the history is (how often the next increment came from another process).
    let switches = history.windows(2).filter(|w| w[0].1 != w[1].1).count();
    eprintln!(
        "atomics, 3 processes: {} fetch-and-adds and {} CAS increments in {took:?}; CAS retries \
         {retries:?}; the fetch-and-add history changes process {switches} times",
        3 * n_faa,
        3 * n_cas
    );
}

/// Instantiates every hammer test for one provider.
macro_rules! hammer {
    ($module:ident, $provider:literal) => {
        mod $module {
            #[test]
            fn send_recv_duplex() {
                super::send_recv_duplex($provider)
            }
            #[test]
            fn write_imm_duplex() {
                super::write_imm_duplex($provider)
            }
            #[test]
            fn atomics_three_processes() {
                super::atomics_three_processes($provider)
            }
        }
    };
}

hammer!(shm, "shm");
hammer!(tcp, "tcp");
#[cfg(feature = "ofi")]
hammer!(ofi, "ofi");
#[cfg(feature = "ofi")]
hammer!(ofi_shm, "ofi:shm");
