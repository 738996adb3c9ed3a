//! The job's topology: which ranks share a host, and how fast each host's link into the
//! network is.
//!
//! A [`Topology`] is detected at init from the host identity of every rank
//! ([`Topology::from_host_ids`], over the runtime's `Communicator::hosts`),
//! or read from a file named by `OXCCL_TOPO_FILE` ([`Topology::from_env`]). With
//! `OXCCL_TOPO_PROBE=1` a communicator measures the link rates a file does not give at init
//! (see the runtime's `Options::topo_probe`). `oxccl topo` prints it.
//!
//! The tuner ([`crate::tuner`]) reads it: several hosts of several ranks run two-tier
//! (hierarchical) collectives; uneven link rates give all-reduces shares in proportion
//! ([`Topology::proportional_weights`], [`Topology::rail_weights`]); rings over hosts whose
//! ranks interleave are ordered host by host.
//!
//! ## File format
//! JSON (when the first non-blank character is `{`) or TOML, with the same fields:
//!
//! ```text
//! {"hosts": [{"name": "h0", "ranks": [0, 1], "link_gbps": 1.0},
//!            {"name": "h1", "ranks": [2, 3], "link_gbps": 0.25}]}
//! ```
//!
//! ```toml
//! [[hosts]]
//! name = "h0"
//! ranks = [0, 1]
//! link_gbps = 1.0
//!
//! [[hosts]]
//! name = "h1"
//! ranks = [2, 3]
//! link_gbps = 0.25
//! ```
//!
//! `link_gbps` is the rate of the host's link into the network per direction, in Gbit/s; it
//! may be left out (unknown). Unknown fields are refused, so that a misspelt key is an error
//! rather than silently ignored. [`Topology::validate`] checks a topology against a job:
//! every rank exactly once, no empty host, unique names, rates finite and positive.
//!
//! ```
//! use oxccl_core::Topology;
//!
//! let topo = Topology::parse(
//!     r#"{"hosts": [{"name": "h0", "ranks": [0, 1], "link_gbps": 1.0},
//!                   {"name": "h1", "ranks": [2, 3], "link_gbps": 0.25}]}"#,
//! )?;
//! topo.validate(4)?;
//! assert_eq!(topo.world(), 4);
//! assert_eq!(topo.host_of(3), Some(1));
//! assert_eq!(topo.host_of(4), None);
//! assert_eq!(topo.ranks_per_host(), Some(2));
//! assert!(!topo.is_uniform_rate());
//! assert_eq!(topo.min_rate(), Some(0.25));
//!
//! // The same topology in TOML.
//! let toml = Topology::parse(
//!     "[[hosts]]\nname = \"h0\"\nranks = [0, 1]\nlink_gbps = 1.0\n\
//!      [[hosts]]\nname = \"h1\"\nranks = [2, 3]\nlink_gbps = 0.25\n",
//! )?;
//! assert_eq!(toml, topo);
//!
//! // Detected: ranks grouped by host identity, hosts in order of their lowest rank.
//! let ids: Vec<String> = ["a", "b", "a"].iter().map(|s| s.to_string()).collect();
//! let detected = Topology::from_host_ids(&ids);
//! assert_eq!(detected.hosts[0].ranks, vec![0, 2]);
//! assert_eq!(detected.hosts[1].ranks, vec![1]);
//! println!("{detected}");
//! # Ok::<(), String>(())
//! ```

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// The environment variable naming a topology file, read by [`Topology::from_env`].
pub const TOPO_FILE_VAR: &str = "OXCCL_TOPO_FILE";

/// The hosts of a job, each with its ranks and link rate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    /// The hosts; detected ones are in order of their lowest rank.
    pub hosts: Vec<Host>,
    /// The network's aggregation service (`oxccl agg`), `host:port`, if it has one: jobs
    /// join it as with `OXCCL_AGG_ADDR` (which wins).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aggregator: Option<String>,
}

/// One host: a group of ranks that reach each other without the network.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Host {
    /// The host's name; for a detected host, its full host identity.
    pub name: String,
    /// The ranks on this host, in the order given (ascending when detected).
    pub ranks: Vec<usize>,
    /// Rate of the host's link into the network, per direction, in Gbit/s; `None`: unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_gbps: Option<f64>,
}

