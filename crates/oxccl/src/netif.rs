//! Which address a rank's tcp listener binds and advertises to its peers.
//!
//! In order:
//! 1. `OXCCL_TCP_ADDR` (`IP` or `IP:port`): that address.
//! 2. `OXCCL_SOCKET_IFNAME`, with `NCCL_SOCKET_IFNAME`'s syntax: a comma-separated list of
//!    interface-name prefixes (`eth,ens`); a leading `^` excludes the listed ones instead
//!    (`^docker,lo`); a leading `=` (after the `^`, if any) makes the names exact
//!    (`=eth0`, `^=docker0`). The first matching interface, in the system's order, with an
//!    address of the store's family (IPv4 unless the store is reached over IPv6).
//!    Loopback matches only when named.
//! 3. By default, the address of the interface that routes to the rendezvous store: the
//!    local address of this rank's store connection (on the rank that serves the store, the
//!    source address the kernel picks for the store's address). That is what a peer reached
//!    the store through, so it is the address most likely reachable from the other hosts.
//!    When that is a loopback address but the job spans several hosts (a host name that
//!    resolves to `127.0.1.1` on its own host, a store on `localhost`), the interface on the
//!    same subnet as another host's address is taken, else the first interface that is up
//!    and neither loopback, link-local nor a container bridge.
//!
//! [`choose`] is a pure function of the interfaces, the settings and what the hosts saw, so
//! that every case is unit-tested; [`interfaces`] reads the real ones.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

/// One address of a network interface of this host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Iface {
    /// The interface's name (`eth0`).
    pub name: String,
    /// One of its addresses.
    pub ip: IpAddr,
    /// The prefix length of that address's subnet.
    pub prefix_len: u8,
}

impl Iface {
    /// Whether `ip` lies in this address's subnet.
    pub fn same_subnet(&self, ip: IpAddr) -> bool {
        let bits = |a: IpAddr| -> (u128, u8) {
            match a {
                IpAddr::V4(v) => (u128::from(u32::from(v)), 32),
                IpAddr::V6(v) => (u128::from(v), 128),
            }
        };
        let ((a, wa), (b, wb)) = (bits(self.ip), bits(ip));
        if wa != wb || self.prefix_len > wa {
            return false;
        }
        let shift = u32::from(wa - self.prefix_len);
        shift >= u32::from(wa) || (a >> shift) == (b >> shift)
    }
}

/// The addresses of this host's interfaces that are up (not `down` in
/// `/sys/class/net/*/operstate`), in the system's order.
pub fn interfaces() -> std::io::Result<Vec<Iface>> {
    let up = |name: &str| {
        std::fs::read_to_string(format!("/sys/class/net/{name}/operstate"))
            .map_or(true, |s| s.trim() != "down")
    };
    Ok(if_addrs::get_if_addrs()?
        .into_iter()
        .filter(|i| up(&i.name))
        .map(|i| Iface {
            prefix_len: match &i.addr {
                if_addrs::IfAddr::V4(a) => a.prefixlen,
                if_addrs::IfAddr::V6(a) => a.prefixlen,
            },
            ip: i.ip(),
            name: i.name,
        })
        .collect())
}

/// `OXCCL_SOCKET_IFNAME`: which interfaces may carry tcp traffic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IfnameFilter {
    exclude: bool,
    exact: bool,
    names: Vec<String>,
}

impl std::str::FromStr for IfnameFilter {
    type Err = String;
    fn from_str(s: &str) -> Result<IfnameFilter, String> {
        let mut rest = s.trim();
        let exclude = rest.starts_with('^');
        if exclude {
            rest = &rest[1..];
        }
        let exact = rest.starts_with('=');
        if exact {
            rest = &rest[1..];
        }
        let names: Vec<String> = rest
            .split(',')
            .map(|n| n.trim().to_owned())
            .filter(|n| !n.is_empty())
            .collect();
        if names.is_empty() {
            return Err(format!(
                "{s:?} names no interface (expected e.g. eth0, eth,ens, =eth0 or ^docker,lo)"
            ));
        }
        Ok(IfnameFilter {
            exclude,
            exact,
            names,
        })
    }
}

impl std::fmt::Display for IfnameFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (x, e) = (
            if self.exclude { "^" } else { "" },
            if self.exact { "=" } else { "" },
        );
        write!(f, "{x}{e}{}", self.names.join(","))
    }
}

impl IfnameFilter {
    /// Whether interface `name` may be used.
    pub fn matches(&self, name: &str) -> bool {
        let listed = self.names.iter().any(|n| {
            if self.exact {
                name == n
            } else {
                name.starts_with(n.as_str())
            }
        });
        listed != self.exclude
    }

