//! Contexts and protection domains: the handles a user opens first.
//!
//! A [`Context`] is a handle on the context's core (`contract::CtxInner`: its shared segment,
//! its tables and its provider's half); opening one is the registry's (`registry`, at the top
//! of the crate, which knows the providers).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::cq::CompletionQueue;
use crate::contract::CtxInner;
use crate::model::{Provider, Result};

/// An open device (`ibv_context`): owns the context segment and the provider's half of the
/// context (`contract::ProviderContext`).
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<CtxInner>,
}

impl Context {
    /// The provider this context runs.
    pub fn provider(&self) -> Provider {
        self.inner.provider
    }

    /// The address of a tcp context's listener, which its queue pairs advertise (`None` for
    /// providers that do not listen on an IP address).
    pub fn tcp_addr(&self) -> Option<std::net::SocketAddr> {
        self.inner.ops.listen_addr()
    }

    /// Allocates a protection domain (`ibv_alloc_pd`).
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        Ok(ProtectionDomain {
            ctx: self.clone(),
            id: self.inner.next_pd.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// Creates a completion queue (`ibv_create_cq`); `cqe` is a hint, the queue grows as needed.
    pub fn create_cq(&self, cqe: usize) -> Result<CompletionQueue> {
        CompletionQueue::new(self.inner.clone(), cqe)
    }
}

/// A protection domain (`ibv_pd`): memory regions and queue pairs of one domain work together.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) ctx: Context,
    pub(crate) id: u64,
}

impl ProtectionDomain {
    /// The context this domain belongs to.
    pub fn context(&self) -> &Context {
        &self.ctx
    }
}

/// This host's identity as shared memory sees it: the kernel's boot id, the network
/// namespace (the shm provider's sockets live in it) and the pid namespace (peers are
/// reached by pid). Processes with the same identity can talk shm; network namespaces on one
/// machine count as separate hosts. Every layer that asks "same host?" (the endpoints here,
/// a communicator's hosts, oxccl-kv's segments) uses this one.
///
/// ```
/// let id = oxccl_verbs::host_identity();
/// assert_eq!(id, oxccl_verbs::host_identity());
/// assert_eq!(id.matches('/').count(), 2); // boot id / net namespace / pid namespace
/// ```
pub fn host_identity() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown-boot".into());
    let ns = |n: &str| {
        std::fs::read_link(format!("/proc/self/ns/{n}"))
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{n}:[?]"))
    };
    format!("{boot}/{}/{}", ns("net"), ns("pid"))
}
