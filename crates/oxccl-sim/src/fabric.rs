//! The modelled network: nodes (ranks and switches), directed links with a rate and a
//! latency, and routes between nodes. Built from a topology file (see [`Fabric::parse`] and
//! the format in [`crate::topo_file`]).
//!
//! ## Routes
//! [`Fabric::route`] is O(path length) for the fabrics the topology file builds (a star of
//! hosts, a rail-optimised leaf-spine cluster, several datacenters): the builder keeps the
//! link of every rank's up and down hop, every leaf's uplink to every spine and the long-haul
//! links, and a route is a few table lookups. Routes that start or end at a switch (an
//! aggregator), and every route of a fabric built by hand (a struct literal with
//! `layout: Layout::default()`), use a general fallback: shortest paths (fewest hops, ties to
//! the lowest link index) that never pass through a rank, from breadth-first searches cached
//! per destination (or per source switch).
//!
//! ## ECMP and symmetry
//! In a leaf-spine cluster a route between leaves crosses one of the spines: a hash of `key`
//! and of quantities of the pair of ranks that the fabric's symmetry ([`Fabric::symmetry`])
//! keeps (their rails), plus the source host's place in its leaf group, modulo
//! the spines. The hosts of a leaf group that send the same way thus take distinct spines
//! (as adaptive routing or a well-spread flow hash would): with a plain hash of the flows, a
//! 16,384-rank ring's cross-host hops collided on spines and ran at a third of the NIC
//! rate, an artefact of this model's few, long-lived flows. So for any pair `(a, b)` and key,
//! `route(π(a), π(b), key)` is the image under `π` of `route(a, b, key)`: the symmetry is an
//! automorphism of the fabric *with its routing*, as long as the engine gives mapped flows
//! the same key (a key made of channel, step or slice numbers, not of rank numbers). The
//! generators (built in [`crate::topo_file`], each checked link by link by
//! [`Fabric::check_symmetry`]): a star of identical hosts shifts by one host (several
//! datacenters: by one datacenter); a single host's ranks shift by one; a cluster shifts by
//! one leaf group (several datacenters: by one datacenter). A cluster of one leaf group and
//! several hosts has none: moving its hosts would move their places in the group, which the
//! spine choice depends on.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};

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
    /// The same for a message to a rank of the same host (over the scale-up path: shm).
    pub scaleup_per_message_s: f64,
    /// An automorphism of the fabric, when it has one: a map of nodes and links that keeps
    /// every link's ends, rate and latency, sends ranks to ranks and hosts to hosts. The
    /// simulator uses it to run one representative of each orbit of ranks.
    pub symmetry: Option<Symmetry>,
    /// How the fabric was built, for fast routes and [`Fabric::topology`];
    /// `Layout::default()` for a fabric built by hand (general routes).
    pub layout: Layout,
}

/// One generator of the fabric's symmetry group (see [`Fabric::symmetry`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Symmetry {
    /// Where each node goes (a permutation of `0..nodes.len()`; ranks to ranks).
    pub node_map: Vec<usize>,
    /// Where each link goes (a permutation of `0..links.len()`).
    pub link_map: Vec<usize>,
}

/// The structure a topology file built (opaque): the tables of the structured routes, what
/// [`Fabric::topology`] reports, and a cache of the general routes. `Layout::default()`:
/// no structure (every route by the general fallback).
#[derive(Default)]
pub struct Layout {
    pub(crate) shape: Shape,
    /// Scale-out rate of every host in Gbit/s (sum over its NICs); `None` when it has none.
    pub(crate) host_gbps: Vec<Option<f64>>,
    /// Each host's datacenter.
    pub(crate) host_dc: Vec<usize>,
    /// The tuner sees each datacenter as one host (`tuner_hosts = "datacenters"`).
    pub(crate) tuner_dcs: bool,
    /// Long-haul rate in Gbit/s (for the tuner's view of datacenters).
    pub(crate) wan_gbps: Option<f64>,
    /// Names of the datacenters.
    pub(crate) dc_names: Vec<String>,
    /// The fabric's `(world, nodes, links, hosts)` when the builder made this layout: its
    /// tables describe that fabric only, so a fabric whose fields were changed since (more
    /// nodes, fewer links, ...) is routed by the general fallback instead ([`Fabric::route`]).
    pub(crate) built_for: [usize; 4],
    pub(crate) cache: RouteCache,
}