impl Topology {
    /// Groups ranks by identical host identity (`ids[rank]`, as
    /// the runtime's `Communicator::hosts` returns them): one host per distinct
    /// identity, named by it, hosts in order of their lowest rank, ranks ascending, link rates
    /// unknown.
    pub fn from_host_ids(ids: &[String]) -> Topology {
        let mut index: HashMap<&str, usize> = HashMap::new();
        let mut hosts: Vec<Host> = Vec::new();
        for (rank, id) in ids.iter().enumerate() {
            let h = *index.entry(id.as_str()).or_insert_with(|| {
                hosts.push(Host {
                    name: id.clone(),
                    ranks: Vec::new(),
                    link_gbps: None,
                });
                hosts.len() - 1
            });
            hosts[h].ranks.push(rank);
        }
        Topology {
            hosts,
            aggregator: None,
        }
    }

    /// Parses a topology from JSON (when the first non-blank character is `{`) or TOML. The
    /// result is not validated: see [`Topology::validate`].
    pub fn parse(text: &str) -> Result<Topology, String> {
        if text.trim_start().starts_with('{') {
            serde_json::from_str(text).map_err(|e| format!("invalid topology JSON: {e}"))
        } else {
            toml::from_str(text)
                .map_err(|e| format!("invalid topology TOML: {}", e.to_string().trim_end()))
        }
    }

