//! In-process unit tests of the API's rules: state machine, argument checks, errors' wording.
//! Cross-process behaviour is tested in `tests/` (conformance, properties, hammer).

use std::time::{Duration, Instant};

use crate::*;

struct Fixture {
    ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
}

fn fixture() -> Fixture {
    let ctx = Device::by_name("shm").unwrap().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    Fixture { ctx, pd, cq }
}

fn pair(f: &Fixture) -> (QueuePair, QueuePair) {
    let a = f.pd.create_qp(&f.cq, &f.cq, &QpConfig::default()).unwrap();
    let b = f.pd.create_qp(&f.cq, &f.cq, &QpConfig::default()).unwrap();
    a.connect(&b.endpoint()).unwrap();
    b.connect(&a.endpoint()).unwrap();
    (a, b)
}

#[test]
fn unknown_provider_lists_the_known_ones() {
    let err = Device::by_name("ib0").unwrap_err().to_string();
    assert!(err.contains("ib0") && err.contains("shm"), "{err}");
    assert_eq!(Device::list().len(), Provider::ALL.len());
}

#[test]
fn state_machine_walks_and_refuses_illegal_transitions() {
    let f = fixture();
    let a = f.pd.create_qp(&f.cq, &f.cq, &QpConfig::default()).unwrap();
    let b = f.pd.create_qp(&f.cq, &f.cq, &QpConfig::default()).unwrap();
    assert_eq!(a.state(), QpState::Reset);
    // RESET -> RTS and RESET -> RTR are illegal.
    let e = a.to_rts().unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidTransition {
                from: QpState::Reset,
                to: QpState::Rts,
                ..
            }
        ),
        "{e}"
    );
    assert!(a.to_rtr(&b.endpoint()).is_err());
    // Nothing may be posted in RESET; receives may in INIT, sends only in RTS.
    let mr = f.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let sge = [Sge::new(&mr, 0, 8)];
    assert!(matches!(
        a.post_recv(&[RecvWr::new(1, &sge)]),
        Err(Error::InvalidState { .. })
    ));
    a.to_init().unwrap();
    a.to_init().unwrap(); // INIT -> INIT is allowed
    a.post_recv(&[RecvWr::new(1, &sge)]).unwrap();
    let wr = SendWr::new(2, WrOp::Send, &sge);
    let e = a.post_send(&[wr]).unwrap_err();
    assert!(
        e.to_string()
            .contains("post_send not allowed in state INIT"),
        "{e}"
    );
    a.to_rtr(&b.endpoint()).unwrap();
    assert_eq!(a.state(), QpState::Rtr);
    assert!(a.to_rtr(&b.endpoint()).is_err(), "RTR -> RTR");
    a.to_rts().unwrap();
    assert!(a.to_init().is_err(), "RTS -> INIT");
    a.to_error();
    assert_eq!(a.state(), QpState::Err);
    assert!(a.to_rts().is_err(), "ERR -> RTS");
    // The receive posted in INIT is flushed by the move to ERR.
    let mut wc = [WorkCompletion::default(); 4];
    let n = f.cq.wait(&mut wc, Duration::from_secs(5)).unwrap();
    assert_eq!(
        (n, wc[0].wr_id, wc[0].status),
        (1, 1, WcStatus::WorkRequestFlushed)
    );
}

#[test]
fn endpoint_round_trips_through_serde() {
    let f = fixture();
    let a = f.pd.create_qp(&f.cq, &f.cq, &QpConfig::default()).unwrap();
    let ep = a.endpoint();
    let text = serde_json::to_string(&ep).unwrap();
    let back: QpEndpoint = serde_json::from_str(&text).unwrap();
    assert_eq!(back, ep);
    assert_eq!(ep.qp_num, a.qp_num());
}

