//! The block store: `put(key, blocks)` and `get(key)` over a DRAM tier (a managed buffer of the
//! engine, so peers READ blocks straight out of it) and a disk tier ([`DiskTier`]), with LRU
//! demotion DRAM → disk and promotion back on a hit (Mooncake Store's design, on one node), and
//! `get_from(segment, key)` for blocks another node holds.
//!
//! A remote get asks the owner over the handshake channel to pin the block in its DRAM
//! (promoting it from disk if needed), READs it with the transfer engine, and unpins it. A pin is
//! a lease: one whose client died expires after the engine's timeout, so no block stays pinned
//! forever.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::batch::{Opcode, TransferRequest};
use crate::disk::{Allocator, DiskOptions, DiskTier, Extent};
use crate::engine::{SegmentId, TransferEngine};
use crate::error::{Error, Result};

/// The service name the block store answers under.
pub const BLOCK_SERVICE: &str = "oxccl-kv/blocks";

/// DRAM allocations are whole multiples of this.
const DRAM_ALIGN: u64 = 64;

/// How a [`BlockStore`] is set up.
#[derive(Clone, Debug)]
pub struct BlockStoreConfig {
    /// Bytes of DRAM (one managed buffer of the engine).
    pub dram_capacity: usize,
    /// The disk tier's file and capacity; `None`: DRAM only (a full DRAM refuses puts).
    pub disk: Option<(PathBuf, u64)>,
    /// How the disk tier is opened.
    pub disk_options: DiskOptions,
}

/// One tier's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Gets served from this tier.
    pub hits: u64,
    /// Bytes written into the tier (puts, demotions, promotions).
    pub bytes_in: u64,
    /// Bytes read out of the tier.
    pub bytes_out: u64,
    /// Time spent moving those bytes.
    pub time: Duration,
    /// Blocks moved out of the tier to the one below (DRAM) or up to DRAM (disk).
    pub moved_out: u64,
}

/// The store's counters, per tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockStats {
    /// The DRAM tier.
    pub dram: TierStats,
    /// The disk tier.
    pub disk: TierStats,
    /// Gets of keys stored nowhere.
    pub misses: u64,
    /// Gets served from other nodes ([`BlockStore::get_from`]): count, bytes, time.
    pub remote: TierStats,
}

enum Place {
    Dram { off: u64, alloc: u64 },
    Disk(Extent),
}

struct Entry {
    blocks: Vec<u64>,
    len: u64,
    place: Place,
    tick: u64,
}

struct State {
    dram: Allocator,
    index: HashMap<String, Entry>,
    lru: BTreeMap<u64, String>,
    tick: u64,
    leases: HashMap<u64, (String, Instant)>,
    next_lease: u64,
    stats: BlockStats,
}

struct Shared {
    engine: Arc<TransferEngine>,
    dram: u64,
    dram_len: u64,
    disk: Option<DiskTier>,
    state: Mutex<State>,
    lease_for: Duration,
}

/// A tiered block store on a transfer engine. Cloning shares it.
#[derive(Clone)]
pub struct BlockStore {
    shared: Arc<Shared>,
    /// The local staging buffer remote gets READ into.
    staging: Arc<Mutex<Option<(u64, usize)>>>,
}

#[derive(Serialize, Deserialize)]
enum Call {
    Pin { key: String },
    Unpin { lease: u64 },
}

#[derive(Serialize, Deserialize)]
struct Pinned {
    addr: u64,
    blocks: Vec<u64>,
    lease: u64,
}

fn round_up(n: u64, a: u64) -> u64 {
    n.div_ceil(a).max(1) * a
}

