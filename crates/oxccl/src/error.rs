//! Errors: every one names the rank it happened on and, for a collective, which one.

use std::time::Duration;

pub use oxccl_core::protocol::OpDesc;

/// Everything that can go wrong (more variants may come: match with a wildcard arm).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A bad argument: buffer sizes, ranks, counts.
    #[error("rank {rank}: invalid argument: {msg}")]
    InvalidArgument {
        /// The calling rank.
        rank: usize,
        /// What was wrong.
        msg: String,
    },
    /// A malformed setting (an `OXCCL_*` variable).
    #[error("invalid setting: {0}")]
    Config(String),
    /// The rendezvous failed.
    #[error("bootstrap: {0}")]
    Bootstrap(#[from] oxccl_bootstrap::Error),
    /// A verbs call failed (setting up a connection or registering memory).
    #[error("rank {rank}: {what}: {source}")]
    Verbs {
        /// The calling rank.
        rank: usize,
        /// What was being done.
        what: String,
        /// The verbs error.
        source: oxccl_verbs::Error,
    },
    /// A collective did not finish in time.
    #[error(
        "rank {rank}: {op} timed out after {timeout:?}: {waiting} (step {step} of {steps}; \
         {bytes} bytes had arrived)"
    )]
    Timeout {
        /// The calling rank.
        rank: usize,
        /// The collective.
        op: Box<OpDesc>,
        /// The timeout.
        timeout: Duration,
        /// What it was waiting for, naming the peer.
        waiting: String,
        /// The peer it was waiting on, when one.
        peer: Option<usize>,
        /// The first unfinished step.
        step: usize,
        /// Steps in this rank's schedule.
        steps: usize,
        /// Bytes received from peers during the call.
        bytes: u64,
    },
    /// A peer died or its connection failed.
    #[error("rank {rank}: {op}: peer rank {peer} failed: {detail}")]
    PeerFailed {
        /// The calling rank.
        rank: usize,
        /// The collective.
        op: String,
        /// The peer.
        peer: usize,
        /// What the transport said.
        detail: String,
    },
    /// The aggregation service ([`crate::agg`]) failed, or the connection to it did.
    #[error("rank {rank}: {op}: the aggregation service at {addr} failed: {detail}")]
    AggregatorFailed {
        /// The calling rank.
        rank: usize,
        /// The collective.
        op: String,
        /// The service's address.
        addr: String,
        /// What happened.
        detail: String,
    },
    /// A peer's advertised address could not be reached while connecting.
    #[error("rank {rank} cannot reach rank {peer}: {detail}")]
    Unreachable {
        /// The calling rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// Both ends' addresses, their interfaces, and what the transport said.
        detail: String,
    },
    /// Ranks called different collectives (or the same with other counts, types, operators
    /// or roots).
    #[error("rank {rank}: collective mismatch: {detail}")]
    Mismatch {
        /// The calling rank.
        rank: usize,
        /// Both sides.
        detail: String,
    },
    /// The communicator was aborted, here or by a peer.
    #[error("rank {rank}: {op} aborted: {reason}")]
    Aborted {
        /// The calling rank.
        rank: usize,
        /// The collective interrupted, if any.
        op: String,
        /// Who aborted.
        reason: String,
    },
    /// [`Work::wait`](crate::Work::wait) gave up; the work is still running.
    #[error("rank {rank}: submitted work did not finish within {timeout:?}")]
    WaitTimeout {
        /// The calling rank.
        rank: usize,
        /// How long it waited.
        timeout: Duration,
    },
    /// [`Communicator::shrink`](crate::Communicator::shrink) could not agree on the
    /// survivors or build their communicator in time (or this rank was excluded).
    #[error(
        "rank {rank}: shrink (epoch {epoch}): {detail}{}",
        missing_list(missing)
    )]
    Shrink {
        /// The calling rank (in the old communicator).
        rank: usize,
        /// The shrink epoch (1 for a communicator's first shrink).
        epoch: u64,
        /// What it waited for, or why it failed.
        detail: String,
        /// The ranks (of the old communicator) that did not answer, if any.
        missing: Vec<usize>,
    },
    /// [`Communicator::grow`](crate::Communicator::grow) or
    /// [`Communicator::join`](crate::Communicator::join) could not admit the newcomers or make
    /// the grown communicator in time.
    #[error("{who}: {detail}{}", missing_list(missing))]
    Grow {
        /// The calling rank (`rank R`), or the newcomer (with its ticket).
        who: String,
        /// What it waited for, or why it failed.
        detail: String,
        /// The members (ranks of the communicator being grown) that did not answer, if any.
        missing: Vec<usize>,
    },
    /// An earlier error left the communicator unusable.
    #[error("rank {rank}: the communicator is unusable after an earlier error: {first}")]
    Poisoned {
        /// The calling rank.
        rank: usize,
        /// The first error.
        first: String,
    },
}

fn missing_list(missing: &[usize]) -> String {
    if missing.is_empty() {
        String::new()
    } else {
        format!("; ranks that did not answer: {missing:?}")
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
