//! The communicator's settings: [`Options`], and how they are read from the `OXCCL_*`
//! variables.

use std::time::Duration;

use oxccl_verbs::Provider;

use super::{Compression, DEFAULT_COMPRESS_CHUNK};
use crate::error::{Error, Result};
use crate::fault::Faults;
use crate::schedule::Algorithm;

/// Bytes each host sends per measurement of the link probe at init (`OXCCL_TOPO_PROBE`).
pub const PROBE_BYTES: usize = 1 << 20;

/// Settings of a communicator; [`Options::from_env`] reads the `OXCCL_*` variables.
#[derive(Clone, Debug)]
pub struct Options {
    /// How long one collective may take (`OXCCL_TIMEOUT`, seconds; default 300).
    pub timeout: Duration,
    /// Force one provider for every peer (`OXCCL_PROVIDER=shm|tcp|ofi`); default: shm between
    /// ranks of one host, tcp across hosts.
    pub provider: Option<Provider>,
    /// This process's host identity (`OXCCL_HOST_ID`); default: [`default_host_id`] (the
    /// boot id, the network and the pid namespace).
    pub host_id: Option<String>,
    /// Force an algorithm where it applies (`OXCCL_ALGO`).
    pub algo: Option<Algorithm>,
    /// Channels (`OXCCL_NCHANNELS`; default 1).
    pub channels: Option<usize>,
    /// Bytes per pipelined chunk and slot (`OXCCL_CHUNK_SIZE`; default 128 KiB on one host,
    /// 1 MiB when any rank talks tcp).
    pub chunk_size: Option<usize>,
    /// Slots per peer and channel (`OXCCL_SLOTS`; default 8 on one host, 4 with tcp).
    pub slots: Option<usize>,
    /// The protocol (`OXCCL_PROTO`): `None` lets each schedule use mailboxes where it can,
    /// `Some(false)` (`slots`) always uses the slot protocol.
    pub mailboxes: Option<bool>,
    /// Whether a mailbox call that repeats a planned shape runs compiled: its steps in the
    /// order its protocol machine gave them once, checked by the verifier with every rank's
    /// (`OXCCL_COMPILED=1|0`; default on).
    pub compiled: bool,
    /// Messages up to this many bytes use the latency algorithms (recursive doubling, trees;
    /// `OXCCL_SMALL_BYTES`, default 64 KiB).
    pub small_bytes: usize,
    /// The watchdog (`OXCCL_WATCHDOG=abort|exit`, `1` meaning `abort`; default off): a thread
    /// that dumps the flight recorder and acts when a call runs longer than
    /// [`Options::watchdog_timeout`].
    pub watchdog: Option<WatchdogAction>,
    /// The watchdog's limit (`OXCCL_WATCHDOG_TIMEOUT`, seconds; default: [`Options::timeout`]).
    pub watchdog_timeout: Option<Duration>,
    /// Faults to inject, for tests (`OXCCL_FAULT`; see [`crate::fault`]).
    pub faults: Option<Faults>,
    /// Measure each host's link rate at init (`OXCCL_TOPO_PROBE`): `None` (the default) does
    /// it for jobs of several hosts whose rates are not all given, with `PROBE_BYTES` (1 MiB)
    /// per transfer; `Some(0)` (`0`) never; `Some(bytes)` (`1` for the default size, or a
    /// size) with that size. See [`Communicator::topology`](super::Communicator::topology); a
    /// topology file's rates win.
    pub topo_probe: Option<usize>,
    /// Learn link rates from what every tcp link delivers while large collectives run, and
    /// agree on new rates and shares every this many of them (`OXCCL_TOPO_LEARN`: `0` off,
    /// `1` on, or the interval; default on, every [`crate::learn::DEFAULT_INTERVAL`]). Only
    /// jobs of several hosts learn.
    pub learn_interval: usize,
    /// The address the tcp provider binds and advertises (`OXCCL_TCP_ADDR`, `IP` or
    /// `IP:port`); default: chosen as [`crate::netif`] says.
    pub tcp_addr: Option<std::net::SocketAddr>,
    /// Which interfaces tcp may use (`OXCCL_SOCKET_IFNAME`, `NCCL_SOCKET_IFNAME`'s syntax:
    /// `eth0`, `eth,ens`, `=eth0`, `^docker,lo`).
    pub socket_ifname: Option<crate::netif::IfnameFilter>,
    /// The providers' own settings (`OXCCL_SPIN_US`, `OXCCL_TCP_POLL`); the tcp address in
    /// it is replaced by the chosen one.
    pub device: oxccl_verbs::DeviceConfig,
    /// How long an idle call polls without yielding (`OXCCL_SPIN_US`); `None`: 50 µs, or 0
    /// when this host runs more ranks than it has CPUs (its affinity mask, its cgroup's
    /// quota). Spinning at all then costs: 4 ranks on 2 vCPUs took ~11 µs per 8 B all-reduce
    /// with 3 µs of spin against ~4-5 µs yielding at once (2026-12-06, AMD EPYC). The spin
    /// also adapts: after a call whose yield gave its CPU to another thread (the scheduler
    /// put a peer on this CPU for a while), the next calls yield at once, and the spin grows
    /// back as waits end within it (2 ranks on one CPU: 34-39 µs a tcp 8 B all-reduce before,
    /// 9.5-13 µs after; `bench/colocated.sh`).
    pub idle_spin: Option<Duration>,
    /// How long an idle call then polls, yielding the CPU between polls, before it sleeps on
    /// the completion queue (`OXCCL_YIELD_US`). `None`: 2 ms when every rank is on this host
    /// (long enough to cover a wake-up through the hypervisor, short enough not to burn a core
    /// a peer could use); 0 across hosts, where a wait is the network's and a yielding poll
    /// only takes CPU from the computation it overlaps (on the 4-host bed, 22% of the CPU
    /// samples of a compressed all-reduce were its worker's `sched_yield`).
    pub idle_yield: Option<Duration>,
    /// The aggregation service to join (`OXCCL_AGG_ADDR`, `host:port`; [`crate::agg`]): its
    /// all-reduces can then stream through it (`OXCCL_ALGO=agg`, or the tuner's choice
    /// across hosts). Default: the topology file's `aggregator`, if any.
    pub agg_addr: Option<String>,
    /// Whether a plain [`Communicator::all_reduce`](super::Communicator::all_reduce) (or
    /// `all_reduce_in_place`) of `f32`/`f16`/`bf16` with `Sum` or `Avg` goes compressed
    /// (`OXCCL_COMPRESS=off|auto|bfp8|bfp4|bfp8/16|...`; default off). Calls started without
    /// blocking and group calls stay exact.
    pub compress: Compression,
    /// Which tcp links are sealed: encrypted and authenticated, record by record, with a key
    /// derived from the job's secret (`OXCCL_ENCRYPT=off|on|auto`; default `auto`).
    /// `auto` seals the tcp links whose peer address is not on this host (neither loopback
    /// nor an address of one of this host's interfaces, as either end sees it; network
    /// namespaces count as other hosts), `on` every tcp link, `off` none. shm links never
    /// leave the host and are never sealed; ofi links are not (the provider's own
    /// business); the link to the aggregation service is not sealed yet. Every rank must
    /// set the same; sealing needs the job's secret.
    pub encrypt: oxccl_verbs::Encrypt,
    /// Bytes of input per pipeline chunk of a compressed all-reduce
    /// (`OXCCL_COMPRESS_CHUNK`, 64K..=1G; default [`DEFAULT_COMPRESS_CHUNK`]). Every rank
    /// must use the same.
    pub compress_chunk: usize,
}

