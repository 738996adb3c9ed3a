//! The tuner: which algorithm, slice size and channels a collective runs with, as a pure
//! function of the communicator's shape and the call. The communicator asks it for every
//! call; the fabric simulator (`oxccl-sim`) asks it too, so that a prediction runs the
//! schedule the runtime would run.
//!
//! ```
//! use oxccl_core::Topology;
//! use oxccl_core::schedule::{Algorithm, Collective};
//! use oxccl_core::tuner::Tuning;
//!
//! // Two hosts of two ranks, talking tcp across hosts.
//! let topo = Topology::parse(
//!     r#"{"hosts": [{"name": "a", "ranks": [0, 1]}, {"name": "b", "ranks": [2, 3]}]}"#,
//! )?;
//! let tuning = Tuning::new(&topo, true);
//! let req = tuning.request(&Collective::AllReduce { count: 1 << 24 }, 4, 2, false);
//! assert_eq!(req.algo, Algorithm::Hierarchical);
//! assert_eq!(req.chunk, (256 << 10) / 4);
//! let small = tuning.request(&Collective::AllReduce { count: 16 }, 4, 2, false);
//! assert_eq!(small.algo, Algorithm::RecursiveDoubling);
//! # Ok::<(), String>(())
//! ```

use crate::Topology;
use crate::schedule::{Algorithm, Collective, RAIL_DIRECT_MAX, Request};

/// Messages up to this many bytes are sent inline (one slot header's page): below it a
/// ring runs on one channel.
pub use crate::protocol::INLINE;

/// Default bytes per slice (and slot) when every peer is on the host.
pub const CHUNK_SHM: usize = 128 << 10;
/// Default bytes per slice (and slot) when any pair of ranks talks over the network. 256 KiB
/// rather than 1 MiB: a 2-rank ring over tcp then pipelines a 2 MiB all-reduce in four
/// fragments a step where it sent one (receive, reduce and send overlap): on loopback 2 MiB took
/// 456 us against 862 us and 8 MiB 2776 us against 4042 us (best of 3 alternating rounds,
/// bench/results/latency-2026-12-06/tcp), at 32 MiB the same. Four slots keep 1 MiB in flight
/// per peer and channel, more than a 10 Gbit/s link's bandwidth-delay product at 100 us.
pub const CHUNK_NET: usize = 256 << 10;
/// Default receive slots per (peer, channel) when every peer is on the host.
pub const SLOTS_SHM: usize = 8;
/// Default receive slots per (peer, channel) when any pair of ranks talks over the network.
pub const SLOTS_NET: usize = 4;
/// Default [`Tuning::small_bytes`].
pub const SMALL_BYTES: usize = 64 << 10;

/// What the tuner knows of a communicator.
#[derive(Clone, Debug, PartialEq)]
pub struct Tuning {
    /// Number of ranks.
    pub world: usize,
    /// Every peer is reached over shm (one host).
    pub all_shm: bool,
    /// Messages up to this many bytes use the latency algorithms (`OXCCL_SMALL_BYTES`).
    pub small_bytes: usize,
    /// Several hosts with the same number, above one, of ranks each: all-reduces and
    /// all-gathers run in two tiers.
    pub two_tier: bool,
    /// Each rank's share of a proportional all-reduce, from uneven link rates
    /// ([`Topology::proportional_weights`]; empty when rates are equal or unknown).
    pub weights: Vec<u32>,
    /// Each rank's share of its rail in a two-tier all-reduce, from uneven host link rates
    /// ([`Topology::rail_weights`]; empty when rates are equal or unknown).
    pub rail_weights: Vec<u32>,
    /// Each rank's host, for hierarchical schedules and host-ordered rings.
    pub host_index: Vec<u32>,
    /// Number of hosts.
    pub hosts: usize,
    /// The ranks of some host are not consecutive: rings are ordered host by host (so that
    /// they cross each host's link once each way instead of once per rank).
    pub interleaved: bool,
    /// An algorithm forced by `OXCCL_ALGO` (used where it applies).
    pub algo: Option<Algorithm>,
    /// The job has an aggregation service (`oxccl agg`): large all-reduces across hosts of
    /// one rank each stream through it.
    pub aggregator: bool,
    /// Bytes per pipelined slice (`OXCCL_CHUNK_SIZE`).
    pub chunk_bytes: usize,
    /// Channels (`OXCCL_NCHANNELS`).
    pub channels: usize,
    /// Receive slots per (peer, channel) (`OXCCL_SLOTS`): a sender has at most this many
    /// fragments of `chunk_bytes` in flight to one peer before it waits for credits.
    pub slots: usize,
}

