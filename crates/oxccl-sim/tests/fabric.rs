//! Topology files, routes, symmetry and the aggregator of the fabric model.

use std::path::PathBuf;

use oxccl_sim::fabric::Layout;
use oxccl_sim::{Fabric, Link, Node, NodeKind};

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/topologies")
}

fn example(name: &str) -> Fabric {
    Fabric::from_file(examples().join(name)).unwrap()
}

/// A deterministic stream of numbers (xorshift).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn route(f: &Fabric, a: usize, b: usize, key: u64) -> Vec<usize> {
    let mut out = Vec::new();
    f.route(a, b, key, &mut out).expect("a route");
    out
}

/// The route is a contiguous path from `a` to `b` that passes through no rank.
fn check_route(f: &Fabric, a: usize, b: usize, key: u64) -> Vec<usize> {
    let r = route(f, a, b, key);
    if a == b {
        assert!(r.is_empty());
        return r;
    }
    assert!(!r.is_empty(), "{a}->{b}: empty route");
    let mut at = a;
    for (i, &l) in r.iter().enumerate() {
        let link = &f.links[l];
        assert_eq!(link.from, at, "{a}->{b}: link {} not contiguous", link.name);
        if i > 0 {
            assert!(
                at >= f.world,
                "{a}->{b}: passes through rank {at} ({})",
                f.nodes[at].name
            );
        }
        at = link.to;
    }
    assert_eq!(at, b, "{a}->{b}: ends at {}", f.nodes[at].name);
    r
}

/// The symmetry is an automorphism (checked link by link) that commutes with routing.
fn check_symmetry(f: &Fabric, pairs: usize, seed: u64) {
    let s = f.symmetry.as_ref().expect("a symmetry");
    assert_eq!(s.node_map.len(), f.nodes.len());
    assert_eq!(s.link_map.len(), f.links.len());
    let mut seen = vec![false; f.nodes.len()];
    for &m in &s.node_map {
        assert!(!std::mem::replace(&mut seen[m], true), "not a permutation");
    }
    for r in 0..f.world {
        assert!(s.node_map[r] < f.world, "rank {r} maps to a switch");
    }
    for (i, l) in f.links.iter().enumerate() {
        let m = &f.links[s.link_map[i]];
        assert_eq!(m.from, s.node_map[l.from]);
        assert_eq!(m.to, s.node_map[l.to]);
        assert_eq!(m.bytes_per_s, l.bytes_per_s);
        assert_eq!(m.latency_s, l.latency_s);
    }
    let mut rng = Rng(seed);
    for _ in 0..pairs {
        let (a, b, key) = (rng.below(f.world), rng.below(f.world), rng.next() % 64);
        let mapped: Vec<usize> = route(f, a, b, key).iter().map(|&l| s.link_map[l]).collect();
        assert_eq!(
            route(f, s.node_map[a], s.node_map[b], key),
            mapped,
            "route({a}, {b}, {key}) does not commute with the symmetry"
        );
    }
}

#[test]
fn a_runtime_topology_file_is_a_star() {
    let json = r#"{"hosts": [{"name": "h0", "ranks": [0, 1], "link_gbps": 1.0},
                             {"name": "h1", "ranks": [2, 3], "link_gbps": 0.25}]}"#;
    let f = Fabric::parse(json).unwrap();
    assert_eq!(f.world, 4);
    assert_eq!(f.topology(), oxccl_core::Topology::parse(json).unwrap());
    // 4 ranks, 2 host switches, 1 core; 4 rank links and 2 host links, both directions.
    assert_eq!(f.nodes.len(), 7);
    assert_eq!(f.links.len(), 12);
    // Same host: through its switch at the shm rate; across hosts: over both host links.
    let r = check_route(&f, 0, 1, 0);
    assert_eq!(r.len(), 2);
    assert_eq!(f.links[r[0]].bytes_per_s, 11e9);
    let r = check_route(&f, 0, 3, 0);
    assert_eq!(r.len(), 4);
    assert_eq!(f.links[r[1]].bytes_per_s, 1e9 / 8.0);
    assert_eq!(f.links[r[2]].bytes_per_s, 0.25e9 / 8.0);
    assert!(f.symmetry.is_none(), "the hosts' rates differ");
    // Defaults of a star.
    assert_eq!(f.reduce_bytes_per_s, 20e9);
    assert!((f.per_message_s - 5e-6).abs() < 1e-15);
    // The same file in TOML.
    let toml = "[[hosts]]\nname = \"h0\"\nranks = [0, 1]\nlink_gbps = 1.0\n\
                [[hosts]]\nname = \"h1\"\nranks = [2, 3]\nlink_gbps = 0.25\n";
    assert_eq!(Fabric::parse(toml).unwrap().topology(), f.topology());
}

