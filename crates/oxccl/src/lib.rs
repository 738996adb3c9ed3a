//! # oxccl: collective communication over verbs
#![deny(missing_docs)]

mod dtype;
mod reduce;
pub mod schedule;
pub mod verify;

pub use dtype::{DataType, Element, ReduceOp};