impl Tuning {
    /// The defaults for a job of `topo`'s shape: `net` says whether any pair of ranks talks
    /// over the network (which picks the larger default slice).
    pub fn new(topo: &Topology, net: bool) -> Tuning {
        Tuning {
            world: topo.world(),
            all_shm: !net,
            small_bytes: SMALL_BYTES,
            two_tier: topo.is_two_tier(),
            weights: topo.proportional_weights(),
            rail_weights: topo.rail_weights(),
            host_index: topo.host_table().iter().map(|&h| h as u32).collect(),
            hosts: topo.hosts.len(),
            interleaved: {
                let t = topo.host_table();
                t.windows(2).filter(|w| w[0] != w[1]).count() + 1 > topo.hosts.len()
            },
            algo: None,
            aggregator: false,
            chunk_bytes: if net { CHUNK_NET } else { CHUNK_SHM },
            channels: 1,
            slots: if net { SLOTS_NET } else { SLOTS_SHM },
        }
    }

    /// The algorithm, chunk (elements) and channels for `coll` over elements of
    /// `elem_size` bytes.
    pub fn choose(&self, coll: &Collective, elem_size: usize) -> (Algorithm, usize, usize) {
        let bytes = coll.count() * elem_size;
        let small = bytes <= self.small_bytes;
        let default = match coll {
            // Tiny messages between ranks of one host: one round of mailbox messages. Above,
            // recursive doubling moves less data (and runs in mailboxes up to their size). Two
            // ranks: recursive doubling is that one round, reducing as it receives.
            Collective::AllReduce { .. } if self.all_shm && bytes <= 1024 && self.world > 2 => {
                Algorithm::Direct
            }
            Collective::AllReduce { .. } if small => Algorithm::RecursiveDoubling,
            // An aggregator across hosts: each host's link carries its data once each way,
            // where a ring's (or a two-tier schedule's rails) carry it 2(h-1)/h times (two
            // hosts gain nothing). In two tiers, each rail streams through it.
            Collective::AllReduce { .. } if self.aggregator && !self.all_shm && self.hosts > 2 => {
                Algorithm::Aggregation
            }
            // Several hosts of several ranks: reduce inside each host first, cross the network
            // once per rail.
            Collective::AllReduce { .. } | Collective::AllGather { .. } if self.two_tier => {
                Algorithm::Hierarchical
            }
            // Its rail phase is a direct exchange: on short rails only.
            Collective::ReduceScatter { .. } if self.two_tier && self.hosts <= RAIL_DIRECT_MAX => {
                Algorithm::Hierarchical
            }
            Collective::Broadcast { .. } if self.two_tier && !small => Algorithm::Hierarchical,
            // Uneven links: each rank reduces what its link can carry.
            Collective::AllReduce { .. } if !self.weights.is_empty() => Algorithm::Proportional,
            Collective::AllReduce { .. }
            | Collective::ReduceScatter { .. }
            | Collective::AllGather { .. } => Algorithm::Ring,
            Collective::Broadcast { .. } | Collective::Reduce { .. } if small => Algorithm::Tree,
            Collective::Broadcast { .. } | Collective::Reduce { .. } => Algorithm::Chain,
            Collective::Barrier => Algorithm::Dissemination,
            _ => Algorithm::Direct,
        };
        let algo = self.algo.filter(|a| a.supports(coll)).unwrap_or(default);
        let chunk = (self.chunk_bytes / elem_size.max(1)).max(1);
        // Small messages on one channel; large ones spread over all.
        let channels = if algo == Algorithm::Ring && bytes > INLINE * self.world {
            self.channels
        } else {
            1
        };
        (algo, chunk, channels)
    }

