//! The tcp provider's striping with several progress shards: a queue pair with several
//! connections, each end a context whose connections are read by several progress threads at
//! once. Large WRITEs must land byte-exact, and requests must still execute in order (RC)
//! when the parts of striped WRITEs and the small requests between them are received in
//! parallel.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use oxccl_verbs::*;

/// The tests count the process's progress threads: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const WAIT: Duration = Duration::from_secs(20);

fn config(nsocks: usize, shards: usize) -> DeviceConfig {
    DeviceConfig {
        tcp_nsocks: nsocks,
        tcp_progress_threads: shards,
        ..DeviceConfig::default()
    }
}

/// The byte at `i` of stream `k`, independent of anything the provider computes.
fn pattern(k: u64, i: u64) -> u8 {
    let mut x = (k << 40) ^ i ^ 0x9e37_79b9_7f4a_7c15;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 29;
    (x >> 24) as u8
}

/// Waits (at most 5 s) until the process has `n` tcp progress threads, and returns how many it
/// has then (a new thread names itself when it first runs).
fn progress_threads_reach(n: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = progress_threads();
        if now == n || Instant::now() >= deadline {
            return now;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The tcp progress threads of this process once their number stays put for 100 ms (a
/// context dropped by an earlier test may leave a thread that is still exiting).
fn progress_threads_settled() -> usize {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut last = progress_threads();
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let now = progress_threads();
        if now == last || Instant::now() >= deadline {
            return now;
        }
        last = now;
    }
}

/// The tcp progress threads of this process (the kernel keeps 15 bytes of a thread's name).
fn progress_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| {
                    std::fs::read_to_string(e.path().join("comm"))
                        .is_ok_and(|n| n.trim_end().starts_with("oxccl-tcp-prog"))
                })
                .count()
        })
        .unwrap_or(0)
}

struct End {
    _ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
}

fn end(cfg: &DeviceConfig, qc: &QpConfig) -> End {
    let ctx = Device::by_name("tcp").unwrap().open_with(cfg).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(1024).unwrap();
    let qp = pd.create_qp(&cq, &cq, qc).unwrap();
    End {
        _ctx: ctx,
        pd,
        cq,
        qp,
    }
}

/// Two queue pairs in two contexts (each with its own listener and shards), connected.
fn pair(cfg: &DeviceConfig, qc: &QpConfig) -> (End, End) {
    let (a, b) = (end(cfg, qc), end(cfg, qc));
    let (ea, eb) = (a.qp.endpoint(), b.qp.endpoint());
    a.qp.connect(&eb).unwrap();
    b.qp.connect(&ea).unwrap();
    (a, b)
}

/// Waits for `n` completions on `cq`, each successful.
fn wait_n(cq: &CompletionQueue, n: usize, what: &str) -> Vec<WorkCompletion> {
    let mut got = Vec::new();
    let mut wc = [WorkCompletion::default(); 64];
    let deadline = Instant::now() + WAIT;
    while got.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "{what}: {} of {n} completions", got.len());
        let k = cq.wait(&mut wc, left).unwrap_or(0);
        for w in &wc[..k] {
            assert_eq!(w.status, WcStatus::Success, "{what}: {w:?}");
        }
        got.extend_from_slice(&wc[..k]);
    }
    got
}

