//! A multi-host test bed on one machine: each host is a network namespace with one veth link to a
//! bridge, and each link is shaped in both directions with `tc tbf`.
//!
//! ```no_run
//! use oxccl_testbed::{HostSpec, Testbed};
//!
//! // Prints `SKIPPED my_test: <reason>` and returns when this machine cannot host a bed
//! // (under CI=true it fails instead: nothing skips in CI).
//! if !oxccl_testbed::require("my_test", Testbed::available()) {
//!     return;
//! }
//! // Three hosts at 1 Gbit/s and one at 250 Mbit/s, both directions of every link shaped.
//! let tb = Testbed::new(&[
//!     HostSpec::mbit(1000),
//!     HostSpec::mbit(1000),
//!     HostSpec::mbit(1000),
//!     HostSpec::mbit(250),
//! ])
//! .unwrap();
//! let server = tb.spawn(1, "my-server", ["--port", "5000"]).unwrap();
//! let out = tb
//!     .output(0, "my-client", [format!("{}:5000", tb.host_addr(1))])
//!     .unwrap();
//! assert!(out.status.success());
//! tb.set_rate(3, Some(500)).unwrap(); // reshape host 3's link on the fly
//! # drop(server);
//! drop(tb); // kills what still runs inside the hosts and deletes every namespace
//! ```
//!
//! # Topology
//!
//! A test bed named `oxtb<pid>-<n>` (the pid of the owning process, a per-process counter) is
//! made of the namespaces `oxtb<pid>-<n>-br`, which holds the bridge `br0`, and
//! `oxtb<pid>-<n>-h<i>` for host `i`. Host `i` has `lo` up and `eth0` with the address
//! `10.77.0.<i+1>/24`; `eth0`'s veth peer is `h<i>` on the bridge. Nothing is created in the
//! root namespace, so the machine's own network is never touched, and every test bed is an
//! isolated layer-2 network: two beds may use the same addresses without seeing each other.
//! Interface names are short and fixed (`eth0`, `br0`, `h<i>`: the kernel allows 15 characters
//! and they live in the bed's own namespaces); namespace names have no such limit.
//! Only these addresses and loopback are reachable from inside a host.
//!
//! # Shaping
//!
//! A shaped link gets a `tbf` root qdisc on both of its ends: egress of `eth0` inside the host
//! (what the host sends) and egress of `h<i>` on the bridge (what the host receives). A flow from
//! host `a` to host `b` therefore runs at `min(rate_a, rate_b)`, and several senders to one host
//! share that host's receive rate, as on a switch port. Under the `tbf`, small packets (ACKs,
//! SYNs) overtake bulk data, so that a long queue in one direction does not starve the other
//! direction's ACKs. The defaults (MTU 9000, a 2 ms bucket, a 50 ms queue, small packets first)
//! were chosen by measurement: one TCP stream carries 99.3 % of the rate, the rest being header
//! overhead; see [`Shaping`] for the numbers. Idle links add no latency (no delay or loss is
//! emulated: `netem` is not available here).
//!
//! # Cleanup
//!
//! [`Drop`] kills every process still running inside the bed's namespaces and deletes them, also
//! while unwinding from a panic. A run that dies without unwinding (SIGKILL, Ctrl-C of the test
//! harness) leaves its namespaces behind; the next [`Testbed::new`] on the machine deletes every
//! test bed whose owning process is gone ([`cleanup_stale`]). Ownership is by pid: should the
//! pid be reused before then, the bed stays until that process is gone too.
//!
//! # Command line
//!
//! The crate's binary, `oxccl-testbed`, does the same from a shell (`up`, `exec`, `rate`,
//! `down`, `list`, `gc`) and carries the small TCP tools the tests run inside the hosts
//! (`tcp-echo-server`, `tcp-echo-client`, `tcp-sink`, `tcp-source`). `bench/testbed.sh` wraps it:
//! it brings a bed up, runs a command in every host or in one, and tears the bed down on exit,
//! failure, Ctrl-C or SIGTERM.

#![deny(missing_docs)]

use std::ffi::OsStr;
use std::io::Write;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};

/// The prefix of every namespace a test bed creates.
pub const PREFIX: &str = "oxtb";

/// Environment variable set for commands run in a host: the host's index.
pub const ENV_HOST: &str = "OXCCL_TESTBED_HOST";
/// Environment variable set for commands run in a host: the number of hosts.
pub const ENV_HOSTS: &str = "OXCCL_TESTBED_HOSTS";
/// Environment variable set for commands run in a host: the host's own address.
pub const ENV_ADDR: &str = "OXCCL_TESTBED_ADDR";
/// Environment variable set for commands run in a host: all hosts' addresses, comma-separated,
/// in host order.
pub const ENV_ADDRS: &str = "OXCCL_TESTBED_ADDRS";

/// The largest number of hosts in one test bed (addresses `10.77.0.1` to `10.77.0.250`).
pub const MAX_HOSTS: usize = 250;

/// Errors from building, reshaping or tearing down a test bed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The machine cannot host a test bed; the text says why.
    #[error("test bed unavailable: {0}")]
    Unavailable(String),
    /// The requested test bed makes no sense (no hosts, too many, rate 0, host out of range).
    #[error("invalid test bed request: {0}")]
    Invalid(String),
    /// A command could not be started.
    #[error("could not run `{command}`: {source}")]
    Spawn {
        /// The command line.
        command: String,
        /// Why it could not start.
        #[source]
        source: std::io::Error,
    },
    /// A command exited unsuccessfully.
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        /// The command line.
        command: String,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// What it wrote to stderr, trimmed.
        stderr: String,
    },
}