    /// Whether the filter names `name` explicitly (so that loopback may be used).
    fn names_it(&self, name: &str) -> bool {
        !self.exclude && self.matches(name)
    }
}

/// How the address was chosen, for logs and error messages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum How {
    /// `OXCCL_TCP_ADDR`.
    TcpAddr,
    /// `OXCCL_SOCKET_IFNAME` (the filter, as given).
    Ifname(String),
    /// The interface that routes to the store.
    StoreRoute,
    /// The store route was loopback in a job of several hosts: the interface on another
    /// host's subnet.
    PeerSubnet,
    /// The store route was loopback (or unknown) in a job of several hosts, and no interface
    /// shares a subnet with another host: the first usable interface.
    FirstUsable,
    /// One host and no route to the store known: loopback.
    Loopback,
}

/// The address a rank's tcp listener uses, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chosen {
    /// The address.
    pub ip: IpAddr,
    /// Its port, when `OXCCL_TCP_ADDR` fixes one (0: any free port).
    pub port: u16,
    /// The interface that has it (`?` when no interface lists it).
    pub iface: String,
    /// Why it was chosen.
    pub how: How,
}

impl std::fmt::Display for Chosen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let why = match &self.how {
            How::TcpAddr => "set by OXCCL_TCP_ADDR".to_owned(),
            How::Ifname(s) => format!("OXCCL_SOCKET_IFNAME={s}"),
            How::StoreRoute => "routes to the store".to_owned(),
            How::PeerSubnet => "the store route is loopback; on another host's subnet".to_owned(),
            How::FirstUsable => "the store route is loopback; first usable interface".to_owned(),
            How::Loopback => "one host".to_owned(),
        };
        if self.port == 0 {
            write!(f, "{} ({}: {why})", self.ip, self.iface)
        } else {
            let a = std::net::SocketAddr::new(self.ip, self.port);
            write!(f, "{a} ({}: {why})", self.iface)
        }
    }
}

/// What [`choose`] is told: the user's settings and what the ranks saw.
#[derive(Clone, Debug, Default)]
pub struct Want<'a> {
    /// `OXCCL_TCP_ADDR`.
    pub tcp_addr: Option<std::net::SocketAddr>,
    /// `OXCCL_SOCKET_IFNAME`.
    pub ifname: Option<&'a IfnameFilter>,
    /// This rank's route to the store ([`oxccl_bootstrap::Bootstrap::route_addr`]).
    pub route: Option<IpAddr>,
    /// The routes of the ranks on other hosts (empty on one host).
    pub others: &'a [IpAddr],
}

fn usable_default(i: &Iface) -> bool {
    const VIRTUAL: [&str; 4] = ["docker", "virbr", "veth", "br-"];
    !i.ip.is_loopback()
        && !is_link_local(i.ip)
        && !i.ip.is_unspecified()
        && !VIRTUAL.iter().any(|p| i.name.starts_with(p))
}

fn is_link_local(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v) => v.is_link_local(),
        IpAddr::V6(v) => (v.segments()[0] & 0xffc0) == 0xfe80,
    }
}