/// A striped WRITE (and WRITE_WITH_IMM) over 4 connections, read by 4 progress shards on each
/// side, lands byte-exact: every byte of the range equals the pattern computed here, and no
/// byte around it is touched; a READ of the range back (its data striped too) brings exactly
/// those bytes. The lengths are not multiples of the 4 KiB part alignment.
#[test]
fn striped_write_over_shards_lands_byte_exact() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let before = progress_threads_settled();
    let (a, b) = pair(&config(4, 4), &QpConfig::default());
    // Each context has 4 shards, each with its thread.
    assert_eq!(
        progress_threads_reach(before + 8),
        before + 8,
        "progress threads of two contexts"
    );
    const CAP: usize = 12 << 20;
    let src = a.pd.alloc_mr(CAP, AccessFlags::LOCAL_WRITE).unwrap();
    let dst = b.pd.alloc_mr(CAP, AccessFlags::ALL).unwrap();
    let cases: [(u64, usize, usize); 4] = [
        // (stream, offset, length)
        (1, 0, 8 << 20),
        (2, 4093, (5 << 20) + 12_345),
        (3, 1, (256 << 10) + 1),
        (4, 777, (1 << 20) - 3),
    ];
    for (round, &(k, off, len)) in cases.iter().enumerate() {
        let data: Vec<u8> = (0..len as u64).map(|i| pattern(k, i)).collect();
        src.write(off, &data).unwrap();
        dst.write(0, &vec![0xee; CAP]).unwrap();
        let sge = [Sge::new(&src, off, len)];
        let imm = !round.is_multiple_of(2);
        if imm {
            b.qp.post_recv(&[RecvWr::new(100 + k, &[])]).unwrap();
        }
        let remote = dst.remote().at(off as u64);
        let op = if imm {
            WrOp::WriteWithImm {
                remote,
                imm: k as u32,
            }
        } else {
            WrOp::Write { remote }
        };
        a.qp.post_send(&[SendWr::new(k, op, &sge)]).unwrap();
        let w = wait_n(&a.cq, 1, "striped write");
        assert_eq!((w[0].wr_id, w[0].byte_len as usize), (k, len));
        if imm {
            let r = wait_n(&b.cq, 1, "its receive");
            assert_eq!((r[0].imm, r[0].byte_len as usize), (Some(k as u32), len));
        }
        let mut seen = vec![0u8; CAP];
        dst.read(0, &mut seen).unwrap();
        assert!(
            seen[..off].iter().all(|&x| x == 0xee),
            "bytes before touched"
        );
        assert!(
            seen[off + len..].iter().all(|&x| x == 0xee),
            "bytes after touched"
        );
        if let Some(i) = (0..len).find(|&i| seen[off + i] != data[i]) {
            panic!(
                "case {round}: byte {i} of {len} is {:#x}, expected {:#x}",
                seen[off + i],
                data[i]
            );
        }
        // And back with a READ into a fresh buffer.
        let back =
            a.pd.alloc_mr(CAP, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
                .unwrap();
        let sge = [Sge::new(&back, off, len)];
        a.qp.post_send(&[SendWr::new(50 + k, WrOp::Read { remote }, &sge)])
            .unwrap();
        let w = wait_n(&a.cq, 1, "striped read");
        assert_eq!((w[0].wr_id, w[0].byte_len as usize), (50 + k, len));
        let mut got = vec![0u8; CAP];
        back.read(0, &mut got).unwrap();
        assert!(got[..off].iter().all(|&x| x == 0), "READ wrote before");
        assert!(got[off + len..].iter().all(|&x| x == 0), "READ wrote after");
        if let Some(i) = (0..len).find(|&i| got[off + i] != data[i]) {
            panic!("case {round}: byte {i} of {len} READ back is wrong");
        }
    }
    assert_eq!(a.qp.state(), QpState::Rts);
    assert_eq!(b.qp.state(), QpState::Rts);
    drop((a, b));
}

