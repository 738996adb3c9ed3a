//! How an engine is set up: [`EngineConfig`], from code or from `OXCCL_KV_*` variables.

use std::net::SocketAddr;
use std::time::Duration;

use oxccl_bootstrap::{Secret, parse_size};
pub use oxccl_verbs::Encrypt;

use crate::error::{Error, Result};

/// How long a wait spins before it sleeps, by default ([`EngineConfig::spin`]).
pub const DEFAULT_SPIN: Duration = Duration::from_micros(20);

/// Which verbs provider carries a segment's data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// shm to segments on this host (kernel bypass, no syscall on the data path), tcp to the
    /// others.
    Auto,
    /// shm only: every segment must be on this host.
    Shm,
    /// tcp for every segment, also on this host.
    Tcp,
}

impl std::str::FromStr for Protocol {
    type Err = Error;
    fn from_str(s: &str) -> Result<Protocol> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(Protocol::Auto),
            "shm" => Ok(Protocol::Shm),
            "tcp" => Ok(Protocol::Tcp),
            // Mooncake's users ask for "rdma": the fastest path oxccl has, kernel bypass inside
            // a host and tcp (RDMA's model over sockets) across hosts.
            "rdma" => Ok(Protocol::Auto),
            _ => Err(Error::arg(format!(
                "protocol {s:?}: expected auto, shm or tcp"
            ))),
        }
    }
}

/// An engine's settings. [`EngineConfig::new`] gives the defaults; [`EngineConfig::from_env`]
/// reads the environment once, at the top (the library never reads it later).
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// The segment name peers open this engine by. `None`: the handshake address (`IP:port`),
    /// which is what the peer-to-peer metadata backend needs.
    pub name: Option<String>,
    /// The address the handshake listener and the tcp provider bind (`IP`, or `IP:port` for a
    /// fixed handshake port). Peers on other hosts must be able to reach it.
    pub local_addr: SocketAddr,
    /// Which provider carries the data.
    pub protocol: Protocol,
    /// tcp: connections (lanes) of an opened segment's queue pair: the tcp provider stripes
    /// large WRITEs over them and reads them with as many progress threads (up to 4). With more
    /// than one, requests larger than `slice_size` are split into slices.
    pub lanes: usize,
    /// tcp: bytes per slice (work request) of a large request.
    pub slice_size: usize,
    /// The default timeout of every wait (a batch, a lookup, a handshake).
    pub timeout: Duration,
    /// How long a peer may stop answering before its requests fail (the queue pairs' timeout):
    /// a dead target is noticed within this time.
    pub peer_timeout: Duration,
    /// How often the engine checks that its descriptor is still published, and publishes it
    /// again when a metadata server restarted empty.
    pub republish_every: Duration,
    /// The job secret every handshake proves (`OXCCL_SECRET`): a stranger opens no segment.
    pub secret: Secret,
    /// Busy polling (`OXCCL_KV_POLL=busy`): a waiting caller polls without sleeping and the tcp
    /// provider's progress threads poll their sockets, for the shortest round trip at the cost
    /// of a core each while they wait. By default they sleep (`OXCCL_KV_POLL=sleep`).
    pub busy_poll: bool,
    /// How long a wait for a completion spins (polling) before it sleeps, in the sleeping
    /// mode (`OXCCL_KV_SPIN_US`; default [`DEFAULT_SPIN`], 20 us). A short request's answer
    /// then often comes while the waiter is still awake: a synchronous 4 KiB WRITE over tcp
    /// loopback took 27-38 us with it and 57-76 us without, when a thread that sleeps at once
    /// costs two wake-ups per round trip of 25 us or more each (a 2-vCPU VM); the waiter is
    /// then on a core for most of a stream of such requests (80 % against 40 %; Mooncake's
    /// synchronous call polls, 100 %). A long wait sleeps after the spin, and a long tcp batch
    /// (1 MiB and more) never spins. 0 sleeps in the provider's wait (`epoll_wait` for tcp, a
    /// futex for shm) at once.
    pub spin: Duration,
    /// tcp: progress threads (shards) of each context (`OXCCL_KV_PROGRESS_THREADS`; 0, the
    /// default: one per lane up to 4 when sleeping, 1 when busy-polling, since every shard's
    /// thread then spins on a core of its own).
    pub progress_threads: usize,
    /// Queue pairs one peer may have connected to this engine at once
    /// (`OXCCL_KV_MAX_PEER_QPS`; default 128). A peer is the IP address its handshake
    /// connection comes from: the names peers prove are whatever they claim (any holder of the
    /// job secret may claim any name, and a new one each time), the address is the one thing
    /// an authenticated peer cannot choose. Every engine of one host shares its host's
    /// allowance, so the default leaves room for a host of many engines, each opening this
    /// segment once. A peer over the cap is refused with an error naming it.
    pub max_peer_qps: usize,
    /// Authenticated handshake connections one peer may hold open to this engine at once
    /// (`OXCCL_KV_MAX_PEER_CONNS`; default 256): each opened segment keeps one (for its
    /// service calls), and each is a thread here. A peer as for `max_peer_qps`.
    pub max_peer_conns: usize,
    /// tcp connections (lanes) one peer may have connected to this engine at once, over all its
    /// queue pairs (`OXCCL_KV_MAX_PEER_LANES`; default 512). A peer as for `max_peer_qps`.
    pub max_peer_lanes: usize,
    /// Notifications kept until [`get_notifies`](crate::TransferEngine::get_notifies) takes
    /// them (`OXCCL_KV_NOTIFY_QUEUE`; default 4096, each at most
    /// [`MAX_NOTIFY`](crate::MAX_NOTIFY) bytes). When full the oldest is dropped and counted
    /// ([`notifies_dropped`](crate::TransferEngine::notifies_dropped)), with a warning at the
    /// first drop.
    pub notify_queue: usize,
    /// How long a lookup of the peer-to-peer backend keeps retrying an address where nobody
    /// listens (connection refused) before it fails (`OXCCL_KV_CONNECT_RETRY`, seconds;
    /// default 1): a peer that is starting gets this long, a wrong address fails in about this
    /// long instead of the whole `timeout`.
    pub connect_retry: Duration,
    /// Whether the tcp lanes are encrypted and authenticated (`OXCCL_ENCRYPT=off|on|auto`;
    /// default auto: the lanes to a segment on another host, not those on this one; shm never
    /// leaves the host and is never encrypted). Both ends must agree: a segment opened with a
    /// different wish is refused, saying which side wants what. The handshake connection is
    /// encrypted always.
    pub encrypt: Encrypt,
}

