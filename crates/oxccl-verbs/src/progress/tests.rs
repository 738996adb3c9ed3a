//! The progress layer against shm queue pairs: tags, windows, waiting threads sharing one
//! poller, timeouts, wakers and the helper.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Wake, Waker};
use std::time::{Duration, Instant};

use super::*;
use crate::{
    AccessFlags, Context, Device, MemoryRegion, ProtectionDomain, QpConfig, QueuePair, SendWr, Sge,
    WrOp,
};

#[test]
fn tags_round_trip() {
    for (op, part) in [
        (0, 0),
        (1, 2),
        (u32::MAX, 0),
        (0, u32::MAX),
        (0xdead_beef, 7),
    ] {
        assert_eq!(untag(tag(op, part)), (op, part));
    }
    assert_eq!(tag(1, 2), (1 << 32) | 2);
}

#[test]
fn a_window_bounds_requests_and_bytes_but_takes_anything_when_empty() {
    let mut w = Window::new(2, 100);
    assert!(w.fits(1000), "an empty window takes any size");
    w.take(60);
    assert!(w.fits(40) && !w.fits(41));
    w.take(40);
    assert!(!w.fits(0), "two requests are the most");
    w.give_back(60);
    assert_eq!(w.in_flight(), 1);
    assert!(w.fits(60) && !w.fits(61));
    w.give_back(40);
    w.give_back(40);
    assert_eq!(
        w.in_flight(),
        0,
        "giving back more than was taken saturates"
    );
}

/// A pair of connected shm queue pairs on one completion queue, and regions to write between.
struct Pair {
    _ctx: Context,
    _pd: ProtectionDomain,
    cq: crate::CompletionQueue,
    a: QueuePair,
    _b: QueuePair,
    src: MemoryRegion,
    dst: MemoryRegion,
}

