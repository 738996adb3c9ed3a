//! Races and abuse found in review, each once a bug: a managed buffer freed while a READ into
//! it is in flight, many threads reconnecting to a failed peer at once, strangers holding
//! handshake connections open, and an unreachable advertised address.

use std::sync::Arc;
use std::time::{Duration, Instant};

use oxccl_bootstrap::{MemoryStore, Secret};
use oxccl_kv::meta::StoreMetadata;
use oxccl_kv::*;

fn config(protocol: Protocol, name: &str) -> EngineConfig {
    let mut c = EngineConfig::new(Secret::new("kv-races-secret-0123456").unwrap());
    c.protocol = protocol;
    c.name = Some(name.into());
    c.timeout = Duration::from_secs(4);
    c.peer_timeout = Duration::from_secs(2);
    c
}

fn meta() -> Arc<dyn Metadata> {
    Arc::new(StoreMetadata::new(Arc::new(MemoryStore::new())))
}

fn req(op: Opcode, source: u64, seg: SegmentId, target: u64, len: usize) -> TransferRequest {
    TransferRequest {
        opcode: op,
        source,
        target_id: seg,
        target_offset: target,
        length: len,
    }
}

/// A managed buffer of an engine serving shm and tcp, read into over tcp: freeing it while the
/// READ is in flight is refused (it used to unmap the memory under the tcp thread, whose late
/// bytes then landed in the next buffer mapped at the same address, with the batch "Ok").
#[test]
fn a_buffer_in_use_is_not_freed_and_late_bytes_land_nowhere_else() {
    let m = meta();
    let a = TransferEngine::new(config(Protocol::Auto, "a"), m.clone()).unwrap();
    let b = TransferEngine::new(config(Protocol::Tcp, "b"), m).unwrap();
    const LEN: usize = 16 << 20;
    let bbuf = b.allocate_managed_buffer(LEN).unwrap();
    b.write_local(bbuf, &vec![0xbb; LEN]).unwrap();
    let seg = a.open_segment("b").unwrap();
    let mut refused = 0;
    for _ in 0..10 {
        let abuf = a.allocate_managed_buffer(LEN).unwrap();
        let id = a
            .submit(&[req(Opcode::Read, abuf, seg, bbuf, LEN)], None)
            .unwrap();
        // Ok when the READ was already over.
        if let Err(e) = a.free_managed_buffer(abuf) {
            assert!(e.to_string().contains("in flight"), "{e}");
            refused += 1;
        }
        let other = a.allocate_managed_buffer(LEN).unwrap();
        a.write_local(other, &vec![0x11; LEN]).unwrap();
        a.wait(id, Duration::from_secs(10)).unwrap();
        a.free_batch(id).unwrap();
        let mut got = vec![0; LEN];
        a.read_local(other, &mut got).unwrap();
        assert!(
            got.iter().all(|&x| x == 0x11),
            "a READ's bytes landed in another buffer"
        );
        let _ = a.free_managed_buffer(abuf);
        a.free_managed_buffer(other).unwrap();
    }
    assert!(
        refused > 0,
        "no READ was still in flight when its buffer was freed"
    );
}

/// After a failure, eight threads submit at once and each reconnects: every batch ends, none
/// waits for a completion that a replaced connection took with it.
#[test]
fn threads_reconnecting_at_once_lose_no_completion() {
    let m = meta();
    let mut ca = config(Protocol::Tcp, "ra");
    ca.lanes = 2;
    ca.slice_size = 64 << 10;
    let a = Arc::new(TransferEngine::new(ca, m.clone()).unwrap());
    let b = TransferEngine::new(config(Protocol::Tcp, "rb"), m).unwrap();
    const LEN: usize = 4 << 20;
    let abuf = a.allocate_managed_buffer(LEN).unwrap();
    let bbuf = b.allocate_managed_buffer(LEN).unwrap();
    let seg = a.open_segment("rb").unwrap();
    for round in 0..6 {
        // Fail the connection: a stale key (b frees a buffer a still knows).
        let stale = b.allocate_managed_buffer(4096).unwrap();
        a.refresh_segment(seg).unwrap();
        b.free_managed_buffer(stale).unwrap();
        let stale_write = req(Opcode::Write, abuf, seg, stale, 4096);
        assert!(a.transfer_sync(&[stale_write], None).is_err());
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let a = a.clone();
                std::thread::spawn(move || {
                    let t = Instant::now();
                    let id = a.submit(&[req(Opcode::Write, abuf, seg, bbuf, LEN)], None)?;
                    let r = a.wait(id, Duration::from_secs(5));
                    let _ = a.free_batch(id);
                    r.map(|()| t.elapsed())
                })
            })
            .collect();
        for t in threads {
            let r = t.join().unwrap();
            assert!(r.is_ok(), "round {round}: {r:?}");
        }
    }
}

/// Strangers holding connections open cost a bounded number of handshake threads (those beyond
/// 64 unproven ones are closed at once, the others after the proof's timeout); once they are
/// gone, a peer with the secret gets through.
#[test]
fn strangers_cannot_pile_up_handshake_threads() {
    let m = meta();
    let a = TransferEngine::new(config(Protocol::Shm, "t"), m.clone()).unwrap();
    let _buf = a.allocate_managed_buffer(4096).unwrap();
    // This process's handshake threads (other tests' engines run beside this one).
    let threads = || {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|c| c.trim() == "oxccl-kv-peer")
            .count()
    };
    let conns: Vec<_> = (0..200)
        .map(|_| std::net::TcpStream::connect(a.handshake_addr()).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let during = threads();
    assert!(
        during <= 64 + 16,
        "{during} handshake threads with 200 strangers"
    );
    drop(conns);
    let friend = TransferEngine::new(config(Protocol::Shm, "friend"), m).unwrap();
    friend.open_segment("t").unwrap();
}

#[test]
fn an_unspecified_address_is_refused_as_unreachable() {
    let mut c = config(Protocol::Auto, "u");
    c.local_addr = "0.0.0.0:0".parse().unwrap();
    let e = TransferEngine::new(c, meta()).map(|_| ()).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("0.0.0.0"),
        "{e}"
    );
}
