//! The engine's errors: each names what failed (segment, peer, request, tier, size).

use std::time::Duration;

/// Errors of the transfer engine, its metadata backends and the block store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A caller's argument is wrong (an unregistered local address, an empty batch, a bad
    /// configuration value).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A request addressed memory the target segment does not expose, or the target refused
    /// it (stale key, unregistered buffer). The target's memory is untouched.
    #[error("remote access error on segment {segment:?}: {detail}")]
    RemoteAccess {
        /// The target segment.
        segment: String,
        /// What was refused (address, length, the buffers the segment has).
        detail: String,
    },
    /// No segment of that name is known to the metadata backend (or the peer behind it is
    /// not answering).
    #[error("segment {name:?} not found in {backend}: {detail}")]
    SegmentNotFound {
        /// The segment asked for.
        name: String,
        /// The backend asked (`redis://...`, `oxccl store at ...`, `p2p handshake`).
        backend: String,
        /// Why.
        detail: String,
    },
    /// The peer behind a segment failed: it died, closed, or its queue pair went to ERR.
    #[error("transfer to segment {segment:?} failed: {detail}")]
    PeerFailed {
        /// The target segment.
        segment: String,
        /// What happened (the provider's completion status and detail).
        detail: String,
    },
    /// The batch was canceled ([`crate::TransferEngine::cancel_batch`]) before this request
    /// was posted: nothing of it moved.
    #[error(
        "batch {batch}, request {request}: canceled before it was sent (to segment {segment:?})"
    )]
    Canceled {
        /// The batch.
        batch: u64,
        /// The request's index in the batch.
        request: usize,
        /// Its target segment.
        segment: String,
    },
    /// A wait ran past its timeout.
    #[error("timed out after {timeout:?} waiting for {what}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// The timeout.
        timeout: Duration,
    },
    /// A peer could not prove the job secret, or this engine could not prove it to the peer.
    #[error("authentication with {peer} failed: {detail}")]
    Auth {
        /// The peer's address.
        peer: String,
        /// Why.
        detail: String,
    },
    /// An authenticated peer asked for more than this engine lets one peer have (queue pairs,
    /// lanes): refused, and the engine goes on serving the others.
    #[error("peer {peer} refused: {detail}")]
    PeerLimit {
        /// The peer: its address, and the name it proved.
        peer: String,
        /// Which cap, its value and its knob.
        detail: String,
    },
    /// The handshake with a peer broke (connection refused, closed, a malformed message).
    #[error("handshake with {peer} failed: {detail}")]
    Handshake {
        /// The peer's address.
        peer: String,
        /// Why.
        detail: String,
    },
    /// A metadata backend failed (its server is unreachable or answered an error).
    #[error("metadata backend {backend} failed: {detail}")]
    Metadata {
        /// The backend.
        backend: String,
        /// Why.
        detail: String,
    },
    /// A storage tier is full.
    #[error("tier {tier} is full: {detail}")]
    TierFull {
        /// The tier (`dram`, `disk at /path`).
        tier: String,
        /// How much was asked for and what is free.
        detail: String,
    },
    /// A block store key is not stored anywhere.
    #[error("key {0:?} not found")]
    KeyNotFound(String),
    /// An I/O error, with what was being done.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// An error of the verbs layer, with what was being done.
    #[error("{what}: {source}")]
    Verbs {
        /// What was being done.
        what: String,
        /// The verbs error.
        source: oxccl_verbs::Error,
    },
    /// The engine was shut down.
    #[error("the transfer engine is shut down")]
    Closed,
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An [`Error::InvalidArgument`].
    pub(crate) fn arg(msg: impl Into<String>) -> Error {
        Error::InvalidArgument(msg.into())
    }

    /// An [`Error::Io`] naming what was being done.
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Error {
        Error::Io {
            what: what.into(),
            source,
        }
    }

    /// An [`Error::Verbs`] naming what was being done.
    pub(crate) fn verbs(what: impl Into<String>, source: oxccl_verbs::Error) -> Error {
        Error::Verbs {
            what: what.into(),
            source,
        }
    }
}
