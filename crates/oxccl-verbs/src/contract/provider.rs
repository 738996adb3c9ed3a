//! The two traits a provider implements, what it is given, and the implementer's guide.
//!
//! The public types ([`Context`], [`ProtectionDomain`], [`MemoryRegion`], [`QueuePair`],
//! [`CompletionQueue`]) are the same for every provider. They own what the verbs model has in
//! common: the queue-pair state machine, the receive ring, completion queues with their
//! doorbells, keys and the region table, and the error and flush rules. What differs (how a
//! request reaches the peer) sits behind two traits:
//!
//! - [`ProviderContext`]: the provider's half of an open [`Context`], made once per context by
//!   the provider's `open` function from the [`DeviceConfig`] the context is opened with. It
//!   makes a [`QpTransport`] for each new queue pair and hears about regions being registered.
//! - [`QpTransport`]: the provider's half of one [`QueuePair`]: its endpoint address,
//!   connecting, the send-queue data path, progress, and the flush when the queue pair fails.
//!
//! Both are trait objects (`Box<dyn ..>`) made with the context or queue pair: one virtual call
//! per `post_send` batch, per queue pair and poll, per posted receive; no allocation per request.
//!
//! # The registry
//!
//! [`Provider`] is a provider's identity (a name callers pick, compare and serialize), defined
//! in the model (`model::endpoint`) with its name. Which module opens it is the registry's
//! (`registry`, at the top of the crate, above the providers): this contract names no
//! provider.
//!
//! # Implementer's guide
//!
//! Adding a provider (ofi, say):
//! 1. A module of its own, `src/ofi/` (declared in `lib.rs`), with
//!    `pub(crate) fn open(args: &OpenArgs<'_>) -> Result<Box<dyn ProviderContext>>`. It uses
//!    only the model and this contract (`crate::model`, `crate::contract`), never a resource
//!    module nor another provider: `tests/layers.rs` checks it.
//! 2. A variant of [`Provider`] with its name (`model::endpoint`), and one line in
//!    `Provider::open` (`registry`): `Provider::Ofi => crate::ofi::open(args),`.
//! 3. Its settings, if any: fields of [`DeviceConfig`] named after it (`ofi_*`, see
//!    `model::config`), read in `DeviceConfig::from_vars`. `open` reads only [`OpenArgs`]: no
//!    environment variables, no files of its own choosing.
//! 4. Its tests: one line each at the bottom of `tests/conformance.rs`, `tests/properties.rs`
//!    and `tests/hammer.rs` (`conformance!(ofi, "ofi");` and so on) runs the suites every
//!    provider passes against it, in two processes.
//!
//! What the core does, so that a provider does not:
//! - **States.** It walks the state machine and checks states before calling the provider:
//!   [`QpTransport::connect`] only in INIT and only for an endpoint of the same provider,
//!   [`QpTransport::post_send`] only in RTS or ERR. Within a batch the transport checks each
//!   request's SGE count with [`QpInner::check_sges`] before posting it (the requests before a
//!   bad one stay posted).
//! - **Receives.** It owns the receive queue: `post_recv` writes the ring (`ring`), then calls
//!   [`QpTransport::recv_posted`]; completion queues harvest finished receives from the ring. A
//!   provider delivers a SEND or WRITE_WITH_IMM into its own queue pair by claiming a slot
//!   ([`QpInner::claim_recv`]), filling the slot's buffers ([`QpInner::recv_spans`] validates
//!   them) and completing it ([`QpInner::complete_recv`]); the shm provider does the same in its
//!   peer's ring, in shared memory.
//! - **Completions.** It owns completion queues: a provider reports every send-queue completion
//!   with [`QpInner::complete_send`] (signaled successes and all failures; the core drops the
//!   unsignaled successes) and never touches a completion queue itself.
//! - **Keys.** It draws lkey and rkey (random, the low bits the table index), keeps the region
//!   table and the map of live regions, and validates local buffers
//!   (`MrInner::local_ptr`). A provider whose hardware chooses keys (libfabric with
//!   `FI_MR_PROV_KEY`) registers the memory in [`ProviderContext::register_mr`] and returns its
//!   key, which then is the region's rkey; it releases the registration in
//!   [`ProviderContext::deregister_mr`].
//!
//! What a provider must guarantee (the semantics of ARCHITECTURE.md, section "verbs"):
//! - **RC ordering.** Requests of one queue pair execute at the target in posting order, and
//!   complete in posting order, failures included (a request that fails locally while earlier
//!   ones are in flight completes after them).
//! - **Validation before effect.** A request whose rkey, range or access flags do not match a
//!   registered region of the target fails with `RemoteAccessError` and leaves the target's
//!   memory untouched; local buffers are validated before anything is sent, so a local error
//!   (`LocalProtectionError`, `LocalLengthError`) has no remote effect.
//! - **Receives.** A SEND and a WRITE_WITH_IMM each consume exactly one posted receive. None
//!   posted: retry within the queue pair's RNR budget ([`QpConfig::rnr_retry`] ×
//!   `rnr_timer`; 7 retries forever), then fail with `RnrRetryExceeded`.
//! - **Errors.** The first failed request moves the queue pair to ERR: report its completion
//!   with [`QpInner::complete_send`] (which reads ERR before the completion can be polled), then
//!   call [`QpInner::set_error`] (or [`QpInner::request_failed`]), holding none of the
//!   transport's own locks: it calls back [`QpTransport::flush_sends`], which completes every
//!   outstanding send oldest first with [`QpInner::send_flush_status`] (`RetryExceeded` for the
//!   first one after the peer was lost, `WorkRequestFlushed` for the rest), and flushes the
//!   receive ring. Requests posted in ERR complete flushed, in order, without being executed.
//! - **Peer loss.** A peer that dies or destroys its queue pair is noticed within
//!   [`QpConfig::timeout`]: [`QpInner::connection_failed`] (with the reason) or
//!   `set_error(Cause::PeerGone)`; [`QpTransport::peer_gone`] then says so, and
//!   [`QpTransport::gone_note`] may explain it. Waiters are woken by the core.
//! - **Cost.** [`QpTransport::progress`] runs on every poll and wait of every completion queue
//!   the queue pair is attached to: a few loads when there is nothing to do.
//!   [`QpTransport::has_pending`] true makes sleeping waiters nap at most 200 µs, so that
//!   retries happen. A data path that needs no system call (shm) must not gain one, nor an
//!   allocation or a contended lock per request.
//! - **Threads.** Both traits are `Send + Sync`; their methods run on any thread, concurrently
//!   (posters, pollers, the provider's own threads). A provider thread reaches its queue pair
//!   through the `Weak<QpInner>` of [`QpSetup::qp`] and calls into the core with none of its own
//!   locks held, since the core may call back into the transport.
//! - **Memory.** A raw pointer into a region is valid only while the region lives: keep the
//!   `Arc<MrInner>` of every buffer a request still reads or writes once the post has returned
//!   (the tcp provider keeps them in the frames still to be written and in the READs and
//!   atomics whose answers land in them; during the post the request borrows them). Every `unsafe`
//!   block has a `// SAFETY:` line saying why it holds.
//! - **Teardown.** [`QpTransport::disconnect`] drops the link so that the peer notices (a cut
//!   cable); [`QpTransport::destroy`] releases what the provider holds for the queue pair; the
//!   `ProviderContext` is dropped after the context segment reads as closed, and stops the
//!   provider's threads (possibly from one of them: never join yourself).
//!
//! Addressing: [`QpTransport::endpoint_addr`] says how a peer reaches the queue pair. A provider
//! whose address is none of the named [`EndpointAddr`] forms uses [`EndpointAddr::Opaque`] (its
//! own bytes: a libfabric endpoint name, say); `connect` refuses the forms it does not use.
//!
//! [`Provider`]: crate::Provider
//! [`Context`]: crate::Context
//! [`ProtectionDomain`]: crate::ProtectionDomain
//! [`MemoryRegion`]: crate::MemoryRegion
//! [`QueuePair`]: crate::QueuePair
//! [`CompletionQueue`]: crate::CompletionQueue
//! [`QpConfig::rnr_retry`]: crate::QpConfig::rnr_retry
//! [`QpConfig::timeout`]: crate::QpConfig::timeout

