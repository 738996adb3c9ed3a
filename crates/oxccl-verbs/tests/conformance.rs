//! The provider conformance suite: one body per behaviour, instantiated for every provider by
//! `conformance!` at the bottom. Each test runs against a peer in another process.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use oxccl_verbs::*;

const RW: AccessFlags = AccessFlags::ALL;
const SIZES: &[usize] = &[0, 1, 4095, 4096, 1 << 20, 64 << 20];

/// Entry point of the peer process (does nothing unless `OXCCL_TEST_PEER` is set).
#[test]
#[ignore = "the peer process of the conformance suite, started by the tests themselves"]
fn peer_process_entry() {
    peer_main();
}

fn sge(mr: &MemoryRegion, offset: usize, len: usize) -> [Sge<'_>; 1] {
    [Sge::new(mr, offset, len)]
}

fn post(qp: &QueuePair, wr_id: u64, op: WrOp, sg: &[Sge<'_>]) {
    qp.post_send(&[SendWr::new(wr_id, op, sg)]).unwrap();
}

/// Waits for one completion, which must be the error `status`; the queue pair must read ERR
/// as soon as the error is polled (not some time later), on every provider.
fn expect_failed(l: &Local, qp: &QueuePair, status: WcStatus) -> WorkCompletion {
    let wc = l.wait_one();
    let state = qp.state();
    assert_eq!(wc.status, status, "{wc:?}");
    assert_eq!(state, QpState::Err, "state when {status:?} was polled");
    wc
}

/// Collects `n` completions one poll at a time; after every failed one, `qp` must read ERR.
fn wait_n_checked(l: &Local, qp: &QueuePair, n: usize) -> Vec<WorkCompletion> {
    (0..n)
        .map(|_| {
            let wc = l.wait_one();
            if wc.status != WcStatus::Success {
                assert_eq!(qp.state(), QpState::Err, "state when {wc:?} was polled");
            }
            wc
        })
        .collect()
}

fn expect_ok(wc: WorkCompletion, wr_id: u64, opcode: WcOpcode) {
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (wr_id, WcStatus::Success, opcode),
        "{wc:?}"
    );
}

pub fn write_every_size(p: &str) {
    let mut peer = Peer::spawn(p);
    let l = Local::new(p);
    let qp = l.connect(&mut peer, 0, &QpSpec::default());
    for (k, &size) in SIZES.iter().enumerate() {
        let (id, rb) = peer.alloc(size + 16, RW);
        peer.ok(Cmd::Fill { id, byte: 0xEE });
        let src = l.pd.alloc_mr(size, AccessFlags::LOCAL_WRITE).unwrap();
        let data = pattern(k as u64 + 1, size);
        src.write(0, &data).unwrap();
        post(
            &qp,
            k as u64,
            WrOp::Write { remote: rb.at(8) },
            &sge(&src, 0, size),
        );
        let wc = l.wait_one();
        expect_ok(wc, k as u64, WcOpcode::Write);
        assert_eq!(wc.byte_len as usize, size);
        let mut expected = vec![0xEE; 8];
        expected.extend_from_slice(&data);
        expected.extend_from_slice(&[0xEE; 8]);
        assert_eq!(peer.hash(id), fnv(&expected), "WRITE of {size} bytes");
    }
}

pub fn write_with_imm_every_size(p: &str) {
    let mut peer = Peer::spawn(p);
    let l = Local::new(p);
    let qp = l.connect(&mut peer, 0, &QpSpec::default());
    for (k, &size) in SIZES.iter().enumerate() {
        let (id, rb) = peer.alloc(size, RW);
        peer.ok(Cmd::PostRecv {
            qp: 0,
            wr_id: 100 + k as u64,
            sges: vec![],
        });
        let src = l.pd.alloc_mr(size, AccessFlags::NONE).unwrap();
        let data = pattern(k as u64 + 7, size);
        src.write(0, &data).unwrap();
        let imm = 0xABC0_0000 | k as u32;
        post(
            &qp,
            k as u64,
            WrOp::WriteWithImm {
                remote: rb.at(0),
                imm,
            },
            &sge(&src, 0, size),
        );
        expect_ok(l.wait_one(), k as u64, WcOpcode::Write);
        let wcs = peer.poll(1, 5000);
        assert_eq!(
            wcs.len(),
            1,
            "receive completion for WRITE_WITH_IMM of {size}"
        );
        expect_ok(wcs[0], 100 + k as u64, WcOpcode::RecvRdmaWithImm);
        assert_eq!((wcs[0].imm, wcs[0].byte_len as usize), (Some(imm), size));
        assert_eq!(peer.hash(id), fnv(&data));
    }
}

pub fn read_every_size(p: &str) {
    let mut peer = Peer::spawn(p);
    let l = Local::new(p);
    let qp = l.connect(&mut peer, 0, &QpSpec::default());
    for (k, &size) in SIZES.iter().enumerate() {
        let (id, rb) = peer.alloc(size, RW);
        peer.ok(Cmd::Pattern {
            id,
            seed: 40 + k as u64,
        });
        let dst = l.pd.alloc_mr(size, AccessFlags::LOCAL_WRITE).unwrap();
        post(
            &qp,
            k as u64,
            WrOp::Read { remote: rb.at(0) },
            &sge(&dst, 0, size),
        );
        let wc = l.wait_one();
        expect_ok(wc, k as u64, WcOpcode::Read);
        assert_eq!(wc.byte_len as usize, size);
        assert!(
            dst.to_vec() == pattern(40 + k as u64, size),
            "READ of {size} bytes"
        );
    }
}

pub fn send_every_size(p: &str) {
    let mut peer = Peer::spawn(p);
    let l = Local::new(p);
    let qp = l.connect(&mut peer, 0, &QpSpec::default());
    for (k, &size) in SIZES.iter().enumerate() {
        let (id, _) = peer.alloc(size + 100, AccessFlags::LOCAL_WRITE);
        peer.ok(Cmd::PostRecv {
            qp: 0,
            wr_id: 7 + k as u64,
            sges: vec![(id, 0, size + 100)],
        });
        let src = l.pd.alloc_mr(size, AccessFlags::NONE).unwrap();
        let data = pattern(k as u64 + 99, size);
        src.write(0, &data).unwrap();
        let with_imm = k % 2 == 1;
        let op = if with_imm {
            WrOp::SendWithImm { imm: k as u32 }
        } else {
            WrOp::Send
        };
        post(&qp, k as u64, op, &sge(&src, 0, size));
        expect_ok(l.wait_one(), k as u64, WcOpcode::Send);
        let wcs = peer.poll(1, 5000);
        assert_eq!(wcs.len(), 1);
        expect_ok(wcs[0], 7 + k as u64, WcOpcode::Recv);
        assert_eq!(wcs[0].byte_len as usize, size);
        assert_eq!(wcs[0].imm, with_imm.then_some(k as u32));
        let mut expected = data.clone();
        expected.extend_from_slice(&[0u8; 100]);
        assert_eq!(peer.hash(id), fnv(&expected), "SEND of {size} bytes");
    }
}

