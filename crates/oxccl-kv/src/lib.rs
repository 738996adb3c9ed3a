//! # oxccl-kv: a KV-cache transfer engine and a tiered block store
//!
//! (docs being written)
#![deny(missing_docs)]

mod batch;
mod config;
mod desc;
pub mod disk;
mod engine;
mod error;
mod handshake;
pub mod meta;

pub use batch::{BatchId, BatchStatus, MAX_BATCH, Opcode, TransferRequest, TransferStatus};
pub use config::{EngineConfig, Protocol, parse_size};
pub use desc::{BufferDesc, DESC_FORMAT, SegmentDesc};
pub use engine::{MAX_NOTIFY, Notification, SegmentId, Service, TransferEngine};
pub use error::{Error, Result};
pub use meta::Metadata;
