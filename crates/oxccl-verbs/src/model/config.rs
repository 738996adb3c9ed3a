//! How a context is configured: [`DeviceConfig`], handed to [`Device::open_with`].
//!
//! The environment is read once, at the top: the communicator, the CLI or the KV engine calls
//! [`DeviceConfig::from_env`] (or [`DeviceConfig::from_vars`] over its own variable source, or
//! fills the struct from its own options) and passes the result down. Nothing below this module
//! reads an environment variable: a provider sees only the `DeviceConfig` it is opened with.
//!
//! Fields that only one provider reads are named after it (`tcp_*`): that provider's section. A
//! new provider's settings are new fields named the same way (`ofi_*`), parsed in
//! [`DeviceConfig::from_vars`] from variables named the same way (`OXCCL_OFI_*`); the fields every
//! provider shares (`spin`) have no prefix.
//!
//! [`Device::open_with`]: crate::Device::open_with

use std::time::Duration;

use super::error::{Error, Result};

/// How a context is set up, given when it is opened ([`Device::open_with`]): providers never
/// read the environment themselves. [`DeviceConfig::from_env`] reads the `OXCCL_*` variables
/// for tools and tests; the communicator fills it in from its own options.
///
/// [`Device::open_with`]: crate::Device::open_with
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceConfig {
    /// tcp: the address the listener binds and advertises to peers (port 0: any free port).
    /// Default `127.0.0.1:0`, which only this host can reach.
    pub tcp_addr: std::net::SocketAddr,
    /// tcp: the progress thread busy-polls instead of blocking in `epoll_wait` (latency mode).
    pub tcp_busy_poll: bool,
    /// tcp: the largest frame a posting thread writes to the socket itself when the connection
    /// is idle; larger ones are left to the progress thread, so a caller that posts (and then
    /// waits) does not spend its time in `sendmsg`. Default: every size (the poster writes).
    pub tcp_inline_max: usize,
    /// tcp: TCP connections per queue pair (`1..=16`; the two sides use the smaller setting).
    /// WRITEs (and the data of READs) of 256 KiB and more are striped over them. Default 1: on
    /// loopback and on the namespace test bed a second connection did not add bandwidth with
    /// one progress thread (`bench/verbs-tcp.sh` measures it); NICs whose single flow is
    /// limited by one core's copy gain from more.
    pub tcp_nsocks: usize,
    /// tcp: progress shards of a context (`0..=16`; 0: automatic, the default): each has its
    /// own epoll set, driver token and progress thread, and connection `i` of a queue pair is
    /// read by shard `i % shards`, so that the parts of a striped transfer are received in
    /// parallel. Automatic is `min(tcp_nsocks, 4)`: one shard (today's single progress thread)
    /// for one connection per queue pair, one per connection up to 4 beyond that (a thread per
    /// lane, as oxccl-kv had with a context per lane, for hosts with cores to spare; on a
    /// 2-vCPU machine a second shard added nothing and cost a few percent of `write_bw`:
    /// `bench/results/kv-striping-2026-12-06/`). More shards than `tcp_nsocks` would have
    /// nothing to read, so the number is capped at `tcp_nsocks`.
    pub tcp_progress_threads: usize,
    /// tcp: the congestion control of the queue pairs' connections (`OXCCL_TCP_CONGESTION`:
    /// `auto`, the default; `system`; or an algorithm's name). See [`TcpCongestion`].
    pub tcp_congestion: TcpCongestion,
    /// ofi: the libfabric provider (`fi_info -l`), as `FI_PROVIDER` names it: `tcp;ofi_rxm`
    /// (the default: any host), `shm` (one host), `verbs;ofi_rxm`, `efa`, `cxi` on RDMA NICs;
    /// empty: libfabric's first choice.
    pub ofi_provider: String,
    /// ofi: the IP address a socket-based provider (`tcp`, `verbs`, `sockets`) binds. Default:
    /// `127.0.0.1` for those (only this host can reach it), the provider's own choice for the
    /// others.
    pub ofi_addr: Option<std::net::IpAddr>,
    /// ofi: the progress thread busy-polls the completion queue instead of blocking in
    /// `fi_cq_sread` or sleeping between polls.
    pub ofi_busy_poll: bool,
    /// How long a completion-queue wait spins before it yields and then sleeps.
    pub spin: Duration,
}

impl Default for DeviceConfig {
    fn default() -> DeviceConfig {
        DeviceConfig {
            tcp_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            tcp_busy_poll: false,
            tcp_inline_max: usize::MAX,
            tcp_nsocks: 1,
            tcp_progress_threads: 0,
            tcp_congestion: TcpCongestion::Auto,
            ofi_provider: "tcp;ofi_rxm".to_string(),
            ofi_addr: None,
            ofi_busy_poll: false,
            spin: Duration::from_micros(50),
        }
    }
}

impl DeviceConfig {
    /// The number of tcp progress shards a context gets ([`DeviceConfig::tcp_progress_threads`]
    /// resolved: automatic is `min(tcp_nsocks, 4)`; never more than `tcp_nsocks`, at least 1).
    pub fn progress_shards(&self) -> usize {
        let socks = self.tcp_nsocks.clamp(1, 16);
        match self.tcp_progress_threads {
            0 => socks.min(4),
            n => n.min(socks),
        }
    }