pub fn atomics(p: &str) {
    let mut peer = Peer::spawn(p);
    let l = Local::new(p);
    let qp = l.connect(&mut peer, 0, &QpSpec::default());
    let (id, rb) = peer.alloc(64, RW);
    peer.ok(Cmd::WriteBytes {
        id,
        offset: 8,
        data: 41u64.to_ne_bytes().to_vec(),
    });
    let res = l.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    let word = rb.at(8);
    let old = |l: &Local, res: &MemoryRegion, id| {
        expect_ok(l.wait_one(), id, WcOpcode::FetchAdd);
        res.atomic_u64(0).unwrap().load(Ordering::Relaxed)
    };
    post(
        &qp,
        1,
        WrOp::FetchAdd {
            remote: word,
            add: 1,
        },
        &sge(&res, 0, 8),
    );
    assert_eq!(old(&l, &res, 1), 41);
    post(
        &qp,
        2,
        WrOp::FetchAdd {
            remote: word,
            add: u64::MAX,
        },
        &sge(&res, 0, 8),
    );
    assert_eq!(old(&l, &res, 2), 42);
    // Compare-and-swap that fails (value is 41), then one that succeeds.
    post(
        &qp,
        3,
        WrOp::CompareSwap {
            remote: word,
            compare: 7,
            swap: 9,
        },
        &sge(&res, 0, 8),
    );
    let wc = l.wait_one();
    expect_ok(wc, 3, WcOpcode::CompareSwap);
    assert_eq!(res.atomic_u64(0).unwrap().load(Ordering::Relaxed), 41);
    assert_eq!(peer.read(id, 8, 8), 41u64.to_ne_bytes());
    post(
        &qp,
        4,
        WrOp::CompareSwap {
            remote: word,
            compare: 41,
            swap: 0xDEAD,
        },
        &sge(&res, 0, 8),
    );
    expect_ok(l.wait_one(), 4, WcOpcode::CompareSwap);
    assert_eq!(res.atomic_u64(0).unwrap().load(Ordering::Relaxed), 41);
    assert_eq!(peer.read(id, 8, 8), 0xDEADu64.to_ne_bytes());
    // Neighbouring words untouched.
    assert_eq!(peer.read(id, 0, 8), [0; 8]);
    assert_eq!(peer.read(id, 16, 8), [0; 8]);
}

/// Fetch-and-adds from two processes at once on one word: none is lost.
pub fn atomics_contended(p: &str) {
    let mut owner = Peer::spawn(p);
    let mut other = Peer::spawn(p);
    let l = Local::new(p);
    let qp = l.connect(&mut owner, 0, &QpSpec::default());
    let (id, rb) = owner.alloc(8, RW);
    // The second initiator is another process, connected to the owner.
    let ep_other = other.setup(0, &QpSpec::default());
    let ep_owner = owner.setup(1, &QpSpec::default());
    other.ok(Cmd::Connect {
        qp: 0,
        ep: ep_owner,
    });
    owner.ok(Cmd::Connect {
        qp: 1,
        ep: ep_other,
    });
    let n = 3000u64;
    let (addr, rkey) = (rb.addr, rb.rkey);
    let remote_loop = std::thread::spawn(move || {
        other.ok(Cmd::FaaLoop {
            qp: 0,
            addr,
            rkey,
            add: 5,
            n,
        });
        other
    });
    let res = l.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    let mut seen = Vec::new();
    for i in 0..n {
        post(
            &qp,
            i,
            WrOp::FetchAdd {
                remote: rb.at(0),
                add: 3,
            },
            &sge(&res, 0, 8),
        );
        expect_ok(l.wait_one(), i, WcOpcode::FetchAdd);
        seen.push(res.atomic_u64(0).unwrap().load(Ordering::Relaxed));
    }
    let _other = remote_loop.join().unwrap();
    assert!(
        seen.windows(2).all(|w| w[1] >= w[0] + 3),
        "old values must increase"
    );
    assert_eq!(owner.read(id, 0, 8), (8 * n).to_ne_bytes(), "lost updates");
}

pub fn scatter_gather(p: &str) {
    let mut peer = Peer::spawn(p);
    let l = Local::new(p);
    let qp = l.connect(&mut peer, 0, &QpSpec::default());
    let (id, rb) = peer.alloc(16 * 1000, RW);
    let src = l.pd.alloc_mr(16 * 1000, AccessFlags::LOCAL_WRITE).unwrap();
    let data = pattern(5, 16 * 1000);
    src.write(0, &data).unwrap();
    // Gather 16 pieces in reverse order.
    let pieces: Vec<Sge> = (0..16)
        .rev()
        .map(|i| Sge::new(&src, i * 1000, 1000))
        .collect();
    post(&qp, 1, WrOp::Write { remote: rb.at(0) }, &pieces);
    expect_ok(l.wait_one(), 1, WcOpcode::Write);
    let expected: Vec<u8> = (0..16)
        .rev()
        .flat_map(|i| data[i * 1000..(i + 1) * 1000].to_vec())
        .collect();
    assert_eq!(peer.hash(id), fnv(&expected));
    // Scatter a READ of the same bytes back into 16 pieces, reversing again.
    let dst = l.pd.alloc_mr(16 * 1000, AccessFlags::LOCAL_WRITE).unwrap();
    let pieces: Vec<Sge> = (0..16)
        .rev()
        .map(|i| Sge::new(&dst, i * 1000, 1000))
        .collect();
    post(&qp, 2, WrOp::Read { remote: rb.at(0) }, &pieces);
    expect_ok(l.wait_one(), 2, WcOpcode::Read);
    assert!(dst.to_vec() == data);
    // SEND gathered from 3 pieces into a receive scattered over 4 uneven pieces.
    let (rid, _) = peer.alloc(4096, AccessFlags::LOCAL_WRITE);
    peer.ok(Cmd::PostRecv {
        qp: 0,
        wr_id: 9,
        sges: vec![
            (rid, 3000, 10),
            (rid, 0, 100),
            (rid, 1000, 1),
            (rid, 2000, 2000),
        ],
    });
    let parts = [
        Sge::new(&src, 0, 50),
        Sge::new(&src, 5000, 7),
        Sge::new(&src, 9000, 500),
    ];
    post(&qp, 3, WrOp::Send, &parts);
    expect_ok(l.wait_one(), 3, WcOpcode::Send);
    let wcs = peer.poll(1, 5000);
    expect_ok(wcs[0], 9, WcOpcode::Recv);
    assert_eq!(wcs[0].byte_len, 557);
    let msg: Vec<u8> = [&data[0..50], &data[5000..5007], &data[9000..9500]].concat();
    assert_eq!(peer.read(rid, 3000, 10), msg[0..10]);
    assert_eq!(peer.read(rid, 0, 100), msg[10..110]);
    assert_eq!(peer.read(rid, 1000, 1), msg[110..111]);
    assert_eq!(peer.read(rid, 2000, 446), msg[111..557]);
    assert_eq!(peer.read(rid, 2446, 4), [0; 4]);
    // More than 16 SGEs is refused at post time, naming the request.
    let many: Vec<Sge> = (0..17).map(|i| Sge::new(&src, i, 1)).collect();
    let err = qp
        .post_send(&[SendWr::new(77, WrOp::Send, &many)])
        .unwrap_err();
    assert!(err.to_string().contains("wr_id 77"), "{err}");
}

