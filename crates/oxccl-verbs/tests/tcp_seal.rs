//! Sealed tcp queue pairs ([`QpConfig::seal`]): every frame travels in AEAD records keyed per
//! connection from the job key and both sides' fresh nonces. The data must move exactly as on a
//! plain queue pair (checked against a pattern computed here), a peer with another job key or
//! without sealing must be refused at connect with an error naming the peer, and a record
//! tampered with on the path (through the man-in-the-middle proxy of `oxccl-seal`) must fail
//! the queue pair, naming the peer and what failed, with nothing of it reaching target memory.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use oxccl_seal::JobKey;
use oxccl_verbs::*;

/// One test at a time: the proxy tests count on their own connections only.
static SERIAL: Mutex<()> = Mutex::new(());

const WAIT: Duration = Duration::from_secs(20);

fn key(secret: &str) -> JobKey {
    JobKey::derive(secret.as_bytes(), "oxccl tcp qp v1")
}

fn sealed(secret: &str) -> QpConfig {
    QpConfig {
        seal: Some(key(secret)),
        timeout: Duration::from_secs(3),
        ..QpConfig::default()
    }
}

fn config(nsocks: usize) -> DeviceConfig {
    DeviceConfig {
        tcp_nsocks: nsocks,
        tcp_progress_threads: nsocks.min(2),
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

/// `a` connects (actively) to `b` (passive), `a` through `via` when given (a proxy in front of
/// `b`'s listener). Returns `a`'s connect result.
fn connect(a: &End, b: &End, via: Option<std::net::SocketAddr>) -> Result<()> {
    let (ea, mut eb) = (a.qp.endpoint(), b.qp.endpoint());
    if let (Some(v), EndpointAddr::Tcp { addr, .. }) = (via, &mut eb.addr) {
        *addr = v.to_string();
    }
    b.qp.connect(&ea)?;
    a.qp.connect(&eb)
}

fn pair(cfg: &DeviceConfig, qa: &QpConfig, qb: &QpConfig) -> (End, End) {
    let a = end(
        cfg,
        &QpConfig {
            connect: ConnectRole::Active,
            ..qa.clone()
        },
    );
    let b = end(
        cfg,
        &QpConfig {
            connect: ConnectRole::Passive,
            ..qb.clone()
        },
    );
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

/// Waits until `qp` is in ERR (at most `WAIT`), and returns its error detail.
fn wait_err(qp: &QueuePair, what: &str) -> String {
    let deadline = Instant::now() + WAIT;
    while qp.state() != QpState::Err {
        assert!(
            Instant::now() < deadline,
            "{what}: the queue pair is still {:?} after {WAIT:?}",
            qp.state()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    qp.error_detail().unwrap_or_default()
}

/// WRITEs, a WRITE_WITH_IMM, a SEND, READs back and both atomics over a sealed queue pair of
/// `nsocks` connections: every byte lands as the pattern says, nothing around it is touched.
fn exchange_exactly(a: &End, b: &End, lens: &[usize]) {
    let cap = lens.iter().max().copied().unwrap_or(0) + 8192;
    let src = a.pd.alloc_mr(cap, AccessFlags::LOCAL_WRITE).unwrap();
    let back =
        a.pd.alloc_mr(cap, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    let dst = b.pd.alloc_mr(cap, AccessFlags::ALL).unwrap();
    let inbox = b.pd.alloc_mr(cap, AccessFlags::LOCAL_WRITE).unwrap();
    for (round, &len) in lens.iter().enumerate() {
        let k = round as u64 + 1;
        let off = (round * 4093) % 4096;
        let data: Vec<u8> = (0..len as u64).map(|i| pattern(k, i)).collect();
        src.write(off, &data).unwrap();
        dst.write(0, &vec![0xee; cap]).unwrap();
        let sge = [Sge::new(&src, off, len)];
        let remote = dst.remote().at(off as u64);
        let op = if round % 2 == 1 {
            b.qp.post_recv(&[RecvWr::new(100 + k, &[])]).unwrap();
            WrOp::WriteWithImm {
                remote,
                imm: k as u32,
            }
        } else {
            WrOp::Write { remote }
        };
        a.qp.post_send(&[SendWr::new(k, op, &sge)]).unwrap();
        let w = wait_n(&a.cq, 1, "sealed write");
        assert_eq!((w[0].wr_id, w[0].byte_len as usize), (k, len));
        if round % 2 == 1 {
            let r = wait_n(&b.cq, 1, "its receive");
            assert_eq!((r[0].imm, r[0].byte_len as usize), (Some(k as u32), len));
        }
        let seen = dst.to_vec();
        assert!(
            seen[..off].iter().all(|&x| x == 0xee),
            "bytes before touched"
        );
        assert!(
            seen[off + len..].iter().all(|&x| x == 0xee),
            "bytes after touched"
        );
        if let Some(i) = (0..len).find(|&i| seen[off + i] != data[i]) {
            panic!("length {len}: byte {i} landed wrong");
        }
        // Back with a READ.
        back.fill(0);
        let sge = [Sge::new(&back, off, len)];
        a.qp.post_send(&[SendWr::new(50 + k, WrOp::Read { remote }, &sge)])
            .unwrap();
        let w = wait_n(&a.cq, 1, "sealed read");
        assert_eq!((w[0].wr_id, w[0].byte_len as usize), (50 + k, len));
        let got = back.to_vec();
        if let Some(i) = (0..len).find(|&i| got[off + i] != data[i]) {
            panic!("length {len}: byte {i} READ back wrong");
        }
        // A SEND of a prefix into a receive.
        let n = len.min(cap - 8192);
        let rs = [Sge::new(&inbox, 0, n)];
        b.qp.post_recv(&[RecvWr::new(200 + k, &rs)]).unwrap();
        let ss = [Sge::new(&src, off, n)];
        a.qp.post_send(&[SendWr::new(300 + k, WrOp::Send, &ss)])
            .unwrap();
        wait_n(&a.cq, 1, "sealed send");
        let r = wait_n(&b.cq, 1, "sealed send's receive");
        assert_eq!(r[0].byte_len as usize, n);
        let mut got = vec![0u8; n];
        inbox.read(0, &mut got).unwrap();
        assert!(got == data[..n], "length {len}: SEND landed wrong");
    }
    // Atomics on a word of the target.
    let word = b.pd.alloc_mr(64, AccessFlags::ALL).unwrap();
    word.atomic_u64(8)
        .unwrap()
        .store(40, std::sync::atomic::Ordering::SeqCst);
    let old = a.pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
    let remote = word.remote().at(8);
    let sge = [Sge::new(&old, 0, 8)];
    a.qp.post_send(&[SendWr::new(7, WrOp::FetchAdd { remote, add: 2 }, &sge)])
        .unwrap();
    wait_n(&a.cq, 1, "fetch-add");
    let sge2 = [Sge::new(&old, 8, 8)];
    a.qp.post_send(&[SendWr::new(
        8,
        WrOp::CompareSwap {
            remote,
            compare: 42,
            swap: 99,
        },
        &sge2,
    )])
    .unwrap();
    wait_n(&a.cq, 1, "compare-swap");
    let mut o = [0u8; 16];
    old.read(0, &mut o).unwrap();
    assert_eq!(u64::from_ne_bytes(o[..8].try_into().unwrap()), 40);
    assert_eq!(u64::from_ne_bytes(o[8..].try_into().unwrap()), 42);
    assert_eq!(
        word.atomic_u64(8)
            .unwrap()
            .load(std::sync::atomic::Ordering::SeqCst),
        99
    );
    assert_eq!(a.qp.state(), QpState::Rts);
    assert_eq!(b.qp.state(), QpState::Rts);
}

/// One connection: small frames (several per record), a payload of exactly one record, one
/// cut over several records, and one large enough to need many.
#[test]
fn sealed_queue_pair_moves_bytes_exactly() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = pair(&config(1), &sealed("job"), &sealed("job"));
    connect(&a, &b, None).unwrap();
    exchange_exactly(&a, &b, &[1, 100, 65_536 - 64, 65_536, 200_001, 3 << 20]);
}

/// Four connections, each sealed with its own keys: striped WRITEs and READ data (at least
/// 256 KiB) land exactly.
#[test]
fn sealed_striped_over_four_connections_moves_bytes_exactly() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = pair(&config(4), &sealed("job"), &sealed("job"));
    connect(&a, &b, None).unwrap();
    exchange_exactly(&a, &b, &[300_000, (5 << 20) + 12_345, 77]);
}

/// A peer with another job key: the connecting side's connect fails, naming the peer's
/// address and the key confirmation; the accepting side's queue pair goes to ERR naming it.
#[test]
fn another_job_key_is_refused_at_connect() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = pair(&config(1), &sealed("job"), &sealed("another job"));
    let baddr = b._ctx.tcp_addr().unwrap();
    let e = connect(&a, &b, None).unwrap_err().to_string();
    assert!(
        e.contains(&baddr.to_string()) && e.contains("key confirmation"),
        "{e}"
    );
    let why = wait_err(&b.qp, "the acceptor");
    assert!(
        why.contains("key") && why.contains("sealed connection 0"),
        "{why}"
    );
}

/// A sealed side and a plain side refuse each other, each saying which wants what.
#[test]
fn sealed_and_plain_refuse_each_other() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let plain = QpConfig {
        timeout: Duration::from_secs(3),
        ..QpConfig::default()
    };
    for (qa, qb, says) in [
        (
            &sealed("job"),
            &plain,
            "its queue pair is plain and ours is sealed",
        ),
        (
            &plain,
            &sealed("job"),
            "its queue pair is sealed (encrypted) and ours is plain",
        ),
    ] {
        let (a, b) = pair(&config(1), qa, qb);
        let baddr = b._ctx.tcp_addr().unwrap();
        let e = connect(&a, &b, None).unwrap_err().to_string();
        assert!(e.contains(&baddr.to_string()) && e.contains(says), "{e}");
        let why = wait_err(&b.qp, "the acceptor");
        assert!(why.contains("refused the peer's connection"), "{why}");
    }
}

// ---------------------------------------------------------------------------------------------
// Through the man-in-the-middle proxy.

use oxccl_seal::mitm::{Plan, Proxy, Tamper, Toward};

/// Cleartext bytes before the records start: the hello toward the target (the acceptor), the
/// reply toward the client (the initiator) (`tcp::frame::HELLO_LEN`, `REPLY_LEN`).
fn handshake(dir: Toward, seen: &[u8]) -> Option<usize> {
    let n = match dir {
        Toward::Target => 80,
        Toward::Client => 56,
    };
    (seen.len() >= n).then_some(n)
}

/// A proxy in front of `b`'s listener that does `tamper` toward `toward` on the first
/// connection.
fn proxy(b: &End, tamper: Tamper, toward: Toward) -> Proxy {
    Proxy::start(
        b._ctx.tcp_addr().unwrap(),
        Plan {
            tamper,
            toward,
            connection: 0,
            handshake,
        },
    )
    .unwrap()
}

/// Whether `hay` holds any `win`-byte window of `needle`.
fn holds_window(hay: &[u8], needle: &[u8], win: usize) -> bool {
    if needle.len() < win {
        return hay.windows(needle.len().max(1)).any(|w| w == needle);
    }
    let set: std::collections::HashSet<&[u8]> = needle.windows(win).step_by(win / 2).collect();
    hay.windows(win).any(|w| set.contains(w))
}

/// Waits (at most `WAIT`) for one completion on `cq` and returns it, whatever its status.
fn next_completion(cq: &CompletionQueue, what: &str) -> WorkCompletion {
    let mut wc = [WorkCompletion::default(); 1];
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "{what}: no completion within {WAIT:?}");
        if cq.wait(&mut wc, left).unwrap_or(0) == 1 {
            return wc[0];
        }
    }
}