fn pair(len: usize) -> Pair {
    let ctx = Device::by_name("shm").unwrap().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(1024).unwrap();
    let cfg = QpConfig {
        max_send_wr: 512,
        ..QpConfig::default()
    };
    let a = pd.create_qp(&cq, &cq, &cfg).unwrap();
    let b = pd.create_qp(&cq, &cq, &cfg).unwrap();
    a.connect(&b.endpoint()).unwrap();
    b.connect(&a.endpoint()).unwrap();
    let src = pd.alloc_mr(len, AccessFlags::LOCAL_WRITE).unwrap();
    let dst = pd
        .alloc_mr(len, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .unwrap();
    Pair {
        _ctx: ctx,
        _pd: pd,
        cq,
        a,
        _b: b,
        src,
        dst,
    }
}

/// Threads that each wait for their own WRITEs share one poller: every completion reaches the
/// handler once, every thread's wait ends with its own data in place, none times out.
#[test]
fn threads_waiting_for_their_own_operations_share_the_poller() {
    const THREADS: usize = 4;
    const ROUNDS: usize = 300;
    const LEN: usize = 256;
    let p = Arc::new(pair(THREADS * LEN));
    let progress = Arc::new(Progress::new(vec![p.cq.clone()]));
    // Completions seen, per thread (the operation's number is the thread's).
    let done: Arc<Vec<AtomicUsize>> = Arc::new((0..THREADS).map(|_| AtomicUsize::new(0)).collect());
    let handled = Arc::new(AtomicUsize::new(0));
    let post = Arc::new(Mutex::new(()));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (p, progress, done, handled, post) = (
                p.clone(),
                progress.clone(),
                done.clone(),
                handled.clone(),
                post.clone(),
            );
            std::thread::spawn(move || {
                for round in 1..=ROUNDS {
                    let byte = (t * 31 + round) as u8;
                    p.src.write(t * LEN, &[byte; LEN]).unwrap();
                    {
                        let _g = post.lock().unwrap();
                        let sge = [Sge::new(&p.src, t * LEN, LEN)];
                        let wr = SendWr::new(
                            tag(t as u32, round as u32),
                            WrOp::Write {
                                remote: p.dst.remote().at((t * LEN) as u64),
                            },
                            &sge,
                        );
                        p.a.post_send(&[wr]).unwrap();
                    }
                    progress
                        .wait_for(
                            Instant::now() + Duration::from_secs(10),
                            || format!("thread {t}'s WRITE {round}"),
                            0,
                            |_, wc| {
                                assert!(wc.is_ok(), "{wc:?}");
                                let (op, _) = untag(wc.wr_id);
                                done[op as usize].fetch_add(1, Ordering::AcqRel);
                                handled.fetch_add(1, Ordering::Relaxed);
                                Ok::<(), ()>(())
                            },
                            || (done[t].load(Ordering::Acquire) >= round).then_some(()),
                        )
                        .unwrap_or_else(|e| panic!("thread {t}: {e:?}"));
                    let mut got = [0u8; LEN];
                    p.dst.read(t * LEN, &mut got).unwrap();
                    assert_eq!(got, [byte; LEN], "thread {t}, round {round}");
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    assert_eq!(handled.load(Ordering::Relaxed), THREADS * ROUNDS);
    assert!(!progress.has_waiters());
}

#[test]
fn a_wait_that_nothing_ends_times_out_naming_what_it_waited_for() {
    let p = pair(64);
    let progress = Progress::new(vec![p.cq.clone()]);
    let start = Instant::now();
    let r = progress.wait_for(
        start + Duration::from_millis(100),
        || "batch 9 to segment \"prefill-0\"".to_string(),
        0,
        |_, _| Ok::<(), ()>(()),
        || None::<()>,
    );
    let took = start.elapsed();
    match r {
        Err(Waited::Timeout { what, waited }) => {
            assert_eq!(what, "batch 9 to segment \"prefill-0\"");
            assert!(waited >= Duration::from_millis(100), "{waited:?}");
        }
        other => panic!("{other:?}"),
    }
    assert!(took < Duration::from_secs(2), "{took:?}");
}

#[test]
fn a_handler_error_stops_driving_and_comes_back() {
    let p = pair(64);
    let sge = [Sge::new(&p.src, 0, 64)];
    let remote = p.dst.remote().at(0);
    p.a.post_send(&[
        SendWr::new(tag(1, 0), WrOp::Write { remote }, &sge),
        SendWr::new(tag(2, 0), WrOp::Write { remote }, &sge),
    ])
    .unwrap();
    let mut progress = Progress::new(vec![p.cq.clone()]);
    let mut seen = Vec::new();
    let r = progress.poll_owned(|_, wc| {
        seen.push(untag(wc.wr_id).0);
        Err(format!("operation {} refused", untag(wc.wr_id).0))
    });
    assert_eq!(r.unwrap_err(), "operation 1 refused");
    assert_eq!(seen, [1], "driving stopped at the failing completion");
}

#[test]
fn rang_says_whether_anything_arrived_since_the_last_poll() {
    let p = pair(64);
    let progress = Progress::new(vec![p.cq.clone()]);
    let none = progress.poll(|_, _| Ok::<(), ()>(())).unwrap();
    assert_eq!(none, Some(0));
    assert!(!progress.rang());
    let sge = [Sge::new(&p.src, 0, 64)];
    let wr = SendWr::new(
        tag(3, 0),
        WrOp::Write {
            remote: p.dst.remote().at(0),
        },
        &sge,
    );
    p.a.post_send(&[wr]).unwrap();
    assert!(progress.rang());
    let n = progress.sleep(0, Duration::from_secs(5), |_, wc| {
        assert_eq!(untag(wc.wr_id), (3, 0));
        Ok::<(), ()>(())
    });
    assert_eq!(n.unwrap(), 1);
    assert!(!progress.rang());
}

#[test]
fn sleeping_over_several_queues_finds_a_completion_on_any() {
    let (p, q) = (pair(64), pair(64));
    let progress = Progress::new(vec![p.cq.clone(), q.cq.clone()]);
    let sge = [Sge::new(&q.src, 0, 64)];
    let wr = SendWr::new(
        tag(4, 1),
        WrOp::Write {
            remote: q.dst.remote().at(0),
        },
        &sge,
    );
    q.a.post_send(&[wr]).unwrap();
    let mut got = None;
    let end = Instant::now() + Duration::from_secs(5);
    while got.is_none() && Instant::now() < end {
        progress
            .sleep(0, Duration::from_millis(50), |queue, wc| {
                got = Some((queue, untag(wc.wr_id)));
                Ok::<(), ()>(())
            })
            .unwrap();
    }
    assert_eq!(got, Some((1, (4, 1))));
}

struct Flag(AtomicBool);

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::Release);
    }
}

#[test]
fn a_parked_waker_is_woken_by_its_own_operation_only() {
    let wakers = Wakers::default();
    let (a, b) = (
        Arc::new(Flag(AtomicBool::new(false))),
        Arc::new(Flag(AtomicBool::new(false))),
    );
    wakers.park(1, &Waker::from(a.clone()));
    wakers.park(2, &Waker::from(b.clone()));
    wakers.wake(1);
    assert!(a.0.load(Ordering::Acquire));
    assert!(!b.0.load(Ordering::Acquire));
    wakers.forget(2);
    wakers.wake(2);
    assert!(
        !b.0.load(Ordering::Acquire),
        "a forgotten waker is not woken"
    );
    wakers.wake(1);
}

/// An engine whose operations nobody waits for: the helper drives them, then ends when the
/// engine goes away.
struct Detached {
    pair: Pair,
    progress: Progress,
    outstanding: AtomicUsize,
    closed: AtomicBool,
}

impl Driven for Detached {
    fn progress(&self) -> &Progress {
        &self.progress
    }
    fn busy(&self) -> bool {
        self.outstanding.load(Ordering::Acquire) > 0
    }
    fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
    fn handle(&self, _: usize, wc: &WorkCompletion) {
        assert!(wc.is_ok());
        self.outstanding.fetch_sub(1, Ordering::AcqRel);
    }
}

#[test]
fn the_helper_drives_operations_nobody_waits_for_and_ends_with_its_engine() {
    let pair = pair(4096);
    let progress = Progress::new(vec![pair.cq.clone()]);
    let e = Arc::new(Detached {
        pair,
        progress,
        outstanding: AtomicUsize::new(0),
        closed: AtomicBool::new(false),
    });
    let helper = {
        let w = Arc::downgrade(&e);
        std::thread::spawn(move || run_helper(w))
    };
    for i in 0..16u32 {
        e.outstanding.fetch_add(1, Ordering::AcqRel);
        let sge = [Sge::new(&e.pair.src, 0, 4096)];
        let wr = SendWr::new(
            tag(i, 0),
            WrOp::Write {
                remote: e.pair.dst.remote().at(0),
            },
            &sge,
        );
        e.pair.a.post_send(&[wr]).unwrap();
    }
    let end = Instant::now() + Duration::from_secs(5);
    while e.busy() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(!e.busy(), "{} left", e.outstanding.load(Ordering::Acquire));
    e.closed.store(true, Ordering::Release);
    let end = Instant::now() + Duration::from_secs(5);
    while !helper.is_finished() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        helper.is_finished(),
        "the helper outlived its engine's close"
    );
    helper.join().unwrap();
}