/// 10⁵ WRITEs, then a WRITE_WITH_IMM: when the immediate arrives, all earlier data is visible.
pub fn ordering(p: &str) {
    let mut peer = Peer::spawn(p);
    let l = Local::new(p);
    let qp = l.connect(&mut peer, 0, &QpSpec::default());
    let n = 100_000usize;
    let (id, rb) = peer.alloc(n * 8, RW);
    peer.ok(Cmd::PostRecv {
        qp: 0,
        wr_id: 1,
        sges: vec![],
    });
    let src = l.pd.alloc_mr(n * 8, AccessFlags::NONE).unwrap();
    let words: Vec<u8> = (0..n as u64).flat_map(|i| i.to_ne_bytes()).collect();
    src.write(0, &words).unwrap();
    for i in 0..n {
        let sg = [Sge::new(&src, i * 8, 8)];
        let wr = SendWr::new(
            i as u64,
            WrOp::Write {
                remote: rb.at(i as u64 * 8),
            },
            &sg,
        );
        qp.post_send(&[if i % 1000 == 999 { wr } else { wr.unsignaled() }])
            .unwrap();
        if i % 1000 == 999 {
            assert_eq!(l.wait_one().status, WcStatus::Success);
        }
    }
    let zero: [Sge; 0] = [];
    post(
        &qp,
        0xFFFF,
        WrOp::WriteWithImm {
            remote: rb.at(0),
            imm: 5,
        },
        &zero,
    );
    match peer.call(Cmd::WaitImmThenCheck {
        id,
        words: n,
        timeout_ms: 10_000,
    }) {
        Reply::Checked {
            wc: Some(wc),
            wrong,
        } => {
            assert_eq!((wc.opcode, wc.imm), (WcOpcode::RecvRdmaWithImm, Some(5)));
            assert_eq!(wrong, 0, "words not yet visible when the immediate arrived");
        }
        r => panic!("{r:?}"),
    }
    expect_ok(l.wait_one(), 0xFFFF, WcOpcode::Write);
}

/// SEND with no receive posted: RNR retries, then RnrRetryExceeded; with infinite retries the send
/// completes once a receive is posted.
pub fn rnr(p: &str) {
    let mut peer = Peer::spawn(p);
    let l = Local::new(p);
    let spec = QpSpec {
        rnr_retry: 3,
        rnr_timer_us: 2000,
        ..QpSpec::default()
    };
    let qp = l.connect(&mut peer, 0, &spec);
    let src = l.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    let t = Instant::now();
    post(&qp, 1, WrOp::Send, &sge(&src, 0, 64));
    post(&qp, 2, WrOp::Send, &sge(&src, 0, 64));
    let wcs = wait_n_checked(&l, &qp, 2);
    assert_eq!(
        (wcs[0].wr_id, wcs[0].status),
        (1, WcStatus::RnrRetryExceeded)
    );
    assert_eq!(
        (wcs[1].wr_id, wcs[1].status),
        (2, WcStatus::WorkRequestFlushed)
    );
    assert!(
        t.elapsed() >= Duration::from_millis(8),
        "gave up after {:?}",
        t.elapsed()
    );
    assert_eq!(qp.state(), QpState::Err);
    // Later requests are flushed.
    post(&qp, 3, WrOp::Send, &sge(&src, 0, 64));
    assert_eq!(l.wait_one().status, WcStatus::WorkRequestFlushed);

    // Infinite retries: the send waits for the receive, in order with later requests.
    let qp = l.connect(&mut peer, 1, &QpSpec::default());
    let (rid, _) = peer.alloc(64, AccessFlags::LOCAL_WRITE);
    post(&qp, 10, WrOp::Send, &sge(&src, 0, 64));
    post(&qp, 11, WrOp::Send, &sge(&src, 0, 32));
    let mut wc = [WorkCompletion::default(); 4];
    assert_eq!(l.cq.poll(&mut wc), 0, "send completed without a receive");
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(l.cq.poll(&mut wc), 0);
    peer.ok(Cmd::PostRecv {
        qp: 1,
        wr_id: 1,
        sges: vec![(rid, 0, 64)],
    });
    peer.ok(Cmd::PostRecv {
        qp: 1,
        wr_id: 2,
        sges: vec![(rid, 0, 64)],
    });
    let wcs = l.wait_n(2);
    assert_eq!(
        wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [(10, WcStatus::Success), (11, WcStatus::Success)]
    );
    let got = peer.poll(2, 5000);
    let mut got = got;
    if got.len() < 2 {
        got.extend(peer.poll(1, 5000));
    }
    assert_eq!(
        got.iter()
            .map(|w| (w.wr_id, w.byte_len))
            .collect::<Vec<_>>(),
        [(1, 64), (2, 32)]
    );
}