#[test]
fn connect_refuses_other_hosts_and_dead_peers() {
    let f = fixture();
    let a = f.pd.create_qp(&f.cq, &f.cq, &QpConfig::default()).unwrap();
    let b = f.pd.create_qp(&f.cq, &f.cq, &QpConfig::default()).unwrap();
    let mut ep = b.endpoint();
    ep.host = "another-boot-id".into();
    a.to_init().unwrap();
    let e = a.to_rtr(&ep).unwrap_err().to_string();
    assert!(
        e.contains("another host") && e.contains("another-boot-id"),
        "{e}"
    );
    let mut ep = b.endpoint();
    if let EndpointAddr::Shm { socket, .. } = &mut ep.addr {
        *socket = "oxccl.nobody.here".into();
    }
    let e = a.to_rtr(&ep).unwrap_err().to_string();
    assert!(e.contains("cannot connect queue pair"), "{e}");
    assert_eq!(
        a.state(),
        QpState::Init,
        "a failed connect leaves the state alone"
    );
    // A wrong queue-pair token is refused by the peer's service.
    let mut ep = b.endpoint();
    if let EndpointAddr::Shm { qp_token, .. } = &mut ep.addr {
        *qp_token ^= 1;
    }
    let e = a.to_rtr(&ep).unwrap_err().to_string();
    assert!(e.contains("refused"), "{e}");
}

#[test]
fn memory_region_keys_access_and_bounds() {
    let f = fixture();
    let a = f.pd.alloc_mr(100, AccessFlags::ALL).unwrap();
    let b = f.pd.alloc_mr(100, AccessFlags::ALL).unwrap();
    assert_ne!(a.rkey(), b.rkey());
    assert_ne!(a.lkey(), a.rkey());
    assert_eq!(a.remote().len, 100);
    assert_eq!(
        format!("{:?}", a.access()),
        "LOCAL_WRITE|REMOTE_WRITE|REMOTE_READ|REMOTE_ATOMIC"
    );
    a.write(90, &[1; 10]).unwrap();
    let e = a.write(91, &[1; 10]).unwrap_err().to_string();
    assert!(e.contains("91+10") && e.contains("100 bytes"), "{e}");
    assert!(a.atomic_u64(4).is_err(), "misaligned");
    assert!(a.atomic_u64(96).is_err(), "out of bounds");
    // User memory: atomics need provider memory on shm, and the error says so.
    let e =
        f.pd.reg_mr(vec![0; 64], AccessFlags::REMOTE_ATOMIC)
            .unwrap_err()
            .to_string();
    assert!(e.contains("alloc_mr"), "{e}");
    let u = f.pd.reg_mr(vec![7; 64], AccessFlags::REMOTE_WRITE).unwrap();
    assert!(!u.is_provider_memory());
    assert_eq!(u.to_vec(), vec![7; 64]);
    u.deregister();
    u.deregister();
    assert!(!u.is_registered());
}

