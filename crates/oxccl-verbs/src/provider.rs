//! Providers: the registry of those built in, and the two traits a provider implements.
//!
//! The public types ([`Context`], [`ProtectionDomain`], [`MemoryRegion`], [`QueuePair`],
//! [`CompletionQueue`]) are the same for every provider. They own what the verbs model has in
//! common: the queue-pair state machine, the receive ring, completion queues with their doorbells,
//! the region table and keys, and the error and flush rules. What differs (how a request reaches
//! the peer) sits behind two traits:
//!
//! - [`ProviderContext`]: the provider's half of an open [`Context`]. Made once per context by the
//!   provider's `open` function, from the [`DeviceConfig`] the context is opened with. It makes a
//!   [`QpTransport`] for each new queue pair and hears about regions being registered.
//! - [`QpTransport`]: the provider's half of one [`QueuePair`]: its endpoint address, connecting,
//!   the send-queue data path, progress, and the flush when the queue pair fails.
//!
//! Both are trait objects (`Box<dyn ..>`), made when the context or queue pair is made: one
//! virtual call per `post_send` or progress step, no allocation per request.
//!
//! # The registry
//!
//! [`Provider`] is the identity of a provider (a name callers pick, compare and serialize); the
//! list at the bottom of this module (`registry! { .. }`) maps each identity to its name and its
//! `open` function, and is the only place that lists them. A new provider is a module of its own
//! (`src/ofi/`, declared in `lib.rs`) plus one line in that list.
//!
//! # Implementer's guide
//!
//! A provider module offers `pub(crate) fn open(args: &OpenArgs<'_>) -> Result<Box<dyn
//! ProviderContext>>`. `args` carries the [`DeviceConfig`] (read nothing else: no environment
//! variables, no files of your own choosing), the context segment (its completion-queue doorbells
//! and region table, see `context`) and the context's map of live regions by table index, which a
//! provider that executes peers' requests in software validates against (tcp does).
//!
//! What the core does, so a provider does not:
//! - It checks work requests' shapes (`max_sge`; [`QpInner::check_sges`] for the send side) and
//!   queue-pair states before calling the provider (`post_send` only in RTS or ERR, `connect`
//!   only in INIT), and walks the state machine.
//! - It owns the receive queue: `post_recv` writes the ring (`ring`), then calls
//!   [`QpTransport::recv_posted`]; receive completions are harvested from the ring by the
//!   completion queue. A provider delivers a SEND or WRITE_WITH_IMM by claiming a slot
//!   ([`QpInner::claim_recv`]), filling the buffers ([`QpInner::recv_spans`] validates them) and
//!   completing it ([`QpInner::complete_recv`]).
//! - It owns completion queues: a provider reports send-queue completions with
//!   [`QpInner::complete_send`] and never touches a completion queue itself.
//! - It generates keys (random, low bits the table index), keeps the region table, and checks
//!   local buffers ([`MrInner::local_ptr`](crate::mr::MrInner::local_ptr)).
//!
//! What a provider must guarantee (the semantics in ARCHITECTURE.md, section "verbs"):
//! - **RC ordering.** Requests of one queue pair execute at the target in posting order, and their
//!   completions are reported in posting order, failures included (a request that fails locally
//!   while earlier ones are in flight completes after them).
//! - **Validation before effect.** A request whose rkey, range or access flags do not match a
//!   registered region of the target fails with `RemoteAccessError` and leaves the target's memory
//!   untouched; local buffers are validated before anything is sent (a local error has no remote
//!   effect).
//! - **Receives.** A SEND and a WRITE_WITH_IMM each consume exactly one posted receive. None posted:
//!   retry within the queue pair's RNR budget ([`QpConfig::rnr_retry`], `rnr_timer`; 7 = forever),
//!   then fail with `RnrRetryExceeded`.
//! - **Errors.** The first failed request moves the queue pair to ERR: push its error completion
//!   (the core moves the state to ERR first, so a poller that sees it sees ERR), then call
//!   [`QpInner::set_error`], which calls [`QpTransport::flush_sends`] and flushes the receive ring.
//!   `flush_sends` completes every outstanding send, oldest first, with
//!   [`QpInner::send_flush_status`] (`RetryExceeded` for the first after the peer was lost,
//!   `WorkRequestFlushed` for the rest). Later posts complete as flushed without being executed.
//! - **Peer loss.** A peer that dies or destroys its queue pair is noticed within
//!   [`QpConfig::timeout`] ([`QpInner::connection_failed`] or `set_error(Cause::PeerGone)`), and
//!   waiters are woken (completing through the core does that).
//! - **Cost.** [`QpTransport::progress`] runs on every poll of every completion queue the queue pair
//!   is attached to: make it a few loads when there is nothing to do. A provider whose data path
//!   needs no system call (shm) must not gain one: no allocation, lock contention or syscall per
//!   request beyond what the transport itself needs.
//! - **Threads.** Both traits are `Send + Sync`; their methods are called from any thread,
//!   concurrently (posting, polling and a provider's own progress thread). A provider's thread
//!   reaches its queue pair through the `Weak<QpInner>` of [`QpSetup::qp`], and must not hold its
//!   own locks while calling into the core (the core may call back into the transport).
//! - **Unsafe.** Raw pointers into regions are valid only while the region is alive: keep the
//!   `Arc<MrInner>` of every buffer a request still reads or writes (the tcp provider keeps them in
//!   its frames), and give each `unsafe` block a `// SAFETY:` line.
//!
//! Addressing: [`QpTransport::endpoint_addr`] says how a peer reaches the queue pair. A provider
//! whose address is not one of the named [`EndpointAddr`] forms uses [`EndpointAddr::Opaque`]
//! (its own bytes, a libfabric endpoint name say). The core refuses an endpoint of another
//! provider before [`QpTransport::connect`] is called; `connect` refuses addresses of forms it
//! does not use.
//!
//! Configuration: settings of a new provider are fields of [`DeviceConfig`] named after it (see
//! `config`); they reach `open` through [`OpenArgs::config`].
//!
//! [`Context`]: crate::Context
//! [`ProtectionDomain`]: crate::ProtectionDomain
//! [`MemoryRegion`]: crate::MemoryRegion
//! [`QueuePair`]: crate::QueuePair
//! [`CompletionQueue`]: crate::CompletionQueue
//! [`QpConfig::rnr_retry`]: crate::QpConfig::rnr_retry
//! [`QpConfig::timeout`]: crate::QpConfig::timeout