/// Every access error: bad rkey, out of range, missing flag; target untouched, QP to ERR, later and
/// outstanding requests flushed.
pub fn access_errors(p: &str) {
    let mut peer = Peer::spawn(p);
    let l = Local::new(p);
    let src = l.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    src.fill(0x5A);
    // (name, target access, op builder, expected status)
    type Case = (
        &'static str,
        AccessFlags,
        fn(RemoteBuffer) -> WrOp,
        usize,
        WcStatus,
    );
    let cases: Vec<Case> = vec![
        (
            "bad rkey",
            RW,
            |rb| WrOp::Write {
                remote: RemoteAddr {
                    addr: rb.addr,
                    rkey: rb.rkey ^ (1 << 40),
                },
            },
            64,
            WcStatus::RemoteAccessError,
        ),
        (
            "zero rkey",
            RW,
            |rb| WrOp::Write {
                remote: RemoteAddr {
                    addr: rb.addr,
                    rkey: 0,
                },
            },
            64,
            WcStatus::RemoteAccessError,
        ),
        (
            "past the end",
            RW,
            |rb| WrOp::Write {
                remote: rb.at(rb.len - 63),
            },
            64,
            WcStatus::RemoteAccessError,
        ),
        (
            "before the start",
            RW,
            |rb| WrOp::Write {
                remote: RemoteAddr {
                    addr: rb.addr - 1,
                    rkey: rb.rkey,
                },
            },
            64,
            WcStatus::RemoteAccessError,
        ),
        (
            "address wraps",
            RW,
            |rb| WrOp::Write {
                remote: RemoteAddr {
                    addr: u64::MAX - 10,
                    rkey: rb.rkey,
                },
            },
            64,
            WcStatus::RemoteAccessError,
        ),
        (
            "write without REMOTE_WRITE",
            AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC,
            |rb| WrOp::Write { remote: rb.at(0) },
            64,
            WcStatus::RemoteAccessError,
        ),
        (
            "write_imm without REMOTE_WRITE",
            AccessFlags::REMOTE_READ,
            |rb| WrOp::WriteWithImm {
                remote: rb.at(0),
                imm: 1,
            },
            64,
            WcStatus::RemoteAccessError,
        ),
        (
            "read without REMOTE_READ",
            AccessFlags::REMOTE_WRITE,
            |rb| WrOp::Read { remote: rb.at(0) },
            64,
            WcStatus::RemoteAccessError,
        ),
        (
            "read past the end",
            RW,
            |rb| WrOp::Read {
                remote: rb.at(rb.len - 8),
            },
            64,
            WcStatus::RemoteAccessError,
        ),
        (
            "atomic without REMOTE_ATOMIC",
            AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            |rb| WrOp::FetchAdd {
                remote: rb.at(0),
                add: 1,
            },
            8,
            WcStatus::RemoteAccessError,
        ),
        (
            "cas without REMOTE_ATOMIC",
            AccessFlags::REMOTE_WRITE,
            |rb| WrOp::CompareSwap {
                remote: rb.at(0),
                compare: 0,
                swap: 1,
            },
            8,
            WcStatus::RemoteAccessError,
        ),
        (
            "misaligned atomic",
            RW,
            |rb| WrOp::FetchAdd {
                remote: rb.at(4),
                add: 1,
            },
            8,
            WcStatus::RemoteInvalidRequest,
        ),
        (
            "atomic past the end",
            RW,
            |rb| WrOp::FetchAdd {
                remote: rb.at(rb.len),
                add: 1,
            },
            8,
            WcStatus::RemoteAccessError,
        ),
    ];
    for (k, (name, access, op, len, status)) in cases.into_iter().enumerate() {
        let qp = l.connect(&mut peer, k, &QpSpec::default());
        let (id, rb) = peer.alloc(1024, access);
        peer.ok(Cmd::Pattern { id, seed: k as u64 });
        let before = peer.hash(id);
        // A receive posted on our side is flushed when the QP fails.
        let rbuf = l.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        qp.post_recv(&[RecvWr::new(500, &sge(&rbuf, 0, 64))])
            .unwrap();
        post(&qp, 1, op(rb), &sge(&src, 0, len));
        let wcs = wait_n_checked(&l, &qp, 2);
        let mine = wcs.iter().find(|w| w.wr_id == 1).unwrap();
        assert_eq!(mine.status, status, "{name}: {wcs:?}");
        let flushed = wcs.iter().find(|w| w.wr_id == 500).unwrap();
        assert_eq!(flushed.status, WcStatus::WorkRequestFlushed, "{name}");
        assert_eq!(qp.state(), QpState::Err, "{name}");
        assert_eq!(peer.hash(id), before, "{name}: target memory changed");
        post(&qp, 2, WrOp::Write { remote: rb.at(0) }, &sge(&src, 0, 8));
        let wc = l.wait_one();
        assert_eq!(
            (wc.wr_id, wc.status),
            (2, WcStatus::WorkRequestFlushed),
            "{name}"
        );
        assert_eq!(
            peer.hash(id),
            before,
            "{name}: flushed request changed target memory"
        );
    }
}

/// Frame sizes that walk a receiver through every way it reads a stream: large payloads (read
/// straight into the target, the next header riding along), small frames between them (read
/// exactly after a large one), long runs of small frames (read ahead again), sizes around the
/// 16 KiB and 64 KiB boundaries, and empty ones.
const MIXED: &[usize] = &[
    (256 << 10) + 64,
    8,
    300 << 10,
    20 << 10,
    16 << 10,
    (16 << 10) - 1,
    1,
    0,
    (64 << 10) - 1,
    (1 << 20) + 3,
    8,
    8,
    8,
    8,
    8,
    8,
    8,
    8,
    8,
    8,
    256 << 10,
    65,
    200 << 10,
    64 << 10,
    (64 << 10) + 1,
    3,
];