#[test]
fn receive_queue_full_is_an_error_not_a_hang() {
    let f = fixture();
    let cfg = QpConfig {
        max_recv_wr: 4,
        ..QpConfig::default()
    };
    let a = f.pd.create_qp(&f.cq, &f.cq, &cfg).unwrap();
    a.to_init().unwrap();
    let mr = f.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let sge = [Sge::new(&mr, 0, 8)];
    for i in 0..4 {
        a.post_recv(&[RecvWr::new(i, &sge)]).unwrap();
    }
    let e = a.post_recv(&[RecvWr::new(9, &sge)]).unwrap_err();
    assert!(
        matches!(
            e,
            Error::QueueFull {
                queue: "receive",
                depth: 4,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn bad_configs_are_refused() {
    let f = fixture();
    for cfg in [
        QpConfig {
            max_sge: 17,
            ..QpConfig::default()
        },
        QpConfig {
            max_recv_wr: 0,
            ..QpConfig::default()
        },
    ] {
        let e = f.pd.create_qp(&f.cq, &f.cq, &cfg).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }
    let other = Device::by_name("shm").unwrap().open().unwrap();
    let foreign_cq = other.create_cq(4).unwrap();
    assert!(
        f.pd.create_qp(&foreign_cq, &f.cq, &QpConfig::default())
            .is_err()
    );
}

#[test]
fn wait_times_out_and_names_the_queue() {
    let f = fixture();
    let (_a, _b) = pair(&f);
    let mut wc = [WorkCompletion::default(); 1];
    let t = Instant::now();
    let e = f.cq.wait(&mut wc, Duration::from_millis(50)).unwrap_err();
    assert!(t.elapsed() >= Duration::from_millis(50));
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let msg = e.to_string();
    assert!(
        msg.contains("completion queue #") && msg.contains("50ms"),
        "{msg}"
    );
}

#[test]
fn a_sleeping_waiter_is_woken_by_another_thread() {
    let f = fixture();
    let (a, b) = pair(&f);
    let rcq = f.ctx.create_cq(4).unwrap();
    let c = f.pd.create_qp(&f.cq, &rcq, &QpConfig::default()).unwrap();
    let d = f.pd.create_qp(&f.cq, &f.cq, &QpConfig::default()).unwrap();
    c.connect(&d.endpoint()).unwrap();
    d.connect(&c.endpoint()).unwrap();
    let mr = f.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    c.post_recv(&[RecvWr::new(5, &[Sge::new(&mr, 0, 64)])])
        .unwrap();
    let waiter = std::thread::spawn(move || {
        let mut wc = [WorkCompletion::default(); 1];
        let t = Instant::now();
        let n = rcq.wait(&mut wc, Duration::from_secs(10)).unwrap();
        (n, wc[0], t.elapsed())
    });
    // Long enough for the waiter to be asleep on the futex.
    std::thread::sleep(Duration::from_millis(150));
    let src = f.pd.alloc_mr(8, AccessFlags::NONE).unwrap();
    d.post_send(&[SendWr::new(
        1,
        WrOp::SendWithImm { imm: 3 },
        &[Sge::new(&src, 0, 8)],
    )])
    .unwrap();
    let (n, wc, waited) = waiter.join().unwrap();
    assert_eq!(
        (n, wc.wr_id, wc.imm, wc.status),
        (1, 5, Some(3), WcStatus::Success)
    );
    assert!(waited < Duration::from_secs(5));
    drop((a, b));
}

#[test]
fn access_flags_compose() {
    let f = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
    assert!(f.contains(AccessFlags::REMOTE_READ));
    assert!(!f.contains(AccessFlags::REMOTE_WRITE));
    assert_eq!(AccessFlags::from_bits_truncate(0xFF), AccessFlags::ALL);
    assert_eq!(format!("{}", AccessFlags::NONE), "NONE");
}

#[test]
fn wire_codes_round_trip() {
    for v in 0..9 {
        assert_eq!(WcStatus::from_u32(v).unwrap() as u32, v);
    }
    assert!(WcStatus::from_u32(9).is_none());
    for v in 0..7 {
        assert_eq!(WcOpcode::from_u32(v).unwrap() as u32, v);
    }
    for v in 0..6 {
        assert_eq!(QpState::from_u32(v) as u32, v);
    }
}

/// Dropping every handle while the tcp progress thread still works on them: the last handle may
/// go on that thread, which must not try to join itself (it used to panic there).
#[test]
fn tcp_context_dropped_under_the_progress_thread() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static PROGRESS_PANICS: AtomicUsize = AtomicUsize::new(0);
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if std::thread::current().name() == Some("oxccl-tcp-progress") {
            PROGRESS_PANICS.fetch_add(1, Ordering::SeqCst);
        }
        previous(info);
    }));
    for _ in 0..30 {
        let ctx = Device::by_name("tcp").unwrap().open().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(64).unwrap();
        let a = pd.create_qp(&cq, &cq, &QpConfig::default()).unwrap();
        let b = pd.create_qp(&cq, &cq, &QpConfig::default()).unwrap();
        let (ea, eb) = (a.endpoint(), b.endpoint());
        a.connect(&eb).unwrap();
        b.connect(&ea).unwrap();
        let src = pd.alloc_mr(1 << 20, AccessFlags::LOCAL_WRITE).unwrap();
        let dst = pd.alloc_mr(1 << 20, AccessFlags::ALL).unwrap();
        let sge = [Sge::new(&src, 0, 1 << 20)];
        let wrs: Vec<SendWr> = (0..8)
            .map(|i| {
                SendWr::new(
                    i,
                    WrOp::Write {
                        remote: dst.remote().at(0),
                    },
                    &sge,
                )
                .unsignaled()
            })
            .collect();
        a.post_send(&wrs).unwrap();
        drop((a, b, src, dst, cq, pd, ctx));
    }
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        PROGRESS_PANICS.load(Ordering::SeqCst),
        0,
        "the progress thread panicked"
    );
}