/// One host of a test bed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostSpec {
    /// The rate of the host's link in Mbit/s (10^6 bit/s), in each direction; `None` leaves it
    /// unshaped (a veth runs at tens of Gbit/s).
    pub rate_mbit: Option<u64>,
}

impl HostSpec {
    /// A host whose link is shaped to `rate_mbit` Mbit/s in each direction.
    pub fn mbit(rate_mbit: u64) -> Self {
        HostSpec {
            rate_mbit: Some(rate_mbit),
        }
    }

    /// A host with an unshaped link.
    pub fn unshaped() -> Self {
        HostSpec { rate_mbit: None }
    }
}

/// How links are shaped: the MTU of every veth, the `tbf` bucket and queue sizes, and whether
/// small packets overtake bulk data.
///
/// Each end of a shaped link gets this qdisc tree ([`Shaping::tc_batch`] prints it):
///
/// ```text
/// tbf 1: rate R burst B                    the shaper
/// └── htb 10: default 2                    two strict-priority bands, no rate of their own
///     ├── class 10:1 prio 0 → bfifo 64 KiB    IPv4 packets under 128 bytes: pure ACKs,
///     │                                       SYN/FIN, messages under ~75 bytes
///     └── class 10:2 prio 1 → bfifo Q         everything else
/// ```
///
/// The default: **MTU 9000** (jumbo frames, as on a cluster network), a **bucket of 2 ms** at
/// the link rate (at least 32 KiB and two frames), a **bulk queue of 50 ms** at the link rate
/// (at least 64 KiB and four frames) and **small packets first**; GSO/TSO stay on (the veth
/// default). For 1 Gbit/s: `tbf rate 1000mbit burst 250000`, bulk queue 6.25 MB; for
/// 250 Mbit/s: `burst 62500`, bulk queue 1.56 MB. With `small_first: false` the tree is a
/// plain `tbf rate R burst B limit B+Q`.
///
/// # What was measured (2 vCPUs, BBR, streams of 1.5 to 2 s after a 0.2 to 0.3 s warm-up)
///
/// `tbf` counts whole frames (IP packet plus the 14-byte Ethernet header), so a link carries at
/// most `(mtu - 52) / (mtu + 14)` of its rate as TCP payload (52 bytes of IP, TCP and timestamp
/// headers): 95.6 % at MTU 1500 (the ~93 to 95 % one sees on a default veth), 99.3 % at 9000,
/// 99.9 % at 65000. With the defaults one stream reaches exactly that bound: 992.7 Mbit/s of
/// 1000 (99.3 %) and 248.2 of 250 (99.3 %), five runs each within 0.1 %; with `mtu: 1500`,
/// 956.4 and 239.1 (95.6 %). The shaper loses nothing; the rest is header overhead. Two streams
/// in opposite directions over one link get 98.9 % each (their ACKs share the link).
///
/// | MTU | bucket | 250 Mbit/s | 1 Gbit/s |
/// |---|---|---|---|
/// | 1500 | 16 KiB | 95.6 % | 58 % |
/// | 1500 | 64 KiB | 95.6 % | 94.9 % |
/// | 1500 | 256 KiB | 95.6 % | 95.5 % |
/// | 9000 | 20 to 256 KiB | 99.2 % | 98 to 99.3 % |
/// | 9000 | 2 ms (default) | 99.3 % | 99.3 % |
/// | 65000 | 256 KiB | 99.9 % | 99.9 % |
///
/// - The bucket must hold a whole frame (tbf drops bigger ones, or splits GSO aggregates), and
///   it must cover the gap between two timer wake-ups, or tokens are lost: at 5 Gbit/s a 20 KiB
///   bucket gave 67 %, 128 KiB 98.6 %. Under load it must be larger still: four 1 Gbit/s
///   streams at once (a ring over 4 hosts, 4 Gbit/s through 2 vCPUs) reached 79 to 87 % each
///   with a 250 µs bucket, 93 to 98 % with 1 ms, 99.1 % with 2 ms. The price: an idle link
///   may send one bucket (2 ms worth) at veth speed before the rate applies.
/// - GSO must stay on: with `gso_max_size 1500` at MTU 1500 a 1 Gbit/s link carried 63 % (the
///   CPU's packet rate, not the shaper); 16 KiB or 64 KiB aggregates make no difference.
///   (TSO cannot be toggled without `ethtool`, which this machine lacks; GSO size can.)
/// - One FIFO per link end cannot serve both of the cases that matter, hence the two bands.
///   Where traffic converges (the bridge's port towards a slow host) a short queue drops:
///   three 1 Gbit/s hosts sending to one 250 Mbit/s host dropped 2574 packets with a 0.5 ms
///   queue, 842 with 5 ms and 311 with 20 ms, losing SYNs (a stall of 1 s, once 7 s); with
///   50 ms, none. But a long FIFO delays the ACKs of the opposite direction behind the data:
///   two streams in opposite directions through a 200 Mbit/s host (the other host at 400) got
///   198 and 50 to 116 Mbit/s in four runs of six with a 50 ms FIFO, and still 110 to 140 in
///   five of eight with 10 ms; only 2 ms was reliable (97 to 99 %, with drops). With small
///   packets first, the 50 ms queue gives both cases at once: 99 % in both directions in 12 of
///   12 runs (400/200 and 1000/250 Mbit/s), and the incast above with no drop and no stall.
///   Strict priority means a flood of small packets can starve bulk data; tests don't do that.
/// - A ring over hosts of 1, 1, 1 and 0.25 Gbit/s, all four links busy: 991.6, 991.6, 247.3
///   and 247.4 Mbit/s, no drops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shaping {
    /// MTU of both ends of every veth (and hence of the bridge).
    pub mtu: u32,
    /// Bucket size as time at the link rate, in microseconds.
    pub burst_us: u64,
    /// Bulk queue length as time at the link rate, in microseconds.
    pub queue_us: u64,
    /// Whether IPv4 packets under 128 bytes (ACKs, SYNs, tiny messages) go ahead of the bulk
    /// queue.
    pub small_first: bool,
}