/// A stream of WRITEs of mixed sizes posted back to back, each to its own range of one region
/// (8 untouched bytes between them): every byte lands where it was sent and nowhere else.
/// Then, in the middle of a stream of large frames, a large WRITE with a wrong rkey and one
/// that runs one byte past its region each fail with `RemoteAccessError`, and the target's
/// memory is exactly what the WRITEs before them left.
pub fn mixed_stream(p: &str) {
    let mut peer = Peer::spawn(p);
    let l = Local::new(p);
    let gap = 8;
    let total: usize = MIXED.iter().map(|s| s + gap).sum::<usize>() + gap;
    let (id, rb) = peer.alloc(total, RW);
    peer.ok(Cmd::Fill { id, byte: 0xEE });
    let big = *MIXED.iter().max().unwrap();
    let src =
        l.pd.alloc_mr(big + 7 * MIXED.len(), AccessFlags::LOCAL_WRITE)
            .unwrap();
    let data = pattern(99, src.len());
    src.write(0, &data).unwrap();
    let mut expected = vec![0xEE; total];
    let qp = l.connect(&mut peer, 0, &QpSpec::default());
    let mut at = gap;
    for (k, &size) in MIXED.iter().enumerate() {
        let from = 7 * k;
        post(
            &qp,
            k as u64,
            WrOp::Write {
                remote: rb.at(at as u64),
            },
            &sge(&src, from, size),
        );
        expected[at..at + size].copy_from_slice(&data[from..from + size]);
        at += size + gap;
    }
    let mut wcs = l.wait_n(MIXED.len());
    wcs.sort_by_key(|w| w.wr_id);
    for (k, (wc, &size)) in wcs.iter().zip(MIXED).enumerate() {
        expect_ok(*wc, k as u64, WcOpcode::Write);
        assert_eq!(wc.byte_len as usize, size, "WRITE {k}");
    }
    assert_eq!(
        peer.hash(id),
        fnv(&expected),
        "a stream of mixed WRITEs: target memory differs"
    );
    let after = fnv(&expected);

    // Large WRITEs, then a bad one among them; each case on a fresh queue pair.
    type Bad = (&'static str, fn(RemoteBuffer, usize) -> RemoteAddr, usize);
    let bad: [Bad; 2] = [
        (
            "wrong rkey",
            |rb, _| RemoteAddr {
                addr: rb.addr,
                rkey: rb.rkey ^ (1 << 33),
            },
            300 << 10,
        ),
        (
            "one byte past the region",
            |rb, len| rb.at(rb.len - len as u64 + 1),
            300 << 10,
        ),
    ];
    for (c, (name, target, len)) in bad.into_iter().enumerate() {
        let qp = l.connect(&mut peer, 1 + c, &QpSpec::default());
        // Two large WRITEs of the bytes already there (the stream's first range), a small
        // one, another large one: the receiver reads frames exactly now.
        let first = MIXED[0];
        for (k, n) in [first, first, 8, first].into_iter().enumerate() {
            post(
                &qp,
                k as u64,
                WrOp::Write {
                    remote: rb.at(gap as u64),
                },
                &sge(&src, 0, n),
            );
        }
        post(
            &qp,
            9,
            WrOp::Write {
                remote: target(rb, len),
            },
            &sge(&src, 0, len),
        );
        let wcs = wait_n_checked(&l, &qp, 5);
        for k in 0..4u64 {
            let w = wcs.iter().find(|w| w.wr_id == k).unwrap();
            assert_eq!(w.status, WcStatus::Success, "{name}: {wcs:?}");
        }
        let mine = wcs.iter().find(|w| w.wr_id == 9).unwrap();
        assert_eq!(mine.status, WcStatus::RemoteAccessError, "{name}: {wcs:?}");
        assert_eq!(qp.state(), QpState::Err, "{name}");
        assert_eq!(peer.hash(id), after, "{name}: target memory changed");
    }
}

/// Outstanding requests (waiting for a receive) are flushed when the queue pair fails.
pub fn outstanding_flushed(p: &str) {
    let mut peer = Peer::spawn(p);
    let l = Local::new(p);
    let qp = l.connect(&mut peer, 0, &QpSpec::default());
    let src = l.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    for i in 0..5 {
        post(&qp, i, WrOp::Send, &sge(&src, 0, 8));
    }
    let mut wc = [WorkCompletion::default(); 8];
    assert_eq!(l.cq.poll(&mut wc), 0);
    qp.to_error();
    let wcs = l.wait_n(5);
    assert!(
        wcs.iter().all(|w| w.status == WcStatus::WorkRequestFlushed),
        "{wcs:?}"
    );
    assert_eq!(
        wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        [0, 1, 2, 3, 4]
    );
}

pub fn use_after_deregistration(p: &str) {
    let mut peer = Peer::spawn(p);
    let l = Local::new(p);
    let qp = l.connect(&mut peer, 0, &QpSpec::default());
    let src = l.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    src.write(0, &[7; 8]).unwrap();
    let (id, rb) = peer.alloc(64, RW);
    // Requests that alternate between two live regions land each in its own.
    let (other, ob) = peer.alloc(64, RW);
    for (k, at) in [rb.at(0), ob.at(16), rb.at(32), ob.at(48)]
        .into_iter()
        .enumerate()
    {
        post(
            &qp,
            10 + k as u64,
            WrOp::Write { remote: at },
            &sge(&src, 0, 8),
        );
        expect_ok(l.wait_one(), 10 + k as u64, WcOpcode::Write);
    }
    let lands = |at: &[usize]| -> Vec<u8> {
        (0..64)
            .map(|b| if at.contains(&(b / 8 * 8)) { 7 } else { 0 })
            .collect()
    };
    assert_eq!(peer.read(id, 0, 64), lands(&[0, 32]));
    assert_eq!(peer.read(other, 0, 64), lands(&[16, 48]));
    post(&qp, 1, WrOp::Write { remote: rb.at(0) }, &sge(&src, 0, 8));
    expect_ok(l.wait_one(), 1, WcOpcode::Write);
    peer.ok(Cmd::Dereg { id });
    // A new region may reuse the table slot. On the queue pair that wrote into the old region,
    // a WRITE with the new rkey lands in the new region, and the old rkey fails (a target that
    // remembers the last region it found must not let it stand in for either).
    let (id2, rb2) = peer.alloc(64, RW);
    assert_ne!(rb2.rkey, rb.rkey);
    post(&qp, 5, WrOp::Write { remote: rb2.at(8) }, &sge(&src, 0, 8));
    expect_ok(l.wait_one(), 5, WcOpcode::Write);
    assert_eq!(peer.read(id2, 0, 16), [[0; 8], [7; 8]].concat());
    post(&qp, 2, WrOp::Write { remote: rb.at(0) }, &sge(&src, 0, 8));
    expect_failed(&l, &qp, WcStatus::RemoteAccessError);
    assert_eq!(peer.read(id2, 0, 16), [[0; 8], [7; 8]].concat());
    // The old rkey fails on a fresh queue pair too.
    let qp = l.connect(&mut peer, 1, &QpSpec::default());
    post(&qp, 3, WrOp::Read { remote: rb.at(0) }, &sge(&src, 0, 8));
    expect_failed(&l, &qp, WcStatus::RemoteAccessError);
    // Local use after deregistration.
    let qp = l.connect(&mut peer, 2, &QpSpec::default());
    src.deregister();
    post(&qp, 4, WrOp::Write { remote: rb2.at(0) }, &sge(&src, 0, 8));
    expect_failed(&l, &qp, WcStatus::LocalProtectionError);
}

pub fn local_errors(p: &str) {
    let mut peer = Peer::spawn(p);
    let l = Local::new(p);
    let (rid, rb) = peer.alloc(4096, RW);
    let ro = l.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    // READ into a buffer without LOCAL_WRITE.
    let qp = l.connect(&mut peer, 0, &QpSpec::default());
    post(&qp, 1, WrOp::Read { remote: rb.at(0) }, &sge(&ro, 0, 8));
    expect_failed(&l, &qp, WcStatus::LocalProtectionError);
    // Local SGE out of bounds.
    let qp = l.connect(&mut peer, 1, &QpSpec::default());
    post(&qp, 2, WrOp::Write { remote: rb.at(0) }, &sge(&ro, 60, 8));
    expect_failed(&l, &qp, WcStatus::LocalProtectionError);
    // Region of another protection domain.
    let other_pd = l.ctx.alloc_pd().unwrap();
    let foreign = other_pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let qp = l.connect(&mut peer, 2, &QpSpec::default());
    post(
        &qp,
        3,
        WrOp::Write { remote: rb.at(0) },
        &sge(&foreign, 0, 8),
    );
    expect_failed(&l, &qp, WcStatus::LocalProtectionError);
    // SEND longer than the receive: receiver LocalLengthError, sender RemoteInvalidRequest.
    let qp = l.connect(&mut peer, 3, &QpSpec::default());
    peer.ok(Cmd::PostRecv {
        qp: 3,
        wr_id: 4,
        sges: vec![(rid, 0, 16)],
    });
    let big = l.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    post(&qp, 5, WrOp::Send, &sge(&big, 0, 17));
    expect_failed(&l, &qp, WcStatus::RemoteInvalidRequest);
    let wcs = peer.poll(1, 5000);
    assert_eq!(
        (wcs[0].wr_id, wcs[0].status),
        (4, WcStatus::LocalLengthError)
    );
    assert_eq!(peer.state(3), QpState::Err);
    // Atomic with a local SGE that is not 8 bytes.
    let qp = l.connect(&mut peer, 4, &QpSpec::default());
    let res = l.pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
    post(
        &qp,
        6,
        WrOp::FetchAdd {
            remote: rb.at(0),
            add: 1,
        },
        &sge(&res, 0, 16),
    );
    expect_failed(&l, &qp, WcStatus::LocalLengthError);
}

/// The peer is killed mid-stream: the initiator's requests and a receive waiter return
/// RetryExceeded within the configured timeout, never hang.
pub fn peer_killed_mid_stream(p: &str) {
    // Far above the send wr_ids, which count up from 0.
    const RECV_ID: u64 = 1 << 40;
    let mut peer = Peer::spawn(p);
    let l = Local::new(p);
    let spec = QpSpec {
        timeout_ms: 1000,
        ..QpSpec::default()
    };
    let qp = l.connect(&mut peer, 0, &spec);
    let (_, rb) = peer.alloc(1 << 20, RW);
    let src = l.pd.alloc_mr(1 << 20, AccessFlags::LOCAL_WRITE).unwrap();
    let rbuf = l.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    qp.post_recv(&[RecvWr::new(RECV_ID, &sge(&rbuf, 0, 64))])
        .unwrap();
    let killer = {
        let pid = peer.pid;
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            let _ = rustix::process::kill_process(
                rustix::process::Pid::from_raw(pid as i32).unwrap(),
                rustix::process::Signal::KILL,
            );
        })
    };
    let start = Instant::now();
    let mut killed_at = None;
    let mut statuses = Vec::new();
    let mut i = 0u64;
    let mut wc = [WorkCompletion::default(); 16];
    'outer: loop {
        if killed_at.is_none() && killer.is_finished() {
            killed_at = Some(Instant::now());
        }
        let r = qp.post_send(&[SendWr::new(
            i,
            WrOp::Write { remote: rb.at(0) },
            &sge(&src, 0, 4096),
        )]);
        assert!(r.is_ok(), "{r:?}");
        i += 1;
        loop {
            let n = l.cq.poll(&mut wc);
            if n == 0 {
                break;
            }
            for w in &wc[..n] {
                if w.status != WcStatus::Success {
                    statuses.push((w.wr_id, w.status));
                }
            }
            if statuses.iter().any(|s| s.0 == RECV_ID) {
                break 'outer;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no error after the peer died"
        );
    }
    let killed_at = killed_at.unwrap_or_else(Instant::now);
    let noticed = killed_at.elapsed();
    assert!(
        noticed < Duration::from_millis(1000 + 500),
        "noticed after {noticed:?}"
    );
    assert!(
        statuses.iter().any(|s| s.1 == WcStatus::RetryExceeded),
        "{statuses:?}"
    );
    assert!(
        statuses
            .iter()
            .any(|s| s == &(RECV_ID, WcStatus::RetryExceeded)),
        "receive waiter: {statuses:?}"
    );
    assert_eq!(qp.state(), QpState::Err);
    peer.kill();
}

