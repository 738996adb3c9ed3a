//! Who a queue pair is to its peers: the provider's identity ([`Provider`]) and the endpoint
//! ([`QpEndpoint`]) exchanged out of band.
//!
//! [`Provider`] only names a provider: which implementation opens it is the registry's
//! (`registry`, at the top of the crate), not the model's.

use serde::{Deserialize, Serialize};

use super::error::{Error, Result};

/// The verbs providers this build contains: a provider's identity. What a provider does is
/// behind the provider traits (module `contract`); which module implements it is the
/// registry's (`registry`); this only names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Provider {
    /// Kernel bypass between processes of one host: shared memory, one copy, no syscall.
    #[serde(rename = "shm")]
    Shm,
    /// RDMA semantics over TCP sockets, for hosts without RDMA hardware.
    #[serde(rename = "tcp")]
    Tcp,
    /// libfabric (OFI): real NICs (verbs, EFA, Slingshot), or libfabric's own `tcp;ofi_rxm`
    /// and `shm`.
    #[serde(rename = "ofi")]
    Ofi,
}

impl Provider {
    /// Every provider built in.
    pub const ALL: &'static [Provider] = &[Provider::Shm, Provider::Tcp, Provider::Ofi];

    /// The provider's name, as `Device::by_name` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Provider::Shm => "shm",
            Provider::Tcp => "tcp",
            Provider::Ofi => "ofi",
        }
    }
}

impl std::str::FromStr for Provider {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let want = s.trim().to_ascii_lowercase();
        Provider::ALL
            .iter()
            .copied()
            .find(|p| p.name() == want)
            .ok_or_else(|| {
                Error::UnknownProvider(
                    s.to_string(),
                    Provider::ALL
                        .iter()
                        .map(|p| p.name())
                        .collect::<Vec<_>>()
                        .join(", "),
                )
            })
    }
}

impl std::fmt::Display for Provider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a peer needs to connect to a queue pair: serialize it and hand it over out of band.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpEndpoint {
    /// Provider of the queue pair; both ends must match.
    pub provider: Provider,
    /// Host identity (boot id) of the owner.
    pub host: String,
    /// Queue pair number (for messages and completions).
    pub qp_num: u32,
    /// Provider-specific address.
    pub addr: EndpointAddr,
}

fn one() -> u32 {
    1
}

/// The provider-specific part of an endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum EndpointAddr {
    /// A shared-memory queue pair.
    Shm {
        /// Owner's process id.
        pid: u32,
        /// Owner context's secret token.
        ctx_token: u64,
        /// Abstract Unix socket of the owner's segment service.
        socket: String,
        /// Secret token of the queue pair's segment.
        qp_token: u64,
    },
    /// A tcp queue pair.
    Tcp {
        /// `IP:port` of the owner context's listener.
        addr: String,
        /// Secret token naming the queue pair in the connection handshake.
        qp_token: u64,
        /// How many TCP connections the owner wants for the queue pair
        /// ([`DeviceConfig::tcp_nsocks`](crate::DeviceConfig::tcp_nsocks)); the two sides use
        /// the smaller wish.
        #[serde(default = "one")]
        nsocks: u32,
    },
    /// An address in a provider's own encoding, for providers whose addresses are none of the
    /// above (a libfabric endpoint name, say): only that provider reads it.
    Opaque {
        /// The address.
        bytes: Vec<u8>,
        /// Secret token naming the queue pair.
        qp_token: u64,
    },
}

impl std::fmt::Display for QpEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.addr {
            EndpointAddr::Shm { pid, .. } => {
                write!(f, "{} qp {} of pid {pid}", self.provider, self.qp_num)
            }
            EndpointAddr::Tcp { addr, .. } => {
                write!(f, "{} qp {} at {addr}", self.provider, self.qp_num)
            }
            EndpointAddr::Opaque { bytes, .. } => {
                write!(f, "{} qp {} at ", self.provider, self.qp_num)?;
                bytes.iter().try_for_each(|b| write!(f, "{b:02x}"))
            }
        }
    }
}