impl Default for Shaping {
    fn default() -> Self {
        Shaping {
            mtu: 9000,
            burst_us: 2000,
            queue_us: 50_000,
            small_first: true,
        }
    }
}

/// The queue of the small-packet band (about a thousand ACKs).
const SMALL_QUEUE_BYTES: u64 = 64 * 1024;

impl Shaping {
    fn frame(&self) -> u64 {
        u64::from(self.mtu) + 14
    }

    /// The `tbf` bucket size in bytes for `rate_mbit`.
    pub fn burst_bytes(&self, rate_mbit: u64) -> u64 {
        // Saturating: an absurd rate or time gives an absurd size that `tc` refuses, not an
        // overflow.
        (rate_mbit.saturating_mul(self.burst_us) / 8)
            .max(32 * 1024)
            .max(2 * self.frame())
    }

    /// The bulk queue in bytes for `rate_mbit`.
    pub fn queue_bytes(&self, rate_mbit: u64) -> u64 {
        (rate_mbit.saturating_mul(self.queue_us) / 8)
            .max(64 * 1024)
            .max(4 * self.frame())
    }

    /// The `tc -batch` lines that shape `dev` to `rate_mbit` from scratch (no root qdisc yet).
    pub fn tc_batch(&self, dev: &str, rate_mbit: u64) -> String {
        let (burst, queue) = (self.burst_bytes(rate_mbit), self.queue_bytes(rate_mbit));
        let mut b = format!(
            "qdisc add dev {dev} root handle 1: tbf rate {rate_mbit}mbit burst {burst} limit {}\n",
            burst.saturating_add(queue)
        );
        if self.small_first {
            // The classes' own rates only have to be out of reach; tbf does the shaping.
            let class = "htb rate 100gbit burst 1mb cburst 1mb quantum 65536";
            b += &format!(
                "qdisc add dev {dev} parent 1:1 handle 10: htb default 2\n\
                 class add dev {dev} parent 10: classid 10:1 {class} prio 0\n\
                 class add dev {dev} parent 10: classid 10:2 {class} prio 1\n\
                 qdisc add dev {dev} parent 10:1 handle 11: bfifo limit {SMALL_QUEUE_BYTES}\n\
                 qdisc add dev {dev} parent 10:2 handle 12: bfifo limit {queue}\n\
                 filter add dev {dev} parent 10: protocol ip prio 1 u32 \
                 match u16 0 0xff80 at 2 flowid 10:1\n"
            );
        }
        b
    }

    /// The `tc -batch` lines that change the rate of `dev`, shaped by [`Shaping::tc_batch`]
    /// with the same settings, to `rate_mbit` without dropping what is queued.
    pub fn tc_batch_change(&self, dev: &str, rate_mbit: u64) -> String {
        let (burst, queue) = (self.burst_bytes(rate_mbit), self.queue_bytes(rate_mbit));
        let mut b = format!(
            "qdisc change dev {dev} root handle 1: tbf rate {rate_mbit}mbit burst {burst} limit {}\n",
            burst.saturating_add(queue)
        );
        if self.small_first {
            b += &format!("qdisc change dev {dev} parent 10:2 handle 12: bfifo limit {queue}\n");
        }
        b
    }
}

/// Builds a [`Testbed`] with non-default settings.
#[derive(Clone, Debug, Default)]
pub struct Builder {
    hosts: Vec<HostSpec>,
    shaping: Shaping,
    owner_pid: Option<u32>,
}

impl Builder {
    /// Adds one host.
    pub fn host(mut self, spec: HostSpec) -> Self {
        self.hosts.push(spec);
        self
    }

    /// Adds hosts.
    pub fn hosts(mut self, specs: &[HostSpec]) -> Self {
        self.hosts.extend_from_slice(specs);
        self
    }

    /// Sets the MTU of every link (default 9000; 1280 to 65000).
    pub fn mtu(mut self, mtu: u32) -> Self {
        self.shaping.mtu = mtu;
        self
    }

    /// Sets all shaping parameters at once.
    pub fn shaping(mut self, shaping: Shaping) -> Self {
        self.shaping = shaping;
        self
    }

    /// Names the process that owns the bed (default: this one). When it is gone, the next
    /// [`Testbed::new`] on the machine deletes the bed. A script that creates a bed with the
    /// `oxccl-testbed up` binary passes its own pid here.
    pub fn owner_pid(mut self, pid: u32) -> Self {
        self.owner_pid = Some(pid);
        self
    }

    /// Creates the test bed. Deletes stale beds first (see [`cleanup_stale`]).
    pub fn build(self) -> Result<Testbed, Error> {
        Testbed::create(self)
    }
}

/// A running test bed; see the [crate documentation](crate). Dropping it tears it down.
#[derive(Debug)]
pub struct Testbed {
    name: String,
    rates: Mutex<Vec<Option<u64>>>,
    shaping: Shaping,
    torn_down: bool,
    /// Children started by [`Testbed::spawn`]: killed by pid on drop too, since one may not have
    /// entered its namespace yet (`ip netns exec` still setting up) when the namespace is
    /// searched for processes.
    spawned: Mutex<Vec<u32>>,
}

