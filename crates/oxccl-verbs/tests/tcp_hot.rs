//! The tcp provider's polls read the connection that last brought a message directly (one
//! `recv`, no `epoll_wait`) most of the time: a message on another connection of the same
//! context must still complete while the application keeps polling (its progress thread then
//! stands back, so only the application's polls can find it).

use std::time::{Duration, Instant};

use oxccl_verbs::*;

const WAIT: Duration = Duration::from_secs(10);

/// A context with one completion queue and `n` queue pairs on it.
struct Side {
    _ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qps: Vec<QueuePair>,
}

fn side(n: usize) -> Side {
    let ctx = Device::by_name("tcp")
        .unwrap()
        .open_with(&DeviceConfig::default())
        .unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256).unwrap();
    let qps = (0..n)
        .map(|_| pd.create_qp(&cq, &cq, &QpConfig::default()).unwrap())
        .collect();
    Side {
        _ctx: ctx,
        pd,
        cq,
        qps,
    }
}

/// Polls `cq` without ever sleeping until a completion with `wr_id` arrives (at most `WAIT`);
/// returns how many polls it took. Completions of other requests are checked and dropped.
fn spin_for(cq: &CompletionQueue, wr_id: u64, what: &str) -> u64 {
    let mut wc = [WorkCompletion::default(); 16];
    let deadline = Instant::now() + WAIT;
    let mut polls = 0u64;
    loop {
        polls += 1;
        let n = cq.poll(&mut wc);
        for w in &wc[..n] {
            assert_eq!(w.status, WcStatus::Success, "{what}: {w:?}");
            if w.wr_id == wr_id {
                return polls;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{what}: no completion of request {wr_id} after {polls} polls in {WAIT:?}"
        );
    }
}

/// Connection 1 turns hot (it alone brought the last message), then a WRITE_WITH_IMM arrives
/// on connection 2 while the application polls without pause: it completes, with its
/// immediate, and the bytes it wrote are there. A poll that only ever read the hot connection
/// would never see it (the test fails on its deadline).
#[test]
fn a_message_on_another_connection_completes_while_one_is_hot() {
    let (a, b) = (side(2), side(2));
    for (qa, qb) in a.qps.iter().zip(&b.qps) {
        let (ea, eb) = (qa.endpoint(), qb.endpoint());
        qa.connect(&eb).unwrap();
        qb.connect(&ea).unwrap();
    }
    let dst = a.pd.alloc_mr(4096, AccessFlags::ALL).unwrap();
    dst.write(0, &[0u8; 4096]).unwrap();
    let src = b.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    src.write(0, &data).unwrap();
    for round in 0..20u64 {
        // Connection 1 brings a message: it is the hot one now.
        a.qps[0]
            .post_recv(&[RecvWr::new(1000 + round, &[])])
            .unwrap();
        let sge = [Sge::new(&src, 0, 8)];
        let op = WrOp::WriteWithImm {
            remote: dst.remote().at(0),
            imm: 1,
        };
        b.qps[0].post_send(&[SendWr::new(round, op, &sge)]).unwrap();
        spin_for(&a.cq, 1000 + round, "the hot connection's message");
        // Then connection 2 does, while the application keeps polling.
        a.qps[1]
            .post_recv(&[RecvWr::new(2000 + round, &[])])
            .unwrap();
        let len = 64 + round as usize * 100;
        let sge = [Sge::new(&src, 0, len)];
        let op = WrOp::WriteWithImm {
            remote: dst.remote().at(1024),
            imm: 2,
        };
        b.qps[1]
            .post_send(&[SendWr::new(100 + round, op, &sge)])
            .unwrap();
        spin_for(&a.cq, 2000 + round, "the other connection's message");
        let mut got = vec![0u8; len];
        dst.read(1024, &mut got).unwrap();
        assert_eq!(
            got,
            data[..len],
            "round {round}: the bytes of the second WRITE"
        );
        // The initiator's completions (its WRITEs were signaled).
        spin_for(&b.cq, 100 + round, "the second WRITE at the initiator");
    }
}