#[test]
fn the_test_bed_examples() {
    for (name, world, symmetric) in [
        ("testbed-a.toml", 4, true),
        ("testbed-b.toml", 4, true),
        ("testbed-c.toml", 4, false),
        ("testbed-d.toml", 4, false),
    ] {
        let f = example(name);
        assert_eq!(f.world, world, "{name}");
        assert_eq!(f.symmetry.is_some(), symmetric, "{name}");
        let t = f.topology();
        t.validate(world).unwrap();
        assert_eq!(
            t,
            oxccl_core::Topology::from_file(examples().join(name)).unwrap(),
            "{name}: the runtime reads the same topology"
        );
        if symmetric {
            check_symmetry(&f, 200, 7);
        }
        for a in 0..world {
            for b in 0..world {
                check_route(&f, a, b, 0);
            }
        }
    }
}

#[test]
fn overrides_and_defaults_of_a_star() {
    let f = Fabric::parse(
        "reduce_gbytes_per_s = 7\nper_message_us = 30\nlink_latency_us = 50\n\
         scaleup_gbytes_per_s = 4\nlink_gbps = 2\n\
         [[hosts]]\nname = \"a\"\nranks = 2\n\
         [[hosts]]\nname = \"b\"\nranks = 2\nscaleup_gbytes_per_s = 8\n",
    )
    .unwrap();
    assert_eq!(f.reduce_bytes_per_s, 7e9);
    assert!((f.per_message_s - 30e-6).abs() < 1e-12);
    assert_eq!(f.hosts[1].1, vec![2, 3]);
    let r = check_route(&f, 0, 3, 0);
    let rates: Vec<f64> = r.iter().map(|&l| f.links[l].bytes_per_s).collect();
    assert_eq!(rates, vec![4e9, 2e9 / 8.0, 2e9 / 8.0, 8e9]);
    assert!((f.links[r[1]].latency_s - 50e-6).abs() < 1e-12);
    assert_eq!(f.topology().hosts[0].link_gbps, Some(2.0));
    assert!(f.symmetry.is_none(), "scale-up rates differ");
    // A payload share of the nominal rate: the links carry less, the tuner sees the rate.
    let f = Fabric::parse(
        "link_efficiency = 0.9\nlink_gbps = 1\n[[hosts]]\nname = \"a\"\nranks = 1\n\
         [[hosts]]\nname = \"b\"\nranks = 1\nlink_efficiency = 0.5\n",
    )
    .unwrap();
    let r = check_route(&f, 0, 1, 0);
    assert_eq!(f.links[r[1]].bytes_per_s, 0.9e9 / 8.0);
    assert_eq!(f.links[r[2]].bytes_per_s, 0.5e9 / 8.0);
    assert_eq!(f.topology().hosts[1].link_gbps, Some(1.0));
}

#[test]
fn a_single_host_scale_up_domain_aggregates_in_its_switch() {
    let f = example("nvl72.toml");
    assert_eq!(f.world, 72);
    let agg = f.aggregator().expect("the switch aggregates");
    assert_eq!(f.nodes[agg].name, "nvl72.sw");
    assert_eq!(
        f.nodes[agg].kind,
        NodeKind::Switch {
            reduce_bytes_per_s: Some(64800e9)
        }
    );
    for r in 0..72 {
        let up = check_route(&f, r, agg, 0);
        assert_eq!(up.len(), 1);
        assert_eq!(f.links[up[0]].bytes_per_s, 900e9);
        assert_eq!(check_route(&f, agg, r, 0).len(), 1);
    }
    // Ranks shift by one.
    check_symmetry(&f, 500, 3);
    assert_eq!(f.symmetry.as_ref().unwrap().node_map[71], 0);
    // Without the reduce rate there is no aggregator.
    let plain = Fabric::parse("[[hosts]]\nname = \"x\"\nranks = 8\n").unwrap();
    assert_eq!(plain.aggregator(), None);
    assert_eq!(plain.topology().hosts[0].link_gbps, None);
}