/// Many striped WRITEs interleaved with small WRITEs, WRITE_WITH_IMMs, SENDs and striped READs
/// on one queue pair of 3 connections, with 3 progress shards per side: when the receive of
/// round `k` completes, every request posted before it has executed (its striped WRITE is all
/// in place, the small WRITE of the round has landed), the receives complete in order, the
/// initiator's completions come in posting order (a READ's only once its data landed, though
/// the ACKs of later requests overtake its data), and every READ sees the WRITE posted before
/// it. The target polls while the shards receive.
#[test]
fn striped_and_small_requests_execute_in_order_with_shards() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    const ROUNDS: usize = 48;
    const SLOT: usize = 512 << 10;
    let qc = QpConfig {
        max_send_wr: 4 * ROUNDS as u32 + 8,
        max_recv_wr: ROUNDS as u32 + 8,
        ..QpConfig::default()
    };
    let (a, b) = pair(&config(3, 3), &qc);
    let len_of = |k: usize| (256 << 10) + (k * 7919) % (SLOT - (256 << 10));
    let src =
        a.pd.alloc_mr(ROUNDS * SLOT, AccessFlags::LOCAL_WRITE)
            .unwrap();
    let small =
        a.pd.alloc_mr(ROUNDS * 64, AccessFlags::LOCAL_WRITE)
            .unwrap();
    let dst = b.pd.alloc_mr(ROUNDS * SLOT + 64, AccessFlags::ALL).unwrap();
    let inbox =
        b.pd.alloc_mr(ROUNDS * 64, AccessFlags::LOCAL_WRITE)
            .unwrap();
    let back =
        a.pd.alloc_mr(
            ROUNDS * SLOT,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        )
        .unwrap();
    for k in 0..ROUNDS {
        let data: Vec<u8> = (0..len_of(k) as u64)
            .map(|i| pattern(k as u64, i))
            .collect();
        src.write(k * SLOT, &data).unwrap();
        let mut msg = [0u8; 64];
        msg[..8].copy_from_slice(&(k as u64 + 1).to_le_bytes());
        msg[8..16].copy_from_slice(&(len_of(k) as u64).to_le_bytes());
        small.write(k * 64, &msg).unwrap();
    }
    let recv_sges: Vec<[Sge; 1]> = (0..ROUNDS)
        .map(|k| [Sge::new(&inbox, k * 64, 64)])
        .collect();
    let recvs: Vec<RecvWr> = (0..ROUNDS)
        .map(|k| RecvWr::new(1000 + k as u64, &recv_sges[k]))
        .collect();
    b.qp.post_recv(&recvs).unwrap();
    // The word the small WRITEs of every round overwrite, just past the slots.
    let last = dst.remote().at((ROUNDS * SLOT) as u64);

    std::thread::scope(|s| {
        let target = s.spawn(|| {
            let mut wc = [WorkCompletion::default(); 16];
            let deadline = Instant::now() + WAIT;
            let mut next = 0usize;
            while next < ROUNDS {
                let left = deadline.saturating_duration_since(Instant::now());
                assert!(!left.is_zero(), "target: {next} of {ROUNDS} receives");
                let n = b.cq.wait(&mut wc, left).unwrap_or(0);
                for w in &wc[..n] {
                    let k = next;
                    assert_eq!(w.status, WcStatus::Success, "round {k}: {w:?}");
                    assert_eq!(w.wr_id, 1000 + k as u64, "receives out of order: {w:?}");
                    if k.is_multiple_of(2) {
                        assert_eq!(w.opcode, WcOpcode::Recv, "{w:?}");
                        let mut msg = [0u8; 16];
                        inbox.read(k * 64, &mut msg).unwrap();
                        assert_eq!(
                            u64::from_le_bytes(msg[..8].try_into().unwrap()),
                            k as u64 + 1
                        );
                    } else {
                        assert_eq!(w.opcode, WcOpcode::RecvRdmaWithImm, "{w:?}");
                        assert_eq!(w.imm, Some(k as u32), "{w:?}");
                    }
                    // Everything posted before this receive's request has executed.
                    let mut word = [0u8; 8];
                    dst.read(ROUNDS * SLOT, &mut word).unwrap();
                    let at = u64::from_le_bytes(word);
                    assert!(at > k as u64, "round {k}: the small WRITE reads {at}");
                    let mut seen = vec![0u8; len_of(k)];
                    dst.read(k * SLOT, &mut seen).unwrap();
                    if let Some(i) =
                        (0..seen.len()).find(|&i| seen[i] != pattern(k as u64, i as u64))
                    {
                        panic!(
                            "round {k}: byte {i} of the striped WRITE before the receive is not \
                             in place"
                        );
                    }
                    next += 1;
                }
            }
        });
        // The initiator: round k is a striped WRITE, a small WRITE, then a SEND (even k) or a
        // WRITE_WITH_IMM of 16 bytes (odd k); only the last request of a round is signaled.
        let big: Vec<[Sge; 1]> = (0..ROUNDS)
            .map(|k| [Sge::new(&src, k * SLOT, len_of(k))])
            .collect();
        let word: Vec<[Sge; 1]> = (0..ROUNDS).map(|k| [Sge::new(&small, k * 64, 8)]).collect();
        let note: Vec<[Sge; 1]> = (0..ROUNDS)
            .map(|k| [Sge::new(&small, k * 64, 16)])
            .collect();
        let reads: Vec<[Sge; 1]> = (0..ROUNDS)
            .map(|k| [Sge::new(&back, k * SLOT, len_of(k))])
            .collect();
        for k in 0..ROUNDS {
            let id = 10 * k as u64;
            let notify = if k.is_multiple_of(2) {
                SendWr::new(id + 2, WrOp::Send, &note[k])
            } else {
                SendWr::new(
                    id + 2,
                    WrOp::WriteWithImm {
                        remote: dst.remote().at((k * SLOT + len_of(k) - 16) as u64),
                        imm: k as u32,
                    },
                    &[],
                )
            };
            let wrs = [
                SendWr::new(
                    id,
                    WrOp::Write {
                        remote: dst.remote().at((k * SLOT) as u64),
                    },
                    &big[k],
                )
                .unsignaled(),
                SendWr::new(id + 1, WrOp::Write { remote: last }, &word[k]).unsignaled(),
                notify,
                // Every third round, a READ of the round's striped WRITE (its data striped).
                SendWr::new(
                    id + 3,
                    WrOp::Read {
                        remote: dst.remote().at((k * SLOT) as u64),
                    },
                    &reads[k],
                ),
            ];
            let n = if k.is_multiple_of(3) { 4 } else { 3 };
            a.qp.post_send(&wrs[..n]).unwrap();
        }
        let want: Vec<u64> = (0..ROUNDS as u64)
            .flat_map(|k| {
                let read = k.is_multiple_of(3).then_some(10 * k + 3);
                [Some(10 * k + 2), read].into_iter().flatten()
            })
            .collect();
        let done = wait_n(&a.cq, want.len(), "initiator");
        let ids: Vec<u64> = done.iter().map(|w| w.wr_id).collect();
        assert_eq!(ids, want, "send completions out of order");
        for k in (0..ROUNDS).step_by(3) {
            let mut seen = vec![0u8; len_of(k)];
            back.read(k * SLOT, &mut seen).unwrap();
            if let Some(i) = (0..seen.len()).find(|&i| seen[i] != pattern(k as u64, i as u64)) {
                panic!("the READ of round {k} read another byte at {i}");
            }
        }
        target.join().unwrap();
    });
    assert_eq!(a.qp.state(), QpState::Rts);
    assert_eq!(b.qp.state(), QpState::Rts);
}

