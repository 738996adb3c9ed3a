//! The modelled network: nodes (ranks and switches), directed links with a rate and a
//! latency, and routes between nodes. Built from a topology file (see [`Fabric::parse`]).

/// What a node is.
#[derive(Clone, Debug, PartialEq)]
pub enum NodeKind {
    /// A rank (an accelerator and its process): nodes `0..world` are the ranks, in order.
    Rank {
        /// Its host (index into [`Fabric::hosts`]).
        host: usize,
    },
    /// A switch (scale-up switch, leaf, spine, long-haul router, or a host's own switch).
    Switch {
        /// Bytes per second it can reduce when a schedule aggregates in it (in-network
        /// reduction); `None` when it can't.
        reduce_bytes_per_s: Option<f64>,
    },
}

/// A node of the fabric.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// Its name, for traces and summaries.
    pub name: String,
    /// What it is.
    pub kind: NodeKind,
}

/// A directed link.
#[derive(Clone, Debug, PartialEq)]
pub struct Link {
    /// Its name, for traces and summaries (e.g. `h3.nic0->leaf0`).
    pub name: String,
    /// Node it leaves.
    pub from: usize,
    /// Node it enters.
    pub to: usize,
    /// Rate in bytes per second.
    pub bytes_per_s: f64,
    /// Propagation and forwarding latency in seconds.
    pub latency_s: f64,
}

/// The modelled network.
#[derive(Clone, Debug)]
pub struct Fabric {
    /// Nodes: the ranks first (`0..world`), then switches.
    pub nodes: Vec<Node>,
    /// Directed links.
    pub links: Vec<Link>,
    /// Number of ranks.
    pub world: usize,
    /// Each host's name and ranks.
    pub hosts: Vec<(String, Vec<usize>)>,
    /// Bytes per second a rank reduces (the receiver's cost of a reducing receive).
    pub reduce_bytes_per_s: f64,
    /// Fixed cost of every message at its sender, in seconds (software overhead).
    pub per_message_s: f64,
    /// An automorphism of the fabric, when it has one: a map of nodes and links that keeps
    /// every link's ends, rate and latency, sends ranks to ranks and hosts to hosts. The
    /// simulator uses it to run one representative of each orbit of ranks.
    pub symmetry: Option<Symmetry>,
}

/// One generator of the fabric's symmetry group (see [`Fabric::symmetry`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Symmetry {
    /// Where each node goes (a permutation of `0..nodes.len()`; ranks to ranks).
    pub node_map: Vec<usize>,
    /// Where each link goes (a permutation of `0..links.len()`).
    pub link_map: Vec<usize>,
}

impl Fabric {
    /// Appends to `out` the links of the route from node `from` to node `to`. `key` picks one
    /// of several equal-cost routes (ECMP), deterministically; routes are loop free.
    ///
    /// Placeholder: a breadth-first search; the topology builder replaces it with routes of
    /// the structured fabrics.
    pub fn route(&self, from: usize, to: usize, key: u64, out: &mut Vec<usize>) {
        let _ = key;
        if from == to {
            return;
        }
        let mut prev = vec![usize::MAX; self.nodes.len()];
        let mut queue = std::collections::VecDeque::from([from]);
        prev[from] = usize::MAX - 1;
        while let Some(n) = queue.pop_front() {
            if n == to {
                break;
            }
            for (i, l) in self.links.iter().enumerate() {
                if l.from == n && prev[l.to] == usize::MAX {
                    prev[l.to] = i;
                    queue.push_back(l.to);
                }
            }
        }
        let mut path = Vec::new();
        let mut n = to;
        while n != from {
            let l = prev[n];
            assert!(
                l < self.links.len(),
                "no route from node {from} to node {to}"
            );
            path.push(l);
            n = self.links[l].from;
        }
        out.extend(path.into_iter().rev());
    }
}