/// Two connected tcp queue pairs of one context, sharing a completion queue.
pub(crate) fn tcp_pair() -> (
    Context,
    ProtectionDomain,
    CompletionQueue,
    QueuePair,
    QueuePair,
) {
    tcp_pair_with(&DeviceConfig::default())
}

/// [`tcp_pair`] on a context opened with `cfg`.
fn tcp_pair_with(
    cfg: &DeviceConfig,
) -> (
    Context,
    ProtectionDomain,
    CompletionQueue,
    QueuePair,
    QueuePair,
) {
    let ctx = Device::by_name("tcp").unwrap().open_with(cfg).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let (a, b) = (
        pd.create_qp(&cq, &cq, &QpConfig::default()).unwrap(),
        pd.create_qp(&cq, &cq, &QpConfig::default()).unwrap(),
    );
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.connect(&eb).unwrap();
    b.connect(&ea).unwrap();
    (ctx, pd, cq, a, b)
}

/// The race of issue 13: a NAKed WRITE_WITH_IMM's `RemoteAccessError` could be polled while
/// the queue pair still read RTS, because the progress thread pushed the completion before
/// moving the queue pair to ERR. The hook holds the progress thread in exactly that window for
/// 300 ms; the queue pair must read ERR as soon as the completion is polled.
#[test]
fn tcp_error_completion_is_polled_with_the_qp_in_err() {
    use std::sync::atomic::Ordering;
    crate::contract::hooks::ERROR_FLUSH_PAUSE_MS.store(300, Ordering::Relaxed);
    let (_ctx, pd, cq, a, b) = tcp_pair();
    b.post_recv(&[RecvWr::new(7, &[])]).unwrap();
    let src = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let dst = pd.alloc_mr(4096, AccessFlags::ALL).unwrap();
    let mut bad = dst.remote();
    bad.rkey ^= 0x5a5a_0000_0000;
    let sge = [Sge::new(&src, 0, 64)];
    let op = WrOp::WriteWithImm {
        remote: bad.at(0),
        imm: 1,
    };
    a.post_send(&[SendWr::new(1, op, &sge)]).unwrap();
    let mut wc = [WorkCompletion::default(); 4];
    let deadline = Instant::now() + Duration::from_secs(10);
    let got = loop {
        let n = cq.poll(&mut wc);
        if let Some(w) = wc[..n].iter().find(|w| w.wr_id == 1) {
            break *w;
        }
        assert!(Instant::now() < deadline, "no completion for the bad write");
    };
    let state = a.state();
    crate::contract::hooks::ERROR_FLUSH_PAUSE_MS.store(0, Ordering::Relaxed);
    assert_eq!(got.status, WcStatus::RemoteAccessError, "{got:?}");
    assert_eq!(
        state,
        QpState::Err,
        "queue pair state when its error was polled"
    );
    // Nothing was written, and the queue pair flushes what comes after.
    let mut seen = [0xffu8; 64];
    dst.read(0, &mut seen).unwrap();
    assert!(seen.iter().all(|&x| x == 0), "the target was touched");
    a.post_send(&[SendWr::new(
        2,
        WrOp::Write {
            remote: dst.remote().at(0),
        },
        &sge,
    )])
    .unwrap();
    let n = cq.wait(&mut wc, Duration::from_secs(5)).unwrap();
    assert!(
        wc[..n]
            .iter()
            .any(|w| w.wr_id == 2 && w.status == WcStatus::WorkRequestFlushed),
        "{:?}",
        &wc[..n]
    );
}