/// A collector of receive completions (`CompletionQueue::take` after `wait_doorbell`) over
/// tcp: it never drives the provider, the progress thread reads the SENDs, and it still gets
/// each one, in order and with its bytes; a doorbell that does not move times out.
#[test]
fn a_collector_takes_what_others_drive_without_driving() {
    let ctx = Device::by_name("tcp").unwrap().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let scq = ctx.create_cq(64).unwrap();
    let rcq = ctx.create_cq(64).unwrap();
    let a = pd.create_qp(&scq, &scq, &QpConfig::default()).unwrap();
    let b = pd.create_qp(&scq, &rcq, &QpConfig::default()).unwrap();
    a.connect(&b.endpoint()).unwrap();
    b.connect(&a.endpoint()).unwrap();
    let src = pd.alloc_mr(4 * 64, AccessFlags::LOCAL_WRITE).unwrap();
    let dst = pd.alloc_mr(4 * 64, AccessFlags::LOCAL_WRITE).unwrap();
    for i in 0..4u64 {
        let sge = [Sge::new(&dst, i as usize * 64, 64)];
        b.post_recv(&[crate::RecvWr::new(i, &sge)]).unwrap();
    }
    let seen = rcq.doorbell();
    let t = Instant::now();
    assert!(
        !rcq.wait_doorbell(seen, Duration::from_millis(50)),
        "nothing was sent"
    );
    assert!(t.elapsed() >= Duration::from_millis(50));
    let mut wcs = [crate::WorkCompletion::EMPTY; 4];
    assert_eq!(rcq.take(&mut wcs), 0);
    for i in 0..4u8 {
        src.write(i as usize * 64, &[i + 1; 64]).unwrap();
        let sge = [Sge::new(&src, i as usize * 64, 64)];
        a.post_send(&[SendWr::new(u64::from(i), WrOp::Send, &sge)])
            .unwrap();
    }
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while got.len() < 4 {
        assert!(Instant::now() < deadline, "collected {got:?} only");
        let seen = rcq.doorbell();
        let n = rcq.take(&mut wcs);
        if n == 0 {
            rcq.wait_doorbell(seen, Duration::from_millis(100));
        }
        got.extend(wcs[..n].iter().map(|w| (w.wr_id, w.byte_len, w.is_ok())));
    }
    assert_eq!(got, (0..4).map(|i| (i, 64, true)).collect::<Vec<_>>());
    let mut back = [0u8; 64];
    for i in 0..4u8 {
        dst.read(i as usize * 64, &mut back).unwrap();
        assert_eq!(back, [i + 1; 64]);
    }
}

