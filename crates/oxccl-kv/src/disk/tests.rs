//! The disk tier's unit tests: round trips (direct and buffered I/O), threads on different
//! extents, existing and kept files, bad arguments, the allocator.

use super::*;
use std::os::unix::fs::MetadataExt;
use std::process::Command;

/// A directory of its own under the temporary directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p =
            std::env::temp_dir().join(format!("oxccl-kv-disk-{}-{n}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("creating a test directory");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// xorshift64*: test data that owes nothing to the code under test.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn small_chunks() -> DiskOptions {
    // 64 KiB chunks: a 3 MiB transfer becomes 48 chunks spread over the workers.
    DiskOptions {
        chunk_size: 64 << 10,
        threads: 4,
        ..DiskOptions::default()
    }
}

fn round_trip(opts: DiskOptions, expect_direct: Option<bool>) {
    let dir = TempDir::new("rt");
    let path = dir.0.join("tier");
    let tier = DiskTier::open(&path, 64 << 20, opts).unwrap();
    if let Some(d) = expect_direct {
        assert_eq!(tier.direct(), d);
    }
    assert!(path.exists());
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let lens = [1usize, 4095, 4096, 4097, 3 * (1 << 20) + 17, 2 << 20];
    // Offsets of the data inside the caller's buffers: 0 of an aligned buffer (in place
    // when the length is aligned too), and odd ones (bounced).
    for &len in &lens {
        for &(woff, roff) in &[(0usize, 0usize), (1, 7), (13, 0), (0, 4095)] {
            let data = rng.bytes(len);
            let ext = tier.alloc(len as u64).unwrap();
            assert!(ext.len() >= len as u64 && ext.len().is_multiple_of(DISK_ALIGN));
            let mut wbuf = AlignedBuf::new((len + woff).next_multiple_of(ALIGN));
            wbuf.as_mut_slice()[woff..woff + len].copy_from_slice(&data);
            tier.write(&ext, &wbuf.as_slice()[woff..woff + len])
                .unwrap();
            let mut rbuf = AlignedBuf::new((len + roff).next_multiple_of(ALIGN));
            rbuf.as_mut_slice().fill(0xa5);
            tier.read(&ext, &mut rbuf.as_mut_slice()[roff..roff + len])
                .unwrap();
            assert!(
                rbuf.as_slice()[roff..roff + len] == data[..],
                "len {len}, write offset {woff}, read offset {roff}"
            );
            // The bytes around the read window are untouched.
            assert!(rbuf.as_slice()[..roff].iter().all(|&b| b == 0xa5));
            assert!(rbuf.as_slice()[roff + len..].iter().all(|&b| b == 0xa5));
            // A shorter read of the same extent gives the prefix.
            let mut short = vec![0u8; len / 2];
            tier.read(&ext, &mut short).unwrap();
            assert!(short[..] == data[..len / 2]);
            tier.free(ext).unwrap();
        }
    }
    let st = tier.stats();
    assert_eq!(st.writes, (lens.len() * 4) as u64);
    assert_eq!(st.reads, (lens.len() * 4 * 2) as u64);
    assert_eq!(st.errors, 0);
    let written: usize = lens.iter().map(|l| l * 4).sum();
    assert_eq!(st.bytes_written, written as u64);
    assert!(st.direct_chunks > 0);
    if tier.direct() {
        assert!(st.bounced_chunks > 0);
    } else {
        assert_eq!(st.bounced_chunks, 0);
    }
    assert_eq!(tier.free_bytes(), tier.capacity());
    drop(tier);
    assert!(
        !path.exists(),
        "the tier created the file, so drop removes it"
    );
}

#[test]
fn round_trip_direct() {
    // The temporary directory is on ext4 here, which has O_DIRECT.
    round_trip(small_chunks(), None);
    round_trip(
        DiskOptions {
            threads: 1,
            ..small_chunks()
        },
        None,
    );
}

#[test]
fn round_trip_buffered() {
    round_trip(
        DiskOptions {
            direct: DirectIo::Off,
            ..small_chunks()
        },
        Some(false),
    );
}

#[test]
fn concurrent_threads_on_different_extents() {
    let dir = TempDir::new("conc");
    let tier = DiskTier::open(&dir.0.join("tier"), 64 << 20, small_chunks()).unwrap();
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let tier = &tier;
            s.spawn(move || {
                let mut rng = Rng(t * 7919 + 1);
                for _ in 0..12 {
                    let len = (rng.next() % (600 << 10)) as usize + 1;
                    let data = rng.bytes(len);
                    let ext = tier.alloc(len as u64).unwrap();
                    tier.write(&ext, &data).unwrap();
                    std::thread::yield_now();
                    let mut back = vec![0u8; len];
                    tier.read(&ext, &mut back).unwrap();
                    assert!(back == data, "thread {t}, {len} bytes");
                    tier.free(ext).unwrap();
                }
            });
        }
    });
    assert_eq!(tier.stats().writes, 96);
    assert_eq!(tier.free_bytes(), tier.capacity());
}