/// A request flushed while its frame is half-sent: the frame is finished (the stream stays
/// framed) from the frame's own copy, not from the source buffer, which the caller may reuse
/// or free as soon as the flushed completion is polled (the engine's failed calls did: the tcp
/// provider then read freed memory, `EFAULT`, or sent what the buffer held next).
#[test]
fn tcp_flushed_half_sent_frame_does_not_read_the_source_again() {
    const LEN: usize = 32 << 20;
    let (_ctx, pd, cq, a, _b) = tcp_pair();
    let src = pd.alloc_mr(LEN, AccessFlags::LOCAL_WRITE).unwrap();
    let dst = pd.alloc_mr(LEN, AccessFlags::ALL).unwrap();
    src.write(0, &vec![0xaa; LEN]).unwrap();
    let sge = [Sge::new(&src, 0, LEN)];
    let op = WrOp::Write {
        remote: dst.remote().at(0),
    };
    a.post_send(&[SendWr::new(1, op, &sge)]).unwrap();
    // 32 MiB do not fit in the socket: the frame is being sent when the queue pair fails.
    a.to_error();
    let mut wc = [WorkCompletion::default(); 4];
    let n = cq.wait(&mut wc, Duration::from_secs(10)).unwrap();
    assert_eq!(
        (wc[0].wr_id, wc[0].status),
        (1, WcStatus::WorkRequestFlushed),
        "{:?}",
        &wc[..n]
    );
    // The caller reuses its buffer at once.
    src.write(0, &vec![0x55; LEN]).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let mut got = vec![0u8; LEN];
    dst.read(0, &mut got).unwrap();
    let reused = got.iter().filter(|&&x| x == 0x55).count();
    assert_eq!(
        reused, 0,
        "{reused} bytes of the reused buffer reached the target"
    );
    assert!(got.iter().all(|&x| x == 0 || x == 0xaa));
}

/// A request NAKed on its header while its payload is still being sent (a bad rkey on a
/// 32 MiB WRITE): once the error is polled the caller frees the source; what is left of the
/// frame is sent from the frame's own copy, not from the freed memory (which gave `EFAULT`,
/// "sending to the peer failed: Bad address").
#[test]
fn tcp_naked_frame_does_not_read_freed_memory() {
    const LEN: usize = 32 << 20;
    let (_ctx, pd, cq, a, _b) = tcp_pair();
    // SAFETY: a fresh anonymous private mapping of LEN bytes, unmapped below only after the
    // request that reads it has completed (as reg_mr_raw requires).
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            LEN,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    // SAFETY: as above.
    let src = unsafe { pd.reg_mr_raw(base.cast(), LEN, AccessFlags::LOCAL_WRITE) }.unwrap();
    let dst = pd.alloc_mr(4096, AccessFlags::ALL).unwrap();
    let mut bad = dst.remote();
    bad.rkey ^= 0x77_0000_0000;
    let sge = [Sge::new(&src, 0, LEN)];
    let op = WrOp::Write { remote: bad.at(0) };
    a.post_send(&[SendWr::new(1, op, &sge)]).unwrap();
    let mut wc = [WorkCompletion::default(); 4];
    let n = cq.wait(&mut wc, Duration::from_secs(10)).unwrap();
    assert_eq!(
        (wc[0].wr_id, wc[0].status),
        (1, WcStatus::RemoteAccessError),
        "{:?}",
        &wc[..n]
    );
    drop(src);
    // SAFETY: the request completed; nothing of ours uses the mapping any more.
    assert_eq!(unsafe { libc::munmap(base, LEN) }, 0);
    std::thread::sleep(Duration::from_millis(500));
    let detail = a.error_detail().unwrap_or_default();
    assert!(!detail.contains("Bad address"), "{detail}");
}