use std::sync::{Arc, Weak};

use crate::config::DeviceConfig;
use crate::context::RegionMap;
use crate::error::{Error, Result};
use crate::mr::MrInner;
use crate::qp::{EndpointAddr, QpEndpoint, QpInner};
use crate::segment::Segment;
use crate::types::{AccessFlags, QpConfig, SendWr};

/// What a provider's `open` is given.
pub(crate) struct OpenArgs<'a> {
    /// The context's configuration: the only settings a provider reads.
    pub config: &'a DeviceConfig,
    /// The context segment (completion-queue doorbells, region table), for a provider that
    /// shares it with peers.
    pub seg: &'a Arc<Segment>,
    /// The context's live regions by table index.
    pub regions: &'a RegionMap,
}

/// What a provider is told about a new queue pair.
pub(crate) struct QpSetup<'a> {
    /// The queue pair itself, for a provider thread that must reach it later.
    pub qp: &'a Weak<QpInner>,
    /// The queue pair's secret token (never `u64::MAX` or `u64::MAX - 1`).
    pub token: u64,
    /// Its segment: state word and receive ring (`ring`).
    pub seg: &'a Arc<Segment>,
    /// Its configuration.
    pub cfg: &'a QpConfig,
}

/// A provider's half of an open context.
pub(crate) trait ProviderContext: Send + Sync {
    /// Makes the provider's half of a new queue pair (in RESET, not attached to any completion
    /// queue yet). Called once per queue pair.
    fn create_qp(&self, setup: &QpSetup<'_>) -> Result<Box<dyn QpTransport>>;

    /// A region is being registered: its keys are chosen and its table entry is not yet
    /// published (no peer can use it before this returns). An error fails the registration.
    fn register_mr(&self, _mr: &MrInner) -> Result<()> {
        Ok(())
    }

    /// A region was deregistered: its keys are already unpublished. Called once per region
    /// whose [`ProviderContext::register_mr`] ran, even if it failed.
    fn deregister_mr(&self, _mr: &MrInner) {}

    /// Whether user memory (not provider memory) may be registered with `access`; an error
    /// says why not and what to do instead.
    fn check_user_access(&self, _access: AccessFlags) -> Result<()> {
        Ok(())
    }

    /// The IP address and port peers reach this context at, for providers that listen on one.
    fn listen_addr(&self) -> Option<std::net::SocketAddr> {
        None
    }
}

/// A provider's half of one queue pair: how its requests reach the peer.
///
/// Every method gets the queue pair (`qp`) for the core's services; see the module docs for what
/// an implementation must guarantee.
pub(crate) trait QpTransport: Send + Sync {
    /// The provider-specific part of this queue pair's endpoint.
    fn endpoint_addr(&self, qp: &QpInner) -> EndpointAddr;