/// The untampered run through the proxy, one connection and four: every byte moves exactly,
/// and the bytes on the wire hold nothing of the payloads, the rkeys or the addresses.
#[test]
fn through_the_proxy_untampered_moves_exactly_and_leaks_nothing() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for nsocks in [1, 4] {
        let (a, b) = pair(&config(nsocks), &sealed("job"), &sealed("job"));
        let p = proxy(&b, Tamper::None, Toward::Target);
        connect(&a, &b, Some(p.addr())).unwrap();
        let lens = [100, 65_536, 300_000];
        exchange_exactly(&a, &b, &lens);
        let wire = p.captured();
        let payload: usize = lens.iter().sum();
        assert!(
            wire.len() > 2 * payload,
            "{nsocks} connections: the proxy forwarded only {} bytes",
            wire.len()
        );
        for (round, &len) in lens.iter().enumerate() {
            let data: Vec<u8> = (0..len as u64)
                .map(|i| pattern(round as u64 + 1, i))
                .collect();
            // The check can find what it looks for.
            assert!(holds_window(&data, &data[len / 3..], 16.min(len / 2)));
            assert!(
                !holds_window(&wire, &data, 16.min(len)),
                "{nsocks} connections: payload {round} travels in clear"
            );
        }
        assert!(!p.tampered());
    }
}