#[test]
fn a_star_core_can_aggregate() {
    let f = Fabric::parse(
        "core_reduce_gbytes_per_s = 1\nlink_gbps = 1\n\
         [[hosts]]\nname = \"a\"\nranks = 1\n[[hosts]]\nname = \"b\"\nranks = 1\n",
    )
    .unwrap();
    let agg = f.aggregator().unwrap();
    assert_eq!(f.nodes[agg].name, "core");
    assert_eq!(check_route(&f, 0, agg, 0).len(), 2);
    assert_eq!(check_route(&f, agg, 1, 0).len(), 2);
}

#[test]
fn a_16k_rank_cluster_is_built_and_routed_fast() {
    let t = std::time::Instant::now();
    let f = example("cluster-2048x8.toml");
    let built = t.elapsed();
    assert_eq!(f.world, 16384);
    assert_eq!(f.hosts.len(), 2048);
    // 2 x 16384 scale-up + 2 x 16384 NIC + 2 x 512 leaves x 32 spines.
    assert_eq!(f.links.len(), 4 * 16384 + 2 * 512 * 32);
    assert!(built.as_secs_f64() < 5.0, "built in {built:?}");
    let topo = f.topology();
    assert_eq!(topo.hosts[5].ranks, (40..48).collect::<Vec<_>>());
    assert_eq!(topo.hosts[5].link_gbps, Some(3200.0));
    assert!(topo.is_two_tier());
    // A million routes in well under a second even unoptimised.
    let mut rng = Rng(11);
    let mut out = Vec::with_capacity(8);
    let t = std::time::Instant::now();
    let mut hops = 0;
    for i in 0..1_000_000u64 {
        out.clear();
        f.route(rng.below(16384), rng.below(16384), i, &mut out)
            .expect("a route");
        hops += out.len();
    }
    let routed = t.elapsed();
    assert!(hops > 0);
    eprintln!("built in {built:?}; 1M routes in {routed:?}");
    assert!(routed.as_secs_f64() < 10.0, "1M routes took {routed:?}");
    for _ in 0..2000 {
        let (a, b) = (rng.below(16384), rng.below(16384));
        let r = check_route(&f, a, b, rng.next());
        let hops = match () {
            _ if a == b => 0,
            _ if a / 8 == b / 8 => 2,
            _ if a % 8 == b % 8 && a / 8 / 32 == b / 8 / 32 => 2,
            _ => 4,
        };
        assert_eq!(r.len(), hops, "{a}->{b}");
    }
    // Shift by one leaf group of 32 hosts.
    let s = f.symmetry.as_ref().expect("symmetric");
    assert_eq!(s.node_map[0], 32 * 8);
    check_symmetry(&f, 5000, 5);
}