/// A passive waiter over tcp (`Progress::wait_passive`): it drives nothing, the progress
/// threads move a 4 MiB WRITE, and the waiter's handler sees its completion, with the bytes in
/// place; waiting for what never comes times out naming it.
#[test]
fn a_passive_waiter_gets_its_completion_from_the_progress_threads() {
    let ctx = Device::by_name("tcp").unwrap().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let a = pd.create_qp(&cq, &cq, &QpConfig::default()).unwrap();
    let b = pd.create_qp(&cq, &cq, &QpConfig::default()).unwrap();
    a.connect(&b.endpoint()).unwrap();
    b.connect(&a.endpoint()).unwrap();
    let len = 4 << 20;
    let src = pd.alloc_mr(len, AccessFlags::LOCAL_WRITE).unwrap();
    let dst = pd
        .alloc_mr(len, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .unwrap();
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
    src.write(0, &data).unwrap();
    let progress = Progress::new(vec![cq]);
    let sge = [Sge::new(&src, 0, len)];
    a.post_send(&[SendWr::new(
        tag(9, 1),
        WrOp::Write {
            remote: dst.remote().at(0),
        },
        &sge,
    )])
    .unwrap();
    let done = AtomicBool::new(false);
    let r = progress.wait_passive(
        Instant::now() + Duration::from_secs(20),
        || "operation 9's WRITE".to_string(),
        0,
        |_, wc| {
            assert_eq!(untag(wc.wr_id), (9, 1));
            done.store(wc.is_ok(), Ordering::SeqCst);
            Ok::<_, String>(())
        },
        || done.load(Ordering::SeqCst).then_some(()),
    );
    assert!(r.is_ok(), "{:?}", r.err().map(|e| e.to_string()));
    let mut back = vec![0u8; len];
    dst.read(0, &mut back).unwrap();
    assert!(back == data, "the WRITE's bytes are not in place");
    let t = Instant::now();
    let r = progress.wait_passive(
        Instant::now() + Duration::from_millis(100),
        || "nothing at all".to_string(),
        0,
        |_, _| Ok::<_, String>(()),
        || None::<()>,
    );
    match r {
        Err(Waited::Timeout { what, .. }) => assert_eq!(what, "nothing at all"),
        other => panic!("{:?}", other.map_err(|e| e.to_string())),
    }
    assert!(t.elapsed() >= Duration::from_millis(100));
}

/// A poll whose own driving completed something (the tcp provider reading its sockets in the
/// polling thread) took it: `rang` then says nothing new arrived, so the engine's check at the
/// end of a call does not read the sockets once more for nothing (one `recv` per call).
#[test]
fn what_a_poll_completes_itself_does_not_ring_again() {
    let (_ctx, pd, cq, a, b) = crate::tests::tcp_pair();
    let src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let dst = pd.alloc_mr(64, AccessFlags::ALL).unwrap();
    let progress = Progress::new(vec![cq.clone()]);
    for round in 0..50u64 {
        b.post_recv(&[crate::RecvWr::new(tag(2, 0), &[])]).unwrap();
        let sge = [Sge::new(&src, 0, 8)];
        let op = WrOp::WriteWithImm {
            remote: dst.remote().at(0),
            imm: round as u32,
        };
        a.post_send(&[SendWr::new(tag(1, 0), op, &sge)]).unwrap();
        // Both completions (the WRITE's, once acknowledged, and the receive's), polled as an
        // engine does: until they are in, then no more.
        let (mut seen, start) = (0, Instant::now());
        while seen < 2 {
            seen += progress.poll(|_, _| Ok::<(), ()>(())).unwrap().unwrap_or(0);
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "round {round}: {seen} of 2 completions"
            );
        }
        assert!(
            !progress.rang(),
            "round {round}: the doorbell rang for completions the last poll took"
        );
    }
}