    /// Reads and parses a topology file ([`Topology::parse`]); errors name the file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Topology, String> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read topology file {}: {e}", path.display()))?;
        Topology::parse(&text).map_err(|e| format!("topology file {}: {e}", path.display()))
    }

    /// Checks the topology against a job of `world` ranks: at least one host, every host named
    /// (names unique) and with at least one rank, every rank `0..world` on exactly one host,
    /// every known link rate finite and above 0. The error names what is wrong: the host, the
    /// missing, repeated or out-of-range rank.
    pub fn validate(&self, world: usize) -> Result<(), String> {
        if self.hosts.is_empty() {
            return Err("the topology has no hosts".into());
        }
        if let Some(a) = &self.aggregator
            && !a.contains(':')
        {
            return Err(format!(
                "aggregator {a:?} is not a host:port address (of `oxccl agg --listen`)"
            ));
        }
        let mut names: HashMap<&str, usize> = HashMap::new();
        let mut seen: Vec<Option<usize>> = vec![None; world];
        for (h, host) in self.hosts.iter().enumerate() {
            if host.name.trim().is_empty() {
                return Err(format!("host {h} has an empty name"));
            }
            if let Some(first) = names.insert(host.name.as_str(), h) {
                return Err(format!(
                    "hosts {first} and {h} have the same name {:?}",
                    host.name
                ));
            }
            if host.ranks.is_empty() {
                return Err(format!("host {h} ({:?}) has no ranks", host.name));
            }
            if let Some(rate) = host.link_gbps
                && !(rate.is_finite() && rate > 0.0)
            {
                return Err(format!(
                    "host {h} ({:?}): link_gbps must be a finite number above 0, not {rate}",
                    host.name
                ));
            }
            for &rank in &host.ranks {
                let Some(slot) = seen.get_mut(rank) else {
                    return Err(format!(
                        "host {h} ({:?}) lists rank {rank}, but the job has {world} ranks{}",
                        host.name,
                        match world {
                            0 => String::new(),
                            1 => " (0)".into(),
                            _ => format!(" (0-{})", world - 1),
                        }
                    ));
                };
                match *slot {
                    Some(other) if other == h => {
                        return Err(format!(
                            "rank {rank} appears twice on host {h} ({:?})",
                            host.name
                        ));
                    }
                    Some(other) => {
                        return Err(format!(
                            "rank {rank} appears on two hosts: {other} ({:?}) and {h} ({:?})",
                            self.hosts[other].name, host.name
                        ));
                    }
                    None => *slot = Some(h),
                }
            }
        }
        let missing: Vec<usize> = (0..world).filter(|&r| seen[r].is_none()).collect();
        if !missing.is_empty() {
            let (noun, verb) = if missing.len() == 1 {
                ("rank", "is")
            } else {
                ("ranks", "are")
            };
            return Err(format!(
                "{noun} {} of the job's {world} {verb} on no host",
                format_ranks(&missing)
            ));
        }
        Ok(())
    }

    /// Number of ranks on all hosts together.
    pub fn world(&self) -> usize {
        self.hosts.iter().map(|h| h.ranks.len()).sum()
    }

    /// Index in [`Topology::hosts`] of the host holding `rank` (a search over the hosts; for
    /// many lookups use [`Topology::host_table`]). `None` when no host holds `rank` (a topology
    /// that passed [`Topology::validate`] holds every rank of the job).
    pub fn host_of(&self, rank: usize) -> Option<usize> {
        self.hosts.iter().position(|h| h.ranks.contains(&rank))
    }

    /// The host index of every rank `0..world()`, precomputed: `host_table()[rank]`. A rank
    /// on no host (an unvalidated topology) maps to `usize::MAX`.
    pub fn host_table(&self) -> Vec<usize> {
        let mut table = vec![usize::MAX; self.world()];
        for (h, host) in self.hosts.iter().enumerate() {
            for &r in &host.ranks {
                if let Some(slot) = table.get_mut(r) {
                    *slot = h;
                }
            }
        }
        table
    }

    /// `Some(k)` when every host has `k` ranks; `None` when they differ or there is no host.
    pub fn ranks_per_host(&self) -> Option<usize> {
        let k = self.hosts.first()?.ranks.len();
        self.hosts.iter().all(|h| h.ranks.len() == k).then_some(k)
    }

    /// Whether the link rates give no reason to treat hosts differently: `false` only when two
    /// known rates differ. Unknown rates are ignored, so a topology with no rate at all is
    /// uniform.
    pub fn is_uniform_rate(&self) -> bool {
        let mut known = self.hosts.iter().filter_map(|h| h.link_gbps);
        match known.next() {
            None => true,
            Some(first) => known.all(|r| r == first),
        }
    }

    /// Several hosts with the same number, above one, of ranks each: where the tuner runs
    /// all-reduce, reduce-scatter, all-gather and large broadcasts in two tiers.
    pub fn is_two_tier(&self) -> bool {
        self.hosts.len() > 1 && self.ranks_per_host().is_some_and(|k| k > 1)
    }

    /// Each rank's share of a proportional all-reduce (parts per million), from the link
    /// rates ([`crate::schedule::proportional_shares`]; ranks on one host share its link);
    /// empty when rates are unknown or equal, or there are fewer than 3 ranks (where every
    /// split takes the same time), so that the tuner keeps the ring.
    pub fn proportional_weights(&self) -> Vec<u32> {
        let world = self.world();
        if world < 3 || self.is_uniform_rate() || self.hosts.iter().any(|h| h.link_gbps.is_none()) {
            return Vec::new();
        }
        // A rank on no host (an unvalidated topology): no weights, as for unknown rates.
        let Some(rates) = (0..world)
            .map(|r| {
                let h = &self.hosts[self.host_of(r)?];
                Some(h.link_gbps.unwrap_or(1.0) / h.ranks.len() as f64)
            })
            .collect::<Option<Vec<f64>>>()
        else {
            return Vec::new();
        };
        let (shares, _) = crate::schedule::proportional_shares(&rates);
        shares.iter().map(|s| (s * 1e6).round() as u32).collect()
    }

    /// Each rank's share of its rail's blocks in a two-tier all-reduce (parts per million):
    /// its host's share of [`crate::schedule::proportional_shares`] over the host link rates.
    /// All rails of a host share its link alike, so each rail meets the one-rank-per-host
    /// problem on rates `rate_h / ranks_per_host`, whose shares are those of the host rates.
    /// Empty when rates are unknown or equal, or there are fewer than 3 hosts.
    pub fn rail_weights(&self) -> Vec<u32> {
        if self.hosts.len() < 3
            || self.is_uniform_rate()
            || self.hosts.iter().any(|h| h.link_gbps.is_none())
        {
            return Vec::new();
        }
        let rates: Vec<f64> = self
            .hosts
            .iter()
            .map(|h| h.link_gbps.unwrap_or(1.0))
            .collect();
        let (shares, _) = crate::schedule::proportional_shares(&rates);
        // A rank on no host (an unvalidated topology): no weights, as for unknown rates.
        (0..self.world())
            .map(|r| Some((shares[self.host_of(r)?] * 1e6).round() as u32))
            .collect::<Option<Vec<u32>>>()
            .unwrap_or_default()
    }

    /// The slowest known link rate in Gbit/s; `None` when no rate is known.
    pub fn min_rate(&self) -> Option<f64> {
        self.hosts
            .iter()
            .filter_map(|h| h.link_gbps)
            .reduce(f64::min)
    }

    /// The topology of a job whose ranks have host identities `host_ids`
    /// (the runtime's `Communicator::hosts`), reading `OXCCL_TOPO_FILE` from
    /// the process environment. See [`Topology::from_vars`].
    pub fn from_env(host_ids: &[String]) -> Result<(Topology, Option<String>), String> {
        Topology::from_vars(host_ids, &|name| std::env::var(name).ok())
    }

    /// [`Topology::from_env`] over any variable source.
    ///
    /// Without `OXCCL_TOPO_FILE` (or with it empty): [`Topology::from_host_ids`], and no note.
    /// With it: the file, validated against `host_ids.len()` ranks (an invalid file is an
    /// error naming the file). **The file wins** over detection, since it is how a user
    /// describes hosts the identities cannot tell apart (or shows the tuner a layout it should
    /// assume); when its grouping of ranks into hosts differs from the detected one, the second
    /// value is a note saying so, for the caller to log.
    pub fn from_vars(
        host_ids: &[String],
        var: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(Topology, Option<String>), String> {
        let detected = Topology::from_host_ids(host_ids);
        let Some(path) = var(TOPO_FILE_VAR).filter(|p| !p.trim().is_empty()) else {
            return Ok((detected, None));
        };
        let file = Topology::from_file(&path)?;
        file.validate(host_ids.len())
            .map_err(|e| format!("topology file {path} ({TOPO_FILE_VAR}): {e}"))?;
        let note = (file.grouping() != detected.grouping()).then(|| {
            format!(
                "{TOPO_FILE_VAR}={path} groups the ranks as {} but their host identities group \
                 them as {}; using the file",
                file.grouping_text(),
                detected.grouping_text()
            )
        });
        Ok((file, note))
    }

    /// The partition of ranks into hosts, independent of host order and names.
    fn grouping(&self) -> Vec<Vec<usize>> {
        let mut groups: Vec<Vec<usize>> = self
            .hosts
            .iter()
            .map(|h| {
                let mut r = h.ranks.clone();
                r.sort_unstable();
                r
            })
            .collect();
        groups.sort();
        groups
    }

    fn grouping_text(&self) -> String {
        let groups: Vec<String> = self
            .grouping()
            .iter()
            .map(|g| format!("[{}]", format_ranks(g)))
            .collect();
        groups.join(" ")
    }
}