impl BlockStore {
    /// A store on `engine`: allocates its DRAM tier, opens its disk tier, and answers peers'
    /// remote gets.
    pub fn new(engine: Arc<TransferEngine>, config: BlockStoreConfig) -> Result<BlockStore> {
        if config.dram_capacity == 0 {
            return Err(Error::arg(
                "a block store needs some DRAM (dram_capacity = 0)",
            ));
        }
        let dram = engine.allocate_managed_buffer(config.dram_capacity)?;
        let disk = match &config.disk {
            Some((path, cap)) => Some(DiskTier::open(path, *cap, config.disk_options.clone())?),
            None => None,
        };
        let shared = Arc::new(Shared {
            lease_for: engine.config().timeout,
            engine: engine.clone(),
            dram,
            dram_len: config.dram_capacity as u64,
            disk,
            state: Mutex::new(State {
                dram: Allocator::new(config.dram_capacity as u64 / DRAM_ALIGN * DRAM_ALIGN),
                index: HashMap::new(),
                lru: BTreeMap::new(),
                tick: 0,
                leases: HashMap::new(),
                next_lease: 1,
                stats: BlockStats::default(),
            }),
        });
        let weak = Arc::downgrade(&shared);
        engine.serve(
            BLOCK_SERVICE,
            Arc::new(move |from: &str, body: &[u8]| {
                let s = weak.upgrade().ok_or(Error::Closed)?;
                s.serve(from, body)
            }),
        );
        Ok(BlockStore {
            shared,
            staging: Arc::new(Mutex::new(None)),
        })
    }

    /// Stores `blocks` under `key`, in DRAM; the least recently used blocks move to disk to
    /// make room. A value already under `key` is replaced (it is gone once `put` is called).
    /// When neither tier has room, the error names the tier, and every other key keeps its
    /// value.
    pub fn put(&self, key: &str, blocks: &[&[u8]]) -> Result<()> {
        self.shared.put(key, blocks)
    }

    /// The blocks stored under `key`, from DRAM, or from disk (and then promoted to DRAM).
    pub fn get(&self, key: &str) -> Result<Vec<Vec<u8>>> {
        self.shared.get(key)
    }

    /// Whether `key` is stored here, and in which tier (`"dram"` or `"disk"`).
    pub fn tier_of(&self, key: &str) -> Option<&'static str> {
        let st = self.shared.lock();
        st.index.get(key).map(|e| match e.place {
            Place::Dram { .. } => "dram",
            Place::Disk(_) => "disk",
        })
    }

    /// Removes `key`; whether it was there.
    pub fn remove(&self, key: &str) -> Result<bool> {
        let mut st = self.shared.lock();
        if st
            .leases
            .values()
            .any(|(k, t)| k == key && *t > Instant::now())
        {
            return Err(Error::arg(format!(
                "key {key:?} is being read by a peer (pinned); try again"
            )));
        }
        Ok(self.shared.drop_entry(&mut st, key))
    }

    /// The blocks another node's store holds under `key`: pinned there, READ over the transfer
    /// engine from `segment` (opened with [`TransferEngine::open_segment`]), then unpinned.
    pub fn get_from(&self, segment: SegmentId, key: &str) -> Result<Vec<Vec<u8>>> {
        let t = Instant::now();
        let e = &self.shared.engine;
        let call = |c: &Call| -> Result<Vec<u8>> {
            e.call(
                segment,
                BLOCK_SERVICE,
                &serde_json::to_vec(c).unwrap_or_default(),
            )
        };
        let reply = call(&Call::Pin { key: key.into() })?;
        let p: Pinned = serde_json::from_slice(&reply)
            .map_err(|err| Error::arg(format!("a malformed pin reply: {err}")))?;
        let len = p
            .blocks
            .iter()
            .try_fold(0u64, |a, &b| a.checked_add(b))
            .filter(|&l| l <= 1 << 40)
            .ok_or_else(|| Error::arg(format!("a pin reply for {key:?} with an absurd size")))?;
        let r = self.read_remote(segment, p.addr, len as usize);
        // The lease must still have held when the READ ended, or the bytes may be another
        // block's (the owner may have evicted it).
        let held = call(&Call::Unpin { lease: p.lease });
        let bytes = r?;
        if held?.first() != Some(&1) {
            return Err(Error::Timeout {
                what: format!(
                    "reading block {key:?}: its pin at the owner expired during the READ, so the \
                     bytes may have changed; try again"
                ),
                timeout: self.shared.lease_for,
            });
        }
        let mut st = self.shared.lock();
        st.stats.remote.hits += 1;
        st.stats.remote.bytes_in += len;
        st.stats.remote.time += t.elapsed();
        drop(st);
        Ok(split(&bytes, &p.blocks))
    }

    fn read_remote(&self, segment: SegmentId, addr: u64, len: usize) -> Result<Vec<u8>> {
        let e = &self.shared.engine;
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        if staging.is_none_or(|(_, l)| l < len) {
            if let Some((a, _)) = staging.take() {
                let _ = e.free_managed_buffer(a);
            }
            let l = len.checked_next_power_of_two().unwrap_or(len).max(1 << 20);
            *staging = Some((e.allocate_managed_buffer(l)?, l));
        }
        let (buf, _) = staging.unwrap_or((0, 0));
        let mut out = vec![0; len];
        if len > 0 {
            e.transfer_sync(
                &[TransferRequest {
                    opcode: Opcode::Read,
                    source: buf,
                    target_id: segment,
                    target_offset: addr,
                    length: len,
                }],
                None,
            )?;
            e.read_local(buf, &mut out)?;
        }
        Ok(out)
    }

    /// The counters.
    pub fn stats(&self) -> BlockStats {
        self.shared.lock().stats
    }

    /// The disk tier, if there is one.
    pub fn disk(&self) -> Option<&DiskTier> {
        self.shared.disk.as_ref()
    }
}

