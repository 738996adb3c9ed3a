//! Read bandwidth of the disk tier (`oxccl_kv::disk::DiskTier`), for `bench/kv-disk.sh`.
//!
//! Writes a file of `--size` bytes through the tier (O_DIRECT required), then reads it back
//! `--passes` times in calls of `--op` bytes (each split by the tier into `--chunk` pieces on
//! `--threads` threads), and prints GB/s (10^9 bytes per second) per pass, the best and the
//! median. The data is checked after the timed passes.
//!
//! ```text
//! cargo run --release -p oxccl-kv --example disk_read_bw -- \
//!     --file /var/tmp/kv-disk.dat --size 1G --threads 4 --chunk 1M --op 64M --passes 3 [--keep] [--unaligned]
//! ```
//!
//! `--keep` leaves the file (written in full) for another tool (fio) to read; `--unaligned`
//! reads into a buffer one byte off a page boundary (the bounce-buffer path).

use std::path::PathBuf;
use std::time::Instant;

use oxccl_kv::disk::{DirectIo, DiskOptions, DiskTier};

fn parse_size(s: &str) -> u64 {
    oxccl_kv::parse_size(s).unwrap_or_else(|| panic!("bad size {s:?}")) as u64
}

/// The 8-byte word stored at byte `pos` of the file.
fn word(pos: u64) -> u64 {
    (pos / 8).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5bd1_e995
}

/// A buffer of `len` bytes starting `skew` bytes past a page boundary.
struct Buf {
    vec: Vec<u8>,
    start: usize,
    len: usize,
}

impl Buf {
    fn new(len: usize, skew: usize) -> Buf {
        let vec = vec![0u8; len + 8192];
        let start = vec.as_ptr().align_offset(4096) + skew;
        Buf { vec, start, len }
    }
    fn get(&mut self) -> &mut [u8] {
        &mut self.vec[self.start..self.start + self.len]
    }
}

fn main() {
    let mut file = PathBuf::from("/var/tmp/oxccl-kv-disk-bench.dat");
    let (mut size, mut threads, mut chunk, mut op, mut passes) =
        (1u64 << 30, 4usize, 1usize << 20, 64usize << 20, 3usize);
    let (mut keep, mut unaligned) = (false, false);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--file" => file = PathBuf::from(val()),
            "--size" => size = parse_size(&val()),
            "--threads" => threads = val().parse().expect("--threads"),
            "--chunk" => chunk = parse_size(&val()) as usize,
            "--op" => op = parse_size(&val()) as usize,
            "--passes" => passes = val().parse().expect("--passes"),
            "--keep" => keep = true,
            "--unaligned" => unaligned = true,
            _ => panic!("unknown argument {a:?} (see the file's header)"),
        }
    }
    assert!(size % op as u64 == 0, "--size must be a multiple of --op");
    let opts = DiskOptions {
        chunk_size: chunk,
        threads,
        preallocate: true,
        direct: DirectIo::Require,
        keep_file: keep,
    };
    let tier = DiskTier::open(&file, size, opts).expect("opening the disk tier");
    let n = (size / op as u64) as usize;
    let extents: Vec<_> = (0..n)
        .map(|_| tier.alloc(op as u64).expect("allocating"))
        .collect();
    let skew = if unaligned { 1 } else { 0 };
    let mut buf = Buf::new(op, skew);

    // Write phase (the open truncated the file).
    let t = Instant::now();
    for e in &extents {
        let b = buf.get();
        for (i, w) in b.chunks_exact_mut(8).enumerate() {
            w.copy_from_slice(&word(e.offset() + 8 * i as u64).to_le_bytes());
        }
        tier.write(e, b).expect("writing");
    }
    tier.sync().expect("fdatasync");
    let wsecs = t.elapsed().as_secs_f64();
    println!(
        "oxccl-disk write: {:.3} GB/s ({} MiB in {:.3} s, incl. fdatasync)",
        size as f64 / wsecs / 1e9,
        size >> 20,
        wsecs
    );

    let mut rates = Vec::new();
    for p in 0..passes {
        let t = Instant::now();
        for e in &extents {
            tier.read(e, buf.get()).expect("reading");
        }
        let secs = t.elapsed().as_secs_f64();
        let gbs = size as f64 / secs / 1e9;
        println!("oxccl-disk read pass {p}: {gbs:.3} GB/s ({secs:.3} s)");
        rates.push(gbs);
    }
    // Check every word of the file (untimed).
    for e in &extents {
        let b = buf.get();
        tier.read(e, b).expect("reading");
        for (i, w) in b.chunks_exact(8).enumerate() {
            let want = word(e.offset() + 8 * i as u64);
            assert_eq!(
                u64::from_le_bytes(w.try_into().unwrap()),
                want,
                "data mismatch at byte {}",
                e.offset() + 8 * i as u64
            );
        }
    }
    rates.sort_by(|a, b| a.total_cmp(b));
    let st = tier.stats();
    println!(
        "oxccl-disk read: threads={threads} chunk={chunk} op={op} direct={} unaligned={unaligned} \
         best={:.3} median={:.3} GB/s (bounced chunks {}, in-place {})",
        tier.direct(),
        rates[rates.len() - 1],
        rates[rates.len() / 2],
        st.bounced_chunks,
        st.direct_chunks
    );
}
