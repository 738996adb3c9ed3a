//! # oxccl: collective communication over verbs
//!
//! A [`Communicator`] joins the ranks of a job (found through `oxccl_bootstrap`) with
//! queue pairs: the shm provider between ranks of one host, tcp across hosts. Its collectives
//! (all-reduce, reduce-scatter, all-gather, broadcast, reduce, all-to-all(v), gather, scatter,
//! barrier, send/recv) work for every [`DataType`] and [`ReduceOp`], in and out of place, for
//! any count, blocking or through [`Communicator::submit`].
//!
//! Algorithms are data: [`schedule::build`] turns (collective, world size, rank, count,
//! algorithm) into a per-rank [`schedule::Schedule`] of steps with dependencies, without I/O;
//! [`verify::verify`] runs every rank's schedule against a symbolic reference (both live in the
//! crate `oxccl-core`, with the data types, the tuner and the topology, and are re-exported
//! here); the executor runs them over verbs with a credit-based slot protocol.
//!
//! ```
//! use std::time::Duration;
//! use oxccl::{Communicator, Options, ReduceOp};
//! use oxccl_bootstrap::{Bootstrap, Config, Secret, StoreServer};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let secret = Secret::new("the job's shared secret")?;
//! let server = StoreServer::bind("127.0.0.1:0", secret.clone())?;
//! let addr = server.addr().to_string();
//! let ranks: Vec<_> = (0..3)
//!     .map(|rank| {
//!         let mut config = Config::new(rank, 3, addr.clone(), secret.clone());
//!         config.serve_store = false;
//!         config.timeout = Duration::from_secs(20);
//!         std::thread::spawn(move || -> oxccl::Result<Vec<f32>> {
//!             let comm = Communicator::init(Bootstrap::new(config)?, Options::default())?;
//!             let mut grad = vec![rank as f32 + 1.0; 1000];
//!             comm.all_reduce_in_place(&mut grad, ReduceOp::Sum)?;
//!             comm.destroy()?;
//!             Ok(grad)
//!         })
//!     })
//!     .collect();
//! for r in ranks {
//!     assert!(r.join().unwrap()?.iter().all(|&x| x == 6.0));
//! }
//! # Ok(()) }
//! ```
//!
//! ## Environment
//! `OXCCL_TIMEOUT` (seconds), `OXCCL_PROVIDER` (`shm`/`tcp`), `OXCCL_HOST_ID`, `OXCCL_ALGO`,
//! `OXCCL_NCHANNELS`, `OXCCL_CHUNK_SIZE`, `OXCCL_SLOTS`, `OXCCL_SMALL_BYTES` (see
//! [`Options`]), and `OXCCL_DEBUG=INFO`, which logs the providers chosen at init and the
//! algorithm and chunking of each kind of call the first time it runs. Logs and warnings are
//! `tracing` events of the target `oxccl` when the program installs a subscriber that wants
//! them (INFO lines then without `OXCCL_DEBUG`); otherwise they go to stderr as
//! `oxccl WARN ...` and `oxccl INFO ...` lines.
//!
//! ## Failures
//! Every call has a timeout ([`Communicator::set_timeout`], [`Communicator::run_timeout`]);
//! a dead peer is named on every survivor; [`Communicator::abort`] stops everything. The opt-in
//! watchdog (`OXCCL_WATCHDOG`, [`Options::watchdog`]) aborts calls that run too long. Each
//! process keeps a flight recorder of the last calls and dumps it as JSON on a timeout, an
//! abort or `SIGUSR1` (`OXCCL_DEBUG_DUMP`, `OXCCL_FLIGHT_RECORDER`; `oxccl doctor` reads the
//! dumps); `oxccl status` asks a running job's processes for it live, through the store
//! ([`status`]). [`fault`] injects failures for tests (`OXCCL_FAULT`).
#![deny(missing_docs)]

pub mod agg;
mod comm;
mod engine;
mod error;
pub mod fault;
pub mod flight;
mod mailbox;
pub mod netif;
mod reduce;
pub mod status;

// The pure parts live in oxccl-core; the runtime's paths to them stay as they were.
use oxccl_core::{dtype, learn, meter};
pub use oxccl_core::{schedule, topology, tuner, verify};