/// A WRITE whose frame must wait (for the progress thread, or for room in the socket) keeps
/// its source region: the caller may drop its handle as soon as the post returns, and the
/// bytes that land are still the ones it posted, not what reuses the freed memory. (A frame
/// that leaves during its post takes no reference to the region: the request borrows it.)
#[test]
fn a_frame_that_waits_keeps_its_source_region() {
    let to_the_driver = DeviceConfig {
        tcp_inline_max: 0,
        ..DeviceConfig::default()
    };
    for (cfg, len) in [
        (to_the_driver, 64 << 10),
        (DeviceConfig::default(), 16 << 20),
    ] {
        let (_ctx, pd, cq, a, _b) = tcp_pair_with(&cfg);
        let dst = pd.alloc_mr(len, AccessFlags::ALL).unwrap();
        let pattern: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        for round in 0..3u64 {
            {
                let src = pd.alloc_mr(len, AccessFlags::LOCAL_WRITE).unwrap();
                src.write(0, &pattern).unwrap();
                let sge = [Sge::new(&src, 0, len)];
                let op = WrOp::Write {
                    remote: dst.remote().at(0),
                };
                a.post_send(&[SendWr::new(round, op, &sge)]).unwrap();
            }
            // What a freed source would be reused for.
            let scratch = pd.alloc_mr(len, AccessFlags::LOCAL_WRITE).unwrap();
            scratch.write(0, &vec![0xee; len]).unwrap();
            let mut wc = [WorkCompletion::default(); 1];
            let n = cq.wait(&mut wc, Duration::from_secs(20)).unwrap();
            assert_eq!(
                (n, wc[0].wr_id, wc[0].status),
                (1, round, WcStatus::Success)
            );
            let mut got = vec![0u8; len];
            dst.read(0, &mut got).unwrap();
            assert!(
                got == pattern,
                "round {round}, {len} bytes: the data changed"
            );
            dst.write(0, &vec![0; len]).unwrap();
        }
    }
}

/// A region registered in a second context over the first context's provider memory
/// (`reg_mr_of`) reaches the same bytes, and keeps them mapped after the first one is dropped:
/// a tcp WRITE into it lands in live memory, never in an unmapped (or reused) range.
#[test]
fn a_borrowed_region_keeps_the_memory_of_the_region_it_borrows() {
    let shm = Device::by_name("shm").unwrap().open().unwrap();
    let shm_pd = shm.alloc_pd().unwrap();
    let tcp = Device::by_name("tcp")
        .unwrap()
        .open_with(&DeviceConfig::default())
        .unwrap();
    let pd = tcp.alloc_pd().unwrap();
    let cq = tcp.create_cq(16).unwrap();
    let owner = shm_pd
        .alloc_mr(8192, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .unwrap();
    let borrowed = pd
        .reg_mr_of(&owner, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .unwrap();
    assert_eq!(
        (borrowed.addr(), borrowed.len()),
        (owner.addr(), owner.len())
    );
    owner.write(0, b"seen by both").unwrap();
    assert_eq!(&borrowed.to_vec()[..12], b"seen by both");
    drop(owner);
    let a = pd.create_qp(&cq, &cq, &QpConfig::default()).unwrap();
    let b = pd.create_qp(&cq, &cq, &QpConfig::default()).unwrap();
    a.connect(&b.endpoint()).unwrap();
    b.connect(&a.endpoint()).unwrap();
    let src = pd
        .reg_mr(vec![0x5c; 4096], AccessFlags::LOCAL_WRITE)
        .unwrap();
    let sge = [Sge::whole(&src)];
    a.post_send(&[SendWr::new(
        1,
        WrOp::Write {
            remote: borrowed.remote().at(100),
        },
        &sge,
    )])
    .unwrap();
    let mut wc = [WorkCompletion::EMPTY; 2];
    assert_eq!(cq.wait(&mut wc, Duration::from_secs(5)).unwrap(), 1);
    assert_eq!(wc[0].status, WcStatus::Success);
    let v = borrowed.to_vec();
    assert_eq!(&v[..12], b"seen by both");
    assert!(v[100..4196].iter().all(|&x| x == 0x5c));
}

/// The registry: every provider has one name, parsing it gives the provider back (any case,
/// trimmed), and the serialized form is the name (endpoints cross process boundaries, so it must
/// not change: "shm", "tcp").
#[test]
fn providers_are_named_once_and_serialize_as_their_names() {
    let names: Vec<&str> = Provider::ALL.iter().map(|p| p.name()).collect();
    assert_eq!(&names[..2], ["shm", "tcp"]);
    let mut unique = names.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), names.len(), "{names:?}");
    for &p in Provider::ALL {
        assert_eq!(p.name().parse::<Provider>().unwrap(), p);
        assert_eq!(
            format!(" {} ", p.name().to_uppercase())
                .parse::<Provider>()
                .unwrap(),
            p
        );
        assert_eq!(p.to_string(), p.name());
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(json, format!("\"{}\"", p.name()));
        assert_eq!(serde_json::from_str::<Provider>(&json).unwrap(), p);
        assert_eq!(Device::by_name(p.name()).unwrap().provider(), p);
    }
    let listed: Vec<Provider> = Device::list().iter().map(|d| d.provider()).collect();
    assert_eq!(listed, Provider::ALL);
}