/// The number of shards follows the configuration: automatic is `min(tcp_nsocks, 4)`, and never
/// more than the connections.
#[test]
fn progress_shards_follow_the_configuration() {
    assert_eq!(DeviceConfig::default().progress_shards(), 1);
    assert_eq!(config(2, 0).progress_shards(), 2);
    assert_eq!(config(8, 0).progress_shards(), 4);
    assert_eq!(config(8, 6).progress_shards(), 6);
    assert_eq!(config(2, 6).progress_shards(), 2);
    assert_eq!(config(4, 1).progress_shards(), 1);
    let vars = |k: &str| (k == "OXCCL_TCP_PROGRESS_THREADS").then(|| "3".to_string());
    assert_eq!(
        DeviceConfig::from_vars(&vars).unwrap().tcp_progress_threads,
        3
    );
    let bad = |k: &str| (k == "OXCCL_TCP_PROGRESS_THREADS").then(|| "lots".to_string());
    let e = DeviceConfig::from_vars(&bad).unwrap_err().to_string();
    assert!(e.contains("OXCCL_TCP_PROGRESS_THREADS"), "{e}");
    // One connection per queue pair: one shard, one thread per context, as before.
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let before = progress_threads_settled();
    let ctx = Device::by_name("tcp")
        .unwrap()
        .open_with(&DeviceConfig::default())
        .unwrap();
    assert_eq!(progress_threads_reach(before + 1), before + 1);
    drop(ctx);
}

