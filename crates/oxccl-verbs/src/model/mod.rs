//! Layer 1, the model: the plain data of the verbs model, and its errors and configuration.
//!
//! Nothing here depends on anything else of the crate: access flags, remote addresses,
//! operations, completions, queue-pair states and settings (`types`), the provider's identity
//! and the endpoints peers exchange (`endpoint`), which links to encrypt (`encrypt`), errors (`error`) and the configuration a
//! context is opened with (`config`).

mod config;
mod encrypt;
mod endpoint;
mod error;
mod types;

pub use config::{DeviceConfig, parse_ip_or_sockaddr};
pub use encrypt::{ENCRYPT_ENV, Encrypt, is_on_host};
pub use endpoint::{EndpointAddr, Provider, QpEndpoint};
pub use error::{Error, Result};
pub use types::*;