/// A test bed found on the machine by [`list`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BedInfo {
    /// The bed's name, the prefix of its namespaces (`oxtb<pid>-<n>`).
    pub name: String,
    /// The pid of the owning process.
    pub owner_pid: u32,
    /// Whether that process still runs.
    pub owner_alive: bool,
    /// The number of host namespaces.
    pub hosts: usize,
    /// All of its namespaces.
    pub namespaces: Vec<String>,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);
/// Serializes namespace creation and deletion inside this process (`ip netns add` sets up the
/// shared `/run/netns` mount on first use and is not safe to race with itself).
static SETUP: Mutex<()> = Mutex::new(());

/// Whether CI runs this (`CI` set to `true` or `1`): then nothing may skip.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| matches!(v.trim(), "true" | "1"))
}

/// Whether test `test` can run, given whether its prerequisite is met: `true` when it is.
/// When it is not, a developer's machine prints `SKIPPED <test>: <reason>` and gets `false`
/// (the test returns), but under `CI=true` the test fails here: CI runs as root with every
/// prerequisite installed, so a missing one is a hole, not a skip.
///
/// ```no_run
/// # fn main() {
/// if !oxccl_testbed::require("my_test", oxccl_testbed::Testbed::available()) {
///     return;
/// }
/// # }
/// ```
pub fn require(test: &str, prerequisite: Result<(), String>) -> bool {
    match prerequisite {
        Ok(()) => true,
        Err(reason) if in_ci() => {
            // Kept: failing the calling test under CI is what this test helper is for.
            panic!("{test}: prerequisite missing under CI=true (nothing may skip in CI): {reason}")
        }
        Err(reason) => {
            println!("SKIPPED {test}: {reason}");
            false
        }
    }
}

impl Testbed {
    /// Whether this machine can host a test bed: `Ok(())`, or why not (not Linux, not root,
    /// `ip` or `tc` missing, namespaces, veth, bridges or tbf unsupported). Probes once per
    /// process by building a throw-away namespace. Tests pass it to [`require`], which skips
    /// with the reason (or fails, under `CI=true`).
    pub fn available() -> Result<(), String> {
        static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
        PROBE.get_or_init(probe).clone()
    }

    /// Creates a test bed with default [`Shaping`], one host per spec.
    pub fn new(hosts: &[HostSpec]) -> Result<Testbed, Error> {
        Testbed::builder().hosts(hosts).build()
    }

    /// A builder for non-default settings.
    pub fn builder() -> Builder {
        Builder::default()
    }

    fn create(b: Builder) -> Result<Testbed, Error> {
        Testbed::available().map_err(Error::Unavailable)?;
        if b.hosts.is_empty() || b.hosts.len() > MAX_HOSTS {
            return Err(Error::Invalid(format!(
                "{} hosts (1 to {MAX_HOSTS})",
                b.hosts.len()
            )));
        }
        if b.hosts.iter().any(|h| h.rate_mbit == Some(0)) {
            return Err(Error::Invalid("a rate of 0 Mbit/s".into()));
        }
        if !(1280..=65000).contains(&b.shaping.mtu) {
            return Err(Error::Invalid(format!(
                "MTU {} (1280 to 65000)",
                b.shaping.mtu
            )));
        }
        cleanup_stale();
        let owner = b.owner_pid.unwrap_or_else(std::process::id);
        let name = claim_name(owner)?;
        let mut tb = Testbed {
            name,
            rates: Mutex::new(b.hosts.iter().map(|h| h.rate_mbit).collect()),
            shaping: b.shaping,
            torn_down: false,
            spawned: Mutex::new(Vec::new()),
        };
        // On failure `tb` is dropped, which deletes whatever was created.
        tb.setup()?;
        Ok(tb)
    }

    fn setup(&mut self) -> Result<(), Error> {
        let br = self.bridge_netns();
        let mtu = self.shaping.mtu.to_string();
        {
            let _g = SETUP.lock().unwrap_or_else(|e| e.into_inner());
            for i in 0..self.len() {
                ip(&["netns", "add", &self.host_netns(i)])?;
            }
        }
        ip(&["-n", &br, "link", "set", "lo", "up"])?;
        ip(&["-n", &br, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &br, "link", "set", "br0", "mtu", &mtu, "up"])?;
        for i in 0..self.len() {
            let h = self.host_netns(i);
            let port = format!("h{i}");
            // Both ends are created directly in their namespaces: nothing appears in the root
            // namespace, even for a moment.
            ip(&[
                "-n", &br, "link", "add", &port, "mtu", &mtu, "type", "veth", "peer", "name",
                "eth0", "mtu", &mtu, "netns", &h,
            ])?;
            ip(&["-n", &br, "link", "set", &port, "master", "br0", "up"])?;
            ip(&["-n", &h, "link", "set", "lo", "up"])?;
            let addr = format!("{}/24", self.host_addr(i));
            ip(&["-n", &h, "addr", "add", &addr, "dev", "eth0"])?;
            ip(&["-n", &h, "link", "set", "eth0", "up"])?;
            let rate = self.rate_mbit(i)?;
            if rate.is_some() {
                self.shape(i, rate)?;
            }
        }
        Ok(())
    }