/// WRITEs that start while earlier ones still land (on other connections) must not overtake
/// an earlier WRITE to the same bytes: striped and whole WRITEs, some overlapping the one
/// before, some elsewhere, leave exactly what applying them in order leaves, and the receive
/// of the WRITE_WITH_IMM posted last completes only after all of them.
#[test]
fn overlapping_writes_land_in_order_with_shards() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    const SPAN: usize = 6 << 20;
    let qc = QpConfig {
        max_send_wr: 256,
        ..QpConfig::default()
    };
    let (a, b) = pair(&config(4, 4), &qc);
    let src = a.pd.alloc_mr(64 << 20, AccessFlags::LOCAL_WRITE).unwrap();
    let dst = b.pd.alloc_mr(SPAN, AccessFlags::ALL).unwrap();
    dst.write(0, &vec![0u8; SPAN]).unwrap();
    let mut reference = vec![0u8; SPAN];
    // (offset, length): a chain of overlapping striped WRITEs, small WRITEs into the middle of
    // the last one, and WRITEs far from the others.
    let mut writes: Vec<(usize, usize)> = Vec::new();
    for k in 0..40usize {
        let w = match k % 4 {
            0 => (((k * 37) << 10) % (2 << 20), (1 << 20) + 4096 * (k % 7)),
            1 => (((k * 37) << 10) % (2 << 20) + 1000, 3000 + k),
            2 => ((4 << 20) + (k % 3) * (300 << 10), (512 << 10) + k),
            _ => (((k * 53) << 10) % (2 << 20), 300 << 10),
        };
        writes.push(w);
    }
    let mut at = 0usize;
    let mut sges = Vec::new();
    for (k, &(off, len)) in writes.iter().enumerate() {
        let data: Vec<u8> = (0..len as u64)
            .map(|i| pattern(100 + k as u64, i))
            .collect();
        src.write(at, &data).unwrap();
        reference[off..off + len].copy_from_slice(&data);
        sges.push([Sge::new(&src, at, len)]);
        at += len;
    }
    b.qp.post_recv(&[RecvWr::new(1, &[])]).unwrap();
    let mut wrs: Vec<SendWr> = writes
        .iter()
        .enumerate()
        .map(|(k, &(off, _))| {
            SendWr::new(
                k as u64,
                WrOp::Write {
                    remote: dst.remote().at(off as u64),
                },
                &sges[k],
            )
            .unsignaled()
        })
        .collect();
    wrs.push(SendWr::new(
        999,
        WrOp::WriteWithImm {
            remote: dst.remote().at(0),
            imm: 7,
        },
        &[],
    ));
    a.qp.post_send(&wrs).unwrap();
    let w = wait_n(&a.cq, 1, "writes");
    assert_eq!(w[0].wr_id, 999);
    let r = wait_n(&b.cq, 1, "the receive after the writes");
    assert_eq!(r[0].imm, Some(7));
    let mut seen = vec![0u8; SPAN];
    dst.read(0, &mut seen).unwrap();
    if let Some(i) = (0..SPAN).find(|&i| seen[i] != reference[i]) {
        panic!(
            "byte {i} is {:#x}, applying the WRITEs in order gives {:#x}",
            seen[i], reference[i]
        );
    }
}