#[test]
fn ecmp_spreads_over_the_spines() {
    let f = example("cluster-128x8.toml");
    assert_eq!(f.world, 1024);
    let spines: Vec<usize> = (f.world..f.nodes.len())
        .filter(|&n| f.nodes[n].name.starts_with("spine"))
        .collect();
    assert_eq!(spines.len(), 32);
    // The ring's cross-host hop (rank 8h+7 to 8h+8) for every host and channel.
    let mut count = vec![0usize; f.nodes.len()];
    // One channel's ring hops (rank 8h+7 to 8h+8, across rails) never share a spine link,
    // inside a leaf group or into the next one.
    let mut seen = std::collections::HashSet::new();
    for h in 0..127 {
        let r = check_route(&f, h * 8 + 7, h * 8 + 8, 0);
        for l in &r[1..3] {
            assert!(
                seen.insert(*l),
                "host {h}'s hop shares {}",
                f.links[*l].name
            );
        }
    }
    for h in 0..127 {
        for ch in 0..8 {
            let r = check_route(&f, h * 8 + 7, h * 8 + 8, ch);
            assert_eq!(r.len(), 4);
            count[f.links[r[1]].to] += 1;
        }
    }
    let used: Vec<usize> = spines.iter().map(|&s| count[s]).collect();
    let (min, max) = (used.iter().min().unwrap(), used.iter().max().unwrap());
    assert!(*min > 0, "a spine is never used: {used:?}");
    assert!(*max <= 3 * 127 * 8 / 32, "ECMP is lopsided: {used:?}");
    // The same key and pair always take the same spine.
    assert_eq!(route(&f, 7, 300, 9), route(&f, 7, 300, 9));
    check_symmetry(&f, 3000, 9);
}

#[test]
fn small_clusters() {
    // One leaf group: no symmetry (a host's place in its group spreads its routes).
    let f = Fabric::parse("[cluster]\nhosts = 4\ngpus_per_host = 2\nspines = 3\n").unwrap();
    assert!(f.symmetry.is_none());
    // Two groups of 2 hosts: shift by one group.
    let f =
        Fabric::parse("[cluster]\nhosts = 4\ngpus_per_host = 2\nspines = 3\nhosts_per_leaf = 2\n")
            .unwrap();
    assert_eq!(f.symmetry.as_ref().unwrap().node_map[0], 4);
    check_symmetry(&f, 2000, 13);
    // One host: its ranks and their rails shift by one.
    let f = Fabric::parse("[cluster]\nhosts = 1\ngpus_per_host = 4\n").unwrap();
    assert_eq!(f.symmetry.as_ref().unwrap().node_map[0], 1);
    check_symmetry(&f, 200, 13);
}

#[test]
fn mixed_nic_generations() {
    let f = example("slow-rail.toml");
    // Rail 7 at 200 Gbit/s: its NIC links and its leaves' uplinks.
    let r = check_route(&f, 7, 8 * 20 + 7, 0);
    assert_eq!(f.links[r[0]].bytes_per_s, 25e9);
    assert_eq!(f.links[r[1]].bytes_per_s, 16.0 * 25e9 / 16.0);
    assert_eq!(f.links[check_route(&f, 6, 14, 0)[0]].bytes_per_s, 50e9);
    assert_eq!(f.topology().hosts[0].link_gbps, Some(7.0 * 400.0 + 200.0));
    check_symmetry(&f, 2000, 17); // every rail the same on every host: still symmetric
    let m = example("mixed-nics.toml");
    assert!(m.symmetry.is_none());
    assert_eq!(m.topology().hosts[3].link_gbps, Some(7.0 * 400.0 + 200.0));
    assert_eq!(m.topology().hosts[9].link_gbps, Some(3200.0));
    assert_eq!(
        m.links[check_route(&m, 3 * 8 + 3, 0, 0)[0]].bytes_per_s,
        25e9
    );
    assert_eq!(
        m.links[check_route(&m, 3 * 8 + 2, 0, 0)[0]].bytes_per_s,
        50e9
    );
}

