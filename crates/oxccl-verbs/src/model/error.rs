//! Errors returned by verbs calls (completions carry their own `WcStatus`).

use std::time::Duration;

use super::types::QpState;

/// Result of a verbs call.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong in a verbs call. Every variant names what it was about.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The named provider does not exist or is not built in.
    #[error("unknown provider {0:?} (available: {1})")]
    UnknownProvider(String, String),
    /// The provider exists but this build or this machine cannot run it; the message says what
    /// to install or rebuild.
    #[error("provider {provider:?} is not available: {why}")]
    ProviderUnavailable {
        /// The provider's name.
        provider: &'static str,
        /// Why, and what to do about it.
        why: String,
    },
    /// An argument was out of range; the message says which.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A queue pair state transition the state machine does not allow.
    #[error("queue pair {qp_num}: illegal transition {from} -> {to}")]
    InvalidTransition {
        /// Queue pair number.
        qp_num: u32,
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
    },
    /// The queue pair is not in a state that allows the operation.
    #[error("queue pair {qp_num}: {op} not allowed in state {state}")]
    InvalidState {
        /// Queue pair number.
        qp_num: u32,
        /// What was attempted.
        op: &'static str,
        /// Current state.
        state: QpState,
    },
    /// A work queue is full.
    #[error("queue pair {qp_num}: {queue} queue full ({depth} outstanding)")]
    QueueFull {
        /// Queue pair number.
        qp_num: u32,
        /// "send" or "receive".
        queue: &'static str,
        /// Configured depth.
        depth: u32,
    },
    /// The remote endpoint cannot be reached with this provider.
    #[error("cannot connect queue pair {qp_num} to {peer}: {reason}")]
    Connect {
        /// Queue pair number.
        qp_num: u32,
        /// The remote endpoint, described.
        peer: String,
        /// Why.
        reason: String,
    },
    /// A blocking wait ran out of time.
    #[error("timed out after {timeout:?} waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// The timeout that elapsed.
        timeout: Duration,
    },
    /// The kernel refused an operation; `what` says which and why it matters.
    #[error("{what}: {source}")]
    Os {
        /// What was being done.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The peer's memory was named with a key, a range or an access it does not grant
    /// ([`QueuePair::map_remote`](crate::QueuePair::map_remote); a request gets
    /// `RemoteAccessError` in its completion instead).
    #[error("queue pair {qp_num}: remote access refused: {detail}")]
    RemoteAccess {
        /// Queue pair number.
        qp_num: u32,
        /// What did not match.
        detail: String,
    },
    /// A resource limit of the provider was reached.
    #[error("resource exhausted: {0}")]
    Exhausted(String),
    /// A sealed (encrypted) connection's handshake or record could not be made; `what` names
    /// the peer, the connection and the step.
    #[error("{what}: {source}")]
    Seal {
        /// What was being done, with whom.
        what: String,
        /// What failed.
        #[source]
        source: oxccl_seal::SealError,
    },
}

impl Error {
    pub(crate) fn os(what: impl Into<String>, source: impl Into<std::io::Error>) -> Self {
        Error::Os {
            what: what.into(),
            source: source.into(),
        }
    }
    pub(crate) fn seal(what: impl Into<String>, source: oxccl_seal::SealError) -> Self {
        Error::Seal {
            what: what.into(),
            source,
        }
    }
    pub(crate) fn arg(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }
}