    /// The bed's name: the prefix of all its namespaces, `oxtb<pid>-<n>`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The number of hosts.
    pub fn len(&self) -> usize {
        self.rates.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Always false: a test bed has at least one host.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The shaping parameters in use.
    pub fn shaping(&self) -> Shaping {
        self.shaping
    }

    /// The name of host `i`'s network namespace (for `ip netns exec` by hand).
    pub fn host_netns(&self, i: usize) -> String {
        host_netns(&self.name, i)
    }

    /// The name of the namespace that holds the bridge.
    pub fn bridge_netns(&self) -> String {
        format!("{}-br", self.name)
    }

    /// Host `i`'s address, `10.77.0.<i+1>`, reachable from every host of this bed.
    pub fn host_addr(&self, i: usize) -> Ipv4Addr {
        host_addr(i)
    }

    /// Host `i`'s link rate in Mbit/s, `None` when unshaped.
    ///
    /// # Errors
    /// [`Error::Invalid`] when `i` is not a host of this bed.
    pub fn rate_mbit(&self, i: usize) -> Result<Option<u64>, Error> {
        let rates = self.rates.lock().unwrap_or_else(|e| e.into_inner());
        rates
            .get(i)
            .copied()
            .ok_or_else(|| Error::Invalid(format!("host {i} of a {}-host test bed", rates.len())))
    }

    /// A command that runs `program` inside host `i` (through `ip netns exec`), with
    /// [`ENV_HOST`], [`ENV_HOSTS`], [`ENV_ADDR`] and [`ENV_ADDRS`] set. Add arguments,
    /// environment and stdio as with any [`Command`]. [`Testbed::try_command`] returns the
    /// error instead of panicking.
    ///
    /// # Panics
    /// If `i` is not a host of this bed (a test's own mistake: the tests index their beds
    /// with constants).
    pub fn command(&self, i: usize, program: impl AsRef<OsStr>) -> Command {
        match self.try_command(i, program) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`Testbed::command`], or [`Error::Invalid`] naming the host when `i` is not a host of
    /// this bed.
    pub fn try_command(&self, i: usize, program: impl AsRef<OsStr>) -> Result<Command, Error> {
        host_command(&self.name, i, self.len(), program)
    }

    /// Starts `program args...` inside host `i`. The child is killed at the latest when the
    /// bed is dropped. A host outside the bed is an [`std::io::ErrorKind::InvalidInput`]
    /// error that names it.
    pub fn spawn<I, S>(
        &self,
        i: usize,
        program: impl AsRef<OsStr>,
        args: I,
    ) -> std::io::Result<Child>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let child = self
            .try_command(i, program)
            .map_err(invalid_input)?
            .args(args)
            .spawn()?;
        self.spawned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(child.id());
        Ok(child)
    }

    /// Runs `program args...` inside host `i` to completion and collects its output. A host
    /// outside the bed is an [`std::io::ErrorKind::InvalidInput`] error that names it.
    pub fn output<I, S>(
        &self,
        i: usize,
        program: impl AsRef<OsStr>,
        args: I,
    ) -> std::io::Result<Output>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.try_command(i, program)
            .map_err(invalid_input)?
            .args(args)
            .stdin(Stdio::null())
            .output()
    }

    /// Reshapes host `i`'s link, both directions, to `rate_mbit` (`None`: unshaped). Takes
    /// effect at once, also for open connections.
    pub fn set_rate(&self, i: usize, rate_mbit: Option<u64>) -> Result<(), Error> {
        let n = self.len();
        if i >= n {
            return Err(Error::Invalid(format!("host {i} of a {n}-host test bed")));
        }
        if rate_mbit == Some(0) {
            return Err(Error::Invalid("a rate of 0 Mbit/s".into()));
        }
        self.shape(i, rate_mbit)?;
        self.rates.lock().unwrap_or_else(|e| e.into_inner())[i] = rate_mbit;
        Ok(())
    }

    fn shape(&self, i: usize, rate_mbit: Option<u64>) -> Result<(), Error> {
        reshape(&self.name, i, rate_mbit, self.shaping)
    }

    /// Keeps the bed running after `self` is gone and returns its name; [`destroy`] (or
    /// `oxccl-testbed down NAME`) deletes it later. It is still deleted as stale once its
    /// owner process is gone.
    pub fn leak(mut self) -> String {
        self.torn_down = true;
        std::mem::take(&mut self.name)
    }

    /// Tears the bed down now and reports failures, which [`Drop`] can only print.
    pub fn teardown(mut self) -> Result<(), Error> {
        self.torn_down = true;
        self.kill_spawned();
        destroy(&self.name)
    }
}

impl Testbed {
    /// SIGKILLs the children [`Testbed::spawn`] started that still run.
    fn kill_spawned(&self) {
        let pids: Vec<String> = self
            .spawned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .map(|p| p.to_string())
            .collect();
        if !pids.is_empty() {
            let _ = Command::new("kill")
                .arg("-KILL")
                .args(&pids)
                .stderr(Stdio::null())
                .status();
        }
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        if !self.torn_down {
            self.torn_down = true;
            self.kill_spawned();
            if let Err(e) = destroy(&self.name) {
                eprintln!("oxccl-testbed: tearing down {}: {e}", self.name);
            }
        }
    }
}

/// Picks the bed's name `oxtb<owner>-<n>` and claims it by creating its bridge namespace, which
/// fails where the name is taken (several `oxccl-testbed up` processes may share an owner, and
/// each has its own counter).
fn claim_name(owner: u32) -> Result<String, Error> {
    let _g = SETUP.lock().unwrap_or_else(|e| e.into_inner());
    let mut last_err = None;
    for _ in 0..1000 {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("{PREFIX}{owner}-{n}");
        match ip(&["netns", "add", &format!("{name}-br")]) {
            Ok(_) => return Ok(name),
            Err(e) => {
                if !netns_list()?
                    .iter()
                    .any(|ns| bed_of(ns) == Some(name.as_str()))
                {
                    return Err(e);
                }
                last_err = Some(e);
            }
        }
    }
    // The loop ran (1000 times) and every pass that did not return set `last_err`.
    Err(last_err.expect("tried at least once"))
}

/// The namespace name of host `i` of the bed `bed`.
pub fn host_netns(bed: &str, i: usize) -> String {
    format!("{bed}-h{i}")
}