#[test]
fn datacenters_are_joined_by_long_haul_links() {
    for km in [0.0, 100.0, 1000.0, 4000.0] {
        let f = example(&format!("two-dc-{km}km.toml"));
        assert_eq!(f.world, 64);
        // Rank 0 (dc0) to rank 32+3 (dc1): NIC, leaf->spine, spine->router, WAN,
        // router->spine, spine->leaf, NIC.
        let r = check_route(&f, 0, 35, 1);
        assert_eq!(r.len(), 7);
        let wan = &f.links[r[3]];
        assert_eq!(wan.name, "dc0.router->dc1.router");
        assert_eq!(wan.bytes_per_s, 400e9);
        assert!((wan.latency_s - (1e-6 + km * 5e-6)).abs() < 1e-12);
        // Inside a datacenter there is no long haul.
        assert_eq!(check_route(&f, 0, 9, 1).len(), 4);
        // The tuner sees the datacenters as its hosts.
        let t = f.topology();
        assert_eq!(t.hosts.len(), 2);
        assert_eq!(t.hosts[1].ranks, (32..64).collect::<Vec<_>>());
        assert_eq!(t.hosts[1].link_gbps, Some(3200.0));
        check_symmetry(&f, 3000, 19);
        assert_eq!(f.symmetry.as_ref().unwrap().node_map[0], 32);
    }
    // A star across datacenters.
    let f = Fabric::parse(
        "link_gbps = 1\n[wan]\ndistance_km = 1000\nlink_gbps = 10\n\
         [[hosts]]\nname = \"a\"\nranks = 1\ndc = 0\n[[hosts]]\nname = \"b\"\nranks = 1\ndc = 0\n\
         [[hosts]]\nname = \"c\"\nranks = 1\ndc = 1\n[[hosts]]\nname = \"d\"\nranks = 1\ndc = 1\n",
    )
    .unwrap();
    let r = check_route(&f, 0, 3, 0);
    assert_eq!(r.len(), 5);
    assert!((f.links[r[2]].latency_s - (10e-6 + 5e-3)).abs() < 1e-12);
    assert_eq!(check_route(&f, 0, 1, 0).len(), 4);
    check_symmetry(&f, 500, 23);
    assert_eq!(f.topology().hosts.len(), 4);
}

#[test]
fn spines_can_aggregate() {
    let f = Fabric::parse(
        "[cluster]\nhosts = 64\ngpus_per_host = 4\nspine_reduce_gbytes_per_s = 100\n",
    )
    .unwrap();
    let agg = f.aggregator().unwrap();
    assert_eq!(f.nodes[agg].name, "spine0");
    for r in [0, 5, 130, 255] {
        assert_eq!(check_route(&f, r, agg, 0).len(), 2);
        assert_eq!(check_route(&f, agg, r, 0).len(), 2);
    }
}

#[test]
fn a_fabric_built_by_hand_routes_by_shortest_paths() {
    // Ranks 0, 1, 2 on a line of switches 3 - 4, with a rank on each.
    let node = |name: &str, kind| Node {
        name: name.into(),
        kind,
    };
    let sw = NodeKind::Switch {
        reduce_bytes_per_s: None,
    };
    let mut links = Vec::new();
    for (a, b) in [(0, 3), (1, 3), (3, 4), (2, 4)] {
        for (x, y) in [(a, b), (b, a)] {
            links.push(Link {
                name: format!("{x}->{y}"),
                from: x,
                to: y,
                bytes_per_s: 1e9,
                latency_s: 0.0,
            });
        }
    }
    let f = Fabric {
        nodes: vec![
            node("r0", NodeKind::Rank { host: 0 }),
            node("r1", NodeKind::Rank { host: 0 }),
            node("r2", NodeKind::Rank { host: 1 }),
            node("s3", sw.clone()),
            node("s4", sw),
        ],
        links,
        world: 3,
        hosts: vec![("a".into(), vec![0, 1]), ("b".into(), vec![2])],
        reduce_bytes_per_s: 1e9,
        per_message_s: 0.0,
        scaleup_per_message_s: 0.0,
        symmetry: None,
        layout: Layout::default(),
    };
    assert_eq!(check_route(&f, 0, 2, 0).len(), 3);
    assert_eq!(check_route(&f, 2, 1, 0).len(), 3);
    assert_eq!(check_route(&f, 0, 1, 0).len(), 2);
    assert_eq!(check_route(&f, 4, 0, 0).len(), 2);
    assert!(f.reaches(0, 2));
    // A fresh clone routes the same.
    assert_eq!(route(&f.clone(), 0, 2, 0), route(&f, 0, 2, 0));
}