/// A blocked receive waiter returns when the peer dies.
pub fn waiter_returns_when_peer_dies(p: &str) {
    let mut peer = Peer::spawn(p);
    let l = Local::new(p);
    let spec = QpSpec {
        timeout_ms: 1000,
        ..QpSpec::default()
    };
    let qp = l.connect(&mut peer, 0, &spec);
    let rbuf = l.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    qp.post_recv(&[
        RecvWr::new(1, &sge(&rbuf, 0, 64)),
        RecvWr::new(2, &sge(&rbuf, 0, 64)),
    ])
    .unwrap();
    let t = Instant::now();
    peer.kill();
    let wcs = l.wait_n(2);
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(
        wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [
            (1, WcStatus::RetryExceeded),
            (2, WcStatus::WorkRequestFlushed)
        ]
    );
}

/// The peer destroys its queue pair (process alive): our requests fail with RetryExceeded.
pub fn peer_qp_destroyed(p: &str) {
    let mut peer = Peer::spawn(p);
    let l = Local::new(p);
    let qp = l.connect(&mut peer, 0, &QpSpec::default());
    let (_, rb) = peer.alloc(64, RW);
    let src = l.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    peer.setup(0, &QpSpec::default()); // replaces (destroys) the old one
    post(&qp, 1, WrOp::Write { remote: rb.at(0) }, &sge(&src, 0, 8));
    expect_failed(&l, &qp, WcStatus::RetryExceeded);
}

/// The peer exits (closing its queue pair) as soon as it has polled the last message of a
/// stream: every request of ours completes successfully, none is flushed as if the peer had
/// died. Over tcp the target holds an ACK back for a frame going the other way to carry; a
/// queue pair destroyed right after its last poll must still send it.
pub fn peer_exits_after_its_last_message(p: &str) {
    for round in 0..3u64 {
        let mut peer = Peer::spawn(p);
        let l = Local::new(p);
        let qp = l.connect(&mut peer, 0, &QpSpec::default());
        let (_, rb) = peer.alloc(64 << 10, RW);
        peer.ok(Cmd::PostRecv {
            qp: 0,
            wr_id: 77,
            sges: vec![],
        });
        let src = l.pd.alloc_mr(64 << 10, AccessFlags::NONE).unwrap();
        src.write(0, &pattern(round, 64 << 10)).unwrap();
        // The peer waits before the stream starts: its own thread, not its provider's
        // background one, takes the messages.
        let line = peer.start(Cmd::WaitThenExit { timeout_ms: 10_000 });
        std::thread::sleep(Duration::from_millis(50));
        for i in 0..8u64 {
            let off = i as usize * (8 << 10);
            let remote = rb.at(off as u64);
            let op = if i == 7 {
                WrOp::WriteWithImm { remote, imm: 7 }
            } else {
                WrOp::Write { remote }
            };
            post(&qp, i, op, &sge(&src, off, 8 << 10));
        }
        match peer.reply(&line) {
            Reply::Wcs(w) if w.len() == 1 => expect_ok(w[0], 77, WcOpcode::RecvRdmaWithImm),
            r => panic!("round {round}: the peer's last receive: {r:?}"),
        }
        let wcs = l.wait_n(8);
        for (i, wc) in wcs.into_iter().enumerate() {
            assert_eq!(
                (wc.wr_id, wc.status),
                (i as u64, WcStatus::Success),
                "round {round}: request {i} after the peer exited: {wc:?}"
            );
        }
    }
}