/// What the watchdog does to a call that runs too long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WatchdogAction {
    /// Abort the communicator: the call, and the peers' calls, return [`Error::Aborted`].
    Abort,
    /// Abort it, tell the peers, then end the process with `abort()` (for jobs whose launcher
    /// restarts failed ranks, like torch's `TORCH_NCCL_ASYNC_ERROR_HANDLING=1`).
    Exit,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            timeout: Duration::from_secs(300),
            provider: None,
            host_id: None,
            algo: None,
            channels: None,
            chunk_size: None,
            slots: None,
            small_bytes: 64 << 10,
            mailboxes: None,
            compiled: true,
            watchdog: None,
            watchdog_timeout: None,
            faults: None,
            topo_probe: None,
            learn_interval: crate::learn::DEFAULT_INTERVAL,
            tcp_addr: None,
            socket_ifname: None,
            device: oxccl_verbs::DeviceConfig::default(),
            idle_spin: None,
            idle_yield: None,
            agg_addr: None,
            compress: Compression::Off,
            encrypt: oxccl_verbs::Encrypt::default(),
            compress_chunk: DEFAULT_COMPRESS_CHUNK,
        }
    }
}

impl Options {
    /// Defaults overridden by the environment; a malformed variable is an error naming it.
    pub fn from_env() -> Result<Options> {
        Options::from_vars(&|k| std::env::var(k).ok())
    }