/// Host `i`'s address in every bed: `10.77.0.<i+1>`.
///
/// # Panics
/// If `i >= MAX_HOSTS`.
pub fn host_addr(i: usize) -> Ipv4Addr {
    // Kept (documented): every caller passes a host of a bed (below `MAX_HOSTS`), which
    // `host_command` and `Testbed::new` check; the tests index beds with constants.
    assert!(i < MAX_HOSTS, "host {i} (at most {MAX_HOSTS})");
    Ipv4Addr::new(10, 77, 0, i as u8 + 1)
}

/// A command that runs `program` inside host `i` of the `n`-host bed `bed`; what
/// [`Testbed::command`] returns, for a bed known only by name.
///
/// # Errors
/// [`Error::Invalid`] when `i` is not below `n`, or `n` is above [`MAX_HOSTS`].
pub fn host_command(
    bed: &str,
    i: usize,
    n: usize,
    program: impl AsRef<OsStr>,
) -> Result<Command, Error> {
    if n > MAX_HOSTS {
        return Err(Error::Invalid(format!(
            "a bed of {n} hosts (at most {MAX_HOSTS})"
        )));
    }
    if i >= n {
        return Err(Error::Invalid(format!("host {i} of a {n}-host test bed")));
    }
    let mut c = Command::new(tool("ip"));
    c.args(["netns", "exec"])
        .arg(host_netns(bed, i))
        .arg(program);
    let addrs: Vec<String> = (0..n).map(|j| host_addr(j).to_string()).collect();
    c.env(ENV_HOST, i.to_string())
        .env(ENV_HOSTS, n.to_string())
        .env(ENV_ADDR, host_addr(i).to_string())
        .env(ENV_ADDRS, addrs.join(","));
    Ok(c)
}

/// An [`Error`] as an I/O error of kind `InvalidInput` (for the functions that return
/// [`std::io::Result`]).
fn invalid_input(e: Error) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string())
}

/// Shapes host `i`'s link of the bed `bed` (both directions) to `rate_mbit` with `shaping`
/// (`None`: unshaped); what [`Testbed::set_rate`] does, for a bed known only by name. A link
/// that is already shaped keeps what it has queued.
///
/// # Errors
/// [`Error::Invalid`] for a rate of 0; [`Error::Command`] when `tc` fails (no such bed or
/// host: its namespace does not exist).
pub fn reshape(bed: &str, i: usize, rate_mbit: Option<u64>, shaping: Shaping) -> Result<(), Error> {
    if rate_mbit == Some(0) {
        return Err(Error::Invalid(format!(
            "a rate of 0 Mbit/s for host {i} of {bed}"
        )));
    }
    let h = host_netns(bed, i);
    let br = format!("{bed}-br");
    let port = format!("h{i}");
    for (ns, dev) in [(h.as_str(), "eth0"), (br.as_str(), port.as_str())] {
        let tree = tc(&["-n", ns, "qdisc", "show", "dev", dev])?;
        let shaped = tree.contains("qdisc tbf 1: root");
        let same_tree = shaped && tree.contains("qdisc htb 10:") == shaping.small_first;
        if shaped && !(same_tree && rate_mbit.is_some()) {
            // Back to the veth default (noqueue).
            tc(&["-n", ns, "qdisc", "del", "dev", dev, "root"])?;
        }
        match rate_mbit {
            Some(rate) if same_tree => tc_batch(ns, &shaping.tc_batch_change(dev, rate))?,
            Some(rate) => tc_batch(ns, &shaping.tc_batch(dev, rate))?,
            None => {}
        }
    }
    Ok(())
}

/// Deletes the bed `bed` (a name from [`Testbed::name`] or [`list`]): kills every process
/// inside its namespaces, then deletes them. Deleting a bed that is already gone succeeds.
pub fn destroy(bed: &str) -> Result<(), Error> {
    let namespaces: Vec<String> = netns_list()?
        .into_iter()
        .filter(|ns| bed_of(ns) == Some(bed))
        .collect();
    delete_namespaces(&namespaces)
}