impl Clone for Layout {
    fn clone(&self) -> Layout {
        Layout {
            shape: self.shape.clone(),
            host_gbps: self.host_gbps.clone(),
            host_dc: self.host_dc.clone(),
            tuner_dcs: self.tuner_dcs,
            wan_gbps: self.wan_gbps,
            dc_names: self.dc_names.clone(),
            built_for: self.built_for,
            cache: RouteCache::default(),
        }
    }
}

impl std::fmt::Debug for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shape = match &self.shape {
            Shape::General => "general",
            Shape::Star(_) => "star",
            Shape::Cluster(_) => "cluster",
        };
        f.debug_struct("Layout")
            .field("shape", &shape)
            .field("datacenters", &self.dc_names.len().max(1))
            .finish()
    }
}

/// Cached breadth-first trees of the general routes.
#[derive(Default)]
pub(crate) struct RouteCache {
    adj: OnceLock<Adjacency>,
    /// Per destination node: the next link from every node towards it.
    to: Mutex<HashMap<usize, Arc<Vec<u32>>>>,
    /// Per source node: the link into every node on the tree of routes from it.
    from: Mutex<HashMap<usize, Arc<Vec<u32>>>>,
}

struct Adjacency {
    out: Vec<Vec<u32>>,
    inc: Vec<Vec<u32>>,
}

const NONE: u32 = u32::MAX;

/// Locks a route cache; a cache poisoned by a panic elsewhere is still a valid cache (every
/// entry is inserted whole).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Clone, Default)]
pub(crate) enum Shape {
    #[default]
    General,
    Star(Star),
    Cluster(Cluster),
}

/// Hosts on a switch each (ranks to it at the scale-up rate), host switches to one core per
/// datacenter, cores joined by long-haul links.
#[derive(Clone)]
pub(crate) struct Star {
    pub(crate) host_of: Vec<u32>,
    pub(crate) up: Vec<u32>,
    pub(crate) down: Vec<u32>,
    /// Per host: host switch -> core, core -> host switch (`NONE` without a core).
    pub(crate) h_up: Vec<u32>,
    pub(crate) h_down: Vec<u32>,
    pub(crate) dcs: usize,
    /// `wan[a * dcs + b]`: core of a -> core of b.
    pub(crate) wan: Vec<u32>,
}

/// Hosts of `g` ranks on a scale-up switch; rank `h*g + i` has a NIC into the leaf of rail
/// `i` of its host's leaf group; every leaf of a datacenter has one link up to and down from
/// each of its spines; spines of a datacenter meet at its router; routers are joined by
/// long-haul links.
#[derive(Clone)]
pub(crate) struct Cluster {
    pub(crate) g: usize,
    pub(crate) hosts_per_dc: usize,
    pub(crate) hpl: usize,
    pub(crate) gpd: usize,
    pub(crate) dcs: usize,
    pub(crate) spines: usize,
    pub(crate) su_up: Vec<u32>,
    pub(crate) su_down: Vec<u32>,
    pub(crate) nic_up: Vec<u32>,
    pub(crate) nic_down: Vec<u32>,
    /// `[leaf * spines + s]`: leaf -> spine s, spine s -> leaf.
    pub(crate) ls_up: Vec<u32>,
    pub(crate) ls_down: Vec<u32>,
    /// `[dc * spines + s]`: spine -> router, router -> spine.
    pub(crate) sr_up: Vec<u32>,
    pub(crate) sr_down: Vec<u32>,
    /// `wan[a * dcs + b]`: router of a -> router of b.
    pub(crate) wan: Vec<u32>,
}

impl Cluster {
    /// (datacenter, group, place in group, rail) of a rank.
    fn place(&self, r: usize) -> (usize, usize, usize, usize) {
        let h = r / self.g;
        let rail = r % self.g;
        let dc = h / self.hosts_per_dc;
        let lh = h % self.hosts_per_dc;
        (dc, lh / self.hpl, lh % self.hpl, rail)
    }

    pub(crate) fn leaf(&self, dc: usize, grp: usize, rail: usize) -> usize {
        (dc * self.gpd + grp) * self.g + rail
    }

