//! # oxccl-sim: a flow-level fabric simulator that runs oxccl's own schedules
//!
//! A [`Fabric`] (ranks, switches, directed links with a rate and a latency, routes; built in
//! code or from a topology file, [`topo_file`]) and a [`Spec`] (the collective, its size,
//! overrides) go into [`simulate`], which builds every rank's schedule with the runtime's
//! own tuner and [`oxccl_core::schedule::build`] and runs them over the fabric: flows share links
//! max-min fairly ([`engine`]), steps run as the executor runs them, under the protocol of
//! [`oxccl_core::protocol`] (its fragments, slots, credits and mailboxes; [`run`] has the
//! model and its assumptions), and the [`Report`] has the predicted time, each rank's finish,
//! each link's bytes and busy time, and optionally a trace. Symmetric fabrics run one rank
//! per orbit of their symmetry ([`sym`], [`run`]).
//!
//! A ring all-reduce on a star of 4 ranks (links of 1 GB/s and 1 µs each way, 5 µs per
//! message, reductions at 4 GB/s), one slice per block of `b = N/4` bytes: each of the
//! `2(P−1)` steps posts, transmits and crosses two links, and each of the first `P−1`
//! reduces, so `T = 2(P−1)/P·N/B + 2(P−1)(o + 2l) + (P−1)·b/R`:
//!
//! ```
//! use oxccl_core::schedule::{Algorithm, Collective};
//! use oxccl_sim::{Fabric, Link, Node, NodeKind, Spec, simulate};
//!
//! let (p, rate, lat, o, reduce) = (4, 1e9, 1e-6, 5e-6, 4e9);
//! let mut nodes: Vec<Node> = (0..p)
//!     .map(|r| Node { name: format!("r{r}"), kind: NodeKind::Rank { host: r } })
//!     .collect();
//! nodes.push(Node { name: "switch".into(), kind: NodeKind::Switch { reduce_bytes_per_s: None } });
//! let mut links = Vec::new();
//! for r in 0..p {
//!     for (from, to) in [(r, p), (p, r)] {
//!         let name = format!("{from}->{to}");
//!         links.push(Link { name, from, to, bytes_per_s: rate, latency_s: lat });
//!     }
//! }
//! let fabric = Fabric {
//!     nodes,
//!     links,
//!     world: p,
//!     hosts: (0..p).map(|r| (format!("h{r}"), vec![r])).collect(),
//!     reduce_bytes_per_s: reduce,
//!     per_message_s: o,
//!     scaleup_per_message_s: o,
//!     symmetry: None,
//!     layout: Default::default(),
//! };
//! let count = 1 << 20; // f32 elements: N = 4 MiB
//! let n = (count * 4) as f64;
//! let spec = Spec {
//!     algo: Some(Algorithm::Ring),
//!     chunk_bytes: Some(1 << 20), // one slice per block
//!     ..Spec::new(Collective::AllReduce { count }, 4)
//! };
//! let report = simulate(&fabric, &spec)?;
//! let pm1 = (p - 1) as f64;
//! let t = 2.0 * pm1 / p as f64 * n / rate + 2.0 * pm1 * (o + 2.0 * lat) + pm1 * (n / p as f64) / reduce;
//! assert!((report.time_s - t).abs() < 1e-9 * t);
//! assert_eq!(report.algo, Algorithm::Ring);
//! # Ok::<(), String>(())
//! ```
#![deny(missing_docs)]

pub mod compress;
pub mod engine;
pub mod fabric;
mod queue;
pub mod run;
pub mod sym;
pub mod topo_file;

pub use compress::{Codec, CompressedReport, simulate_compressed};
pub use fabric::{Fabric, Link, Node, NodeKind, Symmetry};
pub use run::{Event, Options, Report, Spec, Track, simulate, simulate_with};

/// What the unit tests share.
#[cfg(test)]
pub(crate) mod testing {
    /// Asserts that error `e` names each of `parts`.
    pub(crate) fn has(e: &str, parts: &[&str]) {
        for p in parts {
            assert!(e.contains(p), "{e:?} does not name {p:?}");
        }
    }
}