fn delete_namespaces(namespaces: &[String]) -> Result<(), Error> {
    let _g = SETUP.lock().unwrap_or_else(|e| e.into_inner());
    let mut first_err = None;
    // Hosts first, the bridge last; processes die before their namespace's name goes.
    let mut order: Vec<&String> = namespaces.iter().collect();
    order.sort_by_key(|ns| ns.ends_with("-br"));
    for ns in order {
        kill_inside(ns);
        if let Err(e) = ip(&["netns", "del", ns]) {
            // Someone else (a concurrent stale cleanup) may have deleted it first.
            if netns_list().is_ok_and(|l| l.iter().any(|x| x == ns)) {
                first_err.get_or_insert(e);
            }
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// SIGKILLs every process in namespace `ns` (they would keep it alive after deletion).
fn kill_inside(ns: &str) {
    for _ in 0..10 {
        let Ok(out) = Command::new(tool("ip"))
            .args(["netns", "pids", ns])
            .stderr(Stdio::null())
            .output()
        else {
            return;
        };
        let me = std::process::id().to_string();
        let pids: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter(|p| *p != me)
            .map(str::to_owned)
            .collect();
        if pids.is_empty() {
            return;
        }
        let _ = Command::new("kill")
            .arg("-KILL")
            .args(&pids)
            .stderr(Stdio::null())
            .status();
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Every test bed on the machine (namespaces named `oxtb<pid>-<n>-...`).
pub fn list() -> Result<Vec<BedInfo>, Error> {
    let mut beds: Vec<BedInfo> = Vec::new();
    for ns in netns_list()? {
        let Some(bed) = bed_of(&ns) else { continue };
        let Some(pid) = owner_of(bed) else { continue };
        let info = match beds.iter_mut().find(|b| b.name == bed) {
            Some(b) => b,
            None => {
                beds.push(BedInfo {
                    name: bed.to_owned(),
                    owner_pid: pid,
                    owner_alive: pid_alive(pid),
                    hosts: 0,
                    namespaces: Vec::new(),
                });
                beds.last_mut().expect("just pushed")
            }
        };
        if ns.rsplit('-').next().is_some_and(|r| r.starts_with('h')) {
            info.hosts += 1;
        }
        info.namespaces.push(ns);
    }
    beds.sort_by(|a, b| a.name.cmp(&b.name));
    for b in &mut beds {
        b.namespaces.sort();
    }
    Ok(beds)
}

/// Deletes every test bed whose owning process is gone (left by a run that was killed) and
/// returns how many. Never fails: what cannot be deleted is reported on stderr.
pub fn cleanup_stale() -> usize {
    let Ok(beds) = list() else { return 0 };
    let mut n = 0;
    for b in beds.into_iter().filter(|b| !b.owner_alive) {
        match delete_namespaces(&b.namespaces) {
            Ok(()) => n += 1,
            Err(e) => eprintln!("oxccl-testbed: deleting stale test bed {}: {e}", b.name),
        }
    }
    n
}

/// `oxtb<pid>-<n>-h<i>` or `oxtb<pid>-<n>-br` → `oxtb<pid>-<n>`.
fn bed_of(ns: &str) -> Option<&str> {
    let rest = ns.strip_prefix(PREFIX)?;
    if let Some(pid) = rest.strip_suffix("-probe") {
        return (!pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit())).then_some(ns);
    }
    let mut parts = rest.splitn(3, '-');
    let pid = parts.next()?;
    let n = parts.next()?;
    let role = parts.next()?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let role_ok = role == "br" || role.strip_prefix('h').is_some_and(digits);
    (digits(pid) && digits(n) && role_ok).then(|| &ns[..PREFIX.len() + pid.len() + 1 + n.len()])
}

/// The namespace [`Testbed::available`] probes with; its own bed for [`list`] and
/// [`cleanup_stale`], so that a probe killed half-way is cleaned up too.
fn probe_netns(pid: u32) -> String {
    format!("{PREFIX}{pid}-probe")
}

fn owner_of(bed: &str) -> Option<u32> {
    bed.strip_prefix(PREFIX)?.split('-').next()?.parse().ok()
}

fn pid_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

fn netns_list() -> Result<Vec<String>, Error> {
    let out = run(Command::new(tool("ip")).args(["netns", "list"]))?;
    // Lines are `name` or `name (id: 3)`.
    Ok(out
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect())
}

/// The path of a system tool, also where `/usr/sbin` is not on `PATH`.
fn tool(name: &str) -> PathBuf {
    static IP: OnceLock<PathBuf> = OnceLock::new();
    static TC: OnceLock<PathBuf> = OnceLock::new();
    let cell = match name {
        "ip" => &IP,
        "tc" => &TC,
        _ => return PathBuf::from(name),
    };
    cell.get_or_init(|| find_tool(name).unwrap_or_else(|| PathBuf::from(name)))
        .clone()
}

fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

fn ip<S: AsRef<OsStr>>(args: &[S]) -> Result<String, Error> {
    run(Command::new(tool("ip")).args(args))
}

fn tc<S: AsRef<OsStr>>(args: &[S]) -> Result<String, Error> {
    run(Command::new(tool("tc")).args(args))
}

/// Runs `tc -n ns -batch -` with `lines` on stdin.
fn tc_batch(ns: &str, lines: &str) -> Result<(), Error> {
    let mut child = Command::new(tool("tc"))
        .args(["-n", ns, "-batch", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| Error::Spawn {
            command: format!("tc -n {ns} -batch -"),
            source,
        })?;
    // A write error means tc exited early; its status and stderr say why.
    // (Dropped at the end of the statement: tc sees the end of its input.)
    let _ = child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all(lines.as_bytes());
    let out = child.wait_with_output().map_err(|source| Error::Spawn {
        command: format!("tc -n {ns} -batch -"),
        source,
    })?;
    if !out.status.success() {
        return Err(Error::Command {
            command: format!("tc -n {ns} -batch - <<< {lines:?}"),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(())
}

fn run(cmd: &mut Command) -> Result<String, Error> {
    let line = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|source| Error::Spawn {
            command: line.clone(),
            source,
        })?;
    if !out.status.success() {
        return Err(Error::Command {
            command: line,
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn effective_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

fn probe() -> Result<(), String> {
    if !cfg!(target_os = "linux") {
        return Err("network namespaces need Linux".into());
    }
    match effective_uid() {
        Some(0) => {}
        Some(uid) => {
            return Err(format!(
                "not root (euid {uid}); network namespaces need root"
            ));
        }
        None => return Err("cannot read the effective uid from /proc/self/status".into()),
    }
    for t in ["ip", "tc"] {
        if find_tool(t).is_none() {
            return Err(format!("`{t}` not found (install iproute2)"));
        }
    }
    if !std::path::Path::new("/proc/self/ns/net").exists() {
        return Err("the kernel has no network namespaces".into());
    }
    // Build the smallest bed there is, in one throw-away namespace.
    let ns = probe_netns(std::process::id());
    let ns = ns.as_str();
    let steps: [&[&str]; 4] = [
        &["ip", "netns", "add", ns],
        &["ip", "-n", ns, "link", "add", "b0", "type", "bridge"],
        &[
            "ip", "-n", ns, "link", "add", "v0", "type", "veth", "peer", "name", "v1",
        ],
        &[
            "tc", "-n", ns, "qdisc", "add", "dev", "v0", "root", "tbf", "rate", "1mbit", "burst",
            "32kb", "limit", "64kb",
        ],
    ];
    let mut result = Ok(());
    {
        let _g = SETUP.lock().unwrap_or_else(|e| e.into_inner());
        for step in steps {
            let what = match step[3] {
                "add" if step[1] == "netns" => "network namespaces",
                _ if step.contains(&"bridge") => "bridges",
                _ if step.contains(&"veth") => "veth pairs",
                _ => "tc tbf",
            };
            if let Err(e) = run(Command::new(tool(step[0])).args(&step[1..])) {
                result = Err(format!("{what} unsupported: {e}"));
                break;
            }
        }
        let _ = ip(&["netns", "del", ns]);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host outside the bed, or a bed past `MAX_HOSTS`, is an error naming it (it was an
    /// assertion in `Testbed::command` and a panic in `host_addr`).
    #[test]
    fn a_command_for_a_host_outside_the_bed_is_an_error() {
        let e = host_command("oxtb1-2", 4, 4, "true").unwrap_err();
        assert!(matches!(e, Error::Invalid(_)), "{e:?}");
        assert!(e.to_string().contains("host 4 of a 4-host test bed"), "{e}");
        let e = host_command("oxtb1-2", 0, 300, "true").unwrap_err();
        assert!(e.to_string().contains("300 hosts (at most 250)"), "{e}");
        let c = host_command("oxtb1-2", 3, 4, "true").unwrap();
        assert_eq!(
            c.get_args().collect::<Vec<_>>(),
            ["netns", "exec", "oxtb1-2-h3", "true"]
        );
    }

    /// A rate of 0 is refused before `tc` runs (it needs no root).
    #[test]
    fn reshaping_to_zero_is_an_error() {
        let e = reshape("oxtb1-2", 3, Some(0), Shaping::default()).unwrap_err();
        assert!(matches!(e, Error::Invalid(_)), "{e:?}");
        assert!(e.to_string().contains("host 3 of oxtb1-2"), "{e}");
    }

    /// Sizes of absurd rates saturate instead of overflowing (`tc` then refuses them).
    #[test]
    fn absurd_rates_saturate() {
        let s = Shaping {
            burst_us: u64::MAX,
            queue_us: u64::MAX,
            ..Shaping::default()
        };
        assert_eq!(s.burst_bytes(u64::MAX), u64::MAX / 8);
        assert_eq!(s.queue_bytes(2), u64::MAX / 8);
        let (burst, limit) = (u64::MAX / 8, u64::MAX / 8 * 2);
        let b = s.tc_batch("eth0", u64::MAX);
        assert!(b.contains(&format!("burst {burst} limit {limit}\n")), "{b}");
        let b = s.tc_batch_change("eth0", u64::MAX);
        assert!(b.contains(&format!("burst {burst} limit {limit}\n")), "{b}");
    }

    #[test]
    fn names_parse() {
        assert_eq!(bed_of("oxtb123-4-h0"), Some("oxtb123-4"));
        assert_eq!(bed_of("oxtb123-4-h17"), Some("oxtb123-4"));
        assert_eq!(bed_of("oxtb123-4-br"), Some("oxtb123-4"));
        assert_eq!(bed_of("oxtb123-probe"), Some("oxtb123-probe"));
        assert_eq!(owner_of("oxtb123-probe"), Some(123));
        assert_eq!(bed_of("oxtb-probe"), None);
        assert_eq!(bed_of("oxtb123-4-x"), None);
        assert_eq!(bed_of("oxtb-4-h0"), None);
        assert_eq!(bed_of("other"), None);
        assert_eq!(owner_of("oxtb123-4"), Some(123));
        assert_eq!(host_netns("oxtb1-2", 3), "oxtb1-2-h3");
    }

    #[test]
    fn addresses() {
        assert_eq!(host_addr(0), Ipv4Addr::new(10, 77, 0, 1));
        assert_eq!(host_addr(249), Ipv4Addr::new(10, 77, 0, 250));
    }

    #[test]
    fn tbf_sizes() {
        let s = Shaping::default();
        // 2 ms at 1 Gbit/s; 32 KiB at least.
        assert_eq!(s.burst_bytes(1000), 250_000);
        assert_eq!(s.burst_bytes(100), 32 * 1024);
        assert_eq!(s.burst_bytes(1), 32 * 1024);
        // 50 ms at the rate; 64 KiB at least.
        assert_eq!(s.queue_bytes(1000), 6_250_000);
        assert_eq!(s.queue_bytes(1), 64 * 1024);
        let jumbo = Shaping { mtu: 65000, ..s };
        assert_eq!(jumbo.burst_bytes(10), 2 * 65014);
        assert_eq!(jumbo.queue_bytes(10), 4 * 65014);
        let batch = s.tc_batch("eth0", 1000);
        assert!(batch.starts_with(
            "qdisc add dev eth0 root handle 1: tbf rate 1000mbit burst 250000 limit 6500000\n"
        ));
        assert!(batch.contains("parent 10:2 handle 12: bfifo limit 6250000\n"));
        assert!(batch.contains("u32 match u16 0 0xff80 at 2 flowid 10:1\n"));
        assert_eq!(batch.lines().count(), 7);
        let plain = Shaping {
            small_first: false,
            ..s
        };
        assert_eq!(plain.tc_batch("h0", 250).lines().count(), 1);
        assert_eq!(
            s.tc_batch_change("h0", 250),
            "qdisc change dev h0 root handle 1: tbf rate 250mbit burst 62500 limit 1625000\n\
             qdisc change dev h0 parent 10:2 handle 12: bfifo limit 1562500\n"
        );
    }
}
