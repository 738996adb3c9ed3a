//! Layer 1, the model: the plain data of the verbs model, and its errors and configuration.
//!
//! Nothing here depends on anything else of the crate: access flags, remote addresses,
//! operations, completions, queue-pair states and settings (`types`), the provider's identity
//! and the endpoints peers exchange (`endpoint`), which links to encrypt (oxccl-seal's `Encrypt`, re-exported), errors (`error`) and the configuration a
//! context is opened with (`config`).

mod config;
mod endpoint;
mod error;
mod types;

pub use config::{DeviceConfig, TcpCongestion, parse_ip_or_sockaddr};
pub use endpoint::{EndpointAddr, Provider, QpEndpoint};
pub use error::{Error, Result};
pub use oxccl_seal::{ENCRYPT_ENV, Encrypt, is_on_host};
pub use types::*;