/// What only one provider has is asked of the provider: a tcp context listens on the configured
/// address, a shm context on none.
#[test]
fn only_a_tcp_context_has_a_listener() {
    let shm = Device::by_name("shm")
        .unwrap()
        .open_with(&DeviceConfig::default())
        .unwrap();
    assert_eq!(shm.tcp_addr(), None);
    let tcp = Device::by_name("tcp")
        .unwrap()
        .open_with(&DeviceConfig::default())
        .unwrap();
    let addr = tcp.tcp_addr().expect("a tcp context listens");
    assert!(addr.ip().is_loopback() && addr.port() != 0, "{addr}");
    let pd = tcp.alloc_pd().unwrap();
    let cq = tcp.create_cq(4).unwrap();
    let qp = pd.create_qp(&cq, &cq, &QpConfig::default()).unwrap();
    match qp.endpoint().addr {
        EndpointAddr::Tcp { addr: a, .. } => assert_eq!(a, addr.to_string()),
        other => panic!("a tcp queue pair advertised {other:?}"),
    }
}

/// A provider refuses an address of a form it does not use, naming why; the queue pair stays
/// in INIT.
#[test]
fn a_provider_refuses_addresses_it_does_not_use() {
    let f = fixture();
    let a = f.pd.create_qp(&f.cq, &f.cq, &QpConfig::default()).unwrap();
    a.to_init().unwrap();
    let mut ep = a.endpoint();
    ep.addr = EndpointAddr::Opaque {
        bytes: vec![0xfe, 0x01],
        qp_token: 1,
    };
    assert!(ep.to_string().ends_with("at fe01"), "{ep}");
    let e = a.to_rtr(&ep).unwrap_err().to_string();
    assert!(e.contains("not a shm endpoint address"), "{e}");
    assert_eq!(a.state(), QpState::Init);
}

/// The environment is read once, at the top (`DeviceConfig::from_env`): no other source file of
/// this crate reads a variable.
#[test]
fn only_the_configuration_reads_the_environment() {
    fn walk(dir: &std::path::Path, found: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, found);
            } else if p.extension().is_some_and(|x| x == "rs")
                && p.file_name()
                    .is_some_and(|n| n != "config.rs" && n != "tests.rs")
            {
                let text = std::fs::read_to_string(&p).unwrap();
                for needle in ["env::var", "env::vars", "getenv"] {
                    if text.contains(needle) {
                        found.push(format!("{} ({needle})", p.display()));
                    }
                }
            }
        }
    }
    let mut found = Vec::new();
    walk(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut found,
    );
    assert!(found.is_empty(), "reads the environment: {found:?}");
}

/// Deregistering waits for the writes into the region already under way (announced before
/// the check: here, in this process, and by a peer through the region table), and once it is
/// done, no new write can be announced. A peer's count left behind (its process died in the
/// middle of a copy) holds it up only [`crate::DEREGISTER_WAIT_PEERS`].
#[test]
fn deregister_waits_for_writes_under_way() {
    use crate::contract::{TableWriting, Writing};
    let f = fixture();
    for table in [false, true] {
        let hold = Duration::from_millis(if table { 100 } else { 300 });
        let mr = f.pd.alloc_mr(4096, AccessFlags::ALL).unwrap();
        let (inner, rkey) = (mr.inner.clone(), mr.rkey());
        let seg = f.ctx.inner.seg.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let writer = std::thread::spawn(move || {
            if table {
                let w = TableWriting::begin(&seg, rkey).expect("a live region");
                tx.send(()).unwrap();
                std::thread::sleep(hold);
                drop(w);
            } else {
                let w = Writing::begin(inner).expect("a live region");
                tx.send(()).unwrap();
                std::thread::sleep(hold);
                drop(w);
            }
        });
        rx.recv().unwrap();
        let t = Instant::now();
        mr.deregister();
        let waited = t.elapsed();
        assert!(
            waited >= hold * 3 / 4 && waited < crate::DEREGISTER_WAIT,
            "table {table}: deregister returned after {waited:?} (the write took {hold:?})"
        );
        writer.join().unwrap();
        assert!(Writing::begin(mr.inner.clone()).is_none());
        assert!(TableWriting::begin(&f.ctx.inner.seg, rkey).is_none());
    }
    // A peer that died in the middle of its copy.
    let mr = f.pd.alloc_mr(4096, AccessFlags::ALL).unwrap();
    std::mem::forget(TableWriting::begin(&f.ctx.inner.seg, mr.rkey()).expect("a live region"));
    let t = Instant::now();
    mr.deregister();
    let waited = t.elapsed();
    assert!(
        waited >= crate::DEREGISTER_WAIT_PEERS && waited < crate::DEREGISTER_WAIT,
        "deregister returned after {waited:?}"
    );
}

