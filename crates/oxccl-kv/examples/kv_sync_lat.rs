//! Latency of one synchronous transfer (`TransferEngine::transfer_sync` of one WRITE), for
//! `bench/kv-python.sh`, which times the same call through the Python API beside it.
//!
//! Two engines in this process (peer-to-peer metadata), managed buffers on both sides; the
//! initiator opens the target's segment once, warms up, then times `--iters` calls per round
//! and prints one line per round and a summary (microseconds per call: the best round and the
//! median round).
//!
//! ```text
//! cargo run --release -p oxccl-kv --example kv_sync_lat -- --protocol shm --size 4096 --iters 20000 --rounds 5
//! ```

use std::sync::Arc;
use std::time::Instant;

use oxccl_bootstrap::Secret;
use oxccl_kv::meta::P2pMetadata;
use oxccl_kv::{EngineConfig, Metadata, Opcode, Protocol, TransferEngine, TransferRequest};

fn main() {
    let mut protocol = Protocol::Shm;
    let mut size = 4096usize;
    let mut iters = 20_000usize;
    let mut rounds = 5usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--protocol" => protocol = val().parse().expect("--protocol: auto, shm or tcp"),
            "--size" => size = oxccl_kv::parse_size(&val()).expect("--size: bytes"),
            "--iters" => iters = val().parse().expect("--iters: a count"),
            "--rounds" => rounds = val().parse().expect("--rounds: a count"),
            _ => panic!("unknown argument {a} (--protocol, --size, --iters, --rounds)"),
        }
    }
    let secret = Secret::new("kv-sync-lat-bench-secret").expect("secret");
    let mut config = EngineConfig::new(secret.clone());
    config.protocol = protocol;
    let meta: Arc<dyn Metadata> = Arc::new(P2pMetadata::new(secret));
    let a = TransferEngine::new(config.clone(), meta.clone()).expect("engine a");
    let b = TransferEngine::new(config, meta).expect("engine b");
    let abuf = a.allocate_managed_buffer(size).expect("buffer a");
    let bbuf = b.allocate_managed_buffer(size).expect("buffer b");
    a.write_local(abuf, &vec![0x5a; size]).expect("fill");
    let seg = a.open_segment(b.name()).expect("open segment");
    let req = [TransferRequest {
        opcode: Opcode::Write,
        source: abuf,
        target_id: seg,
        target_offset: bbuf,
        length: size,
    }];
    for _ in 0..iters.min(5000) {
        a.transfer_sync(&req, None).expect("warm-up transfer");
    }
    let mut per = Vec::new();
    for r in 0..rounds {
        let t = Instant::now();
        for _ in 0..iters {
            a.transfer_sync(&req, None).expect("transfer");
        }
        let us = t.elapsed().as_secs_f64() * 1e6 / iters as f64;
        println!("rust round {r}: {us:.3} us per transfer_sync ({size} B WRITE, {iters} calls)");
        per.push(us);
    }
    let mut out = vec![0u8; size];
    b.read_local(bbuf, &mut out).expect("read back");
    assert!(out.iter().all(|&x| x == 0x5a), "the target's bytes differ");
    per.sort_by(f64::total_cmp);
    println!(
        "rust summary: best {:.3} us, median {:.3} us ({size} B, {protocol:?})",
        per[0],
        per[per.len() / 2]
    );
}