    /// [`Options::from_env`] over any variable source.
    pub fn from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<Options> {
        let mut o = Options::default();
        o.failure_vars(var)?;
        o.choice_vars(var)?;
        o.protocol_vars(var)?;
        o.topology_vars(var)?;
        o.device_vars(var)?;
        o.compression_vars(var)?;
        if let Some(v) = var("OXCCL_SOCKET_IFNAME").filter(|v| !v.trim().is_empty()) {
            o.socket_ifname = Some(
                v.parse()
                    .map_err(|e| Error::Config(format!("OXCCL_SOCKET_IFNAME: {e}")))?,
            );
        }
        Ok(o)
    }

    /// Timeouts, the watchdog and injected faults.
    fn failure_vars(&mut self, var: &dyn Fn(&str) -> Option<String>) -> Result<()> {
        if let Some(t) = seconds(var, "OXCCL_TIMEOUT")? {
            self.timeout = t;
        }
        self.watchdog_timeout = seconds(var, "OXCCL_WATCHDOG_TIMEOUT")?;
        if let Some(v) = var("OXCCL_WATCHDOG") {
            self.watchdog = match v.trim() {
                "" | "0" | "off" => None,
                "1" | "abort" | "on" => Some(WatchdogAction::Abort),
                "exit" => Some(WatchdogAction::Exit),
                _ => return Err(bad("OXCCL_WATCHDOG", &v, "0, 1 (abort) or exit")),
            };
        }
        if let Some(v) = var("OXCCL_FAULT").filter(|v| !v.trim().is_empty()) {
            self.faults = Some(
                v.parse::<Faults>()
                    .map_err(|e| Error::Config(format!("OXCCL_FAULT={v:?}: {e}")))?,
            );
        }
        Ok(())
    }

