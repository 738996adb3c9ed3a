//! # oxccl-sim: a flow-level fabric simulator that runs oxccl's own schedules
#![deny(missing_docs)]

pub mod fabric;
pub mod run;
pub mod topo_file;

pub use fabric::{Fabric, Link, Node, NodeKind, Symmetry};
pub use run::{Event, Report, Spec, Track, simulate};