/// The address to bind and advertise; see the module's documentation for the order.
pub fn choose(ifaces: &[Iface], want: &Want<'_>) -> Result<Chosen, String> {
    let name_of = |ip: IpAddr| {
        ifaces
            .iter()
            .find(|i| i.ip == ip)
            .map_or_else(|| "?".to_owned(), |i| i.name.clone())
    };
    let listing = || {
        let all: Vec<String> = ifaces
            .iter()
            .map(|i| format!("{} {}", i.name, i.ip))
            .collect();
        if all.is_empty() {
            "none".to_owned()
        } else {
            all.join(", ")
        }
    };
    if let Some(a) = want.tcp_addr {
        return Ok(Chosen {
            ip: a.ip(),
            port: a.port(),
            iface: name_of(a.ip()),
            how: How::TcpAddr,
        });
    }
    let v6 =
        want.route.is_some_and(|r| r.is_ipv6()) || want.others.first().is_some_and(|r| r.is_ipv6());
    if let Some(f) = want.ifname {
        let ok = |i: &&Iface| {
            f.matches(&i.name)
                && (!i.ip.is_loopback() || f.names_it(&i.name))
                && !i.ip.is_unspecified()
        };
        let family = |i: &&Iface| i.ip.is_ipv6() == v6;
        let pick = ifaces
            .iter()
            .filter(ok)
            .filter(|i| !is_link_local(i.ip))
            .find(family)
            .or_else(|| ifaces.iter().filter(ok).find(|i| !is_link_local(i.ip)))
            .ok_or_else(|| {
                format!(
                    "OXCCL_SOCKET_IFNAME={f} matches no interface with a usable address \
                     (this host has: {})",
                    listing()
                )
            })?;
        return Ok(Chosen {
            ip: pick.ip,
            port: 0,
            iface: pick.name.clone(),
            how: How::Ifname(f.to_string()),
        });
    }
    let multi_host = !want.others.is_empty();
    match want.route {
        Some(r) if !(r.is_loopback() && multi_host) => {
            return Ok(Chosen {
                ip: r,
                port: 0,
                iface: name_of(r),
                how: How::StoreRoute,
            });
        }
        None if !multi_host => {
            return Ok(Chosen {
                ip: IpAddr::from([127, 0, 0, 1]),
                port: 0,
                iface: name_of(IpAddr::from([127, 0, 0, 1])),
                how: How::Loopback,
            });
        }
        _ => {}
    }
    // Several hosts, and the store route says nothing useful.
    let subnet = ifaces.iter().filter(|i| usable_default(i)).find(|i| {
        want.others
            .iter()
            .any(|&o| !o.is_loopback() && i.same_subnet(o))
    });
    let (pick, how) = match subnet {
        Some(i) => (i, How::PeerSubnet),
        None => {
            let first = ifaces
                .iter()
                .filter(|i| usable_default(i))
                .find(|i| i.ip.is_ipv6() == v6)
                .or_else(|| ifaces.iter().find(|i| usable_default(i)));
            let Some(i) = first else {
                return Err(format!(
                    "the job spans several hosts but this host routes to the store over \
                     loopback ({}) and has no other usable interface (it has: {}); set \
                     OXCCL_SOCKET_IFNAME or OXCCL_TCP_ADDR",
                    want.route
                        .map_or_else(|| "no route known".to_owned(), |r| r.to_string()),
                    listing()
                ));
            };
            (i, How::FirstUsable)
        }
    };
    Ok(Chosen {
        ip: pick.ip,
        port: 0,
        iface: pick.name.clone(),
        how,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iface(name: &str, ip: &str, prefix_len: u8) -> Iface {
        Iface {
            name: name.into(),
            ip: ip.parse().unwrap(),
            prefix_len,
        }
    }

    fn host() -> Vec<Iface> {
        vec![
            iface("lo", "127.0.0.1", 8),
            iface("docker0", "172.17.0.1", 16),
            iface("eth0", "10.98.0.2", 24),
            iface("eth1", "192.168.5.7", 24),
            iface("ib0", "10.200.0.2", 16),
            iface("lo", "::1", 128),
            iface("eth0", "fe80::1", 64),
            iface("eth0", "fd00::2", 64),
        ]
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn ifname_syntax_is_ncclss() {
        let f: IfnameFilter = "eth".parse().unwrap();
        assert!(f.matches("eth0") && f.matches("eth12") && !f.matches("ib0"));
        let f: IfnameFilter = "=eth0".parse().unwrap();
        assert!(f.matches("eth0") && !f.matches("eth01"));
        let f: IfnameFilter = "^docker,lo".parse().unwrap();
        assert!(!f.matches("docker0") && !f.matches("lo") && f.matches("eth0"));
        let f: IfnameFilter = "^=docker0".parse().unwrap();
        assert!(!f.matches("docker0") && f.matches("docker1"));
        let f: IfnameFilter = " eth , ens ".parse().unwrap();
        assert!(f.matches("ens3") && f.matches("eth0") && !f.matches("lo"));
        assert_eq!(f.to_string(), "eth,ens");
        assert!("".parse::<IfnameFilter>().is_err());
        assert!(
            "^=".parse::<IfnameFilter>()
                .unwrap_err()
                .contains("names no interface")
        );
    }

    #[test]
    fn tcp_addr_wins() {
        let want = Want {
            tcp_addr: Some("10.98.0.2:5000".parse().unwrap()),
            ifname: Some(&"ib".parse().unwrap()),
            route: Some(ip("192.168.5.7")),
            others: &[],
        };
        let c = choose(&host(), &want).unwrap();
        assert_eq!(
            (c.ip, c.port, c.iface.as_str()),
            (ip("10.98.0.2"), 5000, "eth0")
        );
        assert_eq!(c.how, How::TcpAddr);
    }

    #[test]
    fn ifname_picks_the_first_match_of_the_stores_family() {
        let f: IfnameFilter = "eth".parse().unwrap();
        let mut want = Want {
            ifname: Some(&f),
            route: Some(ip("10.0.0.9")),
            ..Want::default()
        };
        let c = choose(&host(), &want).unwrap();
        assert_eq!((c.ip, c.iface.as_str()), (ip("10.98.0.2"), "eth0"));
        assert_eq!(c.to_string(), "10.98.0.2 (eth0: OXCCL_SOCKET_IFNAME=eth)");
        // An IPv6 store: the interface's global IPv6 address, never the link-local one.
        want.route = Some(ip("fd00::1"));
        assert_eq!(choose(&host(), &want).unwrap().ip, ip("fd00::2"));
        // Exclusion skips docker and loopback.
        let f: IfnameFilter = "^docker,eth".parse().unwrap();
        want.ifname = Some(&f);
        want.route = None;
        assert_eq!(choose(&host(), &want).unwrap().iface, "ib0");
        // Loopback only when named (an exclusion list never selects it).
        let f: IfnameFilter = "^eth,ib,docker".parse().unwrap();
        want.ifname = Some(&f);
        assert!(choose(&host(), &want).is_err());
        let f: IfnameFilter = "=lo".parse().unwrap();
        want.ifname = Some(&f);
        assert_eq!(choose(&host(), &want).unwrap().ip, ip("127.0.0.1"));
        let f: IfnameFilter = "=eth9".parse().unwrap();
        want.ifname = Some(&f);
        let e = choose(&host(), &want).unwrap_err();
        assert!(
            e.contains("=eth9 matches no interface") && e.contains("eth1 192.168.5.7"),
            "{e}"
        );
    }

    #[test]
    fn default_is_the_route_to_the_store() {
        let want = Want {
            route: Some(ip("192.168.5.7")),
            others: &[ip("192.168.5.8")],
            ..Want::default()
        };
        let c = choose(&host(), &want).unwrap();
        assert_eq!(
            (c.ip, c.iface.as_str(), &c.how),
            (ip("192.168.5.7"), "eth1", &How::StoreRoute)
        );
        assert_eq!(c.to_string(), "192.168.5.7 (eth1: routes to the store)");
        // One host: loopback is right.
        let want = Want {
            route: Some(ip("127.0.0.1")),
            ..Want::default()
        };
        assert_eq!(choose(&host(), &want).unwrap().iface, "lo");
        let c = choose(&host(), &Want::default()).unwrap();
        assert_eq!((c.ip, c.how), (ip("127.0.0.1"), How::Loopback));
    }

    #[test]
    fn loopback_route_across_hosts_falls_back_to_a_reachable_interface() {
        // Rank 0's host name resolves to 127.0.1.1 on its own host; the others reached it
        // over 10.200.0.0/16.
        let want = Want {
            route: Some(ip("127.0.1.1")),
            others: &[ip("10.200.0.3"), ip("10.200.0.4")],
            ..Want::default()
        };
        let c = choose(&host(), &want).unwrap();
        assert_eq!(
            (c.ip, c.iface.as_str(), &c.how),
            (ip("10.200.0.2"), "ib0", &How::PeerSubnet)
        );
        // No shared subnet: the first usable interface (not docker, not loopback).
        let want = Want {
            route: Some(ip("127.0.1.1")),
            others: &[ip("172.30.0.3")],
            ..Want::default()
        };
        let c = choose(&host(), &want).unwrap();
        assert_eq!((c.iface.as_str(), c.how), ("eth0", How::FirstUsable));
        // Nothing but loopback: an error that says what to set.
        let e = choose(&host()[..1], &want).unwrap_err();
        assert!(e.contains("set OXCCL_SOCKET_IFNAME"), "{e}");
    }

    #[test]
    fn subnets() {
        let i = iface("eth0", "10.98.0.2", 24);
        assert!(i.same_subnet(ip("10.98.0.200")) && !i.same_subnet(ip("10.98.1.2")));
        assert!(!i.same_subnet(ip("fd00::2")));
        let i = iface("eth0", "fd00::2", 64);
        assert!(i.same_subnet(ip("fd00::9")) && !i.same_subnet(ip("fd01::2")));
        assert!(iface("x", "1.2.3.4", 0).same_subnet(ip("9.9.9.9")));
    }

    #[test]
    fn real_interfaces_include_loopback() {
        let all = interfaces().unwrap();
        assert!(all.iter().any(|i| i.ip == ip("127.0.0.1")), "{all:?}");
    }
}
