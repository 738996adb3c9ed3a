//! The wire protocol, without I/O: what travels ([`wire`]: the fragment header and the call's
//! fingerprint in it, the immediates, where slots, credit words and mailboxes lie), and the
//! protocol of one call as a state machine ([`Machine`]: slots, credits, fragments, step
//! dependencies, the mailbox mode), and a mailbox call compiled from that machine to a straight
//! line ([`Program`]). The runtime's executor (`oxccl`'s engine) performs its
//! actions over verbs, the verifier ([`crate::verify`]) over symbolic memory, the simulator
//! (`oxccl-sim`) over its fabric model.
//!
//! A two-rank exchange driven by hand: rank 0 sends 10 bytes in fragments of 4 through 2 slots.
//!
//! ```
//! use oxccl_core::protocol::{Action, Config, Flows, Machine, Queues, Reuse};
//! use oxccl_core::schedule::{Buf, Op, Region, Schedule, Step};
//!
//! let sched = Schedule {
//!     rank: 0,
//!     steps: vec![Step {
//!         op: Op::Send { peer: 1, channel: 0, src: Region::new(Buf::Input, 0, 10) },
//!         deps: vec![],
//!     }],
//!     scratch: 0,
//! };
//! // Rank 0's only link (index 0) leads to rank 1.
//! let queues = Queues::new(&sched, &[usize::MAX, 0], 1)?;
//! let cfg = Config::new(1, 2, 4, 1);
//! let mut flows = Flows::new(1, 1);
//! let mut m = Machine::new(&sched, &queues, cfg, 1, false, Reuse::default());
//! let mut posted = Vec::new();
//! while let Some(a) = m.next(&mut flows) {
//!     posted.push(a);
//! }
//! // Two slots: two fragments, then the sender waits for a credit.
//! assert!(matches!(posted[..], [Action::Post { off: 0, len: 4, .. }, Action::Post { off: 4, .. }]));
//! flows.credit(0, 2); // the receiver consumed both
//! assert!(matches!(m.next(&mut flows), Some(Action::Post { off: 8, len: 2, slot: 0, .. })));
//! for _ in 0..3 {
//!     m.completed(0, true);
//! }
//! assert!(m.is_done());
//! # Ok::<(), String>(())
//! ```

mod desc;
mod machine;
mod program;
pub mod wire;

pub use desc::{OpDesc, seq_text};
pub use machine::{
    Action, Config, Flow, Flows, Machine, Queues, Reuse, StepState, Waiting, mailbox_call,
    mailbox_eligible, mailbox_mode,
};
pub use program::{Instr, Program};
pub use wire::{
    ANNOUNCE, ANNOUNCE_RING, Announce, Geometry, Header, INLINE, Imm, MAGIC, MAILBOX, MAILBOX_DATA,
    Notice, PLACE_MIN, SLOT_HEADER, STAGE, Violation, mailbox,
};
