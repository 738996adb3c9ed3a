//! Fabrics built in code for the simulator's tests.
#![allow(dead_code)]

use oxccl_sim::{Fabric, Link, Node, NodeKind};

/// Link and host parameters of [`cluster`].
#[derive(Clone, Copy, Debug)]
pub struct Params {
    /// Hosts.
    pub hosts: usize,
    /// Ranks per host.
    pub per: usize,
    /// Rate of each rank's NIC link to the core switch, each direction (bytes/s).
    pub nic: f64,
    /// Rate of each rank's link to its host's scale-up switch (bytes/s; used when per > 1).
    pub up: f64,
    /// Latency of every link (s).
    pub lat: f64,
    /// Per-message cost (s).
    pub o: f64,
    /// Reduce rate of a rank (bytes/s).
    pub reduce: f64,
    /// Reduce rate of the core switch, if it aggregates.
    pub core_reduce: Option<f64>,
    /// Give the fabric its shift-by-one-host symmetry.
    pub symmetric: bool,
}

impl Params {
    pub fn star(ranks: usize) -> Params {
        Params {
            hosts: ranks,
            per: 1,
            nic: 1e9,
            up: 1e10,
            lat: 1e-6,
            o: 5e-6,
            reduce: 4e9,
            core_reduce: None,
            symmetric: true,
        }
    }
}

/// `hosts` hosts of `per` ranks: each rank has links to and from its host's scale-up switch
/// (when per > 1) and a NIC link to and from one core switch. Links are laid out host by
/// host, so that shifting by one host is an automorphism with its routes.
pub fn cluster(p: Params) -> Fabric {
    let world = p.hosts * p.per;
    let mut nodes: Vec<Node> = (0..world)
        .map(|r| Node {
            name: format!("r{r}"),
            kind: NodeKind::Rank { host: r / p.per },
        })
        .collect();
    let nvs0 = world;
    if p.per > 1 {
        for h in 0..p.hosts {
            nodes.push(Node {
                name: format!("h{h}.nvs"),
                kind: NodeKind::Switch {
                    reduce_bytes_per_s: None,
                },
            });
        }
    }
    let core = nodes.len();
    nodes.push(Node {
        name: "core".into(),
        kind: NodeKind::Switch {
            reduce_bytes_per_s: p.core_reduce,
        },
    });
    let mut links = Vec::new();
    let mut link = |name: String, from: usize, to: usize, rate: f64| {
        links.push(Link {
            name,
            from,
            to,
            bytes_per_s: rate,
            latency_s: p.lat,
        })
    };
    for h in 0..p.hosts {
        for l in 0..p.per {
            let r = h * p.per + l;
            if p.per > 1 {
                link(format!("r{r}->nvs"), r, nvs0 + h, p.up);
                link(format!("nvs->r{r}"), nvs0 + h, r, p.up);
            }
            link(format!("r{r}->core"), r, core, p.nic);
            link(format!("core->r{r}"), core, r, p.nic);
        }
    }
    let mut f = Fabric {
        nodes,
        links,
        world,
        hosts: (0..p.hosts)
            .map(|h| (format!("h{h}"), (h * p.per..(h + 1) * p.per).collect()))
            .collect(),
        reduce_bytes_per_s: p.reduce,
        per_message_s: p.o,
        scaleup_per_message_s: p.o,
        symmetry: None,
        layout: Default::default(),
    };
    if p.symmetric && p.hosts > 1 {
        let n = f.nodes.len();
        let node_map: Vec<usize> = (0..n)
            .map(|x| {
                if x < world {
                    (x + p.per) % world
                } else if p.per > 1 && x < nvs0 + p.hosts {
                    nvs0 + (x - nvs0 + 1) % p.hosts
                } else {
                    x
                }
            })
            .collect();
        f.symmetry = Some(f.check_symmetry(node_map).expect("a symmetry"));
    }
    f
}

/// Relative difference.
pub fn rel(a: f64, b: f64) -> f64 {
    if a == b {
        0.0
    } else {
        (a - b).abs() / a.abs().max(b.abs())
    }
}