    /// The provider, the host's identity, the algorithm and the aggregation service.
    fn choice_vars(&mut self, var: &dyn Fn(&str) -> Option<String>) -> Result<()> {
        if let Some(v) = var("OXCCL_PROVIDER") {
            self.provider = Some(match v.trim() {
                "shm" => Provider::Shm,
                "tcp" => Provider::Tcp,
                "ofi" => Provider::Ofi,
                _ => return Err(bad("OXCCL_PROVIDER", &v, "shm, tcp or ofi")),
            });
        }
        self.host_id = var("OXCCL_HOST_ID").filter(|v| !v.is_empty());
        if let Some(v) = var("OXCCL_ALGO") {
            let algo = Algorithm::from_name(v.trim()).ok_or_else(|| {
                bad(
                    "OXCCL_ALGO",
                    &v,
                    "ring, rd, tree, chain, direct, dissemination, prop, hier or agg",
                )
            })?;
            self.algo = Some(algo);
        }
        if let Some(v) = var("OXCCL_ENCRYPT") {
            self.encrypt = v
                .trim()
                .parse()
                .map_err(|_| bad("OXCCL_ENCRYPT", &v, "off, on or auto"))?;
        }
        self.agg_addr = var("OXCCL_AGG_ADDR")
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty());
        Ok(())
    }

    /// The protocol's geometry (channels, chunks, slots), mailboxes and small messages.
    fn protocol_vars(&mut self, var: &dyn Fn(&str) -> Option<String>) -> Result<()> {
        if let Some(v) = var("OXCCL_NCHANNELS") {
            let c: usize = v
                .trim()
                .parse()
                .map_err(|_| bad("OXCCL_NCHANNELS", &v, "1..=16"))?;
            if !(1..=16).contains(&c) {
                return Err(bad("OXCCL_NCHANNELS", &v, "1..=16"));
            }
            self.channels = Some(c);
        }
        if let Some(v) = var("OXCCL_CHUNK_SIZE") {
            let c = oxccl_bootstrap::parse_size(&v)
                .filter(|c| (4096..=(64 << 20)).contains(c))
                .ok_or_else(|| bad("OXCCL_CHUNK_SIZE", &v, "bytes (K/M suffixes), 4K..=64M"))?;
            self.chunk_size = Some(c);
        }
        if let Some(v) = var("OXCCL_SLOTS") {
            self.slots = Some(
                v.trim()
                    .parse()
                    .ok()
                    .filter(|s| (2..=256).contains(s))
                    .ok_or_else(|| bad("OXCCL_SLOTS", &v, "2..=256"))?,
            );
        }
        if let Some(v) = var("OXCCL_PROTO") {
            self.mailboxes = match v.trim() {
                "slots" | "simple" => Some(false),
                "mailbox" | "auto" => None,
                _ => return Err(bad("OXCCL_PROTO", &v, "slots or mailbox")),
            };
        }
        if let Some(v) = var("OXCCL_COMPILED") {
            self.compiled = match v.trim() {
                "1" | "on" | "true" => true,
                "0" | "off" | "false" => false,
                _ => return Err(bad("OXCCL_COMPILED", &v, "1 or 0")),
            };
        }
        if let Some(v) = var("OXCCL_SMALL_BYTES") {
            self.small_bytes = oxccl_bootstrap::parse_size(&v)
                .ok_or_else(|| bad("OXCCL_SMALL_BYTES", &v, "bytes"))?;
        }
        Ok(())
    }

    /// Link-rate learning and the link probe at init.
    fn topology_vars(&mut self, var: &dyn Fn(&str) -> Option<String>) -> Result<()> {
        if let Some(v) = var("OXCCL_TOPO_LEARN") {
            self.learn_interval = match v.trim() {
                "0" | "off" => 0,
                "" | "1" | "on" => crate::learn::DEFAULT_INTERVAL,
                x => x
                    .parse()
                    .ok()
                    .filter(|n| (2..=1_000_000).contains(n))
                    .ok_or_else(|| {
                        bad(
                            "OXCCL_TOPO_LEARN",
                            &v,
                            "0 (off), 1 (on) or calls per round (2..)",
                        )
                    })?,
            };
        }
        if let Some(v) = var("OXCCL_TOPO_PROBE") {
            self.topo_probe = match v.trim() {
                "" => None,
                "0" | "off" => Some(0),
                "1" | "on" => Some(PROBE_BYTES),
                x => Some(
                    oxccl_bootstrap::parse_size(x)
                        .filter(|b| (64 << 10..=1 << 30).contains(b))
                        .ok_or_else(|| {
                            bad("OXCCL_TOPO_PROBE", &v, "0, 1 or bytes per probe (64K..=1G)")
                        })?,
                ),
            };
        }
        Ok(())
    }

    /// The providers' settings, idling, and the tcp address.
    fn device_vars(&mut self, var: &dyn Fn(&str) -> Option<String>) -> Result<()> {
        self.device =
            oxccl_verbs::DeviceConfig::from_vars(var).map_err(|e| Error::Config(e.to_string()))?;
        self.idle_spin = micros(var, "OXCCL_SPIN_US")?;
        if let Some(y) = micros(var, "OXCCL_YIELD_US")? {
            self.idle_yield = Some(y);
        }
        if var("OXCCL_TCP_ADDR").is_some_and(|v| !v.trim().is_empty()) {
            self.tcp_addr = Some(self.device.tcp_addr);
        }
        Ok(())
    }

    /// Compressed all-reduces.
    fn compression_vars(&mut self, var: &dyn Fn(&str) -> Option<String>) -> Result<()> {
        if let Some(v) = var("OXCCL_COMPRESS") {
            self.compress = v
                .parse()
                .map_err(|want: String| bad("OXCCL_COMPRESS", &v, &want))?;
        }
        if let Some(v) = var("OXCCL_COMPRESS_CHUNK") {
            self.compress_chunk = oxccl_bootstrap::parse_size(&v)
                .filter(|c| (64 << 10..=1 << 30).contains(c))
                .ok_or_else(|| bad("OXCCL_COMPRESS_CHUNK", &v, "bytes (K/M suffixes), 64K..=1G"))?;
        }
        Ok(())
    }
}