impl EngineConfig {
    /// The defaults, with `secret`: a loopback address, [`Protocol::Auto`], 2 lanes of 1 MiB
    /// slices, 30 s waits, 5 s to notice a dead peer, a republish check every second.
    pub fn new(secret: Secret) -> EngineConfig {
        EngineConfig {
            name: None,
            local_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            protocol: Protocol::Auto,
            lanes: 2,
            slice_size: 1 << 20,
            timeout: Duration::from_secs(30),
            peer_timeout: Duration::from_secs(5),
            republish_every: Duration::from_secs(1),
            secret,
            busy_poll: false,
            spin: DEFAULT_SPIN,
            progress_threads: 0,
            max_peer_qps: 128,
            max_peer_conns: 256,
            max_peer_lanes: 512,
            notify_queue: 4096,
            connect_retry: Duration::from_secs(1),
            encrypt: Encrypt::Auto,
        }
    }

    /// The defaults overridden by the environment: `OXCCL_SECRET` (or `OXCCL_SECRET_FILE`;
    /// required), `OXCCL_KV_NAME`, `OXCCL_KV_ADDR` (`IP` or `IP:port`), `OXCCL_KV_PROTOCOL`,
    /// `OXCCL_KV_LANES`, `OXCCL_KV_SLICE` (bytes, `K`/`M` suffixes), `OXCCL_KV_TIMEOUT` and
    /// `OXCCL_KV_PEER_TIMEOUT` (seconds), `OXCCL_KV_POLL` (`busy` or `sleep`), `OXCCL_KV_SPIN_US`,
    /// `OXCCL_KV_PROGRESS_THREADS`,
    /// `OXCCL_KV_MAX_PEER_QPS`, `OXCCL_KV_MAX_PEER_CONNS`, `OXCCL_KV_MAX_PEER_LANES`, `OXCCL_KV_NOTIFY_QUEUE` (counts) and
    /// `OXCCL_KV_CONNECT_RETRY` (seconds), `OXCCL_ENCRYPT` (`off`, `on` or `auto`). A
    /// malformed value is an error naming the variable.
    pub fn from_env() -> Result<EngineConfig> {
        EngineConfig::from_vars(&|k| std::env::var(k).ok())
    }