#[test]
fn keep_file_and_existing_file() {
    let dir = TempDir::new("keep");
    let path = dir.0.join("tier");
    let opts = DiskOptions {
        keep_file: true,
        ..DiskOptions::default()
    };
    drop(DiskTier::open(&path, 1 << 20, opts).unwrap());
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 1 << 20);
    // An existing file is truncated, resized, and left in place by drop.
    std::fs::write(&path, b"old").unwrap();
    let tier = DiskTier::open(&path, 3 * 4096 + 5, DiskOptions::default()).unwrap();
    assert_eq!(tier.capacity(), 3 * 4096);
    // The file is locked while a tier has it.
    let err = DiskTier::open(&path, 4096, DiskOptions::default()).unwrap_err();
    assert!(
        err.to_string().contains("in use by another disk tier"),
        "{err}"
    );
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 3 * 4096);
    drop(tier);
    assert!(path.exists());
    fn send_sync<T: Send + Sync>() {}
    send_sync::<DiskTier>();
}

#[test]
fn bad_arguments() {
    let dir = TempDir::new("args");
    let p = dir.0.join("tier");
    let arg = |r: Result<DiskTier>| matches!(r, Err(Error::InvalidArgument(_)));
    assert!(arg(DiskTier::open(&p, 4095, DiskOptions::default())));
    let o = DiskOptions {
        chunk_size: 1000,
        ..DiskOptions::default()
    };
    assert!(arg(DiskTier::open(&p, 1 << 20, o)));
    let o = DiskOptions {
        threads: 0,
        ..DiskOptions::default()
    };
    assert!(arg(DiskTier::open(&p, 1 << 20, o)));
    assert!(!p.exists(), "a failed open leaves no file behind");

    let a = DiskTier::open(&p, 1 << 20, DiskOptions::default()).unwrap();
    let b = DiskTier::open(&dir.0.join("other"), 1 << 20, DiskOptions::default()).unwrap();
    let e = a.alloc(10).unwrap();
    assert!(matches!(a.alloc(0), Err(Error::InvalidArgument(_))));
    assert!(matches!(b.write(&e, b"x"), Err(Error::InvalidArgument(_))));
    assert!(matches!(b.free(e), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        a.write(&e, &[0; 4097]),
        Err(Error::InvalidArgument(_))
    ));
    a.free(e).unwrap();
    let err = a.free(e).unwrap_err();
    assert!(err.to_string().contains("not allocated"), "{err}");
    assert!(matches!(
        a.read(&e, &mut [0; 1]),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(a.stats().errors, 0, "argument errors are not I/O errors");
}

#[test]
fn allocator_fill_free_fragment() {
    let dir = TempDir::new("alloc");
    let path = dir.0.join("tier");
    let tier = DiskTier::open(&path, 16 * 4096, DiskOptions::default()).unwrap();
    let exts: Vec<Extent> = (0..16).map(|_| tier.alloc(4096).unwrap()).collect();
    assert_eq!(tier.free_bytes(), 0);
    let err = tier.alloc(1).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::TierFull { .. }));
    assert!(
        text.contains(&format!("disk at {}", path.display())),
        "{text}"
    );
    assert!(
        text.contains("4096 bytes asked") || text.contains("1 bytes asked"),
        "{text}"
    );
    assert!(text.contains("0 free of 65536"), "{text}");
    // Free every other extent: half the space is free, but no two pages in a row.
    for e in exts.iter().step_by(2) {
        tier.free(*e).unwrap();
    }
    assert_eq!(tier.free_bytes(), 8 * 4096);
    let err = tier.alloc(8192).unwrap_err().to_string();
    assert!(
        err.contains("8192 bytes asked, 32768 free of 65536 (largest free extent 4096)"),
        "{err}"
    );
    // A freed hole is reused; freeing a neighbour merges two holes into one.
    let again = tier.alloc(100).unwrap();
    assert_eq!(again.offset(), 0);
    assert_eq!(again.len(), 4096);
    tier.free(exts[3]).unwrap();
    let big = tier.alloc(3 * 4096).unwrap();
    assert_eq!((big.offset(), big.len()), (2 * 4096, 3 * 4096));
    // Freeing everything gives one extent of the whole capacity back.
    tier.free(again).unwrap();
    tier.free(big).unwrap();
    for e in exts.iter().skip(5).step_by(2) {
        tier.free(*e).unwrap();
    }
    tier.free(exts[1]).unwrap();
    assert_eq!(tier.free_bytes(), tier.capacity());
    assert_eq!(tier.largest_free(), tier.capacity());
}

