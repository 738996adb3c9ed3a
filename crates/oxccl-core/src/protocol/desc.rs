//! A call's identity: its sequence number and fingerprint ([`OpDesc`]), as errors, the flight
//! recorder and the wire header name it.

use crate::schedule::CollectiveKind;
use crate::{DataType, ReduceOp};

/// What a collective call was: its sequence number and fingerprint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpDesc {
    /// Per-communicator sequence number (for send/recv: per peer and direction).
    pub seq: u64,
    /// Which collective.
    pub coll: CollectiveKind,
    /// Element count (per rank for reduce-scatter, all-gather, all-to-all, gather, scatter).
    pub count: u64,
    /// Data type.
    pub dtype: DataType,
    /// Reduction operator (meaningful for reducing collectives).
    pub op: ReduceOp,
    /// Root rank (or peer, for send/recv), if any.
    pub root: Option<usize>,
}

/// A call's sequence number as users read it: init's own calls before its closing barrier
/// (#0) are numbered below 0 (`#-5`: the link probe), the user's from 1.
pub fn seq_text(seq: u64) -> String {
    (seq as i64).to_string()
}

impl std::fmt::Display for OpDesc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} #{} (count {}, {}",
            self.coll,
            seq_text(self.seq),
            self.count,
            self.dtype
        )?;
        if self.coll.reduces() {
            write!(f, ", {}", self.op)?;
        }
        if let Some(root) = self.root {
            let what = if self.coll.is_point_to_point() {
                "peer"
            } else {
                "root"
            };
            write!(f, ", {what} {root}")?;
        }
        write!(f, ")")
    }
}