    /// The defaults overridden by `OXCCL_TCP_ADDR` (`IP` or `IP:port`), `OXCCL_TCP_POLL=busy`,
    /// `OXCCL_TCP_NSOCKS`, `OXCCL_TCP_PROGRESS_THREADS`, `OXCCL_TCP_CONGESTION`, `OXCCL_OFI_PROVIDER`, `OXCCL_OFI_ADDR`,
    /// `OXCCL_OFI_POLL=busy` and `OXCCL_SPIN_US`; a malformed value is an error naming the
    /// variable.
    pub fn from_env() -> Result<DeviceConfig> {
        DeviceConfig::from_vars(&|k| std::env::var(k).ok())
    }

    /// [`DeviceConfig::from_env`] over any variable source.
    pub fn from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<DeviceConfig> {
        let mut c = DeviceConfig::default();
        let get = |k: &str| {
            var(k)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        if let Some(a) = get("OXCCL_TCP_ADDR") {
            c.tcp_addr = parse_ip_or_sockaddr(&a).ok_or_else(|| {
                Error::arg(format!(
                    "OXCCL_TCP_ADDR={a:?} is not an IP address or IP:port"
                ))
            })?;
        }
        c.tcp_busy_poll = get("OXCCL_TCP_POLL").is_some_and(|v| v == "busy");
        if let Some(v) = get("OXCCL_TCP_NSOCKS") {
            c.tcp_nsocks = v
                .parse()
                .ok()
                .filter(|n| (1..=16).contains(n))
                .ok_or_else(|| {
                    Error::arg(format!(
                        "OXCCL_TCP_NSOCKS={v:?} is not a number of connections from 1 to 16"
                    ))
                })?;
        }
        if let Some(v) = get("OXCCL_TCP_PROGRESS_THREADS") {
            c.tcp_progress_threads =
                v.parse()
                    .ok()
                    .filter(|n| (0..=16).contains(n))
                    .ok_or_else(|| {
                        Error::arg(format!(
                            "OXCCL_TCP_PROGRESS_THREADS={v:?} is not a number of progress threads \
                         from 0 (automatic) to 16"
                        ))
                    })?;
        }
        if let Some(v) = get("OXCCL_TCP_CONGESTION") {
            c.tcp_congestion = TcpCongestion::parse(&v).ok_or_else(|| {
                Error::arg(format!(
                    "OXCCL_TCP_CONGESTION={v:?} is not `auto`, `system` or the name of a TCP \
                     congestion control (1 to 15 letters, digits or `_`, as \
                     /proc/sys/net/ipv4/tcp_available_congestion_control lists them)"
                ))
            })?;
        }
        if let Some(p) = get("OXCCL_OFI_PROVIDER") {
            c.ofi_provider = p;
        }
        if let Some(a) = get("OXCCL_OFI_ADDR") {
            c.ofi_addr =
                Some(a.parse().map_err(|_| {
                    Error::arg(format!("OXCCL_OFI_ADDR={a:?} is not an IP address"))
                })?);
        }
        c.ofi_busy_poll = get("OXCCL_OFI_POLL").is_some_and(|v| v == "busy");
        if let Some(v) = get("OXCCL_SPIN_US") {
            let us: u64 = v.parse().map_err(|_| {
                Error::arg(format!(
                    "OXCCL_SPIN_US={v:?} is not a number of microseconds"
                ))
            })?;
            c.spin = Duration::from_micros(us);
        }
        Ok(c)
    }
}

/// The congestion control of the tcp provider's connections ([`DeviceConfig::tcp_congestion`]).
///
/// Why it matters: on loopback, Linux's `bbr` (the system default on some hosts) sizes its
/// congestion window from a bandwidth-delay product measured with a round trip of a few
/// microseconds, so it keeps about 1 MiB in flight, and a 2-rank ring all-reduce of 2 MiB,
/// which has 1 MiB in flight each way, waits on ACKs: it took 720-1010 us a call under `bbr`
/// against 435-460 us under `reno` and 425-560 us under `cubic` in the same run (AMD EPYC,
/// 2 vCPUs, `bench/results/latency-2026-12-06/tcpmid/`). Across hosts `bbr` is a sound choice,
/// so [`TcpCongestion::Auto`] changes only loopback connections.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum TcpCongestion {
    /// `reno` (which every Linux allows without privileges) on a connection whose two ends are
    /// loopback addresses, where a window-based control keeps the pipe full; the system's
    /// default on every other connection. Best effort: a kernel that refuses keeps its default.
    #[default]
    Auto,
    /// The system's default (`net.ipv4.tcp_congestion_control`) on every connection.
    System,
    /// This algorithm on every connection; a kernel that refuses it (not available, or not in
    /// `net.ipv4.tcp_allowed_congestion_control` for an unprivileged process) fails the
    /// connection with an error naming the algorithm and the peer.
    Named(String),
}

impl TcpCongestion {
    /// `auto`, `system` or an algorithm's name (at most 15 ASCII letters, digits or `_`, the
    /// kernel's `TCP_CA_NAME_MAX` less its terminator); `None` for anything else.
    pub fn parse(v: &str) -> Option<TcpCongestion> {
        match v {
            "auto" => Some(TcpCongestion::Auto),
            "system" => Some(TcpCongestion::System),
            n if (1..=15).contains(&n.len())
                && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') =>
            {
                Some(TcpCongestion::Named(n.to_string()))
            }
            _ => None,
        }
    }
}

/// `IP` (port 0) or `IP:port`, IPv6 bracketed with a port (`[::1]:0`) or bare (`::1`).
pub fn parse_ip_or_sockaddr(a: &str) -> Option<std::net::SocketAddr> {
    a.parse::<std::net::SocketAddr>().ok().or_else(|| {
        a.trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .ok()
            .map(|ip| std::net::SocketAddr::new(ip, 0))
    })
}