use std::sync::{Arc, Weak};

use super::ctx::RegionMap;
use super::keyrng::KeyRng;
use super::qp::QpInner;
use super::region::{Mapped, MrInner};
use super::segment::Segment;
use super::wr::SendWr;
use crate::model::{
    AccessFlags, DeviceConfig, EndpointAddr, QpConfig, QpEndpoint, RemoteAddr, Result,
};

/// What a provider's `open` is given.
pub(crate) struct OpenArgs<'a> {
    /// The context's configuration: the only settings a provider reads.
    pub config: &'a DeviceConfig,
    /// The context segment (completion-queue doorbells, region table), for a provider that
    /// shares it with peers.
    pub seg: &'a Arc<Segment>,
    /// The context's live regions by table index.
    pub regions: &'a RegionMap,
    /// The context's generator of keys and tokens.
    pub keys: &'a KeyRng,
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

impl QpSetup<'_> {
    /// The queue pair's RNR budget in µs: how long a target may hold its SEND or
    /// WRITE_WITH_IMM waiting for a receive, `rnr_timer × (rnr_retry + 1)` and at least 1; 0
    /// (forever) for 7 retries, as InfiniBand's "retry forever".
    pub fn rnr_budget_us(&self) -> u64 {
        let cfg = self.cfg;
        if cfg.rnr_retry >= 7 {
            0
        } else {
            (cfg.rnr_timer * (cfg.rnr_retry as u32 + 1))
                .as_micros()
                .clamp(1, u64::MAX as u128) as u64
        }
    }
}