    /// INIT → RTR: connects to `remote` (of this provider: the core checked). On success the
    /// core records `remote` and moves to RTR; an error (its reason) leaves the state alone.
    fn connect(&self, qp: &QpInner, remote: &QpEndpoint) -> std::result::Result<(), String>;

    /// Posts send requests, in order (the queue pair is in RTS or ERR; each request's SGE count
    /// is the transport's to check, with [`QpInner::check_sges`], before it is posted). An error
    /// names the request that was not posted; those before it were.
    fn post_send(&self, qp: &QpInner, wrs: &[SendWr<'_>]) -> Result<()>;

    /// A receive was posted to the ring (a delivery that waited for one may go on).
    fn recv_posted(&self, _qp: &QpInner) {}

    /// Called on every poll and wait of the completion queues: retry what waits, notice a lost
    /// peer. Must be cheap when there is nothing to do.
    fn progress(&self, qp: &QpInner);

    /// Whether requests wait to be retried (waiters then sleep in short naps).
    fn has_pending(&self) -> bool {
        false
    }

    /// Whether the peer is known to be gone (a receive it claimed will never complete).
    fn peer_gone(&self, qp: &QpInner) -> bool;

    /// Why the peer is gone, for the queue pair's error detail, when the provider can tell.
    fn gone_note(&self, _qp: &QpInner) -> Option<String> {
        None
    }

    /// The queue pair moved to ERR: complete every outstanding send request, oldest first (see
    /// [`QpInner::send_flush_status`]), and send nothing more.
    fn flush_sends(&self, qp: &QpInner);

    /// [`QueuePair::disconnect`](crate::QueuePair::disconnect): drop the link as a cut cable
    /// would, so that the peer notices.
    fn disconnect(&self, _qp: &QpInner) {}

    /// The queue pair is being destroyed (its handle dropped): release what the provider holds
    /// for it.
    fn destroy(&self, qp: &QpInner) {
        self.disconnect(qp);
    }
}

/// Defines [`Provider`] and its lookups from one list: identity, name, `open` function.
macro_rules! registry {
    ($( $(#[$doc:meta])* $variant:ident = $name:literal => $open:path ),+ $(,)?) => {
        /// The verbs providers this build contains: a provider's identity. What a provider does
        /// is behind the provider traits (module `provider`); this only names it.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
        #[non_exhaustive]
        pub enum Provider {
            $( $(#[$doc])* #[serde(rename = $name)] $variant, )+
        }

        impl Provider {
            /// Every provider built in.
            pub const ALL: &'static [Provider] = &[$(Provider::$variant),+];

            /// The provider's name, as `Device::by_name` takes it.
            pub fn name(self) -> &'static str {
                match self {
                    $( Provider::$variant => $name, )+
                }
            }

            /// Opens the provider's half of a new context.
            pub(crate) fn open(self, args: &OpenArgs<'_>) -> Result<Box<dyn ProviderContext>> {
                match self {
                    $( Provider::$variant => $open(args), )+
                }
            }
        }
    };
}

registry! {
    /// Kernel bypass between processes of one host: shared memory, one copy, no syscall.
    Shm = "shm" => crate::shm::open,
    /// RDMA semantics over TCP sockets, for hosts without RDMA hardware.
    Tcp = "tcp" => crate::tcp::open,
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