    fn spine(&self, a: usize, b: usize, key: u64) -> usize {
        if self.spines == 1 {
            return 0;
        }
        let (_, _, pa, ra) = self.place(a);
        let rb = b % self.g;
        // Not the groups nor the datacenters: a ring's hop into the next group (or
        // datacenter) then lands on the spine after the last host's of its group, not on
        // one of theirs.
        let parts: [u64; 2] = [ra as u64, rb as u64];
        let mut h = mix(key ^ 0x9e37_79b9_7f4a_7c15);
        for p in parts {
            h = mix(h ^ p.wrapping_mul(0xff51_afd7_ed55_8ccd));
        }
        // Spread: the hosts of a leaf group going the same way take consecutive spines.
        ((h % self.spines as u64) as usize + pa) % self.spines
    }
}

/// splitmix64's finaliser.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Fabric {
    /// Appends to `out` the links of the route from node `from` to node `to`. `key` picks one
    /// of several equal-cost routes (ECMP), deterministically; routes are loop free and never
    /// pass through a rank.
    ///
    /// Between two ranks of a built fabric: same host, through the host's (scale-up) switch;
    /// same leaf (same rail and leaf group), through the leaf; else leaf, spine, leaf, with
    /// the spine hashed from `key` and orbit-invariant quantities of the pair (see the
    /// module docs); across datacenters, leaf, spine, router, long-haul link, router, the
    /// same-numbered spine, leaf. Every other route: the general fallback (see the module
    /// docs).
    ///
    /// # Errors
    /// When `from` or `to` is not a node of the fabric, or `to` can't be reached from `from`
    /// (the error names both nodes); `out` then holds what it held before.
    pub fn route(
        &self,
        from: usize,
        to: usize,
        key: u64,
        out: &mut Vec<usize>,
    ) -> Result<(), String> {
        let n = self.nodes.len();
        if from >= n || to >= n {
            return Err(format!(
                "no route from node {from} to node {to}: the fabric has {n} nodes"
            ));
        }
        if from == to {
            return Ok(());
        }
        if from < self.world && to < self.world && self.layout_fits() {
            match &self.layout.shape {
                Shape::Star(s) => {
                    let (ha, hb) = (s.host_of[from] as usize, s.host_of[to] as usize);
                    out.push(s.up[from] as usize);
                    if ha != hb {
                        out.push(s.h_up[ha] as usize);
                        let (da, db) = (self.layout.host_dc[ha], self.layout.host_dc[hb]);
                        if da != db {
                            out.push(s.wan[da * s.dcs + db] as usize);
                        }
                        out.push(s.h_down[hb] as usize);
                    }
                    out.push(s.down[to] as usize);
                    return Ok(());
                }
                Shape::Cluster(c) => {
                    if from / c.g == to / c.g {
                        out.push(c.su_up[from] as usize);
                        out.push(c.su_down[to] as usize);
                        return Ok(());
                    }
                    let (da, ga, _, ra) = c.place(from);
                    let (db, gb, _, rb) = c.place(to);
                    let (la, lb) = (c.leaf(da, ga, ra), c.leaf(db, gb, rb));
                    out.push(c.nic_up[from] as usize);
                    if la != lb {
                        let s = c.spine(from, to, key);
                        out.push(c.ls_up[la * c.spines + s] as usize);
                        if da != db {
                            out.push(c.sr_up[da * c.spines + s] as usize);
                            out.push(c.wan[da * c.dcs + db] as usize);
                            out.push(c.sr_down[db * c.spines + s] as usize);
                        }
                        out.push(c.ls_down[lb * c.spines + s] as usize);
                    }
                    out.push(c.nic_down[to] as usize);
                    return Ok(());
                }
                Shape::General => {}
            }
        }
        self.general_route(from, to, out)
    }

    /// Whether the layout's tables were built for this fabric as it is (see
    /// [`Layout::built_for`]).
    fn layout_fits(&self) -> bool {
        self.layout.built_for == self.dims()
    }

    /// The fabric's `(world, nodes, links, hosts)`, as [`Layout::built_for`] records them.
    pub(crate) fn dims(&self) -> [usize; 4] {
        [
            self.world,
            self.nodes.len(),
            self.links.len(),
            self.hosts.len(),
        ]
    }

    /// The links out of and into every node. A link whose ends are not nodes of the fabric
    /// (a fabric built by hand; [`Fabric::validate`] refuses it) is left out, so that the
    /// searches only ever visit nodes.
    fn adjacency(&self) -> &Adjacency {
        self.layout.cache.adj.get_or_init(|| {
            let n = self.nodes.len();
            let mut out = vec![Vec::new(); n];
            let mut inc = vec![Vec::new(); n];
            for (i, l) in self.links.iter().enumerate() {
                if l.from < n && l.to < n {
                    out[l.from].push(i as u32);
                    inc[l.to].push(i as u32);
                }
            }
            Adjacency { out, inc }
        })
    }

    fn is_rank(&self, n: usize) -> bool {
        matches!(self.nodes[n].kind, NodeKind::Rank { .. })
    }

    /// Node `n`'s name, for errors.
    fn node_name(&self, n: usize) -> &str {
        self.nodes.get(n).map_or("?", |x| x.name.as_str())
    }

    /// The error of a route that does not exist.
    fn no_route(&self, from: usize, to: usize) -> String {
        format!(
            "no route from node {from} ({}) to node {to} ({}): no path of links that does \
             not pass through another rank",
            self.node_name(from),
            self.node_name(to)
        )
    }

    /// The next link from every node towards `to` (fewest hops, not through ranks).
    fn to_table(&self, to: usize) -> Arc<Vec<u32>> {
        if let Some(t) = lock(&self.layout.cache.to).get(&to) {
            return t.clone();
        }
        let adj = self.adjacency();
        let mut next = vec![NONE; self.nodes.len()];
        let mut seen = vec![false; self.nodes.len()];
        seen[to] = true;
        let mut queue = VecDeque::from([to]);
        while let Some(n) = queue.pop_front() {
            if n != to && self.is_rank(n) {
                continue;
            }
            for &l in &adj.inc[n] {
                let p = self.links[l as usize].from;
                if !seen[p] {
                    seen[p] = true;
                    next[p] = l;
                    queue.push_back(p);
                }
            }
        }
        let t = Arc::new(next);
        lock(&self.layout.cache.to).insert(to, t.clone());
        t
    }

    /// The link into every node on the tree of routes from `from` (not through ranks).
    fn tree_from(&self, from: usize) -> Arc<Vec<u32>> {
        if let Some(t) = lock(&self.layout.cache.from).get(&from) {
            return t.clone();
        }
        let adj = self.adjacency();
        let mut prev = vec![NONE; self.nodes.len()];
        let mut seen = vec![false; self.nodes.len()];
        seen[from] = true;
        let mut queue = VecDeque::from([from]);
        while let Some(n) = queue.pop_front() {
            if n != from && self.is_rank(n) {
                continue;
            }
            for &l in &adj.out[n] {
                let q = self.links[l as usize].to;
                if !seen[q] {
                    seen[q] = true;
                    prev[q] = l;
                    queue.push_back(q);
                }
            }
        }
        let t = Arc::new(prev);
        lock(&self.layout.cache.from).insert(from, t.clone());
        t
    }

    /// `from` and `to`: nodes of the fabric (checked by [`Fabric::route`]).
    fn general_route(&self, from: usize, to: usize, out: &mut Vec<usize>) -> Result<(), String> {
        // From a switch (a few of them: aggregators) to many ranks: the tree from the switch;
        // everything else: the table towards the destination.
        if !self.is_rank(from) && self.is_rank(to) {
            let prev = self.tree_from(from);
            let start = out.len();
            let mut n = to;
            while n != from {
                let l = prev[n];
                if l == NONE {
                    out.truncate(start);
                    return Err(self.no_route(from, to));
                }
                out.push(l as usize);
                n = self.links[l as usize].from;
            }
            out[start..].reverse();
            return Ok(());
        }
        let next = self.to_table(to);
        let start = out.len();
        let mut n = from;
        while n != to {
            let l = next[n];
            if l == NONE {
                out.truncate(start);
                return Err(self.no_route(from, to));
            }
            out.push(l as usize);
            n = self.links[l as usize].to;
        }
        Ok(())
    }

    /// Whether node `to` can be reached from node `from` (never through a rank); `false`
    /// when either is not a node of the fabric.
    pub fn reaches(&self, from: usize, to: usize) -> bool {
        let n = self.nodes.len();
        from < n && to < n && (from == to || self.to_table(to)[from] != NONE)
    }

    /// The switch a schedule that aggregates in the network
    /// ([`oxccl_core::schedule::Algorithm::Aggregation`]) targets: the first switch (lowest
    /// node index) that can reduce and that every rank reaches and is reached from. `None`
    /// when no switch of the fabric can.
    pub fn aggregator(&self) -> Option<usize> {
        let world = self.world.min(self.nodes.len());
        (world..self.nodes.len()).find(|&n| {
            matches!(
                self.nodes[n].kind,
                NodeKind::Switch {
                    reduce_bytes_per_s: Some(_)
                }
            ) && {
                let to = self.to_table(n);
                let from = self.tree_from(n);
                (0..world).all(|r| to[r] != NONE && from[r] != NONE)
            }
        })
    }

    /// The runtime's view of the fabric, for its tuner: one host per host of the fabric
    /// (names and ranks as in the file), `link_gbps` the host's scale-out rate in Gbit/s (the
    /// sum over its NICs; `None` for a host without any). With `tuner_hosts =
    /// "datacenters"` in the file, one "host" per datacenter, whose rate is the long-haul
    /// link's, so that the two-tier algorithms reduce inside each datacenter first.
    pub fn topology(&self) -> oxccl_core::Topology {
        // The layout's tables describe the fabric as built; one changed since is seen as a
        // fabric built by hand.
        let fits = self.layout_fits();
        if fits && self.layout.tuner_dcs && !self.layout.dc_names.is_empty() {
            let hosts = self
                .layout
                .dc_names
                .iter()
                .enumerate()
                .map(|(d, name)| {
                    let mut ranks: Vec<usize> = self
                        .hosts
                        .iter()
                        .enumerate()
                        .filter(|(h, _)| self.layout.host_dc.get(*h) == Some(&d))
                        .flat_map(|(_, (_, r))| r.iter().copied())
                        .collect();
                    ranks.sort_unstable();
                    oxccl_core::Host {
                        name: name.clone(),
                        ranks,
                        link_gbps: self.layout.wan_gbps,
                    }
                })
                .collect();
            return oxccl_core::Topology {
                hosts,
                aggregator: None,
            };
        }
        let hosts = self
            .hosts
            .iter()
            .enumerate()
            .map(|(h, (name, ranks))| oxccl_core::Host {
                name: name.clone(),
                ranks: ranks.clone(),
                link_gbps: if fits {
                    self.layout.host_gbps.get(h).copied().flatten()
                } else {
                    None
                },
            })
            .collect();
        oxccl_core::Topology {
            hosts,
            aggregator: None,
        }
    }

    /// Checks what the simulator relies on, for a fabric built by hand (a topology file's
    /// fabric passes by construction; [`crate::simulate`] calls this first): the ranks are
    /// nodes `0..world`, each on a host of [`Fabric::hosts`] that lists it; every other node
    /// is a switch; every link joins two nodes and has a finite rate above 0 and a finite
    /// latency of at least 0; reduce rates are above 0 (infinite: free) and per-message
    /// costs finite and at least 0; the hosts are a valid runtime topology; and a
    /// [`Fabric::symmetry`] is an automorphism ([`Fabric::check_symmetry`] of its node
    /// map). Whether two ranks reach each other is found when a route is needed.
    ///
    /// # Errors
    /// The first problem found, naming the node, link, host or field and its value.
    pub fn validate(&self) -> Result<(), String> {
        let (n, world) = (self.nodes.len(), self.world);
        if world > n {
            return Err(format!(
                "world is {world} ranks but the fabric has {n} nodes (ranks are nodes 0..world)"
            ));
        }
        for (i, node) in self.nodes.iter().enumerate() {
            let name = &node.name;
            match node.kind {
                NodeKind::Rank { host } => {
                    if i >= world {
                        return Err(format!(
                            "node {i} ({name}) is a rank, but ranks are nodes 0..{world} (world)"
                        ));
                    }
                    if host >= self.hosts.len() {
                        return Err(format!(
                            "rank {i} ({name}) is on host {host}, but the fabric has {} hosts",
                            self.hosts.len()
                        ));
                    }
                }
                NodeKind::Switch { .. } if i < world => {
                    return Err(format!(
                        "node {i} ({name}) is a switch, but nodes 0..{world} must be ranks"
                    ));
                }
                NodeKind::Switch {
                    reduce_bytes_per_s: Some(r),
                } if r.is_nan() || r <= 0.0 => {
                    return Err(format!(
                        "switch {i} ({name}) reduces at {r} bytes/s: must be above 0"
                    ));
                }
                NodeKind::Switch { .. } => {}
            }
        }
        for (h, (name, ranks)) in self.hosts.iter().enumerate() {
            for &r in ranks {
                let on = match self.nodes.get(r).map(|x| &x.kind) {
                    Some(NodeKind::Rank { host }) if r < world => *host,
                    _ => {
                        return Err(format!(
                            "host {h} ({name:?}) lists rank {r}, outside the world of {world}"
                        ));
                    }
                };
                if on != h {
                    return Err(format!(
                        "host {h} ({name:?}) lists rank {r}, whose node says it is on host {on}"
                    ));
                }
            }
        }
        for (i, l) in self.links.iter().enumerate() {
            let name = &l.name;
            if l.from >= n || l.to >= n {
                return Err(format!(
                    "link {i} ({name}) joins nodes {} and {}, but the fabric has {n} nodes",
                    l.from, l.to
                ));
            }
            if l.from == l.to {
                return Err(format!(
                    "link {i} ({name}) leaves and enters node {}",
                    l.from
                ));
            }
            if !(l.bytes_per_s.is_finite() && l.bytes_per_s > 0.0) {
                return Err(format!(
                    "link {i} ({name}) has a rate of {} bytes/s: must be finite and above 0",
                    l.bytes_per_s
                ));
            }
            if !(l.latency_s.is_finite() && l.latency_s >= 0.0) {
                return Err(format!(
                    "link {i} ({name}) has a latency of {} s: must be finite and at least 0",
                    l.latency_s
                ));
            }
        }
        // (An infinite reduce rate is a reduction that costs nothing.)
        let r = self.reduce_bytes_per_s;
        if r.is_nan() || r <= 0.0 {
            return Err(format!(
                "the fabric's reduce_bytes_per_s is {r}: must be above 0"
            ));
        }
        for (field, v) in [
            ("per_message_s", self.per_message_s),
            ("scaleup_per_message_s", self.scaleup_per_message_s),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!(
                    "the fabric's {field} is {v}: must be finite and at least 0"
                ));
            }
        }
        if !self.hosts.is_empty() {
            self.topology()
                .validate(world)
                .map_err(|e| format!("the fabric's hosts: {e}"))?;
        }
        if let Some(g) = &self.symmetry
            && self.check_symmetry(g.node_map.clone()).as_ref() != Some(g)
        {
            return Err(format!(
                "the fabric's symmetry (a map of {} nodes and {} links; the fabric has {n} \
                 nodes and {} links) is not an automorphism of the fabric: \
                 Fabric::check_symmetry of its node map disagrees",
                g.node_map.len(),
                g.link_map.len(),
                self.links.len()
            ));
        }
        Ok(())
    }

    /// Completes a candidate automorphism given by where each node goes: `None` unless it is
    /// a permutation other than the identity that sends ranks to ranks, hosts to hosts,
    /// switches to switches of the same reduce rate, and every link to a link with the
    /// images of its ends and the same rate and latency.
    pub fn check_symmetry(&self, node_map: Vec<usize>) -> Option<Symmetry> {
        let n = self.nodes.len();
        if node_map.len() != n || node_map.iter().enumerate().all(|(i, &m)| i == m) {
            return None;
        }
        let mut hit = vec![false; n];
        for &m in &node_map {
            if m >= n || std::mem::replace(&mut hit[m], true) {
                return None;
            }
        }
        let mut host_map: Vec<Option<usize>> = vec![None; self.hosts.len()];
        for (i, node) in self.nodes.iter().enumerate() {
            let image = &self.nodes[node_map[i]].kind;
            match (&node.kind, image) {
                (NodeKind::Rank { host: a }, NodeKind::Rank { host: b }) => {
                    // (A host outside `hosts`: a fabric `validate` refuses.)
                    match *host_map.get(*a)? {
                        None if *b < self.hosts.len() => host_map[*a] = Some(*b),
                        Some(x) if x == *b => {}
                        _ => return None,
                    }
                }
                (
                    NodeKind::Switch {
                        reduce_bytes_per_s: a,
                    },
                    NodeKind::Switch {
                        reduce_bytes_per_s: b,
                    },
                ) if a == b => {}
                _ => return None,
            }
        }
        let mut hosts_hit = vec![false; self.hosts.len()];
        for m in host_map.iter().flatten() {
            if std::mem::replace(&mut hosts_hit[*m], true) {
                return None;
            }
        }
        let index: HashMap<(usize, usize), usize> = self
            .links
            .iter()
            .enumerate()
            .map(|(i, l)| ((l.from, l.to), i))
            .collect();
        if index.len() != self.links.len() {
            return None; // parallel links: the map between them would be a guess
        }
        let mut link_map = Vec::with_capacity(self.links.len());
        for l in &self.links {
            let &j = index.get(&(*node_map.get(l.from)?, *node_map.get(l.to)?))?;
            let m = &self.links[j];
            if m.bytes_per_s != l.bytes_per_s || m.latency_s != l.latency_s {
                return None;
            }
            link_map.push(j);
        }
        Some(Symmetry { node_map, link_map })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::has;
    use crate::{Spec, simulate};
    use oxccl_core::schedule::Collective;

    /// Two ranks on hosts of their own, joined through one switch (links `0->2`, `2->0`,
    /// `1->2`, `2->1`).
    fn pair() -> Fabric {
        let mut nodes: Vec<Node> = (0..2)
            .map(|r| Node {
                name: format!("r{r}"),
                kind: NodeKind::Rank { host: r },
            })
            .collect();
        nodes.push(Node {
            name: "sw".into(),
            kind: NodeKind::Switch {
                reduce_bytes_per_s: None,
            },
        });
        let mut links = Vec::new();
        for r in 0..2 {
            for (from, to) in [(r, 2), (2, r)] {
                links.push(Link {
                    name: format!("{from}->{to}"),
                    from,
                    to,
                    bytes_per_s: 1e9,
                    latency_s: 1e-6,
                });
            }
        }
        Fabric {
            nodes,
            links,
            world: 2,
            hosts: vec![("h0".into(), vec![0]), ("h1".into(), vec![1])],
            reduce_bytes_per_s: 1e10,
            per_message_s: 1e-6,
            scaleup_per_message_s: 1e-6,
            symmetry: None,
            layout: Layout::default(),
        }
    }

    /// The error of simulating an all-reduce of 1 Ki f32 on `f` (which must fail).
    fn sim_err(f: &Fabric) -> String {
        let spec = Spec::new(Collective::AllReduce { count: 1024 }, 4);
        match simulate(f, &spec) {
            Ok(r) => panic!("simulated in {} s", r.time_s),
            Err(e) => e,
        }
    }

    #[test]
    fn the_pair_is_valid_and_simulates() {
        let f = pair();
        f.validate().unwrap();
        let spec = Spec::new(Collective::AllReduce { count: 1024 }, 4);
        assert!(simulate(&f, &spec).unwrap().time_s > 0.0);
    }

    #[test]
    fn a_link_to_a_missing_node_is_an_error() {
        let mut f = pair();
        f.links[3].to = 9;
        has(&sim_err(&f), &["link 3 (2->1)", "nodes 2 and 9", "3 nodes"]);
        // The routes' own search skips it rather than index past the nodes.
        let mut out = Vec::new();
        assert!(f.route(0, 1, 0, &mut out).is_err());
        assert!(f.check_symmetry(vec![1, 0, 2]).is_none());
    }

    #[test]
    fn a_rank_on_a_missing_host_is_an_error() {
        let mut f = pair();
        f.nodes[1].kind = NodeKind::Rank { host: 5 };
        has(&sim_err(&f), &["rank 1 (r1)", "host 5", "2 hosts"]);
        assert!(f.check_symmetry(vec![1, 0, 2]).is_none());
    }

    #[test]
    fn bad_rates_and_latencies_are_errors() {
        let mut f = pair();
        f.links[1].bytes_per_s = 0.0;
        has(&sim_err(&f), &["link 1 (2->0)", "rate of 0 bytes/s"]);
        let mut f = pair();
        f.links[2].latency_s = f64::NAN;
        has(&sim_err(&f), &["link 2 (1->2)", "latency of NaN"]);
        let mut f = pair();
        f.reduce_bytes_per_s = -1.0;
        has(&sim_err(&f), &["reduce_bytes_per_s is -1"]);
        let mut f = pair();
        f.per_message_s = f64::INFINITY;
        has(&sim_err(&f), &["per_message_s is inf"]);
    }

    #[test]
    fn a_world_larger_than_the_nodes_is_an_error() {
        let mut f = pair();
        f.world = 7;
        has(&sim_err(&f), &["world is 7 ranks", "3 nodes"]);
        let mut f = pair();
        f.hosts[1].1.push(2);
        has(
            &sim_err(&f),
            &["host 1 (\"h1\") lists rank 2", "world of 2"],
        );
    }

    #[test]
    fn ranks_that_cannot_reach_each_other_are_an_error() {
        let mut f = pair();
        f.links.truncate(3); // no way back down to rank 1
        let e = sim_err(&f);
        has(&e, &["no route", "node 0 (r0)", "node 1 (r1)"]);
        let mut out = vec![7];
        let e = f.route(0, 1, 0, &mut out).unwrap_err();
        has(&e, &["node 0 (r0) to node 1 (r1)"]);
        assert_eq!(out, [7], "a failed route leaves `out` as it was");
        let e = f.route(0, 3, 0, &mut out).unwrap_err();
        has(&e, &["node 3", "3 nodes"]);
        assert!(!f.reaches(0, 3));
        assert!(!f.reaches(0, 1));
    }

    #[test]
    fn a_symmetry_that_is_not_one_is_an_error() {
        let mut f = pair();
        let g = f.check_symmetry(vec![1, 0, 2]).expect("swapping the ranks");
        f.symmetry = Some(Symmetry {
            node_map: g.node_map.clone(),
            link_map: g.link_map[..2].to_vec(),
        });
        has(&sim_err(&f), &["symmetry", "2 links", "4 links"]);
        f.symmetry = Some(Symmetry {
            node_map: vec![1, 0, 2],
            link_map: vec![0, 1, 2, 3],
        });
        has(&sim_err(&f), &["not an automorphism"]);
        f.symmetry = Some(g);
        f.validate().unwrap();
    }

    /// The run's public helpers take any fabric: on one that `validate` refuses they
    /// answer without indexing past its nodes or hosts.
    #[test]
    fn the_public_helpers_tolerate_a_bad_fabric() {
        use crate::run::{host_link_gbps, protocol_config, tuning};
        let spec = Spec::new(Collective::AllReduce { count: 1024 }, 4);
        let mut f = pair();
        f.links[0].to = 40;
        f.links[3].from = 41;
        f.nodes[1].kind = NodeKind::Rank { host: 9 };
        assert_eq!(host_link_gbps(&f), [None, None]);
        let _ = tuning(&f, &spec);
        let good = pair();
        assert_eq!(host_link_gbps(&good), [Some(8.0), Some(8.0)]);
        let cfg = protocol_config(&tuning(&good, &spec), 0);
        assert!(cfg.fragments(1 << 20) >= 1);
        // The compressed all-reduce divides by the world: none is an error.
        let mut empty = pair();
        empty.world = 0;
        let fmt = oxccl_core::compress::Format::BFP8;
        let e = crate::simulate_compressed(&empty, &spec, fmt, &Default::default(), 1 << 20);
        has(&e.unwrap_err(), &["no rank"]);
    }

    #[test]
    fn a_parsed_fabric_changed_afterwards_routes_without_its_tables() {
        let text = "link_gbps = 1\n[[hosts]]\nname = \"a\"\nranks = 2\n\
                    [[hosts]]\nname = \"b\"\nranks = 2\n";
        let mut f = Fabric::parse(text).unwrap();
        let before = f.nodes.len();
        // A fifth rank (node 4 was a's switch: the switches move up by one).
        f.nodes.insert(
            4,
            Node {
                name: "r4".into(),
                kind: NodeKind::Rank { host: 1 },
            },
        );
        for l in &mut f.links {
            l.from += usize::from(l.from >= 4);
            l.to += usize::from(l.to >= 4);
        }
        f.links.push(Link {
            name: "r4->b.sw".into(),
            from: 4,
            to: before,
            bytes_per_s: 1e9,
            latency_s: 0.0,
        });
        f.world = 5;
        f.hosts[1].1.push(4);
        f.symmetry = None;
        // The star's tables know four ranks; rank 4 is routed by the general search, and
        // has no way in: an error, not an index past the tables.
        let mut out = Vec::new();
        f.route(4, 0, 0, &mut out)
            .expect("r4 -> b.sw -> core -> a.sw -> r0");
        has(&f.route(0, 4, 0, &mut out).unwrap_err(), &["node 4 (r4)"]);
        has(&sim_err(&f), &["no route", "(r4)"]);
        let _ = f.topology();
    }
}
