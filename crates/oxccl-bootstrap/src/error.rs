//! Errors of the bootstrap: each names the rank, peer, address or timeout it is about.

use std::fmt;
use std::time::Duration;

/// Result of bootstrap operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while bootstrapping.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The store's address is held by another socket.
    #[error(
        "cannot serve the store on {addr}: the address is already in use (another process \
         holds it; stop it or choose another port with MASTER_PORT or OXCCL_STORE_ADDR)"
    )]
    AddrInUse {
        /// The address.
        addr: String,
    },
    /// Binding the store's address failed for another reason.
    #[error("cannot serve the store on {addr}: {source}")]
    Bind {
        /// The address.
        addr: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// An address does not parse or resolve.
    #[error("bad store address {addr:?}: {reason}")]
    BadAddr {
        /// The address as given.
        addr: String,
        /// Why.
        reason: String,
    },
    /// The store could not be reached within the timeout.
    #[error("cannot reach the store at {addr} within {}: {reason}", secs(*timeout))]
    Connect {
        /// The store's address.
        addr: String,
        /// How long we tried.
        timeout: Duration,
        /// The last failure.
        reason: String,
    },
    /// The store refused our credentials.
    #[error("the store at {addr} refused this process: {reason} ({hint})")]
    AuthRefused {
        /// The store's address.
        addr: String,
        /// The store's reason.
        reason: String,
        /// Where this process's secret came from and how to make the ranks agree
        /// ([`Secret::mismatch_hint`](crate::Secret::mismatch_hint)).
        hint: String,
    },
    /// The server could not prove it knows the secret: it is not this job's store.
    #[error(
        "the server at {addr} failed to prove that it knows the secret: it is not this job's \
         store (or holds another secret); nothing was sent to it"
    )]
    StoreNotAuthentic {
        /// The server's address.
        addr: String,
    },
    /// The connection to the store broke (the store process exited, was killed, or shut down).
    #[error("the store at {addr} went away: {reason}")]
    StoreGone {
        /// The store's address.
        addr: String,
        /// What was seen.
        reason: String,
    },
    /// The peer does not speak the store protocol.
    #[error("protocol error with the store at {addr}: {reason}")]
    Protocol {
        /// The store's address.
        addr: String,
        /// What was wrong.
        reason: String,
    },
    /// The store refused a request (bad argument, non-integer value under `add`, ...).
    #[error("the store at {addr} refused the request: {message}")]
    Rejected {
        /// The store's address.
        addr: String,
        /// The store's message.
        message: String,
    },
    /// A value read from a store that is not ours does not open with the job's key
    /// ([`SealedValues`](crate::SealedValues)).
    #[error(
        "the value of key {key:?} in the store at {addr} does not open with this job's key: it \
         was set by a process with another secret (OXCCL_SECRET differs, or OXCCL_ENCRYPT=off \
         there), or changed in the store ({reason})"
    )]
    ValueNotAuthentic {
        /// The store's address.
        addr: String,
        /// The key.
        key: String,
        /// What failed.
        reason: String,
    },
    /// A value could not be sealed for a store that is not ours
    /// ([`SealedValues`](crate::SealedValues)): nothing was sent.
    #[error("cannot seal the value of key {key:?} for the store at {addr}: {source}")]
    ValueNotSealed {
        /// The store's address.
        addr: String,
        /// The key.
        key: String,
        /// What failed (the OS random source, or a value too long).
        source: oxccl_seal::SealError,
    },
    /// A request's argument is invalid (checked before anything is sent).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Waiting for keys timed out.
    #[error(
        "timed out after {} waiting for keys {} in the store at {addr}",
        secs(*timeout),
        List(missing)
    )]
    Timeout {
        /// The store's address.
        addr: String,
        /// The timeout.
        timeout: Duration,
        /// The keys still missing.
        missing: Vec<String>,
    },
    /// Waiting for ranks (to join, or to reach a collective) timed out.
    #[error(
        "timed out after {} waiting for ranks {} of {world_size} to {what}",
        secs(*timeout),
        List(missing)
    )]
    RanksMissing {
        /// What the ranks were to do, e.g. "join the store at 127.0.0.1:29500".
        what: String,
        /// The ranks that did not.
        missing: Vec<usize>,
        /// The world size.
        world_size: usize,
        /// The timeout.
        timeout: Duration,
    },
    /// Ranks disagree about the world size.
    #[error(
        "ranks disagree about the world size: rank {rank} was started with world size \
         {world_size}, but rank {other_rank} with {other_world_size}"
    )]
    WorldSizeMismatch {
        /// One rank.
        rank: usize,
        /// Its world size.
        world_size: usize,
        /// Another rank.
        other_rank: usize,
        /// Its world size.
        other_world_size: usize,
    },
    /// Two processes claim the same rank.
    #[error("rank {rank} was claimed twice: by {first} and by {second}")]
    DuplicateRank {
        /// The rank.
        rank: usize,
        /// The process that registered first (pid, host).
        first: String,
        /// The process that registered second.
        second: String,
    },
    /// A rank is not below the world size.
    #[error("rank {rank} is out of range for world size {world_size} (ranks are 0..{world_size})")]
    RankOutOfRange {
        /// The rank.
        rank: usize,
        /// The world size.
        world_size: usize,
    },
    /// No launcher environment was found.
    #[error(
        "no launcher environment found: looked for {} (or set OXCCL_RANK, OXCCL_WORLD_SIZE and \
         OXCCL_STORE_ADDR)",
        .looked_for.join(", ")
    )]
    NoLauncher {
        /// The variables looked for.
        looked_for: Vec<&'static str>,
    },
    /// An environment variable holds a value that cannot be used.
    #[error("environment variable {var}={value:?}: {reason}")]
    BadEnv {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// Another rank gave up (its init failed) and told the others through the store, so that
    /// nobody waits out a timeout for a rank that will never come.
    #[error("rank {rank} failed: {message}")]
    RankFailed {
        /// The rank that failed.
        rank: usize,
        /// Its error.
        message: String,
    },
    /// An [`AbortHandle`](crate::AbortHandle) stopped a wait of this rank.
    #[error("rank {rank}: aborted ({reason}) while waiting {waiting}")]
    Aborted {
        /// This rank.
        rank: usize,
        /// Why ([`AbortHandle::abort_with`](crate::AbortHandle::abort_with)).
        reason: String,
        /// What it was waiting for, e.g. `for ranks [2] of 3 to join the store at
        /// 127.0.0.1:29500`.
        waiting: String,
    },
    /// Some required configuration is missing.
    #[error("{0}")]
    Config(String),
    /// The secret is missing or unusable.
    #[error("secret: {0}")]
    Secret(String),
    /// A value exchanged through the store does not (de)serialize.
    #[error("{what}: {source}")]
    Serde {
        /// Which value, from which rank.
        what: String,
        /// The serde error.
        source: serde_json::Error,
    },
}