/// A malformed variable's error: its name, its value and what was expected.
fn bad(name: &str, v: &str, want: &str) -> Error {
    Error::Config(format!("{name}={v:?}: expected {want}"))
}

/// Variable `name` as a positive number of seconds, if set.
fn seconds(var: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<Option<Duration>> {
    let Some(v) = var(name) else { return Ok(None) };
    match v.trim().parse::<f64>() {
        Ok(secs) if secs > 0.0 && secs.is_finite() && secs < 1e9 => {
            Ok(Some(Duration::from_secs_f64(secs)))
        }
        _ => Err(bad(name, &v, "a positive number of seconds")),
    }
}

/// Variable `name` as microseconds, if set and not empty.
fn micros(var: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<Option<Duration>> {
    let Some(v) = var(name).filter(|v| !v.trim().is_empty()) else {
        return Ok(None);
    };
    v.trim()
        .parse::<u64>()
        .map(|us| Some(Duration::from_micros(us)))
        .map_err(|_| bad(name, &v, "microseconds"))
}

/// This host's identity ([`oxccl_verbs::host_identity`]: the kernel's boot id, the network
/// and the pid namespace), so that ranks that can talk shm count as one host and network
/// namespaces on one machine as separate hosts.
pub fn default_host_id() -> String {
    oxccl_verbs::host_identity()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(vars: &[(&str, &str)]) -> Result<Options> {
        Options::from_vars(&|k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn settings_parse_and_bad_ones_are_named() {
        let o = opts(&[
            ("OXCCL_TIMEOUT", "2.5"),
            ("OXCCL_PROVIDER", "tcp"),
            ("OXCCL_ALGO", "ring"),
            ("OXCCL_NCHANNELS", "3"),
            ("OXCCL_CHUNK_SIZE", "512K"),
            ("OXCCL_SLOTS", "4"),
            ("OXCCL_PROTO", "slots"),
            ("OXCCL_SMALL_BYTES", "1M"),
            ("OXCCL_ENCRYPT", "on"),
            ("OXCCL_COMPILED", "0"),
        ])
        .unwrap();
        assert!(!o.compiled);
        assert_eq!(o.encrypt, oxccl_verbs::Encrypt::On);
        assert_eq!(o.timeout, Duration::from_millis(2500));
        assert_eq!(o.provider, Some(Provider::Tcp));
        assert_eq!(o.algo, Some(Algorithm::Ring));
        assert_eq!(
            (o.channels, o.chunk_size, o.slots),
            (Some(3), Some(512 << 10), Some(4))
        );
        assert_eq!((o.mailboxes, o.small_bytes), (Some(false), 1 << 20));
        let d = opts(&[]).unwrap();
        assert_eq!((d.provider, d.chunk_size, d.mailboxes), (None, None, None));
        assert_eq!(d.encrypt, oxccl_verbs::Encrypt::Auto);
        assert!(d.compiled);
        for (v, want) in [
            ("off", oxccl_verbs::Encrypt::Off),
            ("auto", oxccl_verbs::Encrypt::Auto),
        ] {
            assert_eq!(opts(&[("OXCCL_ENCRYPT", v)]).unwrap().encrypt, want);
        }
        for (k, v) in [
            ("OXCCL_TIMEOUT", "-1"),
            ("OXCCL_PROVIDER", "ib"),
            ("OXCCL_ALGO", "magic"),
            ("OXCCL_NCHANNELS", "0"),
            ("OXCCL_CHUNK_SIZE", "1"),
            ("OXCCL_SLOTS", "1"),
            ("OXCCL_PROTO", "ll"),
            ("OXCCL_ENCRYPT", "maybe"),
            ("OXCCL_COMPILED", "yes"),
        ] {
            let e = opts(&[(k, v)]).unwrap_err().to_string();
            assert!(e.contains(k) && e.contains(v), "{k}={v}: {e}");
        }
    }
}