/// A peer that executed our last requests and destroyed its queue pair at once sends the ACK
/// it held back on connection 0, and its other connections' ends may reach us first (another
/// path, or, here, the hook that ends them 150 ms before it sends): our requests must still
/// complete successfully, and the queue pair then fails as the peer's close says.
#[test]
fn the_ack_that_comes_after_another_connections_end_completes_our_requests() {
    for round in 0..3 {
        ack_after_another_end(round);
    }
}

fn ack_after_another_end(round: usize) {
    use std::sync::atomic::Ordering;
    let cfg = DeviceConfig {
        tcp_nsocks: 2,
        tcp_progress_threads: 2,
        ..DeviceConfig::default()
    };
    let end = || {
        let ctx = Device::by_name("tcp").unwrap().open_with(&cfg).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(64).unwrap();
        let qp = pd.create_qp(&cq, &cq, &QpConfig::default()).unwrap();
        (ctx, pd, cq, qp)
    };
    let (_ca, pa, cqa, a) = end();
    let (_cb, pb, cqb, b) = end();
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.connect(&eb).unwrap();
    b.connect(&ea).unwrap();
    let dst = pb.alloc_mr(4096, AccessFlags::ALL).unwrap();
    b.post_recv(&[RecvWr::new(9, &[])]).unwrap();
    crate::contract::hooks::TCP_CLOSE_CONN0_LAST_MS.store(150, Ordering::Relaxed);
    // The target's own thread waits (so it, not its progress thread, takes the message and
    // holds the ACK back), then destroys its queue pair as soon as the receive completes.
    let target = std::thread::spawn(move || {
        let mut wc = [WorkCompletion::default(); 1];
        let n = cqb.wait(&mut wc, Duration::from_secs(20)).unwrap();
        drop(b);
        (n, wc[0])
    });
    std::thread::sleep(Duration::from_millis(50));
    let src = pa.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    src.write(0, &[0x3c; 4096]).unwrap();
    let sge = [Sge::whole(&src)];
    let remote = dst.remote().at(0);
    a.post_send(&[
        SendWr::new(1, WrOp::Write { remote }, &sge),
        SendWr::new(2, WrOp::WriteWithImm { remote, imm: 5 }, &sge),
    ])
    .unwrap();
    let (n, rwc) = target.join().unwrap();
    assert_eq!((n, rwc.wr_id, rwc.status), (1, 9, WcStatus::Success));
    let mut wc = [WorkCompletion::default(); 2];
    let mut got = Vec::new();
    while got.len() < 2 {
        let n = cqa.wait(&mut wc, Duration::from_secs(20)).unwrap();
        got.extend_from_slice(&wc[..n]);
    }
    crate::contract::hooks::TCP_CLOSE_CONN0_LAST_MS.store(0, Ordering::Relaxed);
    let got: Vec<_> = got.iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(
        got,
        [(1, WcStatus::Success), (2, WcStatus::Success)],
        "round {round}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.state() != QpState::Err {
        assert!(
            Instant::now() < deadline,
            "the queue pair still reads {:?}",
            a.state()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let why = a.error_detail().unwrap_or_default();
    assert!(why.contains("closed the connection"), "{why}");
}