fn split(bytes: &[u8], blocks: &[u64]) -> Vec<Vec<u8>> {
    let mut out = Vec::with_capacity(blocks.len());
    let mut at = 0usize;
    for &b in blocks {
        let end = (at + b as usize).min(bytes.len());
        out.push(bytes[at..end].to_vec());
        at = end;
    }
    out
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn touch(st: &mut State, key: &str) {
        st.tick += 1;
        let t = st.tick;
        if let Some(e) = st.index.get_mut(key) {
            st.lru.remove(&e.tick);
            e.tick = t;
            st.lru.insert(t, key.to_string());
        }
    }

    fn drop_entry(&self, st: &mut State, key: &str) -> bool {
        let Some(e) = st.index.remove(key) else {
            return false;
        };
        st.lru.remove(&e.tick);
        match e.place {
            Place::Dram { off, alloc } => {
                let _ = st.dram.free(off, alloc);
            }
            Place::Disk(x) => {
                if let Some(d) = &self.disk {
                    let _ = d.free(x);
                }
            }
        }
        true
    }

    /// DRAM space for `len` bytes, demoting least recently used unpinned blocks (other than
    /// `keep`) to disk until it fits.
    fn make_room(&self, st: &mut State, len: u64, keep: &str) -> Result<(u64, u64)> {
        let alloc = round_up(len, DRAM_ALIGN);
        if alloc > self.dram_len {
            return Err(Error::TierFull {
                tier: "dram".into(),
                detail: format!("{len} bytes asked, the tier holds {}", self.dram_len),
            });
        }
        loop {
            if let Some(off) = st.dram.alloc(alloc) {
                return Ok((off, alloc));
            }
            let now = Instant::now();
            let victim = st
                .lru
                .values()
                .find(|k| {
                    k.as_str() != keep
                        && matches!(st.index.get(*k).map(|e| &e.place), Some(Place::Dram { .. }))
                        && !st.leases.values().any(|(l, t)| l == *k && *t > now)
                })
                .cloned();
            let Some(victim) = victim else {
                return Err(Error::TierFull {
                    tier: "dram".into(),
                    detail: format!(
                        "{len} bytes asked, {} free in pieces of at most {}, and every block \
                         there is pinned by a reader",
                        st.dram.free_bytes(),
                        st.dram.largest_free()
                    ),
                });
            };
            self.demote(st, &victim)?;
        }
    }

    /// Moves a DRAM block to disk. A full disk is an error naming it; the block stays in DRAM.
    fn demote(&self, st: &mut State, key: &str) -> Result<()> {
        let Some(disk) = &self.disk else {
            return Err(Error::TierFull {
                tier: "dram".into(),
                detail: "no room, and no disk tier to move blocks to".into(),
            });
        };
        let Some(e) = st.index.get(key) else {
            return Ok(());
        };
        let Place::Dram { off, alloc } = e.place else {
            return Ok(());
        };
        let len = e.len;
        let t = Instant::now();
        let ext = disk.alloc(len.max(1))?;
        let mut bytes = vec![0; len as usize];
        let r = self
            .engine
            .read_local(self.dram + off, &mut bytes)
            .and_then(|()| disk.write(&ext, &bytes));
        if let Err(err) = r {
            let _ = disk.free(ext);
            return Err(err);
        }
        let _ = st.dram.free(off, alloc);
        if let Some(e) = st.index.get_mut(key) {
            e.place = Place::Disk(ext);
        }
        let el = t.elapsed();
        st.stats.dram.bytes_out += len;
        st.stats.dram.moved_out += 1;
        st.stats.disk.bytes_in += len;
        st.stats.disk.time += el;
        Ok(())
    }

    fn put(&self, key: &str, blocks: &[&[u8]]) -> Result<()> {
        let len: u64 = blocks.iter().map(|b| b.len() as u64).sum();
        let t = Instant::now();
        let mut st = self.lock();
        if st
            .leases
            .values()
            .any(|(k, t)| k == key && *t > Instant::now())
        {
            return Err(Error::arg(format!(
                "key {key:?} is being read by a peer (pinned); try again"
            )));
        }
        self.drop_entry(&mut st, key);
        let (off, alloc) = self.make_room(&mut st, len, key)?;
        let mut at = self.dram + off;
        for b in blocks {
            if let Err(e) = self.engine.write_local(at, b) {
                let _ = st.dram.free(off, alloc);
                return Err(e);
            }
            at += b.len() as u64;
        }
        st.index.insert(
            key.to_string(),
            Entry {
                blocks: blocks.iter().map(|b| b.len() as u64).collect(),
                len,
                place: Place::Dram { off, alloc },
                tick: 0,
            },
        );
        Self::touch(&mut st, key);
        st.stats.dram.bytes_in += len;
        st.stats.dram.time += t.elapsed();
        Ok(())
    }

    /// Brings `key` into DRAM if it is on disk; its DRAM offset and block sizes.
    fn promote(&self, st: &mut State, key: &str) -> Result<(u64, Vec<u64>)> {
        let (len, blocks, ext) = match st.index.get(key) {
            None => {
                st.stats.misses += 1;
                return Err(Error::KeyNotFound(key.into()));
            }
            Some(Entry {
                place: Place::Dram { off, .. },
                blocks,
                ..
            }) => {
                let r = (*off, blocks.clone());
                st.stats.dram.hits += 1;
                Self::touch(st, key);
                return Ok(r);
            }
            Some(Entry {
                place: Place::Disk(x),
                len,
                blocks,
                ..
            }) => (*len, blocks.clone(), *x),
        };
        let t = Instant::now();
        let disk = self
            .disk
            .as_ref()
            .ok_or_else(|| Error::KeyNotFound(key.into()))?;
        let mut bytes = vec![0; len as usize];
        disk.read(&ext, &mut bytes)?;
        st.stats.disk.hits += 1;
        st.stats.disk.bytes_out += len;
        let (off, alloc) = self.make_room(st, len, key)?;
        if let Err(e) = self.engine.write_local(self.dram + off, &bytes) {
            let _ = st.dram.free(off, alloc);
            return Err(e);
        }
        let _ = disk.free(ext);
        if let Some(e) = st.index.get_mut(key) {
            e.place = Place::Dram { off, alloc };
        }
        Self::touch(st, key);
        let el = t.elapsed();
        st.stats.disk.moved_out += 1;
        st.stats.disk.time += el;
        st.stats.dram.bytes_in += len;
        Ok((off, blocks))
    }

    fn get(&self, key: &str) -> Result<Vec<Vec<u8>>> {
        let t = Instant::now();
        let mut st = self.lock();
        let (off, blocks) = self.promote(&mut st, key)?;
        let len: u64 = blocks.iter().sum();
        let mut bytes = vec![0; len as usize];
        self.engine.read_local(self.dram + off, &mut bytes)?;
        st.stats.dram.bytes_out += len;
        st.stats.dram.time += t.elapsed();
        Ok(split(&bytes, &blocks))
    }

    fn serve(&self, _from: &str, body: &[u8]) -> Result<Vec<u8>> {
        let call: Call = serde_json::from_slice(body)
            .map_err(|e| Error::arg(format!("a malformed block-store call: {e}")))?;
        let mut st = self.lock();
        let now = Instant::now();
        st.leases.retain(|_, (_, t)| *t > now);
        match call {
            Call::Pin { key } => {
                let (off, blocks) = self.promote(&mut st, &key)?;
                let lease = st.next_lease;
                st.next_lease += 1;
                st.leases.insert(lease, (key, now + self.lease_for));
                let len: u64 = blocks.iter().sum();
                st.stats.dram.bytes_out += len;
                let p = Pinned {
                    addr: self.dram + off,
                    blocks,
                    lease,
                };
                Ok(serde_json::to_vec(&p).unwrap_or_default())
            }
            Call::Unpin { lease } => {
                // 1: the lease was still held (the block stayed put); 0: it had expired.
                Ok(vec![u8::from(st.leases.remove(&lease).is_some())])
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{EngineConfig, Protocol};
    use crate::meta::StoreMetadata;
    use oxccl_bootstrap::{MemoryStore, Secret};

    fn engine(meta: &Arc<StoreMetadata>, name: &str) -> Arc<TransferEngine> {
        let mut c = EngineConfig::new(Secret::new("blocks-test-secret-1").unwrap());
        c.name = Some(name.into());
        c.protocol = Protocol::Shm;
        Arc::new(TransferEngine::new(c, meta.clone()).unwrap())
    }

    fn store(engine: Arc<TransferEngine>, dram: usize, disk: Option<(PathBuf, u64)>) -> BlockStore {
        let config = BlockStoreConfig {
            dram_capacity: dram,
            disk,
            disk_options: DiskOptions::default(),
        };
        BlockStore::new(engine, config).unwrap()
    }

    fn block(k: u64, len: usize) -> Vec<u8> {
        (0..len).map(|i| (i as u64 * 31 + k * 7) as u8).collect()
    }

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("oxccl-kv-blocks-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn cold_blocks_go_to_disk_and_come_back_on_a_hit() {
        let meta = Arc::new(StoreMetadata::new(Arc::new(MemoryStore::new())));
        let dir = tmpdir("lru");
        let s = store(
            engine(&meta, "lru"),
            1 << 20,
            Some((dir.join("tier"), 16 << 20)),
        );
        // 8 values of 256 KiB (two blocks each) in 1 MiB of DRAM: the oldest go to disk.
        for k in 0..8u64 {
            s.put(
                &format!("k{k}"),
                &[&block(k, 100_000), &block(k + 100, 162_144)],
            )
            .unwrap();
        }
        let tiers: Vec<_> = (0..8)
            .map(|k| s.tier_of(&format!("k{k}")).unwrap())
            .collect();
        assert_eq!(&tiers[..4], &["disk"; 4], "{tiers:?}");
        assert_eq!(&tiers[4..], &["dram"; 4], "{tiers:?}");
        // A hit on disk promotes (and demotes the LRU one of DRAM, k4).
        let got = s.get("k1").unwrap();
        assert_eq!(got, vec![block(1, 100_000), block(101, 162_144)]);
        assert_eq!(s.tier_of("k1"), Some("dram"));
        assert_eq!(s.tier_of("k4"), Some("disk"));
        for k in 0..8u64 {
            let got = s.get(&format!("k{k}")).unwrap();
            assert_eq!(
                got,
                vec![block(k, 100_000), block(k + 100, 162_144)],
                "k{k}"
            );
        }
        let st = s.stats();
        assert!(st.disk.hits >= 5 && st.dram.hits >= 1, "{st:?}");
        assert!(st.dram.moved_out >= 8 && st.disk.moved_out >= 5, "{st:?}");
        assert!(matches!(s.get("nope"), Err(Error::KeyNotFound(_))));
        assert_eq!(s.stats().misses, 1);
        assert!(s.remove("k3").unwrap());
        // Replacing a value as large as most of DRAM works (the old one makes room).
        s.put("big", &[&block(9, 700_000)]).unwrap();
        s.put("big", &[&block(10, 700_000)]).unwrap();
        assert_eq!(s.get("big").unwrap(), vec![block(10, 700_000)]);
        assert!(matches!(s.get("k3"), Err(Error::KeyNotFound(_))));
        drop(s);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_full_disk_names_the_tier_and_keeps_the_dram_copy() {
        let meta = Arc::new(StoreMetadata::new(Arc::new(MemoryStore::new())));
        let dir = tmpdir("full");
        let s = store(
            engine(&meta, "full"),
            512 << 10,
            Some((dir.join("tier"), 256 << 10)),
        );
        s.put("a", &[&block(1, 256 << 10)]).unwrap();
        s.put("b", &[&block(2, 256 << 10)]).unwrap();
        s.put("c", &[&block(3, 256 << 10)]).unwrap(); // a → disk (fills it)
        assert_eq!(s.tier_of("a"), Some("disk"));
        let e = s.put("d", &[&block(4, 256 << 10)]).unwrap_err();
        assert!(
            matches!(e, Error::TierFull { ref tier, .. } if tier.starts_with("disk at")),
            "{e}"
        );
        // Nothing was lost: b and c are still in DRAM, a on disk, d was not stored.
        assert_eq!(s.get("b").unwrap(), vec![block(2, 256 << 10)]);
        assert_eq!(s.get("c").unwrap(), vec![block(3, 256 << 10)]);
        assert_eq!(s.tier_of("d"), None);
        // A value larger than DRAM names the DRAM tier.
        let e = s.put("huge", &[&vec![0; 1 << 20]]).unwrap_err();
        assert!(
            matches!(e, Error::TierFull { ref tier, .. } if tier == "dram"),
            "{e}"
        );
        drop(s);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_remote_get_reads_the_owners_blocks_even_from_its_disk() {
        let meta = Arc::new(StoreMetadata::new(Arc::new(MemoryStore::new())));
        let dir = tmpdir("remote");
        let owner = store(
            engine(&meta, "owner"),
            1 << 20,
            Some((dir.join("tier"), 8 << 20)),
        );
        let client_engine = engine(&meta, "client");
        let client = store(client_engine.clone(), 1 << 20, None);
        for k in 0..6u64 {
            owner.put(&format!("k{k}"), &[&block(k, 300_000)]).unwrap();
        }
        assert_eq!(owner.tier_of("k0"), Some("disk"));
        let seg = client_engine.open_segment("owner").unwrap();
        for k in [0u64, 5, 1] {
            let got = client.get_from(seg, &format!("k{k}")).unwrap();
            assert_eq!(got, vec![block(k, 300_000)], "k{k}");
        }
        let e = client.get_from(seg, "missing").unwrap_err();
        assert!(e.to_string().contains("missing"), "{e}");
        assert_eq!(client.stats().remote.hits, 3);
        assert!(owner.stats().disk.hits >= 2);
        drop((owner, client));
        let _ = std::fs::remove_dir_all(dir);
    }
}