/// Ranks as ascending ranges: `0-3,6,8-9` (sorted first).
pub fn format_ranks(ranks: &[usize]) -> String {
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        parts.push(if j > i {
            format!("{}-{}", sorted[i], sorted[j])
        } else {
            sorted[i].to_string()
        });
        i = j + 1;
    }
    parts.join(",")
}

/// A name short enough for a table: names up to 40 characters as they are, longer ones (host
/// identities: a boot id and a network namespace) as their first 8 and last 20 characters.
fn short_name(name: &str) -> String {
    let chars: Vec<char> = name.chars().collect();
    if chars.len() <= 40 {
        return name.to_string();
    }
    let head: String = chars[..8].iter().collect();
    let tail: String = chars[chars.len() - 20..].iter().collect();
    format!("{head}…{tail}")
}

/// A table: one row per host (index, name, ranks as ranges, link rate or `unknown`), then a
/// summary line.
impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rows: Vec<[String; 4]> = self
            .hosts
            .iter()
            .enumerate()
            .map(|(h, host)| {
                [
                    h.to_string(),
                    short_name(&host.name),
                    format_ranks(&host.ranks),
                    match host.link_gbps {
                        Some(r) => format!("{r} Gbit/s"),
                        None => "unknown".into(),
                    },
                ]
            })
            .collect();
        let header = ["host", "name", "ranks", "link"];
        let mut width = header.map(|s| s.chars().count());
        for row in &rows {
            for (w, cell) in width.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let line = |f: &mut fmt::Formatter<'_>, cells: [&str; 4]| {
            writeln!(
                f,
                "{:>w0$}  {:<w1$}  {:<w2$}  {}",
                cells[0],
                cells[1],
                cells[2],
                cells[3],
                w0 = width[0],
                w1 = width[1],
                w2 = width[2]
            )
        };
        line(f, header)?;
        for row in &rows {
            line(f, [&row[0], &row[1], &row[2], &row[3]])?;
        }
        let n = self.hosts.len();
        write!(
            f,
            "{} rank{} on {n} host{}",
            self.world(),
            if self.world() == 1 { "" } else { "s" },
            if n == 1 { "" } else { "s" }
        )?;
        if let Some(k) = self.ranks_per_host() {
            write!(f, ", {k} per host")?;
        }
        if self.min_rate().is_some() {
            if self.is_uniform_rate() {
                write!(f, ", uniform link rate")?;
            } else {
                write!(f, ", uneven link rates")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn host(name: &str, ranks: &[usize], rate: Option<f64>) -> Host {
        Host {
            name: name.into(),
            ranks: ranks.to_vec(),
            link_gbps: rate,
        }
    }

    fn two_by_two() -> Topology {
        Topology {
            hosts: vec![
                host("h0", &[0, 1], Some(1.0)),
                host("h1", &[2, 3], Some(0.25)),
            ],
            aggregator: None,
        }
    }

    #[test]
    fn a_rank_on_no_host_gives_no_weights_rather_than_a_panic() {
        // Unvalidated: rank 2 of 0..4 is on no host; the rates differ, so weights would be made.
        let t = Topology {
            hosts: vec![
                host("a", &[0], Some(1.0)),
                host("b", &[1], Some(2.0)),
                host("c", &[3, 4], Some(4.0)),
            ],
            aggregator: None,
        };
        assert!(t.validate(4).is_err());
        assert_eq!(t.host_of(2), None);
        assert_eq!(t.proportional_weights(), Vec::<u32>::new());
        assert_eq!(t.rail_weights(), Vec::<u32>::new());
        // The same hosts holding 0..4: weights, one per rank.
        let ok = Topology {
            hosts: vec![
                host("a", &[0], Some(1.0)),
                host("b", &[1], Some(2.0)),
                host("c", &[2, 3], Some(4.0)),
            ],
            aggregator: None,
        };
        ok.validate(4).unwrap();
        assert_eq!(ok.proportional_weights().len(), 4);
        assert_eq!(ok.rail_weights().len(), 4);
    }

    #[test]
    fn grouping_by_host_id_orders_hosts_by_lowest_rank() {
        let t = Topology::from_host_ids(&ids(&["b", "a", "b", "c", "a"]));
        assert_eq!(
            t.hosts,
            vec![
                host("b", &[0, 2], None),
                host("a", &[1, 4], None),
                host("c", &[3], None)
            ]
        );
        assert_eq!(t.world(), 5);
        assert_eq!(t.host_of(4), Some(1));
        assert_eq!(t.host_of(5), None);
        assert_eq!(t.host_table(), vec![0, 1, 0, 2, 1]);
        assert_eq!(t.ranks_per_host(), None);
        assert!(t.is_uniform_rate());
        assert_eq!(t.min_rate(), None);
        t.validate(5).unwrap();
        let one = Topology::from_host_ids(&ids(&["x", "x", "x"]));
        assert_eq!(one.hosts, vec![host("x", &[0, 1, 2], None)]);
        assert_eq!(one.ranks_per_host(), Some(3));
        assert_eq!(Topology::from_host_ids(&[]).hosts, vec![]);
    }

    #[test]
    fn parses_json_and_toml_alike() {
        let json = r#"  {"hosts": [{"name": "h0", "ranks": [0, 1], "link_gbps": 1.0},
                                {"name": "h1", "ranks": [2, 3], "link_gbps": 0.25}]}"#;
        let toml = "# two hosts\n[[hosts]]\nname = \"h0\"\nranks = [0, 1]\nlink_gbps = 1\n\n\
                    [[hosts]]\nname = \"h1\"\nranks = [2, 3]\nlink_gbps = 0.25\n";
        assert_eq!(Topology::parse(json).unwrap(), two_by_two());
        assert_eq!(Topology::parse(toml).unwrap(), two_by_two());
        // Rates may be left out; JSON output leaves unknown rates out, and reads back.
        let t = Topology::parse("[[hosts]]\nname = \"a\"\nranks = [0]\n").unwrap();
        assert_eq!(t.hosts, vec![host("a", &[0], None)]);
        let out = serde_json::to_string(&Topology::from_host_ids(&ids(&["a", "a"]))).unwrap();
        assert_eq!(out, r#"{"hosts":[{"name":"a","ranks":[0,1]}]}"#);
        assert_eq!(Topology::parse(&out).unwrap().world(), 2);
        let out = serde_json::to_string(&two_by_two()).unwrap();
        assert_eq!(Topology::parse(&out).unwrap(), two_by_two());
    }

    #[test]
    fn parse_errors_say_which_format() {
        let e = Topology::parse(r#"{"hosts": [{"name": "h0", "ranks": [0], "link_gbs": 1}]}"#)
            .unwrap_err();
        assert!(e.contains("JSON") && e.contains("link_gbs"), "{e}");
        let e = Topology::parse("[[hosts]]\nname = \"h0\"\nranks = 0\n").unwrap_err();
        assert!(e.contains("TOML") && e.contains("ranks"), "{e}");
        let e = Topology::parse("{").unwrap_err();
        assert!(e.contains("JSON"), "{e}");
        let e = Topology::parse("hosts = 3").unwrap_err();
        assert!(e.contains("TOML"), "{e}");
    }

    #[test]
    fn from_file_names_the_file() {
        let dir = std::env::temp_dir().join(format!("oxccl-topo-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.toml");
        let e = Topology::from_file(&missing).unwrap_err();
        assert!(
            e.contains("missing.toml") && e.contains("cannot read"),
            "{e}"
        );
        let bad = dir.join("bad.json");
        std::fs::write(&bad, "{\"hosts\": 1}").unwrap();
        let e = Topology::from_file(&bad).unwrap_err();
        assert!(e.contains("bad.json") && e.contains("JSON"), "{e}");
        let good = dir.join("good.toml");
        std::fs::write(&good, "[[hosts]]\nname = \"h0\"\nranks = [0, 1]\n").unwrap();
        assert_eq!(Topology::from_file(&good).unwrap().world(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn validation_names_what_is_wrong() {
        let check = |t: Topology, world: usize, want: &[&str]| {
            let e = t.validate(world).unwrap_err();
            for w in want {
                assert!(e.contains(w), "{e:?} does not contain {w:?}");
            }
        };
        two_by_two().validate(4).unwrap();
        check(
            Topology {
                hosts: vec![],
                aggregator: None,
            },
            0,
            &["no hosts"],
        );
        check(
            Topology {
                hosts: vec![host("h0", &[0, 1], None), host("h1", &[], None)],
                aggregator: None,
            },
            2,
            &["host 1", "\"h1\"", "no ranks"],
        );
        check(
            Topology {
                hosts: vec![host("h0", &[0], None), host("h0", &[1], None)],
                aggregator: None,
            },
            2,
            &["hosts 0 and 1", "\"h0\""],
        );
        check(
            Topology {
                hosts: vec![host(" ", &[0], None)],
                aggregator: None,
            },
            1,
            &["host 0", "empty name"],
        );
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            check(
                Topology {
                    hosts: vec![host("h0", &[0], None), host("h1", &[1], Some(bad))],
                    aggregator: None,
                },
                2,
                &["host 1", "\"h1\"", "link_gbps"],
            );
        }
        check(
            Topology {
                hosts: vec![host("h0", &[0, 1], None), host("h1", &[1, 2], None)],
                aggregator: None,
            },
            3,
            &["rank 1", "two hosts", "0 (\"h0\")", "1 (\"h1\")"],
        );
        check(
            Topology {
                hosts: vec![host("h0", &[0, 0], None)],
                aggregator: None,
            },
            1,
            &["rank 0", "twice", "host 0"],
        );
        check(
            Topology {
                hosts: vec![host("h0", &[0, 1], None), host("h1", &[4], None)],
                aggregator: None,
            },
            3,
            &["host 1", "rank 4", "3 ranks", "(0-2)"],
        );
        check(two_by_two(), 6, &["ranks 4-5", "no host"]);
        check(
            Topology {
                hosts: vec![host("h0", &[0, 2], None)],
                aggregator: None,
            },
            3,
            &["rank 1 ", "no host"],
        );
    }

    #[test]
    fn rate_helpers() {
        let mut t = two_by_two();
        assert!(!t.is_uniform_rate());
        assert_eq!(t.min_rate(), Some(0.25));
        t.hosts[1].link_gbps = Some(1.0);
        assert!(t.is_uniform_rate());
        t.hosts[1].link_gbps = None;
        assert!(t.is_uniform_rate());
        assert_eq!(t.min_rate(), Some(1.0));
        assert_eq!(t.ranks_per_host(), Some(2));
    }

    #[test]
    fn display_is_a_table_with_ranges() {
        let t = Topology {
            hosts: vec![
                host("h0", &[0, 1, 2, 3], Some(2.0)),
                host("second", &[4, 6, 7], Some(0.5)),
                host("h2", &[5], None),
            ],
            aggregator: None,
        };
        let want = "\
host  name    ranks  link
   0  h0      0-3    2 Gbit/s
   1  second  4,6-7  0.5 Gbit/s
   2  h2      5      unknown
8 ranks on 3 hosts, uneven link rates";
        assert_eq!(t.to_string(), want);
        let id = "0123456789abcdef-0123-4567-89ab-cdef01234567/net:[4026531840]".to_string();
        let d = Topology::from_host_ids(&[id.clone(), id.clone()]);
        assert_eq!(d.hosts[0].name, id);
        let want = "\
host  name                           ranks  link
   0  01234567…567/net:[4026531840]  0-1    unknown
2 ranks on 1 host, 2 per host";
        assert_eq!(d.to_string(), want);
    }

    #[test]
    fn env_file_wins_with_a_note_when_grouping_differs() {
        let detected = ids(&["a", "a", "b", "b"]);
        let none = |_: &str| None;
        let (t, note) = Topology::from_vars(&detected, &none).unwrap();
        assert_eq!(t, Topology::from_host_ids(&detected));
        assert!(note.is_none());

        let dir = std::env::temp_dir().join(format!("oxccl-topo-env-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let same = dir.join("same.json");
        std::fs::write(&same, serde_json::to_string(&two_by_two()).unwrap()).unwrap();
        let same_s = same.to_string_lossy().into_owned();
        let var = |n: &str| (n == TOPO_FILE_VAR).then(|| same_s.clone());
        let (t, note) = Topology::from_vars(&detected, &var).unwrap();
        assert_eq!(t, two_by_two());
        assert!(note.is_none(), "{note:?}");

        let other = dir.join("other.toml");
        std::fs::write(
            &other,
            "[[hosts]]\nname = \"x\"\nranks = [0, 2]\n[[hosts]]\nname = \"y\"\nranks = [1, 3]\n",
        )
        .unwrap();
        let other_s = other.to_string_lossy().into_owned();
        let var = |n: &str| (n == TOPO_FILE_VAR).then(|| other_s.clone());
        let (t, note) = Topology::from_vars(&detected, &var).unwrap();
        assert_eq!(t.hosts[0].ranks, vec![0, 2]);
        let note = note.expect("a note");
        assert!(
            note.contains("[0,2] [1,3]") && note.contains("[0-1] [2-3]") && note.contains("file"),
            "{note}"
        );

        // Validated against the job's size; the error names the file and the variable.
        let e = Topology::from_vars(&ids(&["a", "a", "a"]), &var).unwrap_err();
        assert!(
            e.contains("other.toml") && e.contains(TOPO_FILE_VAR) && e.contains("rank 3"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_names_the_aggregation_service() {
        let t = Topology::parse(
            "aggregator = \"10.0.0.254:29600\"\n[[hosts]]\nname = \"a\"\nranks = [0]\n",
        )
        .unwrap();
        assert_eq!(t.aggregator.as_deref(), Some("10.0.0.254:29600"));
        t.validate(1).unwrap();
        let bad = Topology {
            aggregator: Some("10.0.0.254".into()),
            ..t
        };
        assert!(bad.validate(1).unwrap_err().contains("host:port"));
    }
}
