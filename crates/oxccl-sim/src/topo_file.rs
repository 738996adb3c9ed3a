//! Topology files for the simulator: the runtime's `OXCCL_TOPO_FILE` format
//! ([`oxccl_core::topology`]), extended with optional fields. A runtime topology file is a valid
//! simulator file (a star of hosts); a `[cluster]` table generates a two-tier GPU cluster in a
//! few lines instead. JSON (first non-blank character `{`) or TOML, the same fields; unknown
//! fields are refused, and every bad value is an error naming the field and the value.
//!
//! Units are in the field names: `_gbps` is Gbit/s (network links, as the runtime's
//! `link_gbps`), `_gbytes_per_s` is GB/s (10^9 bytes/s: scale-up links, reduce rates), `_us`
//! microseconds, `_km` kilometres.
//!
//! ## A star of hosts (the test bed; any runtime file)
//! ```toml
//! [[hosts]]
//! name = "h0"
//! ranks = [0, 1]          # or a count: `ranks = 2` (the next ranks in order)
//! link_gbps = 1.0         # the host's link into the central switch, per direction
//! # scaleup_gbytes_per_s = 11      # ranks <-> the host's own switch (default: top level's)
//! # switch_reduce_gbytes_per_s = 3000   # the host switch aggregates (in-switch reduction)
//! # dc = 0                          # its datacenter (see [wan])
//! # link_efficiency = 0.93          # payload share of link_gbps (default: top level's, 1)
//!
//! [[hosts]]
//! name = "h1"
//! ranks = [2, 3]
//! link_gbps = 0.25
//! ```
//! Every rank has a link up to and down from its host's switch at the scale-up rate; every
//! host switch a link up to and down from its datacenter's core switch at `link_gbps`.
//!
//! ## A two-tier cluster (generator)
//! ```toml
//! [cluster]
//! hosts = 2048            # hosts of...
//! gpus_per_host = 8       # ...G ranks on a scale-up switch (rank = host * G + local index)
//! nic_gbps = 400          # one NIC per rank into the leaf of its rail (default 400)
//! hosts_per_leaf = 32     # a leaf group: the hosts one leaf per rail serves (default 32)
//! oversubscription = 1.0  # a leaf's down capacity over its up capacity (default 1)
//! # spines = 32           # spines per datacenter (default hosts_per_leaf / oversubscription)
//! # rail_nic_gbps = [400, 400, 400, 400, 400, 400, 400, 200]   # per rail
//! # nic_overrides = [{hosts = "0-63", gbps = 200}, {hosts = "7", rails = [3], gbps = 100}]
//! # scaleup_reduce_gbytes_per_s = 3000   # scale-up switches aggregate (NVLS-class)
//! # spine_reduce_gbytes_per_s = 1000     # spines aggregate (SHARP-class)
//! scaleup_gbytes_per_s = 900  # top level: per rank and direction (default 900 for a cluster)
//! ```
//! Each leaf has `hosts_per_leaf` NIC links down and one link up to and down from each
//! spine of its datacenter, the up links together carrying `hosts_per_leaf * rate /
//! oversubscription` (`rate`: its rail's NIC rate).
//!
//! ## Several datacenters
//! ```toml
//! [wan]
//! datacenters = 2         # a cluster's hosts are split evenly, in order; a star's hosts say `dc`
//! distance_km = 1000      # one-way latency 5 us per km (5 ms per 1,000 km), plus link_latency_us
//! link_gbps = 3200        # long-haul capacity between every pair of datacenters, per direction
//! ```
//! A cluster's spines of a datacenter meet at its router (links as fast as all the
//! datacenter's leaf uplinks together); a star's cores are joined directly.
//!
//! ## Top-level fields (all optional)
//! | field | meaning | star default | cluster default |
//! |---|---|---|---|
//! | `reduce_gbytes_per_s` | a rank's reduce rate | 20 | 2000 |
//! | `per_message_us` | fixed cost per message at its sender | 5 | 2 |
//! | `scaleup_per_message_us` | the same for a message inside a host (shm; measured here: an 8-byte all-reduce of 2 ranks takes 0.4 µs) | 0.5 | 2 |
//! | `scaleup_gbytes_per_s` | rank <-> host switch, per direction | 11 | 900 |
//! | `scaleup_latency_us` | latency of a scale-up hop | 1 | 0.5 |
//! | `link_latency_us` | latency of a network hop (each link of a route) | 10 | 1 |
//! | `link_gbps` | a star host's rate when it gives none | none | - |
//! | `core_reduce_gbytes_per_s` | a star's core switches aggregate | none | - |
//! | `link_efficiency` | the share of a network link's nominal rate its payload gets (a star's host links, a cluster's NICs; a star host may override it); the runtime's tuner still sees the nominal rates | 1 | 1 |
//! | `tuner_hosts` | `"hosts"`, or `"datacenters"`: the runtime's tuner sees one host per datacenter, so two-tier algorithms reduce inside each datacenter first | hosts | hosts |
//!
//! The star defaults describe the test bed (this machine): 11 GB/s is a single thread's
//! memcpy rate for large buffers, 20 GB/s a reduction working in cache-sized slices;
//! `bench/sim-validate.sh` measures the link rates and the per-message cost instead.

use std::path::Path;

use serde::Deserialize;

use crate::fabric::{Cluster, Layout, Shape, Star};
use crate::{Fabric, Link, Node, NodeKind};

/// One-way latency of a long-haul link per kilometre (5 ms per 1,000 km).
pub const WAN_S_PER_KM: f64 = 5e-6;

/// The most ranks a topology file may describe (64 times the largest example's 16,384): a
/// larger job is refused with an error, not attempted until memory runs out.
pub const MAX_RANKS: usize = 1 << 20;
/// The most links a topology file's fabric may have (each a few dozen bytes).
pub const MAX_LINKS: usize = 1 << 23;