/// Several queue pairs, each driven by its own thread with its own CQ, to several peer processes.
pub fn many_threads(p: &str) {
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let p = p.to_string();
            std::thread::spawn(move || {
                let mut peer = Peer::spawn(&p);
                let l = Local::new(&p);
                let qp = l.connect(&mut peer, 0, &QpSpec::default());
                let (id, rb) = peer.alloc(64 * 1024, RW);
                let src = l.pd.alloc_mr(64 * 1024, AccessFlags::LOCAL_WRITE).unwrap();
                let data = pattern(t, 64 * 1024);
                src.write(0, &data).unwrap();
                for i in 0..64 {
                    post(
                        &qp,
                        i,
                        WrOp::Write {
                            remote: rb.at(i * 1024),
                        },
                        &sge(&src, i as usize * 1024, 1024),
                    );
                }
                let wcs = l.wait_n(64);
                assert!(
                    wcs.iter()
                        .enumerate()
                        .all(|(i, w)| w.wr_id == i as u64 && w.is_ok())
                );
                assert_eq!(peer.hash(id), fnv(&data));
            })
        })
        .collect();
    for t in threads {
        t.join().expect("thread");
    }
}

/// One completion queue shared by many queue pairs, two peers, mixed operations.
pub fn shared_cq(p: &str) {
    let mut peers = [Peer::spawn(p), Peer::spawn(p)];
    let l = Local::new(p);
    let mut qps = Vec::new();
    let mut bufs = Vec::new();
    for (k, peer) in peers.iter_mut().enumerate() {
        for j in 0..4 {
            qps.push(l.connect(peer, j, &QpSpec::default()));
            let (id, rb) = peer.alloc(4096, RW);
            peer.ok(Cmd::PostRecv {
                qp: j,
                wr_id: j as u64,
                sges: vec![],
            });
            bufs.push((k, id, rb));
        }
    }
    let src = l.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    src.write(0, &pattern(3, 4096)).unwrap();
    for (q, qp) in qps.iter().enumerate() {
        let rb = bufs[q].2;
        post(
            qp,
            q as u64 * 10,
            WrOp::Write { remote: rb.at(0) },
            &sge(&src, 0, 4096),
        );
        post(
            qp,
            q as u64 * 10 + 1,
            WrOp::WriteWithImm {
                remote: rb.at(0),
                imm: q as u32,
            },
            &sge(&src, 0, 16),
        );
    }
    let mut got: Vec<u64> = l
        .wait_n(16)
        .iter()
        .map(|w| {
            assert!(w.is_ok(), "{w:?}");
            w.wr_id
        })
        .collect();
    got.sort();
    let mut want: Vec<u64> = (0..8).flat_map(|q| [q * 10, q * 10 + 1]).collect();
    want.sort();
    assert_eq!(got, want);
    for (k, peer) in peers.iter_mut().enumerate() {
        let mut imms: Vec<u32> = Vec::new();
        while imms.len() < 4 {
            let w = peer.poll(4, 5000);
            assert!(!w.is_empty());
            imms.extend(w.iter().map(|w| w.imm.unwrap()));
        }
        imms.sort();
        assert_eq!(imms, (k as u32 * 4..k as u32 * 4 + 4).collect::<Vec<_>>());
        for &(pk, id, _) in bufs.iter().filter(|b| b.0 == k) {
            let _ = pk;
            assert_eq!(peer.hash(id), fnv(&pattern(3, 4096)));
        }
    }
}

/// `map_remote`: where the provider maps the peer's memory (shm's provider memory), stores
/// through the mapping are the peer's bytes; a key, range or access the peer does not grant is
/// refused, naming it, and the queue pair stays usable; elsewhere (tcp, user memory) there is
/// no mapping and requests remain the way.
pub fn map_remote(p: &str) {
    let mut peer = Peer::spawn(p);
    let l = Local::new(p);
    let qp = l.connect(&mut peer, 0, &QpSpec::default());
    let (id, rb) = peer.alloc(4096, RW);
    peer.ok(Cmd::Fill { id, byte: 0 });
    let m = qp.map_remote(rb, AccessFlags::REMOTE_WRITE).unwrap();
    if p == "shm" {
        let m = m.expect("shm maps a peer's provider memory");
        assert_eq!(m.len(), 4096);
        let data = pattern(5, 4000);
        m.write(96, &data).unwrap();
        m.atomic_u64(8).unwrap().store(0xfeed, Ordering::Release);
        let mut want = vec![0u8; 4096];
        want[96..4096].copy_from_slice(&data);
        want[8..16].copy_from_slice(&0xfeedu64.to_le_bytes());
        assert_eq!(peer.hash(id), fnv(&want));
        // The peer's own writes are seen through the mapping.
        peer.ok(Cmd::WriteBytes {
            id,
            offset: 0,
            data: vec![7; 8],
        });
        let mut got = [0u8; 8];
        m.read(0, &mut got).unwrap();
        assert_eq!(got, [7; 8]);
        assert!(m.write(4090, &[0; 8]).is_err(), "a write past the mapping");
        assert!(m.atomic_u64(4).is_err(), "an unaligned word");
        // User memory is reached by requests only.
        let (_, user) = peer.alloc_kind(4096, RW.without_atomic(), true);
        assert!(
            qp.map_remote(user, AccessFlags::REMOTE_WRITE)
                .unwrap()
                .is_none()
        );
    } else {
        assert!(m.is_none(), "{p} maps nothing");
    }
    let refused =
        |remote: RemoteBuffer, need: AccessFlags, what: &str| match qp.map_remote(remote, need) {
            Err(Error::RemoteAccess { detail, .. }) => {
                assert!(detail.contains("rkey"), "{what}: {detail}")
            }
            Ok(None) if p != "shm" => {}
            other => panic!("{what}: {other:?}"),
        };
    refused(
        RemoteBuffer {
            rkey: rb.rkey ^ 0x100,
            ..rb
        },
        AccessFlags::REMOTE_WRITE,
        "a wrong rkey",
    );
    refused(
        RemoteBuffer { len: 8192, ..rb },
        AccessFlags::REMOTE_WRITE,
        "beyond the region",
    );
    let (_, ro) = peer.alloc(4096, AccessFlags::REMOTE_READ);
    refused(
        ro,
        AccessFlags::REMOTE_WRITE,
        "write access to a read-only region",
    );
    // None of that moved the queue pair: a request still works.
    assert_eq!(qp.state(), QpState::Rts);
    let src = l.pd.alloc_mr(8, AccessFlags::NONE).unwrap();
    src.write(0, &[9; 8]).unwrap();
    post(&qp, 1, WrOp::Write { remote: rb.at(16) }, &sge(&src, 0, 8));
    expect_ok(l.wait_one(), 1, WcOpcode::Write);
    assert_eq!(peer.read(id, 16, 8), vec![9; 8]);
}

