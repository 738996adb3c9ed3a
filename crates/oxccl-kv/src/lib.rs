//! # oxccl-kv: a KV-cache transfer engine and a tiered block store
//!
//! The data path of disaggregated inference: prefill nodes WRITE KV-cache blocks into decode
//! nodes' memory (or decode nodes READ them), over the oxccl verbs, so the same code gets kernel
//! bypass inside a host (`shm`: one `memcpy`, no syscall) and RDMA semantics over TCP across hosts
//! (`tcp`, several connections per peer). Shaped like Mooncake's transfer engine:
//!
//! - A [`TransferEngine`] registers memory ([`TransferEngine::allocate_managed_buffer`], or the
//!   caller's with [`TransferEngine::register_memory`]) as its *segment*, published to a
//!   [`Metadata`] backend under the engine's name: peer to peer ([`meta::P2pMetadata`]), the oxccl
//!   store ([`meta::StoreMetadata`]) or Redis ([`meta::RedisMetadata`]).
//! - A peer opens the segment by name ([`TransferEngine::open_segment`]; an authenticated
//!   handshake, so a stranger without the job secret opens nothing, and everything after the
//!   proof in `oxccl-seal` records; the tcp lanes encrypted as [`EngineConfig::encrypt`] says)
//!   and submits batches of READ
//!   and WRITE requests ([`TransferEngine::submit`], [`TransferEngine::wait`],
//!   [`TransferEngine::batch_status`], or [`TransferEngine::transfer_sync`]).
//! - A batch may carry a notification, delivered to the target only after all of the batch's
//!   data is visible there ([`TransferEngine::get_notifies`]).
//! - A [`BlockStore`] keeps `put(key, blocks)`/`get(key)` values in a DRAM tier and a disk tier
//!   ([`disk::DiskTier`], `O_DIRECT`), with LRU demotion and promotion, and serves remote gets.
//!
//! Every wait has a timeout; errors name the segment, the request and what the target said.
//!
//! ```
//! use std::sync::Arc;
//! use oxccl_bootstrap::{MemoryStore, Secret};
//! use oxccl_kv::{EngineConfig, Opcode, TransferEngine, TransferRequest, meta::StoreMetadata};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Normally two processes (or hosts) sharing a metadata server and the job secret.
//! let meta = Arc::new(StoreMetadata::new(Arc::new(MemoryStore::new())));
//! let secret = Secret::new("the-job-secret-of-this-example")?;
//! let config = |name: &str| EngineConfig { name: Some(name.into()), ..EngineConfig::new(secret.clone()) };
//! let decode = TransferEngine::new(config("decode-0"), meta.clone())?;
//! let prefill = TransferEngine::new(config("prefill-0"), meta)?;
//!
//! let kv = decode.allocate_managed_buffer(1 << 20)?; // where the blocks land
//! let src = prefill.allocate_managed_buffer(1 << 20)?;
//! prefill.write_local(src, &[7u8; 4096])?;
//!
//! let seg = prefill.open_segment("decode-0")?;
//! let write = TransferRequest { opcode: Opcode::Write, source: src, target_id: seg,
//!                               target_offset: kv, length: 4096 };
//! prefill.transfer_sync(&[write], Some(b"layer 0 ready"))?;
//!
//! let notes = decode.wait_notifies(std::time::Duration::from_secs(5));
//! assert_eq!(notes[0].msg, b"layer 0 ready");
//! let mut got = [0u8; 4096];
//! decode.read_local(kv, &mut got)?; // the data was there before the notification
//! assert_eq!(got, [7u8; 4096]);
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

mod batch;
mod blocks;
mod config;
mod desc;
pub mod disk;
mod engine;
mod error;
mod handshake;
pub mod meta;

pub use batch::{
    BatchId, BatchStatus, BatchSummary, MAX_BATCH, Opcode, Transfer, TransferRequest,
    TransferStatus,
};
pub use blocks::{BLOCK_SERVICE, BlockStats, BlockStore, BlockStoreConfig, TierStats};
pub use config::{DEFAULT_SPIN, Encrypt, EngineConfig, Protocol};
pub use desc::{BufferDesc, DESC_FORMAT, SegmentDesc};
pub use engine::{LaneRedirect, MAX_NOTIFY, Notification, SegmentId, Service, TransferEngine};
pub use error::{Error, Result};
pub use meta::Metadata;
/// Byte counts as the `OXCCL_*` variables write them (`64K`, `1M`): the bootstrap's parser.
pub use oxccl_bootstrap::parse_size;