/// Refuses a fabric of more than [`MAX_LINKS`] links (`None`: more than `usize` counts).
fn check_links(what: &str, links: Option<usize>) -> Result<(), String> {
    match links {
        Some(l) if l <= MAX_LINKS => Ok(()),
        Some(l) => Err(format!(
            "{what} would have {l} links, more than the simulator's limit of {MAX_LINKS}"
        )),
        None => Err(format!(
            "{what} would have more links than can be counted (the limit is {MAX_LINKS})"
        )),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    hosts: Option<Vec<HostSpec>>,
    /// The runtime's aggregation service address: accepted (a runtime file is a simulator
    /// file); the simulator's aggregation is `core_reduce_gbytes_per_s`.
    #[allow(dead_code)]
    aggregator: Option<String>,
    cluster: Option<ClusterSpec>,
    wan: Option<WanSpec>,
    reduce_gbytes_per_s: Option<f64>,
    per_message_us: Option<f64>,
    scaleup_per_message_us: Option<f64>,
    scaleup_gbytes_per_s: Option<f64>,
    scaleup_latency_us: Option<f64>,
    link_latency_us: Option<f64>,
    link_gbps: Option<f64>,
    core_reduce_gbytes_per_s: Option<f64>,
    tuner_hosts: Option<String>,
    link_efficiency: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Ranks {
    List(Vec<usize>),
    Count(usize),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HostSpec {
    name: String,
    ranks: Ranks,
    link_gbps: Option<f64>,
    dc: Option<usize>,
    scaleup_gbytes_per_s: Option<f64>,
    switch_reduce_gbytes_per_s: Option<f64>,
    link_efficiency: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterSpec {
    hosts: usize,
    gpus_per_host: usize,
    nic_gbps: Option<f64>,
    hosts_per_leaf: Option<usize>,
    oversubscription: Option<f64>,
    spines: Option<usize>,
    rail_nic_gbps: Option<Vec<f64>>,
    nic_overrides: Option<Vec<NicOverride>>,
    scaleup_reduce_gbytes_per_s: Option<f64>,
    spine_reduce_gbytes_per_s: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NicOverride {
    hosts: String,
    rails: Option<Vec<usize>>,
    gbps: f64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WanSpec {
    datacenters: Option<usize>,
    distance_km: f64,
    link_gbps: f64,
}

/// `Some(v)` checked finite and above 0 (or at least 0 with `zero_ok`).
fn check(field: &str, v: Option<f64>, zero_ok: bool) -> Result<Option<f64>, String> {
    match v {
        Some(x) if !(x.is_finite() && (x > 0.0 || zero_ok && x == 0.0)) => Err(format!(
            "{field} must be a finite number {}, not {x}",
            if zero_ok { "of at least 0" } else { "above 0" }
        )),
        v => Ok(v),
    }
}

/// `Some(e)` checked in (0, 1].
fn efficiency(field: &str, v: Option<f64>) -> Result<Option<f64>, String> {
    match v {
        Some(x) if !(x.is_finite() && x > 0.0 && x <= 1.0) => Err(format!(
            "{field} must be a share of the nominal rate, above 0 and at most 1, not {x}"
        )),
        v => Ok(v),
    }
}

/// Parses `0-63,128` into host indices below `hosts`.
fn parse_hosts(field: &str, s: &str, hosts: usize) -> Result<Vec<usize>, String> {
    let bad = || format!("{field} must be host indices like \"0-63,128\", not {s:?}");
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let a: usize = a.parse().map_err(|_| bad())?;
        let b: usize = b.parse().map_err(|_| bad())?;
        if a > b {
            return Err(bad());
        }
        if b >= hosts {
            return Err(format!(
                "{field}: host {b} is outside the cluster's {hosts} hosts (0-{})",
                hosts - 1
            ));
        }
        out.extend(a..=b);
    }
    Ok(out)
}

struct Builder {
    nodes: Vec<Node>,
    links: Vec<Link>,
}

impl Builder {
    fn node(&mut self, name: String, kind: NodeKind) -> usize {
        self.nodes.push(Node { name, kind });
        self.nodes.len() - 1
    }

    fn switch(&mut self, name: String, reduce_gbytes: Option<f64>) -> usize {
        self.node(
            name,
            NodeKind::Switch {
                reduce_bytes_per_s: reduce_gbytes.map(|g| g * 1e9),
            },
        )
    }

    fn link(&mut self, from: usize, to: usize, bytes_per_s: f64, latency_s: f64) -> u32 {
        self.links.push(Link {
            name: format!("{}->{}", self.nodes[from].name, self.nodes[to].name),
            from,
            to,
            bytes_per_s,
            latency_s,
        });
        (self.links.len() - 1) as u32
    }

    /// Long-haul links between every ordered pair of `ends` (one per datacenter): the
    /// table `[a * n + z]` of the link from `a` to `z` (`u32::MAX` where `a == z`).
    fn wan_mesh(&mut self, ends: &[usize], w: &WanSpec, link_lat: f64) -> Vec<u32> {
        let n = ends.len();
        let mut table = vec![u32::MAX; n * n];
        for a in 0..n {
            for z in (0..n).filter(|&z| z != a) {
                table[a * n + z] = self.link(
                    ends[a],
                    ends[z],
                    w.link_gbps * 1e9 / 8.0,
                    link_lat + w.distance_km * WAN_S_PER_KM,
                );
            }
        }
        table
    }

    fn duplex(&mut self, a: usize, b: usize, bytes_per_s: f64, latency_s: f64) -> (u32, u32) {
        (
            self.link(a, b, bytes_per_s, latency_s),
            self.link(b, a, bytes_per_s, latency_s),
        )
    }
}

impl Fabric {
    /// Parses a topology file (JSON or TOML; the format is in [`crate::topo_file`]) and builds
    /// its fabric.
    ///
    /// # Errors
    /// Text that is not the format, and every bad value: each error names the field (the
    /// host, the rank, the link) and the value.
    pub fn parse(text: &str) -> Result<Fabric, String> {
        let file: File = if text.trim_start().starts_with('{') {
            serde_json::from_str(text).map_err(|e| format!("invalid topology JSON: {e}"))?
        } else {
            toml::from_str(text)
                .map_err(|e| format!("invalid topology TOML: {}", e.to_string().trim_end()))?
        };
        let fabric = build(file)?;
        // What the builders can't see field by field: a rate that overflows once converted
        // to bytes per second (`link_gbps = 1e300`), and so on.
        fabric.validate()?;
        Ok(fabric)
    }

    /// Reads a topology file and builds its fabric ([`Fabric::parse`]); errors name the file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Fabric, String> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read topology file {}: {e}", path.display()))?;
        Fabric::parse(&text).map_err(|e| format!("topology file {}: {e}", path.display()))
    }
}

struct Common {
    reduce: f64,
    per_message: f64,
    scaleup_per_message: f64,
    scaleup: f64,
    scaleup_lat: f64,
    link_lat: f64,
    tuner_dcs: bool,
    efficiency: f64,
}

fn common(f: &File, cluster: bool) -> Result<Common, String> {
    let d = |star: f64, cl: f64| if cluster { cl } else { star };
    let tuner_dcs = match f.tuner_hosts.as_deref() {
        None | Some("hosts") => false,
        Some("datacenters") => true,
        Some(other) => {
            return Err(format!(
                "tuner_hosts must be \"hosts\" or \"datacenters\", not {other:?}"
            ));
        }
    };
    Ok(Common {
        reduce: check("reduce_gbytes_per_s", f.reduce_gbytes_per_s, false)?
            .unwrap_or(d(20.0, 2000.0))
            * 1e9,
        per_message: check("per_message_us", f.per_message_us, true)?.unwrap_or(d(5.0, 2.0)) * 1e-6,
        scaleup_per_message: check("scaleup_per_message_us", f.scaleup_per_message_us, true)?
            .unwrap_or(d(0.5, 2.0))
            * 1e-6,
        scaleup: check("scaleup_gbytes_per_s", f.scaleup_gbytes_per_s, false)?
            .unwrap_or(d(11.0, 900.0))
            * 1e9,
        scaleup_lat: check("scaleup_latency_us", f.scaleup_latency_us, true)?
            .unwrap_or(d(1.0, 0.5))
            * 1e-6,
        link_lat: check("link_latency_us", f.link_latency_us, true)?.unwrap_or(d(10.0, 1.0)) * 1e-6,
        tuner_dcs,
        efficiency: efficiency("link_efficiency", f.link_efficiency)?.unwrap_or(1.0),
    })
}

fn wan(f: &File) -> Result<Option<&WanSpec>, String> {
    if let Some(w) = &f.wan {
        check("wan.distance_km", Some(w.distance_km), true)?;
        check("wan.link_gbps", Some(w.link_gbps), false)?;
        if w.datacenters == Some(0) {
            return Err("wan.datacenters must be at least 1, not 0".into());
        }
    }
    Ok(f.wan.as_ref())
}

fn build(f: File) -> Result<Fabric, String> {
    check("link_gbps", f.link_gbps, false)?;
    check(
        "core_reduce_gbytes_per_s",
        f.core_reduce_gbytes_per_s,
        false,
    )?;
    match (&f.hosts, &f.cluster) {
        (Some(_), Some(_)) => {
            Err("give either hosts (a list) or cluster (a generator), not both".into())
        }
        (None, None) => Err("the file has neither hosts nor cluster".into()),
        (Some(specs), None) => build_star(&f, specs),
        (None, Some(cs)) => {
            if f.link_gbps.is_some() || f.core_reduce_gbytes_per_s.is_some() {
                return Err("link_gbps and core_reduce_gbytes_per_s describe a star of hosts; a cluster has nic_gbps and spine_reduce_gbytes_per_s".into());
            }
            build_cluster(&f, cs)
        }
    }
}

fn build_star(f: &File, specs: &[HostSpec]) -> Result<Fabric, String> {
    let c = common(f, false)?;
    let wan = wan(f)?;
    let (topo, world) = star_topology(f, specs)?;
    let (dcs, host_dc) = star_datacenters(wan, specs)?;
    let hosts_n = specs.len();
    let core = hosts_n > 1 || dcs > 1;
    // Ranks up and down, host switches up and down, the long-haul mesh.
    let links = (world + hosts_n)
        .checked_mul(2)
        .zip(dcs.checked_mul(dcs - 1))
        .and_then(|(a, b)| a.checked_add(b));
    check_links(
        &format!("a star of {hosts_n} hosts, {world} ranks and {dcs} datacenters"),
        links,
    )?;
    let mut b = Builder {
        nodes: Vec::new(),
        links: Vec::new(),
    };
    let mut host_of = vec![0u32; world];
    for (h, host) in topo.hosts.iter().enumerate() {
        for &r in &host.ranks {
            host_of[r] = h as u32;
        }
    }
    for (r, &h) in host_of.iter().enumerate() {
        b.node(
            format!("{}.r{r}", topo.hosts[h as usize].name),
            NodeKind::Rank { host: h as usize },
        );
    }
    let sw: Vec<usize> = specs
        .iter()
        .map(|s| b.switch(format!("{}.sw", s.name), s.switch_reduce_gbytes_per_s))
        .collect();
    let cores: Vec<usize> = if core {
        (0..dcs)
            .map(|d| {
                let name = if dcs > 1 {
                    format!("dc{d}.core")
                } else {
                    "core".into()
                };
                b.switch(name, f.core_reduce_gbytes_per_s)
            })
            .collect()
    } else {
        Vec::new()
    };
    let (mut up, mut down) = (vec![0u32; world], vec![0u32; world]);
    for r in 0..world {
        let h = host_of[r] as usize;
        let rate = specs[h].scaleup_gbytes_per_s.map_or(c.scaleup, |g| g * 1e9);
        (up[r], down[r]) = b.duplex(r, sw[h], rate, c.scaleup_lat);
    }
    let (mut h_up, mut h_down) = (vec![u32::MAX; hosts_n], vec![u32::MAX; hosts_n]);
    let mut host_gbps = vec![None; hosts_n];
    if core {
        for h in 0..hosts_n {
            let Some(gbps) = topo.hosts[h].link_gbps else {
                return Err(format!(
                    "hosts[{h}] ({:?}) has no link_gbps (nor is there a top-level link_gbps): \
                     the simulator needs every host's rate",
                    specs[h].name
                ));
            };
            host_gbps[h] = Some(gbps);
            let eff = specs[h].link_efficiency.unwrap_or(c.efficiency);
            (h_up[h], h_down[h]) =
                b.duplex(sw[h], cores[host_dc[h]], gbps * eff * 1e9 / 8.0, c.link_lat);
        }
    }
    let wan_links = match wan.filter(|_| dcs > 1) {
        Some(w) => b.wan_mesh(&cores[..dcs], w, c.link_lat),
        None => vec![u32::MAX; dcs * dcs],
    };
    let mut fabric = Fabric {
        nodes: b.nodes,
        links: b.links,
        world,
        hosts: topo
            .hosts
            .iter()
            .map(|h| (h.name.clone(), h.ranks.clone()))
            .collect(),
        reduce_bytes_per_s: c.reduce,
        per_message_s: c.per_message,
        scaleup_per_message_s: c.scaleup_per_message,
        symmetry: None,
        layout: Layout {
            shape: Shape::Star(Star {
                host_of,
                up,
                down,
                h_up,
                h_down,
                dcs,
                wan: wan_links,
            }),
            host_gbps,
            host_dc: host_dc.clone(),
            tuner_dcs: c.tuner_dcs,
            wan_gbps: wan.map(|w| w.link_gbps),
            dc_names: (0..dcs).map(|d| format!("dc{d}")).collect(),
            ..Layout::default()
        },
    };
    fabric.layout.built_for = fabric.dims();
    let map = star_symmetry(&fabric, &host_dc, dcs, &cores, &sw);
    fabric.symmetry = fabric.check_symmetry(map);
    Ok(fabric)
}

/// A star's hosts as the runtime sees them, after the runtime's checks (every rank once, names
/// unique, rates valid), and the job's world: its ranks are 0..=the highest listed (a gap is
/// a rank on no host).
fn star_topology(f: &File, specs: &[HostSpec]) -> Result<(oxccl_core::Topology, usize), String> {
    let mut next: usize = 0;
    let mut topo = oxccl_core::Topology {
        hosts: Vec::new(),
        aggregator: None,
    };
    for (h, s) in specs.iter().enumerate() {
        let name = format!("hosts[{h}] ({:?})", s.name);
        let ranks = match &s.ranks {
            Ranks::List(r) => {
                if let Some(&big) = r.iter().find(|&&x| x >= MAX_RANKS) {
                    return Err(format!(
                        "{name}.ranks lists rank {big}; the simulator's limit is {MAX_RANKS} \
                         ranks (0-{})",
                        MAX_RANKS - 1
                    ));
                }
                r.clone()
            }
            Ranks::Count(k) => match next.checked_add(*k) {
                Some(end) if end <= MAX_RANKS => (next..end).collect(),
                _ => {
                    return Err(format!(
                        "{name}.ranks = {k} after {next} ranks: more than the simulator's \
                         limit of {MAX_RANKS} ranks"
                    ));
                }
            },
        };
        next = next.max(ranks.iter().map(|r| r + 1).max().unwrap_or(0));
        check(&format!("{name}.link_gbps"), s.link_gbps, false)?;
        check(
            &format!("{name}.scaleup_gbytes_per_s"),
            s.scaleup_gbytes_per_s,
            false,
        )?;
        check(
            &format!("{name}.switch_reduce_gbytes_per_s"),
            s.switch_reduce_gbytes_per_s,
            false,
        )?;
        efficiency(&format!("{name}.link_efficiency"), s.link_efficiency)?;
        topo.hosts.push(oxccl_core::Host {
            name: s.name.clone(),
            ranks,
            link_gbps: s.link_gbps.or(f.link_gbps),
        });
    }
    let world = next;
    topo.validate(world)?;
    Ok((topo, world))
}

/// How many datacenters a star spans, and each host's.
fn star_datacenters(
    wan: Option<&WanSpec>,
    specs: &[HostSpec],
) -> Result<(usize, Vec<usize>), String> {
    let dcs = match wan.and_then(|w| w.datacenters) {
        Some(d) => d,
        // (A `dc` of `usize::MAX` stays there, and fails the check below.)
        None => specs
            .iter()
            .filter_map(|s| s.dc)
            .max()
            .map_or(1, |d| d.saturating_add(1)),
    };
    if dcs > 1 && wan.is_none() {
        return Err(format!(
            "hosts are in {dcs} datacenters (dc) but there is no [wan] to join them"
        ));
    }
    let host_dc: Vec<usize> = specs.iter().map(|s| s.dc.unwrap_or(0)).collect();
    for (h, &d) in host_dc.iter().enumerate() {
        if d >= dcs {
            return Err(format!(
                "hosts[{h}] ({:?}).dc must be below wan.datacenters = {dcs}, not {d}",
                specs[h].name
            ));
        }
    }
    Ok((dcs, host_dc))
}

/// A star's candidate symmetry as a node map (empty: none): hosts shift by one (inside one
/// datacenter), by one datacenter, or, for a single host, its ranks shift by one.
/// [`Fabric::check_symmetry`] decides.
fn star_symmetry(
    fabric: &Fabric,
    host_dc: &[usize],
    dcs: usize,
    cores: &[usize],
    sw: &[usize],
) -> Vec<usize> {
    let hosts_n = fabric.hosts.len();
    let n = fabric.nodes.len();
    let mut map: Vec<usize> = (0..n).collect();
    let ranks_of = |h: usize| &fabric.hosts[h].1;
    let sigma: Option<Vec<usize>> = if hosts_n == 1 {
        let rs = ranks_of(0);
        for (i, &r) in rs.iter().enumerate() {
            map[r] = rs[(i + 1) % rs.len()];
        }
        None
    } else if dcs == 1 {
        Some((0..hosts_n).map(|h| (h + 1) % hosts_n).collect())
    } else {
        let per: Vec<Vec<usize>> = (0..dcs)
            .map(|d| (0..hosts_n).filter(|&h| host_dc[h] == d).collect())
            .collect();
        if per.iter().all(|p| p.len() == per[0].len()) {
            let mut s = vec![0; hosts_n];
            for d in 0..dcs {
                for (j, &h) in per[d].iter().enumerate() {
                    s[h] = per[(d + 1) % dcs][j];
                }
            }
            for d in 0..dcs {
                map[cores[d]] = cores[(d + 1) % dcs];
            }
            Some(s)
        } else {
            map.clear();
            None
        }
    };
    if let Some(s) = sigma {
        for h in 0..hosts_n {
            let (a, z) = (ranks_of(h), ranks_of(s[h]));
            if a.len() != z.len() {
                map.clear();
                break;
            }
            for (i, &r) in a.iter().enumerate() {
                map[r] = z[i];
            }
            map[sw[h]] = sw[s[h]];
        }
    }
    map
}

/// Each rail's NIC rate, and each rank's (`rail_nic_gbps`, then `nic_overrides`), in Gbit/s.
fn nic_rates(cs: &ClusterSpec, nic: f64) -> Result<(Vec<f64>, Vec<f64>), String> {
    let (hn, g) = (cs.hosts, cs.gpus_per_host);
    let world = hn * g;
    let mut rail = vec![nic; g];
    if let Some(r) = &cs.rail_nic_gbps {
        if r.len() != g {
            return Err(format!(
                "cluster.rail_nic_gbps has {} rates; gpus_per_host is {g} (one rate per rail)",
                r.len()
            ));
        }
        for (i, &x) in r.iter().enumerate() {
            check(&format!("cluster.rail_nic_gbps[{i}]"), Some(x), false)?;
        }
        rail.clone_from(r);
    }
    let mut rate: Vec<f64> = (0..world).map(|r| rail[r % g]).collect();
    for (k, o) in cs.nic_overrides.iter().flatten().enumerate() {
        let field = format!("cluster.nic_overrides[{k}]");
        check(&format!("{field}.gbps"), Some(o.gbps), false)?;
        let hosts = parse_hosts(&format!("{field}.hosts"), &o.hosts, hn)?;
        let rails: Vec<usize> = match &o.rails {
            Some(rs) => {
                if let Some(&bad) = rs.iter().find(|&&x| x >= g) {
                    return Err(format!(
                        "{field}.rails: rail {bad} is outside gpus_per_host {g} (0-{})",
                        g - 1
                    ));
                }
                rs.clone()
            }
            None => (0..g).collect(),
        };
        for h in hosts {
            for &i in &rails {
                rate[h * g + i] = o.gbps;
            }
        }
    }
    Ok((rail, rate))
}

/// The cluster's symmetry generator as a node map (identity where it has none): hosts shift
/// by a datacenter, or by a leaf group, or (one host) its ranks by one.
fn cluster_symmetry(
    n: usize,
    cl: &Cluster,
    hn: usize,
    su: &[usize],
    leaves: &[usize],
    spine_nodes: &[usize],
    routers: &[usize],
) -> Vec<usize> {
    let (g, hpd, hpl, gpd, dcs, spines) =
        (cl.g, cl.hosts_per_dc, cl.hpl, cl.gpd, cl.dcs, cl.spines);
    let world = hn * g;
    let n_leaves = leaves.len();
    let mut map: Vec<usize> = (0..n).collect();
    let host_shift = |map: &mut [usize], by: usize| {
        for (r, m) in map.iter_mut().take(world).enumerate() {
            *m = (r + by * g) % world;
        }
        for h in 0..hn {
            map[su[h]] = su[(h + by) % hn];
        }
    };
    if dcs > 1 {
        host_shift(&mut map, hpd);
        for l in 0..n_leaves {
            map[leaves[l]] = leaves[(l + gpd * g) % n_leaves];
        }
        for k in 0..dcs * spines {
            map[spine_nodes[k]] = spine_nodes[(k + spines) % (dcs * spines)];
        }
        for d in 0..dcs {
            map[routers[d]] = routers[(d + 1) % dcs];
        }
    } else if gpd > 1 {
        if hpd.is_multiple_of(hpl) {
            host_shift(&mut map, hpl);
            for l in 0..n_leaves {
                map[leaves[l]] = leaves[(l + g) % n_leaves];
            }
        }
    } else if hn == 1 {
        // One host: its ranks (and their rails' leaves) shift by one.
        for (r, m) in map.iter_mut().take(world).enumerate() {
            *m = (r + 1) % world;
        }
        for l in 0..n_leaves {
            map[leaves[l]] = leaves[(l + 1) % n_leaves];
        }
    }
    map
}

fn build_cluster(f: &File, cs: &ClusterSpec) -> Result<Fabric, String> {
    let c = common(f, true)?;
    let wan = wan(f)?;
    let (cl, nic, over) = cluster_shape(cs, wan)?;
    let (hn, hpd, dcs) = (cs.hosts, cl.hosts_per_dc, cl.dcs);
    let world = hn * cl.g;
    let (rail, rate) = nic_rates(cs, nic)?;
    let mut b = Builder {
        nodes: Vec::with_capacity(world + hn + dcs * cl.gpd * cl.g + dcs * (cl.spines + 1)),
        links: Vec::new(),
    };
    let nodes = cluster_nodes(&mut b, cs, &cl);
    let (cl, host_gbps) = cluster_links(&mut b, cl, hn, &nodes, &c, (&rail, &rate, over), wan);
    // The symmetry's generator (the ECMP hash commutes with it: see crate::fabric).
    let map = cluster_symmetry(
        b.nodes.len(),
        &cl,
        hn,
        &nodes.su,
        &nodes.leaves,
        &nodes.spines,
        &nodes.routers,
    );
    // (One leaf group of several hosts: moving hosts would change their places in it, which
    // spread the routes over the spines. No symmetry: at most hosts_per_leaf hosts.)
    let g = cl.g;
    let mut fabric = Fabric {
        nodes: b.nodes,
        links: b.links,
        world,
        hosts: (0..hn)
            .map(|h| (format!("h{h}"), (h * g..(h + 1) * g).collect()))
            .collect(),
        reduce_bytes_per_s: c.reduce,
        per_message_s: c.per_message,
        scaleup_per_message_s: c.scaleup_per_message,
        symmetry: None,
        layout: Layout {
            shape: Shape::Cluster(cl),
            host_gbps,
            host_dc: (0..hn).map(|h| h / hpd).collect(),
            tuner_dcs: c.tuner_dcs,
            wan_gbps: wan.map(|w| w.link_gbps),
            dc_names: (0..dcs).map(|d| format!("dc{d}")).collect(),
            ..Layout::default()
        },
    };
    fabric.layout.built_for = fabric.dims();
    fabric.symmetry = fabric.check_symmetry(map);
    Ok(fabric)
}

/// A cluster's dimensions, checked (its link tables still empty), its NIC rate (Gbit/s) and
/// its oversubscription.
fn cluster_shape(cs: &ClusterSpec, wan: Option<&WanSpec>) -> Result<(Cluster, f64, f64), String> {
    let (hn, g) = (cs.hosts, cs.gpus_per_host);
    if hn == 0 {
        return Err("cluster.hosts must be at least 1, not 0".into());
    }
    if g == 0 {
        return Err("cluster.gpus_per_host must be at least 1, not 0".into());
    }
    match hn.checked_mul(g) {
        Some(world) if world <= MAX_RANKS => {}
        _ => {
            return Err(format!(
                "cluster.hosts ({hn}) times cluster.gpus_per_host ({g}) is more than the \
                 simulator's limit of {MAX_RANKS} ranks"
            ));
        }
    }
    let nic = check("cluster.nic_gbps", cs.nic_gbps, false)?.unwrap_or(400.0);
    let over = check("cluster.oversubscription", cs.oversubscription, false)?.unwrap_or(1.0);
    check(
        "cluster.scaleup_reduce_gbytes_per_s",
        cs.scaleup_reduce_gbytes_per_s,
        false,
    )?;
    check(
        "cluster.spine_reduce_gbytes_per_s",
        cs.spine_reduce_gbytes_per_s,
        false,
    )?;
    let dcs = match wan {
        Some(w) => w.datacenters.unwrap_or(1),
        None => 1,
    };
    if !hn.is_multiple_of(dcs) {
        return Err(format!(
            "cluster.hosts ({hn}) must split evenly into wan.datacenters ({dcs})"
        ));
    }
    let hpd = hn / dcs;
    let hpl = match cs.hosts_per_leaf {
        Some(0) => return Err("cluster.hosts_per_leaf must be at least 1, not 0".into()),
        Some(k) => k.min(hpd),
        None => 32.min(hpd),
    };
    let gpd = hpd.div_ceil(hpl);
    let need_spines = g > 1 || gpd > 1 || dcs > 1;
    let spines = match cs.spines {
        Some(0) if need_spines => {
            return Err("cluster.spines must be at least 1, not 0".into());
        }
        Some(s) => s,
        None if need_spines => ((hpl as f64 / over).ceil() as usize).max(1),
        None => 0,
    };
    // Ranks up and down to their scale-up switch and their leaf, leaves to spines, spines to
    // routers, the long-haul mesh.
    let leaves = dcs.checked_mul(gpd).and_then(|x| x.checked_mul(g));
    let links = leaves
        .and_then(|l| l.checked_mul(spines))
        .zip(dcs.checked_mul(spines))
        .and_then(|(a, b)| a.checked_add(b))
        .and_then(|x| x.checked_add(hn * g * 2))
        .and_then(|x| x.checked_mul(2))
        .zip(dcs.checked_mul(dcs - 1))
        .and_then(|(a, b)| a.checked_add(b));
    check_links(
        &format!(
            "a cluster of {hn} hosts of {g} ranks, {dcs} datacenters and {spines} spines each"
        ),
        links,
    )?;
    let cl = Cluster {
        g,
        hosts_per_dc: hpd,
        hpl,
        gpd,
        dcs,
        spines,
        su_up: Vec::new(),
        su_down: Vec::new(),
        nic_up: Vec::new(),
        nic_down: Vec::new(),
        ls_up: Vec::new(),
        ls_down: Vec::new(),
        sr_up: Vec::new(),
        sr_down: Vec::new(),
        wan: Vec::new(),
    };
    Ok((cl, nic, over))
}

/// A cluster's switches, by tier.
struct ClusterNodes {
    /// Each host's scale-up switch.
    su: Vec<usize>,
    /// The leaves: per datacenter, per leaf group, per rail.
    leaves: Vec<usize>,
    /// The spines: per datacenter.
    spines: Vec<usize>,
    /// Each datacenter's router (none in one datacenter).
    routers: Vec<usize>,
}

/// A cluster's nodes: its ranks, then its switches.
fn cluster_nodes(b: &mut Builder, cs: &ClusterSpec, cl: &Cluster) -> ClusterNodes {
    let (hn, g, gpd, dcs, spines) = (cs.hosts, cl.g, cl.gpd, cl.dcs, cl.spines);
    for r in 0..hn * g {
        b.node(
            format!("h{}.g{}", r / g, r % g),
            NodeKind::Rank { host: r / g },
        );
    }
    let su: Vec<usize> = (0..hn)
        .map(|h| b.switch(format!("h{h}.su"), cs.scaleup_reduce_gbytes_per_s))
        .collect();
    let dcp = |d: usize| {
        if dcs > 1 {
            format!("dc{d}.")
        } else {
            String::new()
        }
    };
    let leaves: Vec<usize> = (0..dcs * gpd * g)
        .map(|l| {
            let (d, grp, i) = (l / (gpd * g), l / g % gpd, l % g);
            b.switch(format!("{}leaf{grp}.rail{i}", dcp(d)), None)
        })
        .collect();
    let spine_nodes: Vec<usize> = (0..dcs * spines)
        .map(|k| {
            b.switch(
                format!("{}spine{}", dcp(k / spines.max(1)), k % spines.max(1)),
                cs.spine_reduce_gbytes_per_s,
            )
        })
        .collect();
    let routers: Vec<usize> = if dcs > 1 {
        (0..dcs)
            .map(|d| b.switch(format!("dc{d}.router"), None))
            .collect()
    } else {
        Vec::new()
    };
    ClusterNodes {
        su,
        leaves,
        spines: spine_nodes,
        routers,
    }
}

/// A cluster's links, tier by tier (`rates`: each rail's NIC rate, each rank's, in Gbit/s, and
/// the oversubscription): `cl` with its link tables, and each host's NIC rates' sum.
fn cluster_links(
    b: &mut Builder,
    cl: Cluster,
    hn: usize,
    nodes: &ClusterNodes,
    c: &Common,
    (rail, rate, over): (&[f64], &[f64], f64),
    wan: Option<&WanSpec>,
) -> (Cluster, Vec<Option<f64>>) {
    let (g, hpd, hpl, gpd, dcs, spines) =
        (cl.g, cl.hosts_per_dc, cl.hpl, cl.gpd, cl.dcs, cl.spines);
    let world = hn * g;
    let (su, leaves, spine_nodes, routers) =
        (&nodes.su, &nodes.leaves, &nodes.spines, &nodes.routers);
    let (mut su_up, mut su_down) = (vec![0u32; world], vec![0u32; world]);
    let (mut nic_up, mut nic_down) = (vec![0u32; world], vec![0u32; world]);
    let mut host_gbps = vec![Some(0.0); hn];
    for r in 0..world {
        let h = r / g;
        (su_up[r], su_down[r]) = b.duplex(r, su[h], c.scaleup, c.scaleup_lat);
    }
    for r in 0..world {
        let h = r / g;
        let (d, grp, i) = (h / hpd, h % hpd / hpl, r % g);
        let leaf = leaves[cl.leaf(d, grp, i)];
        (nic_up[r], nic_down[r]) =
            b.duplex(r, leaf, rate[r] * c.efficiency * 1e9 / 8.0, c.link_lat);
        if let Some(x) = host_gbps[h].as_mut() {
            *x += rate[r];
        }
    }
    let n_leaves = leaves.len();
    let (mut ls_up, mut ls_down) = (vec![0u32; n_leaves * spines], vec![0u32; n_leaves * spines]);
    let mut spine_down_bps = vec![0.0; dcs * spines];
    for (l, &leaf) in leaves.iter().enumerate() {
        let d = l / (gpd * g);
        let uplink = hpl as f64 * rail[l % g] * 1e9 / 8.0 / over / spines.max(1) as f64;
        for s in 0..spines {
            (ls_up[l * spines + s], ls_down[l * spines + s]) =
                b.duplex(leaf, spine_nodes[d * spines + s], uplink, c.link_lat);
            spine_down_bps[d * spines + s] += uplink;
        }
    }
    let (mut sr_up, mut sr_down) = (Vec::new(), Vec::new());
    let mut wan_links = Vec::new();
    if let Some(w) = wan.filter(|_| dcs > 1) {
        for k in 0..dcs * spines {
            let (u, dn) = b.duplex(
                spine_nodes[k],
                routers[k / spines],
                spine_down_bps[k],
                c.link_lat,
            );
            sr_up.push(u);
            sr_down.push(dn);
        }
        wan_links = b.wan_mesh(&routers[..dcs], w, c.link_lat);
    }
    let cl = Cluster {
        su_up,
        su_down,
        nic_up,
        nic_down,
        ls_up,
        ls_down,
        sr_up,
        sr_down,
        wan: wan_links,
        ..cl
    };
    (cl, host_gbps)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::has;

    /// The error of `text`, which must not parse.
    fn err(text: &str) -> String {
        match Fabric::parse(text) {
            Ok(f) => panic!("parsed into {} nodes: {text}", f.nodes.len()),
            Err(e) => e,
        }
    }

    #[test]
    fn a_rank_count_past_the_limit_is_an_error() {
        let e = err("[[hosts]]\nname = \"a\"\nranks = 2\n\
                     [[hosts]]\nname = \"b\"\nranks = 18446744073709551615\n");
        has(
            &e,
            &[
                "hosts[1] (\"b\").ranks",
                "18446744073709551615",
                "after 2 ranks",
            ],
        );
        let e = err("[[hosts]]\nname = \"a\"\nranks = 1048577\n");
        has(&e, &["hosts[0] (\"a\").ranks = 1048577", "1048576"]);
    }

    #[test]
    fn a_rank_past_the_limit_is_an_error() {
        let e = err("[[hosts]]\nname = \"a\"\nranks = [0, 5000000000]\n");
        has(&e, &["hosts[0] (\"a\").ranks", "rank 5000000000"]);
        let e = err("[[hosts]]\nname = \"a\"\nranks = [18446744073709551615]\n");
        has(&e, &["hosts[0] (\"a\")", "rank 18446744073709551615"]);
    }

    #[test]
    fn a_cluster_past_the_limits_is_an_error() {
        let e = err("[cluster]\nhosts = 4294967296\ngpus_per_host = 4294967296\n");
        has(
            &e,
            &["cluster.hosts (4294967296)", "gpus_per_host (4294967296)"],
        );
        // A tiny oversubscription asks for more spines than usize holds.
        let e = err("[cluster]\nhosts = 64\ngpus_per_host = 8\noversubscription = 1e-300\n");
        has(&e, &["64 hosts of 8 ranks", "links"]);
        let e = err("[cluster]\nhosts = 64\ngpus_per_host = 8\nspines = 1000000\n");
        has(&e, &["1000000 spines", "links", "8388608"]);
    }

    #[test]
    fn too_many_datacenters_is_an_error() {
        let hosts = "[[hosts]]\nname = \"a\"\nranks = 1\nlink_gbps = 1\n\
                     [[hosts]]\nname = \"b\"\nranks = 1\nlink_gbps = 1\n";
        let e = err(&format!(
            "{hosts}[wan]\ndatacenters = 1099511627776\ndistance_km = 1\nlink_gbps = 1\n"
        ));
        has(&e, &["1099511627776 datacenters", "links"]);
        let e = err(&format!(
            "{hosts}dc = 18446744073709551615\n[wan]\ndistance_km = 1\nlink_gbps = 1\n"
        ));
        has(&e, &["hosts[1] (\"b\").dc", "18446744073709551615"]);
    }

    #[test]
    fn a_rate_that_overflows_once_converted_names_the_link() {
        let e = err("[[hosts]]\nname = \"a\"\nranks = 1\nlink_gbps = 1\n\
                     [[hosts]]\nname = \"b\"\nranks = 1\nlink_gbps = inf\n");
        has(&e, &["hosts[1] (\"b\").link_gbps", "inf"]);
        let e = err("link_gbps = 1e300\n[[hosts]]\nname = \"a\"\nranks = 1\n\
                     [[hosts]]\nname = \"b\"\nranks = 1\n");
        has(&e, &["a.sw->core", "inf bytes/s"]);
    }

    /// Files to mutate: a star, a cluster, several datacenters.
    const SEEDS: [&str; 4] = [
        "link_gbps = 1\nper_message_us = 2\n[[hosts]]\nname = \"a\"\nranks = [0, 1]\n\
         scaleup_gbytes_per_s = 11\n[[hosts]]\nname = \"b\"\nranks = 2\nlink_gbps = 0.25\n",
        "[cluster]\nhosts = 4\ngpus_per_host = 2\nhosts_per_leaf = 2\noversubscription = 2\n\
         rail_nic_gbps = [400, 200]\nnic_overrides = [{hosts = \"0-1\", rails = [1], gbps = 100}]\n",
        "tuner_hosts = \"datacenters\"\n[cluster]\nhosts = 4\ngpus_per_host = 2\nspines = 3\n\
         [wan]\ndatacenters = 2\ndistance_km = 100\nlink_gbps = 800\n",
        "{\"hosts\": [{\"name\": \"a\", \"ranks\": 2, \"link_gbps\": 1, \"dc\": 1}, \
         {\"name\": \"b\", \"ranks\": [2, 3], \"link_gbps\": 2, \"dc\": 0}], \
         \"wan\": {\"distance_km\": 10, \"link_gbps\": 1}}",
    ];

    /// Values put in place of a number of a seed (none makes a fabric so large that a
    /// case takes long: those are refused by the limits).
    const VALUES: [&str; 16] = [
        "0",
        "1",
        "2",
        "3",
        "7",
        "-1",
        "0.5",
        "1e300",
        "1e-320",
        "nan",
        "inf",
        "-inf",
        "4294967296",
        "18446744073709551615",
        "99999999999999999999999",
        "\"x\"",
    ];

    /// The byte ranges of the numbers in `text`.
    fn numbers(text: &str) -> Vec<(usize, usize)> {
        let b = text.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.len() {
            if b[i].is_ascii_digit() {
                let s = i;
                while i < b.len() && (b[i].is_ascii_digit() || b[i] == b'.') {
                    i += 1;
                }
                out.push((s, i));
            } else {
                i += 1;
            }
        }
        out
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(4096))]
        /// Any seed with some of its numbers replaced by odd values, a line dropped, or
        /// cut short parses or fails with an error: it never panics.
        #[test]
        fn mutated_files_parse_or_fail_without_panicking(
            seed in 0..SEEDS.len(),
            subs in proptest::collection::vec((0..64usize, 0..VALUES.len()), 0..6),
            drop_line in proptest::option::of(0..16usize),
            cut in proptest::option::of(0..400usize),
        ) {
            let mut text = SEEDS[seed].to_string();
            for (k, v) in subs {
                let nums = numbers(&text);
                if nums.is_empty() {
                    break;
                }
                let (s, e) = nums[k % nums.len()];
                text.replace_range(s..e, VALUES[v]);
            }
            if let Some(l) = drop_line {
                let lines: Vec<&str> = text.lines().collect();
                let l = l % lines.len();
                text = lines
                    .iter()
                    .enumerate()
                    .filter(|&(i, _)| i != l)
                    .map(|(_, x)| *x)
                    .collect::<Vec<_>>()
                    .join("\n");
            }
            if let Some(c) = cut
                && c < text.len()
                && text.is_char_boundary(c)
            {
                text.truncate(c);
            }
            match Fabric::parse(&text) {
                Ok(f) => {
                    f.validate().map_err(proptest::test_runner::TestCaseError::fail)?;
                }
                Err(e) => proptest::prop_assert!(!e.is_empty()),
            }
        }
    }
}