/// An rkey and a target address, on the wire of a sealed WRITE and READ, are not there in
/// clear (nor is the payload).
#[test]
fn through_the_proxy_rkeys_and_addresses_are_not_in_clear() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = pair(&config(1), &sealed("job"), &sealed("job"));
    let p = proxy(&b, Tamper::None, Toward::Target);
    connect(&a, &b, Some(p.addr())).unwrap();
    let src = a.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let dst = b.pd.alloc_mr(4096, AccessFlags::ALL).unwrap();
    let data: Vec<u8> = (0..4096).map(|i| pattern(9, i)).collect();
    src.write(0, &data).unwrap();
    let sge = [Sge::new(&src, 0, 4096)];
    a.qp.post_send(&[SendWr::new(
        1,
        WrOp::Write {
            remote: dst.remote().at(0),
        },
        &sge,
    )])
    .unwrap();
    wait_n(&a.cq, 1, "write");
    assert_eq!(dst.to_vec(), data);
    let wire = p.captured();
    for (what, bytes) in [
        ("rkey", dst.rkey().to_le_bytes()),
        ("address", dst.addr().to_le_bytes()),
    ] {
        assert!(
            !wire.windows(8).any(|w| w == bytes),
            "the {what} travels in clear"
        );
    }
    assert!(
        !holds_window(&wire, &data, 16),
        "the payload travels in clear"
    );
}