#[derive(Debug, Clone)]
enum Op {
    Alloc(u64),
    Free(usize),
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        (1u64..=12).prop_map(Op::Alloc),
        (0usize..64).prop_map(Op::Free),
    ]
}

proptest::proptest! {
    /// The allocator against a model: a map of which pages are taken.
    #[test]
    fn allocator_matches_model(ops in proptest::collection::vec(op(), 1..200)) {
        const PAGES: usize = 64;
        let mut a = Allocator::new(PAGES as u64 * DISK_ALIGN);
        let mut taken = [false; PAGES];
        let mut live: Vec<(u64, u64)> = Vec::new();
        for op in ops {
            match op {
                Op::Alloc(pages) => {
                    let n = pages as usize;
                    let fits = (0..=PAGES.saturating_sub(n))
                        .any(|s| taken[s..s + n].iter().all(|t| !t));
                    match a.alloc(pages * DISK_ALIGN) {
                        Some(off) => {
                            proptest::prop_assert!(fits);
                            proptest::prop_assert_eq!(off % DISK_ALIGN, 0);
                            let s = (off / DISK_ALIGN) as usize;
                            proptest::prop_assert!(s + n <= PAGES);
                            for t in &mut taken[s..s + n] {
                                proptest::prop_assert!(!*t, "overlap at page {}", s);
                                *t = true;
                            }
                            live.push((off, pages * DISK_ALIGN));
                        }
                        None => proptest::prop_assert!(!fits, "{} pages fit but alloc failed", n),
                    }
                }
                Op::Free(i) if !live.is_empty() => {
                    let (off, len) = live.swap_remove(i % live.len());
                    a.free(off, len).unwrap();
                    let s = (off / DISK_ALIGN) as usize;
                    taken[s..s + (len / DISK_ALIGN) as usize].fill(false);
                    proptest::prop_assert!(a.free(off, len).is_err(), "double free accepted");
                }
                Op::Free(_) => {}
            }
            let free_pages = taken.iter().filter(|t| !**t).count() as u64;
            proptest::prop_assert_eq!(a.free_bytes, free_pages * DISK_ALIGN);
            // The two indexes agree, and free extents are merged (never adjacent).
            proptest::prop_assert_eq!(a.free_by_offset.len(), a.free_by_size.len());
            let mut prev_end = None;
            for (&off, &len) in &a.free_by_offset {
                proptest::prop_assert!(a.free_by_size.contains(&(len, off)));
                proptest::prop_assert!(prev_end != Some(off), "unmerged free extents at {}", off);
                let s = (off / DISK_ALIGN) as usize;
                proptest::prop_assert!(taken[s..s + (len / DISK_ALIGN) as usize].iter().all(|t| !t));
                prev_end = Some(off + len);
            }
        }
    }
}

/// A missing prerequisite: a skip normally, a failure under `CI=true`.
fn prerequisite_missing(why: &str) {
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("CI=true and the full-disk test cannot run: {why}");
    }
    eprintln!("skipping the full-disk test: {why}");
}

/// A file system (`tmpfs`, `ramfs`) mounted on a temporary directory, unmounted when
/// dropped. Needs root: `Err` says why it could not be mounted.
struct SmallFs {
    dir: TempDir,
}