    /// [`EngineConfig::from_env`] over any variable source.
    pub fn from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<EngineConfig> {
        // No secret set: the per-user secret file, as for a communicator.
        let secret = Secret::from_vars_or_user_file(var).map_err(|e| Error::arg(e.to_string()))?;
        let mut c = EngineConfig::new(secret);
        let get = |k: &str| {
            var(k)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        c.name = get("OXCCL_KV_NAME");
        if let Some(a) = get("OXCCL_KV_ADDR") {
            c.local_addr = oxccl_verbs::parse_ip_or_sockaddr(&a).ok_or_else(|| {
                Error::arg(format!(
                    "OXCCL_KV_ADDR={a:?} is not an IP address or IP:port"
                ))
            })?;
        }
        if let Some(p) = get("OXCCL_KV_PROTOCOL") {
            c.protocol = p
                .parse()
                .map_err(|e| Error::arg(format!("OXCCL_KV_PROTOCOL: {e}")))?;
        }
        if let Some(v) = get("OXCCL_KV_LANES") {
            c.lanes = v
                .parse()
                .ok()
                .filter(|&n| (1..=64).contains(&n))
                .ok_or_else(|| Error::arg(format!("OXCCL_KV_LANES={v:?}: expected 1 to 64")))?;
        }
        if let Some(v) = get("OXCCL_KV_SLICE") {
            c.slice_size = parse_size(&v).filter(|&n| n >= 4096).ok_or_else(|| {
                Error::arg(format!(
                    "OXCCL_KV_SLICE={v:?}: expected a size of at least 4K"
                ))
            })?;
        }
        // (Its error names the variable and the value.)
        c.encrypt = Encrypt::from_vars(&|k| get(k)).map_err(|e| Error::arg(e.to_string()))?;
        if let Some(v) = get("OXCCL_KV_POLL") {
            c.busy_poll = match v.to_ascii_lowercase().as_str() {
                "busy" => true,
                "sleep" => false,
                _ => {
                    return Err(Error::arg(format!(
                        "OXCCL_KV_POLL={v:?}: expected busy or sleep"
                    )));
                }
            };
        }
        if let Some(v) = get("OXCCL_KV_SPIN_US") {
            c.spin = v
                .parse::<u64>()
                .ok()
                .filter(|&us| us <= 1_000_000)
                .map(Duration::from_micros)
                .ok_or_else(|| {
                    Error::arg(format!(
                        "OXCCL_KV_SPIN_US={v:?}: expected microseconds from 0 to 1000000"
                    ))
                })?;
        }
        if let Some(v) = get("OXCCL_KV_PROGRESS_THREADS") {
            c.progress_threads = v
                .parse::<usize>()
                .ok()
                .filter(|&n| n <= 16)
                .ok_or_else(|| {
                    Error::arg(format!(
                        "OXCCL_KV_PROGRESS_THREADS={v:?}: expected 0 (automatic) to 16"
                    ))
                })?;
        }
        for (k, slot) in [
            ("OXCCL_KV_MAX_PEER_QPS", &mut c.max_peer_qps),
            ("OXCCL_KV_MAX_PEER_CONNS", &mut c.max_peer_conns),
            ("OXCCL_KV_MAX_PEER_LANES", &mut c.max_peer_lanes),
            ("OXCCL_KV_NOTIFY_QUEUE", &mut c.notify_queue),
        ] {
            if let Some(v) = get(k) {
                *slot = v
                    .parse::<usize>()
                    .ok()
                    .filter(|&n| n >= 1)
                    .ok_or_else(|| Error::arg(format!("{k}={v:?}: expected a count >= 1")))?;
            }
        }
        for (k, slot) in [
            ("OXCCL_KV_TIMEOUT", &mut c.timeout),
            ("OXCCL_KV_PEER_TIMEOUT", &mut c.peer_timeout),
            ("OXCCL_KV_CONNECT_RETRY", &mut c.connect_retry),
        ] {
            if let Some(v) = get(k) {
                *slot = v
                    .parse::<f64>()
                    .ok()
                    .filter(|s| s.is_finite() && *s > 0.0)
                    .map(Duration::from_secs_f64)
                    .ok_or_else(|| Error::arg(format!("{k}={v:?}: expected seconds > 0")))?;
            }
        }
        Ok(c)
    }

    /// Checks the values against each other.
    pub(crate) fn check(&self) -> Result<()> {
        if self.lanes == 0 || self.lanes > 64 {
            return Err(Error::arg(format!(
                "lanes = {}: expected 1 to 64",
                self.lanes
            )));
        }
        if self.slice_size < 4096 || self.slice_size > (1 << 30) {
            return Err(Error::arg(format!(
                "slice_size = {}: expected 4 KiB to 1 GiB",
                self.slice_size
            )));
        }
        if let Some(n) = &self.name
            && (n.is_empty() || n.len() > 1024)
        {
            return Err(Error::arg(format!(
                "engine name of {} bytes: expected 1 to 1024",
                n.len()
            )));
        }
        if self.local_addr.ip().is_unspecified() {
            return Err(Error::arg(format!(
                "local address {}: peers cannot reach an unspecified address; give the IP of \
                 the interface they reach this host by",
                self.local_addr
            )));
        }
        for (v, what) in [
            (self.max_peer_qps, "max_peer_qps (OXCCL_KV_MAX_PEER_QPS)"),
            (
                self.max_peer_conns,
                "max_peer_conns (OXCCL_KV_MAX_PEER_CONNS)",
            ),
            (
                self.max_peer_lanes,
                "max_peer_lanes (OXCCL_KV_MAX_PEER_LANES)",
            ),
            (self.notify_queue, "notify_queue (OXCCL_KV_NOTIFY_QUEUE)"),
        ] {
            if v == 0 {
                return Err(Error::arg(format!("{what} = 0: expected at least 1")));
            }
        }
        if self.timeout.is_zero() || self.peer_timeout.is_zero() {
            return Err(Error::arg("timeouts must be longer than zero"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(p: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = p
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn the_environment_is_read_and_bad_values_are_named() {
        let c = EngineConfig::from_vars(&vars(&[
            ("OXCCL_SECRET", "s3cret-s3cret"),
            ("OXCCL_KV_ADDR", "127.0.0.2:7000"),
            ("OXCCL_KV_PROTOCOL", "tcp"),
            ("OXCCL_KV_LANES", "4"),
            ("OXCCL_KV_SLICE", "256K"),
            ("OXCCL_KV_TIMEOUT", "2.5"),
            ("OXCCL_KV_POLL", "Busy"),
            ("OXCCL_KV_MAX_PEER_QPS", "3"),
            ("OXCCL_KV_MAX_PEER_CONNS", "5"),
            ("OXCCL_KV_MAX_PEER_LANES", "7"),
            ("OXCCL_KV_NOTIFY_QUEUE", "11"),
            ("OXCCL_KV_CONNECT_RETRY", "0.25"),
        ]))
        .unwrap();
        assert_eq!(
            (
                c.max_peer_qps,
                c.max_peer_conns,
                c.max_peer_lanes,
                c.notify_queue
            ),
            (3, 5, 7, 11)
        );
        assert_eq!(c.connect_retry, Duration::from_millis(250));
        assert!(c.busy_poll);
        assert_eq!(c.local_addr, "127.0.0.2:7000".parse().unwrap());
        assert_eq!(
            (c.protocol, c.lanes, c.slice_size),
            (Protocol::Tcp, 4, 256 << 10)
        );
        assert_eq!(c.timeout, Duration::from_millis(2500));
        // No secret set and no home to keep the per-user file in: the error says what to set.
        let e = EngineConfig::from_vars(&vars(&[])).unwrap_err();
        assert!(e.to_string().contains("OXCCL_SECRET"), "{e}");
        // With a home, the per-user secret file is made there and used.
        let home = std::env::temp_dir().join(format!("oxccl-kv-home-{}", std::process::id()));
        let c = EngineConfig::from_vars(&vars(&[("HOME", home.to_str().unwrap())])).unwrap();
        let file = std::fs::read_to_string(home.join(".config/oxccl/secret")).unwrap();
        assert_eq!(c.secret.as_bytes(), file.trim_end().as_bytes());
        std::fs::remove_dir_all(&home).unwrap();
        for (k, v) in [
            ("OXCCL_KV_LANES", "0"),
            ("OXCCL_KV_SLICE", "12"),
            ("OXCCL_KV_PROTOCOL", "carrier-pigeon"),
            ("OXCCL_KV_ADDR", "nowhere"),
            ("OXCCL_KV_TIMEOUT", "-1"),
            ("OXCCL_KV_POLL", "spin-a-little"),
            ("OXCCL_KV_MAX_PEER_QPS", "0"),
            ("OXCCL_KV_MAX_PEER_LANES", "many"),
            ("OXCCL_KV_NOTIFY_QUEUE", "-5"),
            ("OXCCL_KV_CONNECT_RETRY", "0"),
        ] {
            let e = EngineConfig::from_vars(&vars(&[("OXCCL_SECRET", "s3cret-s3cret"), (k, v)]))
                .unwrap_err();
            assert!(
                e.to_string().contains(k) || e.to_string().contains(v),
                "{k}: {e}"
            );
        }
        assert_eq!(parse_size("1G"), Some(1 << 30));
        assert_eq!(parse_size("x"), None);
    }
}