impl Error {
    /// Whether the error means the store is gone (the connection broke).
    pub fn is_store_gone(&self) -> bool {
        matches!(self, Error::StoreGone { .. })
    }

    /// The ranks the error names as missing or failed (none for other errors).
    pub fn missing_ranks(&self) -> Vec<usize> {
        match self {
            Error::RanksMissing { missing, .. } => missing.clone(),
            Error::RankFailed { rank, .. } => vec![*rank],
            _ => vec![],
        }
    }

    /// Whether the error is a timeout (keys or ranks missing).
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. } | Error::RanksMissing { .. })
    }
}

/// Formats a duration as seconds ("5s", "0.25s").
pub(crate) fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s:.0}s")
    } else {
        format!("{}s", (s * 1000.0).round() / 1000.0)
    }
}

/// A list that prints at most 32 items, like `[2, 3]` or `[0, 1, ... and 90 more]`.
pub(crate) struct List<'a, T>(pub &'a [T]);

impl<T: fmt::Debug> fmt::Display for List<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 32;
        f.write_str("[")?;
        for (i, x) in self.0.iter().take(SHOWN).enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{x:?}")?;
        }
        if self.0.len() > SHOWN {
            write!(f, ", ... and {} more", self.0.len() - SHOWN)?;
        }
        f.write_str("]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_what_they_are_about() {
        let e = Error::RanksMissing {
            what: "join the store at 127.0.0.1:29500".into(),
            missing: vec![2, 3],
            world_size: 4,
            timeout: Duration::from_secs(5),
        };
        assert_eq!(
            e.to_string(),
            "timed out after 5s waiting for ranks [2, 3] of 4 to join the store at 127.0.0.1:29500"
        );
        let many: Vec<usize> = (0..100).collect();
        let s = List(&many).to_string();
        assert!(s.ends_with(", 31, ... and 68 more]"), "{s}");
        assert_eq!(secs(Duration::from_millis(250)), "0.25s");
        let e = Error::NoLauncher {
            looked_for: vec!["RANK", "SLURM_PROCID"],
        };
        assert!(e.to_string().contains("RANK, SLURM_PROCID"));
    }
}