#[test]
fn bad_files_are_refused_with_the_field_and_value() {
    let cases: &[(&str, &str)] = &[
        (
            "[[hosts]]\nname = \"a\"\nranks = [0]\nlink_gbs = 1\n",
            "link_gbs",
        ),
        (
            "[[hosts]]\nname = \"a\"\nranks = [0]\nlink_gbps = -1\n",
            "link_gbps must be a finite number above 0, not -1",
        ),
        ("[[hosts]]\nname = \"a\"\nranks = [1]\n", "rank 0"),
        (
            "[[hosts]]\nname = \"a\"\nranks = [0]\n[[hosts]]\nname = \"b\"\nranks = [1]\n",
            "has no link_gbps",
        ),
        (
            "per_message_us = -3\n[[hosts]]\nname = \"a\"\nranks = 1\n",
            "per_message_us must be a finite number of at least 0, not -3",
        ),
        (
            "tuner_hosts = \"racks\"\n[[hosts]]\nname = \"a\"\nranks = 1\n",
            "tuner_hosts must be",
        ),
        (
            "[cluster]\nhosts = 0\ngpus_per_host = 8\n",
            "cluster.hosts must be at least 1, not 0",
        ),
        (
            "[cluster]\nhosts = 2\ngpus_per_host = 8\nnic_gbps = 0\n",
            "cluster.nic_gbps must be a finite number above 0, not 0",
        ),
        (
            "[cluster]\nhosts = 2\ngpus_per_host = 8\nrail_nic_gbps = [1]\n",
            "rail_nic_gbps has 1 rates",
        ),
        (
            "[cluster]\nhosts = 2\ngpus_per_host = 2\nnic_overrides = [{hosts = \"0-5\", gbps = 1}]\n",
            "host 5 is outside",
        ),
        (
            "[cluster]\nhosts = 2\ngpus_per_host = 2\nnic_overrides = [{hosts = \"x\", gbps = 1}]\n",
            "not \"x\"",
        ),
        (
            "[cluster]\nhosts = 2\ngpus_per_host = 2\nnic_overrides = [{hosts = \"0\", rails = [2], gbps = 1}]\n",
            "rail 2 is outside",
        ),
        (
            "[cluster]\nhosts = 3\ngpus_per_host = 2\n[wan]\ndatacenters = 2\ndistance_km = 1\nlink_gbps = 1\n",
            "split evenly",
        ),
        (
            "[cluster]\nhosts = 2\ngpus_per_host = 2\n[wan]\ndatacenters = 2\ndistance_km = -1\nlink_gbps = 1\n",
            "wan.distance_km must be a finite number of at least 0, not -1",
        ),
        (
            "[cluster]\nhosts = 2\ngpus_per_host = 2\nracks = 3\n",
            "racks",
        ),
        (
            "[cluster]\nhosts = 2\ngpus_per_host = 2\n[[hosts]]\nname = \"a\"\nranks = 1\n",
            "not both",
        ),
        ("", "neither hosts nor cluster"),
        (
            "link_efficiency = 1.2\n[[hosts]]\nname = \"a\"\nranks = 1\n",
            "link_efficiency must be a share of the nominal rate, above 0 and at most 1, not 1.2",
        ),
        (
            "{\"hosts\": [{\"name\": \"a\", \"ranks\": [0], \"dc\": 1}]}",
            "no [wan]",
        ),
        ("{\"hosts\": [", "invalid topology JSON"),
    ];
    for (text, want) in cases {
        let err = Fabric::parse(text).expect_err(text);
        assert!(err.contains(want), "{text:?}: {err:?} lacks {want:?}");
    }
    let err = Fabric::from_file("/nonexistent/t.toml").unwrap_err();
    assert!(err.contains("/nonexistent/t.toml"), "{err}");
}

#[test]
fn every_example_builds_and_routes() {
    let mut n = 0;
    for e in std::fs::read_dir(examples()).unwrap() {
        let path = e.unwrap().path();
        if path.extension().and_then(|x| x.to_str()) != Some("toml") {
            continue;
        }
        let f = Fabric::from_file(&path).unwrap();
        let mut rng = Rng(29);
        for _ in 0..500 {
            check_route(&f, rng.below(f.world), rng.below(f.world), rng.next());
        }
        f.topology().validate(f.world).unwrap();
        n += 1;
    }
    assert!(n >= 10, "{n} examples");
}
