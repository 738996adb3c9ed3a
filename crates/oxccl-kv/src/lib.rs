//! # oxccl-kv: a KV-cache transfer engine and a tiered block store
//!
//! (docs being written)
#![deny(missing_docs)]

mod desc;
mod error;
mod handshake;
pub mod meta;

pub use desc::{BufferDesc, DESC_FORMAT, SegmentDesc};
pub use error::{Error, Result};
pub use meta::Metadata;