    /// The schedule request for `rank`'s part of `coll` ([`crate::schedule::build`] turns it
    /// into steps).
    pub fn request(
        &self,
        coll: &Collective,
        elem_size: usize,
        rank: usize,
        in_place: bool,
    ) -> Request {
        let (algo, chunk, channels) = self.choose(coll, elem_size);
        Request {
            coll: coll.clone(),
            world: self.world,
            rank,
            in_place,
            hosts: if algo == Algorithm::Hierarchical
                || (algo == Algorithm::Aggregation && self.two_tier)
                || (algo == Algorithm::Ring && self.interleaved)
            {
                self.host_index.clone()
            } else {
                Vec::new()
            },
            algo,
            chunk,
            channels,
            weights: match algo {
                Algorithm::Proportional if self.weights.is_empty() => vec![1; self.world],
                Algorithm::Proportional => self.weights.clone(),
                Algorithm::Hierarchical if matches!(coll, Collective::AllReduce { .. }) => {
                    self.rail_weights.clone()
                }
                _ => Vec::new(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topo(text: &str) -> Topology {
        Topology::parse(text).unwrap()
    }

    #[test]
    fn choices_follow_the_topology() {
        let big = Collective::AllReduce { count: 1 << 24 };
        // One host: the ring, on the configured channels.
        let one = topo(r#"{"hosts": [{"name": "a", "ranks": [0, 1, 2]}]}"#);
        let mut t = Tuning::new(&one, false);
        t.channels = 4;
        assert_eq!(t.choose(&big, 4), (Algorithm::Ring, CHUNK_SHM / 4, 4));
        assert_eq!(
            t.choose(&Collective::AllReduce { count: 8 }, 4).0,
            Algorithm::Direct
        );
        // Uneven links, one rank per host: proportional shares, the slow host owns nothing.
        let uneven = topo(
            r#"{"hosts": [{"name": "a", "ranks": [0], "link_gbps": 1.0},
                          {"name": "b", "ranks": [1], "link_gbps": 1.0},
                          {"name": "c", "ranks": [2], "link_gbps": 1.0},
                          {"name": "d", "ranks": [3], "link_gbps": 0.25}]}"#,
        );
        let req = Tuning::new(&uneven, true).request(&big, 4, 3, false);
        assert_eq!(req.algo, Algorithm::Proportional);
        assert_eq!(req.weights[3], 0);
        assert!(req.weights[..3].iter().all(|&w| w > 300_000));
        // Two tiers with uneven hosts: hierarchical, rail shares by host, host-mates alike.
        let two = topo(
            r#"{"hosts": [{"name": "a", "ranks": [0, 3], "link_gbps": 1.0},
                          {"name": "b", "ranks": [1, 4], "link_gbps": 1.0},
                          {"name": "c", "ranks": [2, 5], "link_gbps": 0.25}]}"#,
        );
        let t = Tuning::new(&two, true);
        assert!(t.interleaved);
        let req = t.request(&big, 4, 0, false);
        assert_eq!(req.algo, Algorithm::Hierarchical);
        assert_eq!(req.hosts, vec![0, 1, 2, 0, 1, 2]);
        assert_eq!(req.weights[2], 0);
        assert_eq!(req.weights[0], req.weights[3]);
        // Its all-gather has no shares; a mid-size ring there is ordered by host.
        let ag = t.request(&Collective::AllGather { count: 1 << 20 }, 4, 0, false);
        assert_eq!(
            (ag.algo, ag.weights.is_empty()),
            (Algorithm::Hierarchical, true)
        );
        let mut forced = t.clone();
        forced.algo = Some(Algorithm::Ring);
        let ring = forced.request(&big, 4, 0, false);
        assert_eq!((ring.algo, ring.hosts.len()), (Algorithm::Ring, 6));
        // A forced algorithm that can't run the collective is ignored.
        let b = forced.request(
            &Collective::Broadcast {
                count: 1 << 20,
                root: 0,
            },
            4,
            0,
            false,
        );
        assert_eq!(b.algo, Algorithm::Hierarchical);
    }

    #[test]
    fn an_aggregator_takes_large_all_reduces_across_more_than_two_hosts() {
        let big = Collective::AllReduce { count: 1 << 24 };
        let four = topo(
            r#"{"hosts": [{"name": "a", "ranks": [0]}, {"name": "b", "ranks": [1]},
                          {"name": "c", "ranks": [2]}, {"name": "d", "ranks": [3]}]}"#,
        );
        let mut t = Tuning::new(&four, true);
        assert_eq!(t.choose(&big, 4).0, Algorithm::Ring);
        t.aggregator = true;
        assert_eq!(t.choose(&big, 4).0, Algorithm::Aggregation);
        // Small calls keep their latency algorithm; other collectives theirs.
        assert_eq!(
            t.choose(&Collective::AllReduce { count: 16 }, 4).0,
            Algorithm::RecursiveDoubling
        );
        assert_eq!(
            t.choose(&Collective::AllGather { count: 1 << 24 }, 4).0,
            Algorithm::Ring
        );
        // Two tiers of three hosts: each rail streams through it (the request has the hosts).
        let tiers = topo(
            r#"{"hosts": [{"name": "a", "ranks": [0, 1]}, {"name": "b", "ranks": [2, 3]},
                          {"name": "c", "ranks": [4, 5]}]}"#,
        );
        let mut t = Tuning::new(&tiers, true);
        t.aggregator = true;
        let req = t.request(&big, 4, 0, false);
        assert_eq!((req.algo, req.hosts.len()), (Algorithm::Aggregation, 6));
        // Two hosts gain nothing from it: the two-tier schedule stays.
        let two =
            topo(r#"{"hosts": [{"name": "a", "ranks": [0, 1]}, {"name": "b", "ranks": [2, 3]}]}"#);
        let mut t = Tuning::new(&two, true);
        t.aggregator = true;
        assert_eq!(t.choose(&big, 4).0, Algorithm::Hierarchical);
    }
}