/// Registered user memory at the target (reached with process_vm_readv/writev on shm).
pub fn user_memory(p: &str) {
    let mut peer = Peer::spawn(p);
    let l = Local::new(p);
    let qp = l.connect(&mut peer, 0, &QpSpec::default());
    let (id, rb) = peer.alloc_kind(1 << 20, RW.without_atomic(), true);
    let src =
        l.pd.reg_mr(pattern(11, 1 << 20), AccessFlags::LOCAL_WRITE)
            .unwrap();
    post(
        &qp,
        1,
        WrOp::Write { remote: rb.at(0) },
        &sge(&src, 0, 1 << 20),
    );
    expect_ok(l.wait_one(), 1, WcOpcode::Write);
    assert_eq!(peer.hash(id), fnv(&pattern(11, 1 << 20)));
    peer.ok(Cmd::Pattern { id, seed: 12 });
    let dst =
        l.pd.reg_mr(vec![0; 1 << 20], AccessFlags::LOCAL_WRITE)
            .unwrap();
    post(
        &qp,
        2,
        WrOp::Read { remote: rb.at(0) },
        &sge(&dst, 0, 1 << 20),
    );
    expect_ok(l.wait_one(), 2, WcOpcode::Read);
    assert!(dst.to_vec() == pattern(12, 1 << 20));
    // SEND into a user-memory receive buffer.
    peer.ok(Cmd::PostRecv {
        qp: 0,
        wr_id: 3,
        sges: vec![(id, 100, 1000)],
    });
    post(&qp, 4, WrOp::Send, &sge(&src, 0, 1000));
    expect_ok(l.wait_one(), 4, WcOpcode::Send);
    assert_eq!(peer.poll(1, 5000)[0].byte_len, 1000);
    assert_eq!(peer.read(id, 100, 1000), pattern(11, 1000));
    // Out of bounds is still refused before any byte moves.
    post(
        &qp,
        5,
        WrOp::Write {
            remote: rb.at((1 << 20) - 10),
        },
        &sge(&src, 0, 11),
    );
    expect_failed(&l, &qp, WcStatus::RemoteAccessError);
}

trait NoAtomic {
    fn without_atomic(self) -> Self;
}
impl NoAtomic for AccessFlags {
    fn without_atomic(self) -> Self {
        AccessFlags::from_bits_truncate(self.bits() & !AccessFlags::REMOTE_ATOMIC.bits())
    }
}

/// Instantiates every conformance test for one provider.
macro_rules! conformance {
    ($module:ident, $provider:literal) => {
        conformance!($module, $provider, killed: #[test]);
    };
    ($module:ident, $provider:literal, killed: $(#[$killed:meta])*) => {
        mod $module {
            #[test]
            fn write_every_size() {
                super::write_every_size($provider)
            }
            #[test]
            fn write_with_imm_every_size() {
                super::write_with_imm_every_size($provider)
            }
            #[test]
            fn read_every_size() {
                super::read_every_size($provider)
            }
            #[test]
            fn send_every_size() {
                super::send_every_size($provider)
            }
            #[test]
            fn atomics() {
                super::atomics($provider)
            }
            #[test]
            fn atomics_contended() {
                super::atomics_contended($provider)
            }
            #[test]
            fn scatter_gather() {
                super::scatter_gather($provider)
            }
            #[test]
            fn ordering() {
                super::ordering($provider)
            }
            #[test]
            fn rnr() {
                super::rnr($provider)
            }
            #[test]
            fn access_errors() {
                super::access_errors($provider)
            }
            #[test]
            fn mixed_stream() {
                super::mixed_stream($provider)
            }
            #[test]
            fn outstanding_flushed() {
                super::outstanding_flushed($provider)
            }
            #[test]
            fn use_after_deregistration() {
                super::use_after_deregistration($provider)
            }
            #[test]
            fn local_errors() {
                super::local_errors($provider)
            }
            $(#[$killed])*
            fn peer_killed_mid_stream() {
                super::peer_killed_mid_stream($provider)
            }
            #[test]
            fn waiter_returns_when_peer_dies() {
                super::waiter_returns_when_peer_dies($provider)
            }
            #[test]
            fn peer_qp_destroyed() {
                super::peer_qp_destroyed($provider)
            }
            #[test]
            fn peer_exits_after_its_last_message() {
                super::peer_exits_after_its_last_message($provider)
            }
            #[test]
            fn many_threads() {
                super::many_threads($provider)
            }
            #[test]
            fn shared_cq() {
                super::shared_cq($provider)
            }
            #[test]
            fn user_memory() {
                super::user_memory($provider)
            }
            #[test]
            fn map_remote() {
                super::map_remote($provider)
            }
        }
    };
}

conformance!(shm, "shm");
conformance!(tcp, "tcp");
#[cfg(feature = "ofi")]
conformance!(ofi, "ofi");
// libfabric 1.17's shm provider takes a spinlock inside the receiver's shared memory on every
// send, and the receiver takes it to progress: a peer killed while it holds it leaves every
// sender spinning in `fi_send` forever (about one kill in five here). Nothing outside libfabric
// can bound that wait; the provider's watch names it after 5 s and fails every other caller
// (ofi/mod.rs, "Peer loss"). Over `tcp;ofi_rxm` (`ofi` above) the test runs.
#[cfg(feature = "ofi")]
conformance!(ofi_shm, "ofi:shm", killed: #[test] #[ignore = "libfabric 1.17 shm: a killed peer can leave fi_send spinning on its lock (see the comment above)"]);
