//! [`CollectiveKind`]: which collective a call is, without its counts.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::Collective;
use crate::ParseNameError;
use crate::dtype::parse_name;

/// Which collective a call is, without its counts: the one identity that error messages, the
/// flight recorder and its dumps, `oxccl perf` and the wire header share. The names are the
/// ones [`Collective::name`] gives (`all_reduce`, `reduce_scatter`, ..., `all_to_allv`, `send`,
/// `recv`), for [`Display`](fmt::Display), [`FromStr`] and serde alike; the discriminants are
/// the codes of the wire header's collective byte ([`CollectiveKind::code`]).
///
/// ```
/// use oxccl_core::schedule::{Collective, CollectiveKind};
///
/// let kind = Collective::AllToAllV { send_counts: vec![1], recv_counts: vec![1] }.kind();
/// assert_eq!(kind, CollectiveKind::AllToAllV);
/// assert_eq!(kind.to_string(), "all_to_allv");
/// assert_eq!("all_to_allv".parse(), Ok(kind));
/// assert_eq!(CollectiveKind::from_code(kind.code()), Some(kind));
/// assert_eq!(CollectiveKind::from_code(200), None);
/// ```
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum CollectiveKind {
    /// [`Collective::AllReduce`].
    #[serde(rename = "all_reduce")]
    AllReduce = 0,
    /// [`Collective::ReduceScatter`].
    #[serde(rename = "reduce_scatter")]
    ReduceScatter = 1,
    /// [`Collective::AllGather`].
    #[serde(rename = "all_gather")]
    AllGather = 2,
    /// [`Collective::Broadcast`].
    #[serde(rename = "broadcast")]
    Broadcast = 3,
    /// [`Collective::Reduce`].
    #[serde(rename = "reduce")]
    Reduce = 4,
    /// [`Collective::AllToAll`].
    #[serde(rename = "all_to_all")]
    AllToAll = 5,
    /// [`Collective::AllToAllV`].
    #[serde(rename = "all_to_allv")]
    AllToAllV = 6,
    /// [`Collective::Gather`].
    #[serde(rename = "gather")]
    Gather = 7,
    /// [`Collective::Scatter`].
    #[serde(rename = "scatter")]
    Scatter = 8,
    /// [`Collective::Barrier`].
    #[serde(rename = "barrier")]
    Barrier = 9,
    /// [`Collective::Send`].
    #[serde(rename = "send")]
    Send = 10,
    /// [`Collective::Recv`].
    #[serde(rename = "recv")]
    Recv = 11,
}

impl CollectiveKind {
    /// Every kind, in the order of their codes.
    pub const ALL: [CollectiveKind; 12] = [
        CollectiveKind::AllReduce,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllGather,
        CollectiveKind::Broadcast,
        CollectiveKind::Reduce,
        CollectiveKind::AllToAll,
        CollectiveKind::AllToAllV,
        CollectiveKind::Gather,
        CollectiveKind::Scatter,
        CollectiveKind::Barrier,
        CollectiveKind::Send,
        CollectiveKind::Recv,
    ];

    /// The short name, as `oxccl perf`, error messages and flight-recorder dumps spell it.
    pub const fn name(self) -> &'static str {
        self.names()[0]
    }

    /// Every name [`FromStr`] accepts for this kind (only its name).
    const fn names(self) -> &'static [&'static str] {
        match self {
            CollectiveKind::AllReduce => &["all_reduce"],
            CollectiveKind::ReduceScatter => &["reduce_scatter"],
            CollectiveKind::AllGather => &["all_gather"],
            CollectiveKind::Broadcast => &["broadcast"],
            CollectiveKind::Reduce => &["reduce"],
            CollectiveKind::AllToAll => &["all_to_all"],
            CollectiveKind::AllToAllV => &["all_to_allv"],
            CollectiveKind::Gather => &["gather"],
            CollectiveKind::Scatter => &["scatter"],
            CollectiveKind::Barrier => &["barrier"],
            CollectiveKind::Send => &["send"],
            CollectiveKind::Recv => &["recv"],
        }
    }

    /// The code the wire header carries for this kind.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// The kind a wire header's code names, if any.
    pub fn from_code(code: u8) -> Option<CollectiveKind> {
        CollectiveKind::ALL.into_iter().find(|k| k.code() == code)
    }

    /// Whether it combines values with a reduction operator (all-reduce, reduce-scatter,
    /// reduce).
    pub const fn reduces(self) -> bool {
        matches!(
            self,
            CollectiveKind::AllReduce | CollectiveKind::ReduceScatter | CollectiveKind::Reduce
        )
    }

    /// Whether it has a root rank (broadcast, reduce, gather, scatter).
    pub const fn is_rooted(self) -> bool {
        matches!(
            self,
            CollectiveKind::Broadcast
                | CollectiveKind::Reduce
                | CollectiveKind::Gather
                | CollectiveKind::Scatter
        )
    }

    /// Whether it is point to point (send, recv): calls numbered per peer and direction,
    /// not in the communicator's sequence of collectives.
    pub const fn is_point_to_point(self) -> bool {
        matches!(self, CollectiveKind::Send | CollectiveKind::Recv)
    }
}