pub use comm::{
    Buffers, COMPRESS_AUTO_MIN_BYTES, CallBuffers, Communicator, Compression,
    DEFAULT_COMPRESS_CHUNK, Group, Input, Options, Output, PendingInit, Registered, Registration,
    WatchdogAction, Work, default_host_id,
};
pub use engine::Stats;
pub use error::{Error, OpDesc, Result};
pub use fault::{Fault, FaultKind, Faults, InitStage};
pub use flight::DUMP_VERSION;
pub use oxccl_bootstrap::AbortHandle;
pub use oxccl_core::compress;
pub use oxccl_core::dtype::{DataType, Element, ParseNameError, ReduceOp, as_bytes, as_bytes_mut};
pub use oxccl_core::fp8::{self, F8E4M3, F8E5M2};
pub use oxccl_core::schedule::CollectiveKind;
pub use oxccl_core::topology::{Host, Topology};
pub use oxccl_verbs::Provider;

/// Whether `OXCCL_DEBUG` asks for INFO lines (`INFO`, `TRACE` or `DEBUG`), or the program's
/// `tracing` subscriber wants INFO events of the target `oxccl`.
pub(crate) fn log_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("OXCCL_DEBUG")
            .map(|v| matches!(v.to_ascii_uppercase().as_str(), "INFO" | "TRACE" | "DEBUG"))
            .unwrap_or(false)
    }) || tracing::enabled!(target: "oxccl", tracing::Level::INFO)
}

/// Whether `OXCCL_DEBUG=TRACE` asks for the detailed lines too (each rank's link meters).
pub(crate) fn trace_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("OXCCL_DEBUG").is_ok_and(|v| v.eq_ignore_ascii_case("TRACE")))
}

/// A warning (failures, dumps, injected faults), whatever `OXCCL_DEBUG` says: a `tracing`
/// event of the target `oxccl` when the program's subscriber wants it, else one line to
/// stderr in one write.
pub(crate) fn log_warn(msg: String) {
    if tracing::enabled!(target: "oxccl", tracing::Level::WARN) {
        tracing::warn!(target: "oxccl", "{msg}");
    } else {
        to_stderr("WARN", &msg);
    }
}

/// One `OXCCL_DEBUG` line: a `tracing` event (INFO, target `oxccl`) when the program's
/// subscriber wants it, else one line to stderr in a single write, so that lines of ranks
/// sharing a terminal or pipe do not interleave.
pub(crate) fn log_line(msg: String) {
    if tracing::enabled!(target: "oxccl", tracing::Level::INFO) {
        tracing::info!(target: "oxccl", "{msg}");
    } else {
        to_stderr("INFO", &msg);
    }
}

fn to_stderr(level: &str, msg: &str) {
    use std::io::Write;
    let line = format!("oxccl {level} {msg}\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}

#[cfg(test)]
mod log_tests {
    use std::sync::{Arc, Mutex};

    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};
    use tracing::{Event, Metadata, Subscriber};

    /// A subscriber that keeps the messages of the events of target `oxccl` it is given.
    struct Capture(Arc<Mutex<Vec<(String, String)>>>);

    struct Message(String);

    impl Visit for Message {
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                self.0 = format!("{value:?}");
            }
        }
    }

    impl Subscriber for Capture {
        fn enabled(&self, m: &Metadata<'_>) -> bool {
            m.target() == "oxccl"
        }
        fn new_span(&self, _: &Attributes<'_>) -> Id {
            Id::from_u64(1)
        }
        fn record(&self, _: &Id, _: &Record<'_>) {}
        fn record_follows_from(&self, _: &Id, _: &Id) {}
        fn event(&self, e: &Event<'_>) {
            let mut m = Message(String::new());
            e.record(&mut m);
            let level = e.metadata().level().to_string();
            self.0.lock().unwrap().push((level, m.0));
        }
        fn enter(&self, _: &Id) {}
        fn exit(&self, _: &Id) {}
    }

    /// With a subscriber that wants them, warnings and INFO lines go to it (and
    /// `log_enabled` says so even without `OXCCL_DEBUG`).
    #[test]
    fn a_subscriber_receives_the_lines() {
        let got = Arc::new(Mutex::new(Vec::new()));
        tracing::subscriber::with_default(Capture(got.clone()), || {
            assert!(super::log_enabled());
            super::log_warn("rank 3: something failed".into());
            super::log_line("rank 3: connected".into());
        });
        let got = got.lock().unwrap();
        assert_eq!(
            *got,
            vec![
                ("WARN".to_string(), "rank 3: something failed".to_string()),
                ("INFO".to_string(), "rank 3: connected".to_string()),
            ]
        );
    }
}