impl SmallFs {
    fn mount(fstype: &str, options: &str) -> std::result::Result<SmallFs, String> {
        let uid = std::fs::metadata("/proc/self").map(|m| m.uid());
        if uid.as_ref().ok() != Some(&0) {
            return Err(format!(
                "not root (uid {uid:?}); the test mounts a {fstype}"
            ));
        }
        let dir = TempDir::new(fstype);
        let out = Command::new("mount")
            .args(["-t", fstype, "-o", options, fstype])
            .arg(&dir.0)
            .output()
            .map_err(|e| format!("running mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount -t {fstype} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(SmallFs { dir })
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.dir.0)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("umount {} failed", self.dir.0.display());
        }
    }
}

#[test]
fn really_full_disk_is_tier_full() {
    let fs = match SmallFs::mount("tmpfs", "size=1m") {
        Ok(fs) => fs,
        Err(why) => return prerequisite_missing(&why),
    };
    let path = fs.dir.0.join("tier");
    let name = format!("disk at {}", path.display());

    // Preallocating 8 MiB on a 1 MiB file system fails at open, and leaves no file.
    let err = DiskTier::open(&path, 8 << 20, DiskOptions::default()).unwrap_err();
    assert!(matches!(err, Error::TierFull { .. }), "{err}");
    assert!(err.to_string().contains(&name), "{err}");
    assert!(!path.exists());

    // Deferred allocation: the open succeeds and the writes run out of space.
    let opts = DiskOptions {
        preallocate: false,
        chunk_size: 64 << 10,
        ..DiskOptions::default()
    };
    let tier = DiskTier::open(&path, 8 << 20, opts).unwrap();
    eprintln!(
        "tmpfs: O_DIRECT {}",
        if tier.direct() { "on" } else { "off" }
    );
    let mut rng = Rng(42);
    let mut stored = Vec::new();
    let mut full = None;
    for i in 0..8 {
        let data = rng.bytes(256 << 10);
        let ext = tier.alloc(data.len() as u64).unwrap();
        match tier.write(&ext, &data) {
            Ok(()) => stored.push((ext, data)),
            Err(e) => {
                full = Some((i, e));
                break;
            }
        }
    }
    let (i, err) = full.expect("8 writes of 256 KiB (2 MiB) fitted in a 1 MiB tmpfs");
    eprintln!("write {i} of 256 KiB: {err}");
    assert!(matches!(err, Error::TierFull { .. }), "write {i}: {err}");
    let text = err.to_string();
    assert!(text.contains(&name), "{text}");
    assert!(text.contains("no room"), "{text}");
    assert!(
        (1..=4).contains(&i),
        "{i} writes of 256 KiB fitted in 1 MiB"
    );
    assert_eq!(tier.stats().errors, 1);
    // What was written before the file system filled is intact.
    for (ext, data) in &stored {
        let mut back = vec![0u8; data.len()];
        tier.read(ext, &mut back).unwrap();
        assert!(back == *data);
    }
    drop(tier);
    assert!(!path.exists());
    drop(fs);
}

#[test]
fn falls_back_to_buffered_without_o_direct() {
    // ramfs refuses O_DIRECT (EINVAL) and fallocate (EOPNOTSUPP).
    let fs = match SmallFs::mount("ramfs", "mode=0700") {
        Ok(fs) => fs,
        Err(why) => return prerequisite_missing(&why),
    };
    let path = fs.dir.0.join("tier");
    let require = DiskOptions {
        direct: DirectIo::Require,
        ..DiskOptions::default()
    };
    let err = DiskTier::open(&path, 1 << 20, require).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(err.to_string().contains("O_DIRECT"), "{err}");
    assert!(!path.exists());
    let tier = DiskTier::open(&path, 1 << 20, small_chunks()).unwrap();
    assert!(!tier.direct());
    let data = Rng(5).bytes(200_001);
    let ext = tier.alloc(data.len() as u64).unwrap();
    tier.write(&ext, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    tier.read(&ext, &mut back).unwrap();
    assert!(back == data);
    assert_eq!(tier.stats().bounced_chunks, 0);
    drop(tier);
    drop(fs);
}
