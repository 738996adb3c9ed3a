//! A man in the middle of oxccl-kv's wires (`oxccl_seal::mitm`): on the segment handshake
//! socket, a flipped bit, a replayed, a dropped and a reordered record are each caught and
//! named (which peer, which record, what kind), in both directions, and nothing of the tampered
//! message reaches the application (the service is not called with it, the caller gets no
//! reply); the untampered run works; and the bytes a stranger sees hold no descriptor, token,
//! rkey, address or payload. The data lanes' test is at the end.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use oxccl_bootstrap::{MemoryStore, Secret};
use oxccl_kv::meta::StoreMetadata;
use oxccl_kv::*;
use oxccl_seal::mitm::{Plan, Proxy, Tamper, Toward, holds};

fn secret() -> Secret {
    Secret::new("kv-mitm-test-secret-0123456").unwrap()
}

fn config(name: &str) -> EngineConfig {
    let mut c = EngineConfig::new(secret());
    c.protocol = Protocol::Tcp;
    c.name = Some(name.into());
    c.lanes = 2;
    c.timeout = Duration::from_secs(5);
    c.peer_timeout = Duration::from_secs(2);
    c
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// A metadata backend whose lookups send the client to a proxy instead of the owner's
/// handshake address.
struct Redirect {
    inner: StoreMetadata,
    to: String,
}

impl Metadata for Redirect {
    fn publish(&self, desc: &SegmentDesc) -> Result<()> {
        self.inner.publish(desc)
    }
    fn lookup(&self, name: &str, timeout: Duration) -> Result<SegmentDesc> {
        let mut d = self.inner.lookup(name, timeout)?;
        d.handshake = self.to.clone();
        Ok(d)
    }
    fn remove(&self, name: &str) -> Result<()> {
        self.inner.remove(name)
    }
    fn present(&self, name: &str, version: u64) -> Result<bool> {
        self.inner.present(name, version)
    }
    fn describe(&self) -> String {
        "redirect".into()
    }
}

/// The cleartext before the records in one direction: the handshake's frames (4-byte length,
/// then the body): the client's proof toward the target; the hello and the welcome back.
fn kv_handshake(dir: Toward, seen: &[u8]) -> Option<usize> {
    let frames = match dir {
        Toward::Target => 1,
        Toward::Client => 2,
    };
    let mut at = 0;
    for _ in 0..frames {
        let len = u32::from_le_bytes(seen.get(at..at + 4)?.try_into().ok()?) as usize;
        at += 4 + len;
    }
    // Only once every frame went by (the rest is read at once, and the peer answers them
    // before it sends more).
    if seen.len() < at {
        return None;
    }
    Some(at)
}

const BIG: usize = 150 << 10;

/// The target (with an echo service that records what it was called with), a client that
/// reaches it through a proxy with `plan`, and the proxy.
struct World {
    target: TransferEngine,
    tbuf: u64,
    client: TransferEngine,
    calls: Arc<Mutex<Vec<Vec<u8>>>>,
    proxy: Proxy,
}

fn world(tamper: Tamper, toward: Toward) -> World {
    let store = Arc::new(MemoryStore::new());
    let target = TransferEngine::new(
        config("target"),
        Arc::new(StoreMetadata::new(store.clone())),
    )
    .unwrap();
    let tbuf = target.allocate_managed_buffer(1 << 20).unwrap();
    let calls = Arc::new(Mutex::new(Vec::new()));
    let c2 = calls.clone();
    target.serve(
        "echo",
        Arc::new(move |_from: &str, body: &[u8]| {
            c2.lock().unwrap().push(body.to_vec());
            Ok(body.iter().rev().copied().collect())
        }),
    );
    let plan = Plan {
        tamper,
        toward,
        connection: 0,
        handshake: kv_handshake,
    };
    let proxy = Proxy::start(target.handshake_addr().parse().unwrap(), plan).unwrap();
    let meta = Redirect {
        inner: StoreMetadata::new(store),
        to: proxy.addr().to_string(),
    };
    let client = TransferEngine::new(config("client"), Arc::new(meta)).unwrap();
    World {
        target,
        tbuf,
        client,
        calls,
        proxy,
    }
}

#[test]
fn the_untampered_handshake_works_and_says_nothing_to_a_stranger() {
    let w = world(Tamper::None, Toward::Target);
    let seg = w.client.open_segment("target").unwrap();
    // The descriptor came through the proxy, intact.
    let desc = w.client.segment_descriptor(seg).unwrap();
    assert_eq!(desc, w.target.descriptor());
    // A service call, small and large, both ways.
    let small = pattern(4096, 7);
    let big = pattern(BIG, 8);
    for body in [&small, &big] {
        let r = w.client.call(seg, "echo", body).unwrap();
        assert!(r.iter().rev().eq(body.iter()));
    }
    // The lanes work (they do not pass this proxy).
    let src = w.client.allocate_managed_buffer(64 << 10).unwrap();
    let data = pattern(64 << 10, 9);
    w.client.write_local(src, &data).unwrap();
    let req = TransferRequest {
        opcode: Opcode::Write,
        source: src,
        target_id: seg,
        target_offset: w.tbuf,
        length: data.len(),
    };
    w.client.transfer_sync(&[req], Some(b"done")).unwrap();
    let mut got = vec![0; data.len()];
    w.target.read_local(w.tbuf, &mut got).unwrap();
    assert_eq!(got, data);

    let seen = w.proxy.captured();
    assert!(seen.len() > BIG * 2, "the proxy saw {} bytes", seen.len());
    let has = |needle: &[u8]| holds(&seen, needle);
    // The scan finds what is there: the cleartext proof names the target.
    assert!(has(b"\"target\""), "the hello is in the clear");
    // No message of the conversation, no field of a descriptor or an endpoint.
    for word in [
        "get_desc",
        "\"call\"",
        "\"reply\"",
        "connected",
        "\"buffers\"",
        "\"rkeys\"",
        "\"providers\"",
        "\"endpoints\"",
        "qp_token",
        "\"keys\"",
        "echo",
    ] {
        assert!(!has(word.as_bytes()), "the wire shows {word}");
    }
    // No network address (the descriptor's handshake address, the queue pairs' listeners).
    assert!(!has(b"127.0.0.1"), "an address");
    assert!(!has(w.target.handshake_addr().as_bytes()));
    // No address or rkey of the target's buffer, in text or in binary.
    let b = &desc.buffers[0];
    assert!(!has(b.addr.to_string().as_bytes()), "the buffer's address");
    assert!(!has(&b.addr.to_le_bytes()));
    for (_, rkey) in &b.rkeys {
        assert!(!has(format!("[\"tcp\",{rkey}]").as_bytes()), "an rkey");
        assert!(!has(&rkey.to_le_bytes()[..4]) || *rkey < 1 << 16);
    }
    // Neither payload, raw or as the JSON that carries it.
    let json = |p: &[u8]| serde_json::to_string(&p[..64]).unwrap();
    for p in [&small, &big] {
        assert!(!has(&p[..32]), "a payload's bytes");
        let j = json(p);
        assert!(!has(&j.as_bytes()[1..j.len() - 1]), "a payload as JSON");
    }
}

/// Tampers with record `record` toward `toward`, then checks the caller's error names `kind`.
fn tampered_call_fails(tamper: Tamper, toward: Toward, kind: &str) {
    let w = world(tamper, toward);
    // Records 0 and 1 each way: the descriptor and the queue pair's connection. Then the big
    // call: records 2.. (the tampered one is in its middle).
    let seg = w.client.open_segment("target").unwrap();
    let big = pattern(BIG, 11);
    let err = w.client.call(seg, "echo", &big).unwrap_err().to_string();
    assert!(
        w.proxy.tampered_within(Duration::from_secs(2)),
        "{tamper:?} {toward:?}: the proxy did nothing; the call said {err}"
    );
    assert!(
        err.contains(kind),
        "{tamper:?} toward {toward:?}: {kind:?} not in: {err}"
    );
    // Which record, and from whom.
    assert!(
        err.contains("record 4") || err.contains("record 5"),
        "{err}"
    );
    match toward {
        // The target caught it: it names the client and says so, and never called the service
        // with any of it.
        Toward::Target => {
            assert!(err.contains("\"client\""), "{err}");
            assert!(w.calls.lock().unwrap().is_empty(), "the service was called");
        }
        // The client caught it: it names the target's address, and the caller got no reply.
        Toward::Client => {
            assert!(err.contains(&w.proxy.addr().to_string()), "{err}");
            assert_eq!(w.calls.lock().unwrap().len(), 1);
        }
    }
    // Nothing after a broken record is trusted: the next call goes on a fresh connection
    // (the proxy's second, untouched), and works.
    assert_eq!(w.client.call(seg, "echo", b"xyz").unwrap(), b"zyx");
    assert_eq!(w.calls.lock().unwrap().last().unwrap(), b"xyz");
}

const RECORD: u64 = 4;

#[test]
fn a_flipped_bit_is_caught_both_ways() {
    for toward in [Toward::Target, Toward::Client] {
        tampered_call_fails(
            Tamper::FlipBit { record: RECORD },
            toward,
            "record 4 failed authentication",
        );
    }
}

#[test]
fn a_replayed_record_is_caught_both_ways() {
    for toward in [Toward::Target, Toward::Client] {
        tampered_call_fails(
            Tamper::Replay { record: RECORD },
            toward,
            "record 4 arrived where record 5 was due (replayed",
        );
    }
}

#[test]
fn a_dropped_record_is_caught_both_ways() {
    for toward in [Toward::Target, Toward::Client] {
        tampered_call_fails(
            Tamper::Drop { record: RECORD },
            toward,
            "record 5 arrived where record 4 was due (an earlier record was dropped",
        );
    }
}

#[test]
fn reordered_records_are_caught_both_ways() {
    for toward in [Toward::Target, Toward::Client] {
        tampered_call_fails(
            Tamper::Swap { record: RECORD },
            toward,
            "record 5 arrived where record 4 was due",
        );
    }
}

#[test]
fn a_tampered_descriptor_opens_nothing() {
    // Record 0 toward the client is the descriptor: a flipped bit there fails the open, naming
    // the record, and no segment is opened.
    let w = world(Tamper::FlipBit { record: 0 }, Toward::Client);
    let err = w.client.open_segment("target").unwrap_err().to_string();
    assert!(w.proxy.tampered_within(Duration::from_secs(2)));
    assert!(err.contains("record 0 failed authentication"), "{err}");
    // A replayed request toward the target: the queue pair's connection is refused.
    let w = world(Tamper::Replay { record: 0 }, Toward::Target);
    let err = w.client.open_segment("target").unwrap_err().to_string();
    assert!(w.proxy.tampered_within(Duration::from_secs(2)));
    assert!(
        err.contains("record 0 arrived where record 1 was due"),
        "{err}"
    );
}

/// The data lanes through a proxy: a WRITE and a READ of patterns with `encrypt` on both ends;
/// what the proxy saw of the lanes, and whether its bytes hold either pattern.
fn lanes_through_a_proxy(encrypt: Encrypt) -> (usize, bool) {
    let meta: Arc<dyn Metadata> = Arc::new(StoreMetadata::new(Arc::new(MemoryStore::new())));
    let cfg = |name: &str| EngineConfig {
        encrypt,
        ..config(name)
    };
    let target = TransferEngine::new(cfg("target"), meta.clone()).unwrap();
    let client = TransferEngine::new(cfg("client"), meta).unwrap();
    const N: usize = 256 << 10;
    let tbuf = target.allocate_managed_buffer(2 * N).unwrap();
    let back = pattern(N, 21);
    target.write_local(tbuf + N as u64, &back).unwrap();
    let proxies: Arc<Mutex<Vec<Proxy>>> = Arc::default();
    let p2 = proxies.clone();
    client.redirect_lanes(Some(Arc::new(move |addr: &str| {
        // Every connection forwarded as it is (no tamper), and captured.
        let plan = Plan {
            connection: usize::MAX,
            ..Plan::new(Tamper::None, Toward::Target)
        };
        let p = Proxy::start(addr.parse().unwrap(), plan).unwrap();
        let a = p.addr().to_string();
        p2.lock().unwrap().push(p);
        a
    })));
    let seg = client.open_segment("target").unwrap();
    assert_eq!(client.lanes_encrypted(seg).unwrap(), encrypt == Encrypt::On);
    let src = client.allocate_managed_buffer(2 * N).unwrap();
    let out = pattern(N, 20);
    client.write_local(src, &out).unwrap();
    let req = |opcode, off: u64| TransferRequest {
        opcode,
        source: src + off,
        target_id: seg,
        target_offset: tbuf + off,
        length: N,
    };
    client
        .transfer_sync(&[req(Opcode::Write, 0), req(Opcode::Read, N as u64)], None)
        .unwrap();
    let mut got = vec![0; N];
    target.read_local(tbuf, &mut got).unwrap();
    assert!(got == out, "the WRITE arrived changed");
    client.read_local(src + N as u64, &mut got).unwrap();
    assert!(got == back, "the READ brought other bytes");
    let seen: Vec<u8> = proxies
        .lock()
        .unwrap()
        .iter()
        .flat_map(|p| p.captured())
        .collect();
    let has = |needle: &[u8]| holds(&seen, needle);
    (seen.len(), has(&out[1000..1032]) || has(&back[1000..1032]))
}

/// The control: lanes in clear through the proxy carry the patterns where it sees them (so the
/// proxy is on the lanes, and the check below can fail).
#[test]
fn lanes_in_clear_show_the_payload_to_a_proxy() {
    let (seen, shows) = lanes_through_a_proxy(Encrypt::Off);
    assert!(seen > 2 * (256 << 10), "the proxy saw {seen} bytes");
    assert!(shows, "the proxy saw the lanes but not the payload");
}

/// Encrypted lanes (the tcp provider's sealing of `QpConfig::seal`): the same WRITE and READ
/// through the proxy, and no pattern in what it saw.
#[test]
fn encrypted_lanes_show_nothing_to_a_proxy() {
    let (seen, shows) = lanes_through_a_proxy(Encrypt::On);
    assert!(seen > 2 * (256 << 10), "the proxy saw {seen} bytes");
    assert!(!shows, "a payload pattern crossed the lanes in clear");
}

/// A bit flipped 300,000 bytes into the first lane toward the target (past
/// its cleartext handshake, inside the WRITE's records, whatever their framing) fails the
/// transfer, and no byte of the target's buffer holds anything but what it held before or
/// what was written (no garbage from the broken record), and its notification never comes.
#[test]
fn a_flipped_bit_on_an_encrypted_lane_fails_the_write_and_lands_nothing() {
    let meta: Arc<dyn Metadata> = Arc::new(StoreMetadata::new(Arc::new(MemoryStore::new())));
    let cfg = |name: &str| EngineConfig {
        encrypt: Encrypt::On,
        ..config(name)
    };
    let target = TransferEngine::new(cfg("target"), meta.clone()).unwrap();
    let client = TransferEngine::new(cfg("client"), meta).unwrap();
    const N: usize = 4 << 20;
    let tbuf = target.allocate_managed_buffer(N).unwrap();
    let before = pattern(N, 30);
    target.write_local(tbuf, &before).unwrap();
    let proxies: Arc<Mutex<Vec<Proxy>>> = Arc::default();
    let p2 = proxies.clone();
    client.redirect_lanes(Some(Arc::new(move |addr: &str| {
        let plan = Plan::new(Tamper::FlipAt { offset: 300_000 }, Toward::Target);
        let p = Proxy::start(addr.parse().unwrap(), plan).unwrap();
        let a = p.addr().to_string();
        p2.lock().unwrap().push(p);
        a
    })));
    let seg = client.open_segment("target").unwrap();
    assert!(client.lanes_encrypted(seg).unwrap());
    let src = client.allocate_managed_buffer(N).unwrap();
    let written = pattern(N, 31);
    client.write_local(src, &written).unwrap();
    let req = TransferRequest {
        opcode: Opcode::Write,
        source: src,
        target_id: seg,
        target_offset: tbuf,
        length: N,
    };
    let err = client.transfer_sync(&[req], Some(b"must not arrive"));
    assert!(proxies.lock().unwrap().iter().any(|p| p.tampered()));
    let err = err.expect_err("a WRITE with a flipped bit on its lane succeeded");
    eprintln!("the WRITE failed: {err}");
    let mut got = vec![0; N];
    target.read_local(tbuf, &mut got).unwrap();
    let garbage = (0..N)
        .filter(|&i| got[i] != before[i] && got[i] != written[i])
        .count();
    assert!(
        garbage < 64,
        "{garbage} bytes of the target hold neither the old nor the written data"
    );
    // Nor did the notification of the failed batch arrive.
    assert!(target.wait_notifies(Duration::from_millis(500)).is_empty());
}