/// What a tampered run shows: the target's queue pair goes to ERR, its error naming the
/// sealed connection and the peer's address and what failed (`says`), and the initiator's
/// request fails.
fn assert_failed(victim: &End, other: &End, p: &Proxy, says: &str, what: &str) -> String {
    let why = wait_err(&victim.qp, what);
    assert!(p.tampered(), "{what}: the proxy did not tamper");
    assert!(
        why.contains("sealed connection 0 with 127.0.0.1:") && why.contains(says),
        "{what}: {why}"
    );
    let _ = other;
    eprintln!("{what}: {why}");
    why
}

/// A WRITE that fits in one record, its record's bit flipped on the way: the target's queue
/// pair fails naming the record, the target memory is untouched, the WRITE fails.
#[test]
fn flipped_record_fails_the_queue_pair_and_never_lands() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = pair(&config(1), &sealed("job"), &sealed("job"));
    // Record 0 is the initiator's key confirmation; record 1 the WRITE.
    let p = proxy(&b, Tamper::FlipBit { record: 1 }, Toward::Target);
    connect(&a, &b, Some(p.addr())).unwrap();
    let src = a.pd.alloc_mr(8192, AccessFlags::LOCAL_WRITE).unwrap();
    let dst = b.pd.alloc_mr(8192, AccessFlags::ALL).unwrap();
    dst.fill(0xee);
    let data: Vec<u8> = (0..8192).map(|i| pattern(3, i)).collect();
    src.write(0, &data).unwrap();
    let sge = [Sge::new(&src, 0, 8192)];
    a.qp.post_send(&[SendWr::new(
        1,
        WrOp::Write {
            remote: dst.remote().at(0),
        },
        &sge,
    )])
    .unwrap();
    let why = assert_failed(&b, &a, &p, "record 1", "flipped bit");
    let w = next_completion(&a.cq, "the tampered WRITE");
    assert_ne!(w.status, WcStatus::Success, "{w:?} ({why})");
    assert!(
        dst.to_vec().iter().all(|&x| x == 0xee),
        "the tampered record reached target memory"
    );
}