impl Collective {
    /// Which collective this is.
    pub fn kind(&self) -> CollectiveKind {
        match self {
            Collective::AllReduce { .. } => CollectiveKind::AllReduce,
            Collective::ReduceScatter { .. } => CollectiveKind::ReduceScatter,
            Collective::AllGather { .. } => CollectiveKind::AllGather,
            Collective::Broadcast { .. } => CollectiveKind::Broadcast,
            Collective::Reduce { .. } => CollectiveKind::Reduce,
            Collective::AllToAll { .. } => CollectiveKind::AllToAll,
            Collective::AllToAllV { .. } => CollectiveKind::AllToAllV,
            Collective::Gather { .. } => CollectiveKind::Gather,
            Collective::Scatter { .. } => CollectiveKind::Scatter,
            Collective::Barrier => CollectiveKind::Barrier,
            Collective::Send { .. } => CollectiveKind::Send,
            Collective::Recv { .. } => CollectiveKind::Recv,
        }
    }
}

impl fmt::Display for CollectiveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

impl FromStr for CollectiveKind {
    type Err = ParseNameError;

    /// Parses a name ([`CollectiveKind::name`]), ignoring ASCII case and surrounding
    /// whitespace.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_name("collective", s, &CollectiveKind::ALL, CollectiveKind::names)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_codes_and_serde_agree() {
        // Today's wire codes: the kinds' order.
        for (code, kind) in CollectiveKind::ALL.into_iter().enumerate() {
            assert_eq!(kind.code() as usize, code);
            assert_eq!(CollectiveKind::from_code(code as u8), Some(kind));
            assert_eq!(kind.name().parse::<CollectiveKind>(), Ok(kind));
            assert_eq!(kind.to_string(), kind.name());
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{}\"", kind.name()));
            assert_eq!(serde_json::from_str::<CollectiveKind>(&json).unwrap(), kind);
        }
        assert_eq!(CollectiveKind::from_code(12), None);
        assert_eq!(" All_Reduce ".parse(), Ok(CollectiveKind::AllReduce));
        let e = "allreduce"
            .parse::<CollectiveKind>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown collective \"allreduce\"") && e.contains("all_to_allv"));
        assert!(serde_json::from_str::<CollectiveKind>("\"AllReduce\"").is_err());
    }

    #[test]
    fn every_collective_has_its_kind() {
        let c = 3;
        let colls = [
            Collective::AllReduce { count: c },
            Collective::ReduceScatter { count: c },
            Collective::AllGather { count: c },
            Collective::Broadcast { count: c, root: 0 },
            Collective::Reduce { count: c, root: 0 },
            Collective::AllToAll { count: c },
            Collective::AllToAllV {
                send_counts: vec![c],
                recv_counts: vec![c],
            },
            Collective::Gather { count: c, root: 0 },
            Collective::Scatter { count: c, root: 0 },
            Collective::Barrier,
            Collective::Send { count: c, peer: 1 },
            Collective::Recv { count: c, peer: 1 },
        ];
        for (coll, kind) in colls.iter().zip(CollectiveKind::ALL) {
            assert_eq!(coll.kind(), kind);
            assert_eq!(coll.name(), kind.name());
            assert_eq!(coll.reduces(), kind.reduces());
            let rooted = coll.root().is_some() && !kind.is_point_to_point();
            assert_eq!(rooted, kind.is_rooted());
        }
    }
}