/// A region about to be registered, as [`ProviderContext::register_mr`] sees it.
#[allow(
    dead_code,
    reason = "shm reads the index, lkey and segment; the rest is for a provider that registers \
              memory with its hardware (ofi: fi_mr_reg), none built in yet"
)]
pub(crate) struct RegionInfo<'a> {
    /// Index in the context's region table (the low bits of the core's keys).
    pub index: u32,
    /// The local key.
    pub lkey: u64,
    /// The remote key the core drew (random, low bits the index).
    pub rkey: u64,
    /// Start address in this process.
    pub addr: u64,
    /// Length in bytes.
    pub len: usize,
    /// Access flags.
    pub access: AccessFlags,
    /// The shared memory behind provider memory (`alloc_mr`); `None` for user memory.
    pub segment: Option<&'a Arc<Segment>>,
}

/// A provider's half of an open context.
pub(crate) trait ProviderContext: Send + Sync {
    /// Makes the provider's half of a new queue pair (in RESET, not attached to any completion
    /// queue yet). Called once per queue pair.
    fn create_qp(&self, setup: &QpSetup<'_>) -> Result<Box<dyn QpTransport>>;

    /// A region is being registered (nothing of it is published yet; no peer can use it before
    /// this returns). `Ok(Some(rkey))` replaces the core's rkey with the provider's own (a key
    /// the hardware chose; nonzero): peers then name the region with it. An error fails the
    /// registration.
    fn register_mr(&self, _mr: &RegionInfo<'_>) -> Result<Option<u64>> {
        Ok(None)
    }

    /// A region whose [`ProviderContext::register_mr`] succeeded was deregistered: its keys are
    /// already unpublished. Called once per region.
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

    /// Called once per poll of a completion queue of this context, before its queue pairs'
    /// [`QpTransport::progress`]: a provider whose progress is software (tcp) moves bytes here,
    /// in the application's thread. Must be cheap when there is nothing to do.
    fn progress(&self) {}

    /// Called at the end of that poll with the number of completions it returned: a provider
    /// that holds back acknowledgements to let them ride on the application's next message
    /// (tcp) sends them when the poll found nothing (the application is waiting, not about to
    /// answer).
    fn polled(&self, _completions: usize) {}

    /// A completion-queue wait found nothing and would sleep on its doorbell for `nap`: a
    /// provider may instead block in its own wait (tcp: `epoll_wait` on its sockets), handling
    /// what arrives, for at most `nap`, and return true. False (the default): the waiter sleeps
    /// on the doorbell.
    fn block(&self, _nap: std::time::Duration) -> bool {
        false
    }

    /// A completion was added to a queue of this context by some thread: wake a waiter that
    /// blocks in [`ProviderContext::block`], if one does and this is another thread.
    fn notify(&self) {}
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

    /// [`QueuePair::map_remote`](crate::QueuePair::map_remote): the peer's memory at `remote`
    /// (`len` bytes, with `need` access), validated as a request is, mapped into this process.
    /// `Ok(None)` where the provider cannot map the peer's memory (the default: a network, or
    /// user memory that only a system call reaches); an error (`RemoteAccessError`'s reasons)
    /// where the key, range or access does not match.
    fn map_remote(
        &self,
        _qp: &QpInner,
        _remote: RemoteAddr,
        _len: usize,
        _need: AccessFlags,
    ) -> Result<Option<Mapped>> {
        Ok(None)
    }

    /// [`QueuePair::disconnect`](crate::QueuePair::disconnect): drop the link as a cut cable
    /// would, so that the peer notices.
    fn disconnect(&self, _qp: &QpInner) {}

    /// The queue pair is being destroyed (its handle dropped): release what the provider holds
    /// for it. Unlike a disconnect, a destroy first sends what the peer is owed for requests it
    /// has already executed here (an acknowledgement held back): the peer's requests complete
    /// even when this side closes right after its last poll
    /// (`tests/conformance.rs::peer_exits_after_its_last_message`).
    fn destroy(&self, qp: &QpInner) {
        self.disconnect(qp);
    }
}