/// A fetch-and-add's record replayed: the word is added to once, the queue pair fails.
#[test]
fn replayed_record_fails_the_queue_pair_and_acts_once() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = pair(&config(1), &sealed("job"), &sealed("job"));
    let p = proxy(&b, Tamper::Replay { record: 1 }, Toward::Target);
    connect(&a, &b, Some(p.addr())).unwrap();
    let word = b.pd.alloc_mr(64, AccessFlags::ALL).unwrap();
    word.atomic_u64(0)
        .unwrap()
        .store(1000, std::sync::atomic::Ordering::SeqCst);
    let old = a.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    let sge = [Sge::new(&old, 0, 8)];
    a.qp.post_send(&[SendWr::new(
        1,
        WrOp::FetchAdd {
            remote: word.remote().at(0),
            add: 5,
        },
        &sge,
    )])
    .unwrap();
    assert_failed(&b, &a, &p, "record 1", "replayed record");
    assert_eq!(
        word.atomic_u64(0)
            .unwrap()
            .load(std::sync::atomic::Ordering::SeqCst),
        1005,
        "the replayed fetch-and-add acted twice (or never)"
    );
}

/// Two WRITEs in two records; the proxy drops the first (or swaps them): the target's queue
/// pair fails on the record out of order, and neither WRITE reaches target memory.
#[test]
fn dropped_or_swapped_record_fails_the_queue_pair() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for tamper in [Tamper::Drop { record: 1 }, Tamper::Swap { record: 1 }] {
        let what = format!("{tamper:?}");
        let (a, b) = pair(&config(1), &sealed("job"), &sealed("job"));
        let p = proxy(&b, tamper, Toward::Target);
        connect(&a, &b, Some(p.addr())).unwrap();
        let src = a.pd.alloc_mr(2048, AccessFlags::LOCAL_WRITE).unwrap();
        let dst = b.pd.alloc_mr(2048, AccessFlags::ALL).unwrap();
        dst.fill(0xee);
        let data: Vec<u8> = (0..2048).map(|i| pattern(4, i)).collect();
        src.write(0, &data).unwrap();
        for k in 0..2 {
            let sge = [Sge::new(&src, k * 1024, 1024)];
            a.qp.post_send(&[SendWr::new(
                k as u64,
                WrOp::Write {
                    remote: dst.remote().at(k as u64 * 1024),
                },
                &sge,
            )])
            .unwrap();
            // Each WRITE leaves in a record of its own.
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_failed(&b, &a, &p, "record", &what);
        assert!(
            dst.to_vec().iter().all(|&x| x == 0xee),
            "{what}: a WRITE reached target memory"
        );
    }
}

/// READ data (toward the initiator) with a flipped bit: the initiator's queue pair fails,
/// the READ's buffer is untouched.
#[test]
fn flipped_read_data_fails_the_initiator() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = pair(&config(1), &sealed("job"), &sealed("job"));
    // Toward the client: record 0 is the acceptor's key confirmation, record 1 the READ data.
    let p = proxy(&b, Tamper::FlipBit { record: 1 }, Toward::Client);
    connect(&a, &b, Some(p.addr())).unwrap();
    let src = b.pd.alloc_mr(4096, AccessFlags::ALL).unwrap();
    src.write(0, &(0..4096).map(|i| pattern(5, i)).collect::<Vec<_>>())
        .unwrap();
    let back =
        a.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    back.fill(0x55);
    let sge = [Sge::new(&back, 0, 4096)];
    a.qp.post_send(&[SendWr::new(
        1,
        WrOp::Read {
            remote: src.remote().at(0),
        },
        &sge,
    )])
    .unwrap();
    let why = wait_err(&a.qp, "flipped READ data");
    assert!(p.tampered());
    assert!(
        why.contains("sealed connection 0 with 127.0.0.1:") && why.contains("record 1"),
        "{why}"
    );
    let w = next_completion(&a.cq, "the READ");
    assert_ne!(w.status, WcStatus::Success, "{w:?}");
    assert!(
        back.to_vec().iter().all(|&x| x == 0x55),
        "the tampered READ data reached the READ's buffer"
    );
}

/// The key confirmation record tampered with: the connect fails, naming the peer.
#[test]
fn tampered_key_confirmation_fails_the_connect() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = pair(&config(1), &sealed("job"), &sealed("job"));
    let p = proxy(&b, Tamper::FlipBit { record: 0 }, Toward::Client);
    let e = connect(&a, &b, Some(p.addr())).unwrap_err().to_string();
    assert!(p.tampered());
    assert!(
        e.contains(&p.addr().to_string()) && e.contains("key confirmation"),
        "{e}"
    );
}
