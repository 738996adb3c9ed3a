//! # oxccl-sim: a flow-level fabric simulator that runs oxccl's own schedules
#![deny(missing_docs)]

pub mod engine;
pub mod fabric;
pub mod run;
pub mod sym;
pub mod topo_file;

pub use fabric::{Fabric, Link, Node, NodeKind, Symmetry};
pub use run::{Event, Options, Report, Spec, Track, simulate, simulate_with};
