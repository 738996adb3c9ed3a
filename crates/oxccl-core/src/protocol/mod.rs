//! The wire protocol's constants and, later, its state machine: what the runtime's executor
//! (`oxccl`'s engine) writes into a peer's receive slots, shared with the tuner, which sizes its
//! choices by what fits in one slot.

/// Bytes of the header in front of every fragment in a receive slot (the collective's sequence
/// number and fingerprint, the transfer's length, the fragment's offset).
pub const SLOT_HEADER: usize = 64;

mod machine;

pub use machine::{
    Action, Config, Flow, Flows, Machine, Queues, Reuse, StepState, Waiting, mailbox_eligible,
};
