//! Bootstrap configuration: explicit, or read from a launcher's environment.

use std::fmt;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::hostlist;
use crate::secret::Secret;

/// Port of the store when `MASTER_ADDR` is set without `MASTER_PORT` (torch's default).
pub const DEFAULT_PORT: u16 = 29500;
/// How long joining and each collective may take unless configured.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The launcher whose environment gave the rank and world size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Launcher {
    /// Given in code, or by `OXCCL_RANK` and `OXCCL_WORLD_SIZE`.
    Explicit,
    /// torchrun / torch.distributed.elastic (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, ...).
    Torchrun,
    /// Slurm's srun (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`).
    Slurm,
    /// Open MPI's mpirun (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, ...).
    OpenMpi,
    /// A PMI launcher such as MPICH's hydra (`PMI_RANK`, `PMI_SIZE`).
    Pmi,
}

/// Each launcher's variables: rank, world size, local rank, local world size ("" for none),
/// innermost launcher first: a process of `mpirun` inside a Slurm job also inherits the job's
/// `SLURM_PROCID` (0 in a batch script) and `SLURM_NTASKS`, which are not its rank and size.
const LAUNCHERS: [(Launcher, [&str; 4]); 4] = [
    (
        Launcher::Torchrun,
        ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
    ),
    (
        Launcher::OpenMpi,
        [
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ],
    ),
    (
        Launcher::Slurm,
        ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", ""],
    ),
    (
        Launcher::Pmi,
        ["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"],
    ),
];

impl Launcher {
    /// The launcher whose rank variable this environment carries (`Explicit` for
    /// `OXCCL_RANK`), or `None` for a process not started by one: tools use it to decide
    /// whether to start their own ranks.
    pub fn in_env() -> Option<Launcher> {
        Launcher::in_vars(&|name| std::env::var(name).ok())
    }

    /// [`Launcher::in_env`] over any variable source.
    pub fn in_vars(var: &dyn Fn(&str) -> Option<String>) -> Option<Launcher> {
        let set = |name: &str| var(name).is_some_and(|v| !v.trim().is_empty());
        LAUNCHERS
            .iter()
            .find(|(_, [rank, ..])| set(rank))
            .map(|(l, _)| *l)
            .or_else(|| set("OXCCL_RANK").then_some(Launcher::Explicit))
    }
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::Explicit => "explicit",
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "Slurm",
            Launcher::OpenMpi => "Open MPI",
            Launcher::Pmi => "PMI",
        })
    }
}

/// Everything [`Bootstrap::new`](crate::Bootstrap::new) needs.
#[derive(Clone, Debug)]
pub struct Config {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Rank among the processes of this host, when the launcher says.
    pub local_rank: Option<usize>,
    /// Number of ranks on this host, when the launcher says.
    pub local_world_size: Option<usize>,
    /// The store's address, `host:port`.
    pub store_addr: String,
    /// Where `store_addr` came from when no variable named it (neither `OXCCL_STORE_ADDR`
    /// nor `MASTER_ADDR`): e.g. `the first node of SLURM_STEP_NODELIST="node[01-04]" and a
    /// port from SLURM_JOB_ID=42, SLURM_STEP_ID=0`. `None` when it was given. Errors about
    /// reaching the store should repeat it, and say that MASTER_ADDR and MASTER_PORT override
    /// it.
    pub store_addr_inferred: Option<String>,
    /// Whether rank 0 serves the store (`false`: a standalone `oxccl store` runs).
    pub serve_store: bool,
    /// Address rank 0 binds the store to; `None`: the store address (or, when that is not
    /// an address of this host, every interface on its port).
    pub bind_addr: Option<String>,
    /// The job's shared secret. Required.
    pub secret: Option<Secret>,
    /// How long joining, connecting and each collective may take.
    pub timeout: Duration,
    /// Namespace of this job's keys in the store (a standalone store may serve several jobs).
    pub job_id: String,
    /// Where the configuration came from.
    pub launcher: Launcher,
}

impl Config {
    /// An explicit configuration: rank 0 serves the store at `store_addr`.
    pub fn new(
        rank: usize,
        world_size: usize,
        store_addr: impl Into<String>,
        secret: Secret,
    ) -> Config {
        Config {
            rank,
            world_size,
            local_rank: None,
            local_world_size: None,
            store_addr: store_addr.into(),
            store_addr_inferred: None,
            serve_store: true,
            bind_addr: None,
            secret: Some(secret),
            timeout: DEFAULT_TIMEOUT,
            job_id: "default".into(),
            launcher: Launcher::Explicit,
        }
    }

    /// Reads the configuration from this process's environment; see [`Config::from_vars`].
    pub fn from_env() -> Result<Config> {
        Config::from_vars(&|name| std::env::var(name).ok())
    }

    /// Reads the configuration from environment variables, looked up by `var`.
    ///
    /// The launcher is the first found of: torchrun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    /// `LOCAL_WORLD_SIZE`), Open MPI (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
    /// `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE`), Slurm (`SLURM_PROCID`,
    /// `SLURM_NTASKS`, `SLURM_LOCALID`) and PMI (`PMI_RANK`, `PMI_SIZE`, and hydra's
    /// `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`): the innermost first, since `mpirun` inside a
    /// Slurm job leaves the job's `SLURM_PROCID` in its processes' environment. Explicit
    /// options override it field by field:
    ///
    /// - `OXCCL_RANK`, `OXCCL_WORLD_SIZE`, `OXCCL_LOCAL_RANK`, `OXCCL_LOCAL_WORLD_SIZE`;
    /// - `OXCCL_STORE_ADDR` (`host:port`), else `MASTER_ADDR` and `MASTER_PORT` (default
    ///   29500), else, when rank 0 serves the store, what the launcher says
    ///   ([`Config::store_addr_inferred`] then says where it came from):
    ///   - Slurm: the first node of `SLURM_STEP_NODELIST` (else `SLURM_JOB_NODELIST`, else
    ///     `SLURM_NODELIST`), where task 0 runs; rank 0 checks that it is its own node
    ///     (`SLURMD_NODENAME`) and listens on every interface (`0.0.0.0`);
    ///   - Open MPI 4's mpirun: the first IPv4 address (else IPv6) of mpirun's host in
    ///     `OMPI_MCA_orte_hnp_uri`; rank 0 checks that it runs there (its local daemon's
    ///     `OMPI_MCA_orte_local_daemon_uri` lists that address);
    ///
    ///   and the port is `MASTER_PORT`, else one that every rank derives alike, from 20000 to
    ///   29499 (below Linux's ephemeral ports and torchrun's 29500): under Slurm `20000 +
    ///   (SLURM_JOB_ID × 32 + SLURM_STEP_ID) mod 9500` (a step id unset counts as 0), so that
    ///   steps 0 to 31 of a job get different ports, and so does the same step of jobs whose
    ///   ids differ by less than 2375; under Open MPI `20000 + OMPI_MCA_ess_base_jobid mod
    ///   9500` (the id of each mpirun's job differs);
    /// - `OXCCL_STORE_STANDALONE=1`: a standalone store runs, rank 0 does not serve one;
    /// - `OXCCL_STORE_BIND`: the address rank 0 binds;
    /// - `OXCCL_BOOTSTRAP_TIMEOUT`: seconds (default 300);
    /// - `OXCCL_JOB_ID`: key namespace (default: `TORCHELASTIC_RUN_ID`, the Slurm job and step,
    ///   `PMIX_NAMESPACE`, else "default");
    /// - `OXCCL_SECRET` or `OXCCL_SECRET_FILE`: the shared secret.
    pub fn from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<Config> {
        let get = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        let num = |name: &'static str| -> Result<Option<usize>> {
            match get(name) {
                None => Ok(None),
                Some(v) => v
                    .trim()
                    .parse::<usize>()
                    .map(Some)
                    .map_err(|_| Error::BadEnv {
                        var: name,
                        value: v,
                        reason: "not a non-negative integer".into(),
                    }),
            }
        };
        let opt_num = |name: &'static str| if name.is_empty() { Ok(None) } else { num(name) };
        let mut found = None;
        for (launcher, [r, w, lr, lw]) in LAUNCHERS {
            if let (Some(rank), Some(world)) = (num(r)?, num(w)?) {
                found = Some((launcher, rank, world, opt_num(lr)?, opt_num(lw)?));
                break;
            }
        }
        let (explicit_rank, explicit_world) = (num("OXCCL_RANK")?, num("OXCCL_WORLD_SIZE")?);
        let (launcher, rank, world_size, local_rank, local_world_size) =
            match (found, explicit_rank, explicit_world) {
                (Some((l, r, w, lr, lw)), er, ew) => (l, er.unwrap_or(r), ew.unwrap_or(w), lr, lw),
                (None, Some(r), Some(w)) => (Launcher::Explicit, r, w, None, None),
                (None, Some(_), None) => {
                    return Err(Error::Config(
                        "OXCCL_RANK is set but OXCCL_WORLD_SIZE is not".into(),
                    ));
                }
                (None, None, Some(_)) => {
                    return Err(Error::Config(
                        "OXCCL_WORLD_SIZE is set but OXCCL_RANK is not".into(),
                    ));
                }
                (None, None, None) => {
                    let mut looked_for = vec!["OXCCL_RANK", "OXCCL_WORLD_SIZE"];
                    for (_, [r, w, _, _]) in LAUNCHERS {
                        looked_for.extend([r, w]);
                    }
                    return Err(Error::NoLauncher { looked_for });
                }
            };
        let local_rank = num("OXCCL_LOCAL_RANK")?.or(local_rank);
        let local_world_size = num("OXCCL_LOCAL_WORLD_SIZE")?.or(local_world_size);

        let serve_store = match get("OXCCL_STORE_STANDALONE") {
            None => true,
            Some(v) => match v.trim().to_ascii_lowercase().as_str() {
                "1" | "true" | "yes" | "on" => false,
                "0" | "false" | "no" | "off" => true,
                _ => {
                    return Err(Error::BadEnv {
                        var: "OXCCL_STORE_STANDALONE",
                        value: v,
                        reason: "expected 1 or 0".into(),
                    });
                }
            },
        };
        let master_port = || -> Result<Option<u16>> {
            get("MASTER_PORT")
                .map(|p| {
                    p.trim().parse::<u16>().map_err(|_| Error::BadEnv {
                        var: "MASTER_PORT",
                        value: p,
                        reason: "not a port number".into(),
                    })
                })
                .transpose()
        };
        let mut bind_addr = get("OXCCL_STORE_BIND");
        let (store_addr, store_addr_inferred) = match (get("OXCCL_STORE_ADDR"), get("MASTER_ADDR"))
        {
            (Some(a), _) => (a.trim().to_owned(), None),
            (None, Some(host)) => (
                join_host_port(host.trim(), master_port()?.unwrap_or(DEFAULT_PORT)),
                None,
            ),
            (None, None) => {
                let found = if serve_store {
                    infer_store(launcher, rank, master_port()?, &get)?
                } else {
                    Err("a standalone store (OXCCL_STORE_STANDALONE) is not found by itself".into())
                };
                match found {
                    Ok(inferred) => {
                        bind_addr = bind_addr.or(inferred.bind);
                        (inferred.addr, Some(inferred.source))
                    }
                    Err(why) => {
                        return Err(Error::Config(format!(
                            "no store address: set OXCCL_STORE_ADDR=host:port, or MASTER_ADDR \
                                 and MASTER_PORT (rank {rank} of {world_size} from the {launcher} \
                                 environment; {why})"
                        )));
                    }
                }
            }
        };
        let timeout = match get("OXCCL_BOOTSTRAP_TIMEOUT") {
            None => DEFAULT_TIMEOUT,
            Some(v) => v
                .trim()
                .parse::<f64>()
                .ok()
                .and_then(|s| Duration::try_from_secs_f64(s).ok())
                .filter(|d| !d.is_zero())
                .ok_or_else(|| Error::BadEnv {
                    var: "OXCCL_BOOTSTRAP_TIMEOUT",
                    value: v,
                    reason: "expected a positive number of seconds".into(),
                })?,
        };
        let job_id = get("OXCCL_JOB_ID")
            .or_else(|| get("TORCHELASTIC_RUN_ID"))
            .or_else(|| {
                get("SLURM_JOB_ID").map(|j| match get("SLURM_STEP_ID") {
                    Some(s) => format!("{j}.{s}"),
                    None => j,
                })
            })
            .or_else(|| get("PMIX_NAMESPACE"))
            .unwrap_or_else(|| "default".into());
        Ok(Config {
            rank,
            world_size,
            local_rank,
            local_world_size,
            store_addr,
            store_addr_inferred,
            serve_store,
            bind_addr,
            secret: Secret::from_vars(var)?,
            timeout,
            job_id,
            launcher,
        })
    }
}

/// `host:port`, bracketing IPv6 literals.
/// A byte count as the `OXCCL_*` variables write it: `4096`, `64K`, `1M`, `1G` (binary
/// units); `None` when it is not one (or overflows).
pub fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last()? {
        (i, 'k' | 'K') => (&s[..i], 1 << 10),
        (i, 'm' | 'M') => (&s[..i], 1 << 20),
        (i, 'g' | 'G') => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    num.trim().parse::<usize>().ok()?.checked_mul(mult)
}

fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// First port of the range that a store's port inferred from a job id falls in.
const INFERRED_PORT_BASE: u16 = 20000;
/// Size of that range: ports 20000 to 29499, below Linux's ephemeral ports (32768 and up) and
/// torchrun's 29500.
const INFERRED_PORT_SPAN: u16 = 9500;

/// The store's port for a Slurm step without `MASTER_PORT`: `20000 + (job × 32 + step) mod
/// 9500`.
///
/// Deterministic, so every rank computes the same one. Steps 0 to 31 of one job get different
/// ports, and so does the same step of two jobs whose ids differ by less than 2375: steps of
/// one job, and jobs started one after another, can share a node.
fn slurm_port(job: u64, step: u64) -> u16 {
    port_in_range(u128::from(job) * 32 + u128::from(step))
}

/// `20000 + slot mod 9500`.
fn port_in_range(slot: u128) -> u16 {
    let offset = slot % u128::from(INFERRED_PORT_SPAN);
    INFERRED_PORT_BASE + offset as u16
}

/// A store address read from a launcher's own variables.
struct Inferred {
    addr: String,
    /// What rank 0 binds, when not the address itself.
    bind: Option<String>,
    /// Where the address came from, for errors.
    source: String,
}

/// The store's address from the launcher's variables, `Err(why not)` when they do not name
/// it, or an error when they name it wrongly (or rank 0 is not where they say the store is).
fn infer_store(
    launcher: Launcher,
    rank: usize,
    master_port: Option<u16>,
    get: &dyn Fn(&str) -> Option<String>,
) -> Result<std::result::Result<Inferred, String>> {
    match launcher {
        Launcher::Slurm => infer_slurm(rank, master_port, get),
        Launcher::OpenMpi => infer_open_mpi(rank, master_port, get),
        _ => Ok(Err(format!(
            "the {launcher} environment does not name the store's host; Slurm's node list and \
             Open MPI 4's OMPI_MCA_orte_hnp_uri would"
        ))),
    }
}

/// A non-negative integer variable, or `None` when unset.
fn integer(get: &dyn Fn(&str) -> Option<String>, var: &'static str) -> Result<Option<u64>> {
    get(var)
        .map(|v| {
            v.trim().parse::<u64>().map_err(|_| Error::BadEnv {
                var,
                value: v,
                reason: "not a non-negative integer".into(),
            })
        })
        .transpose()
}

/// Slurm: the first node of the step (task 0 runs there with every distribution but
/// `arbitrary`), a port from the job and step ids, and rank 0 serving on every interface.
fn infer_slurm(
    rank: usize,
    master_port: Option<u16>,
    get: &dyn Fn(&str) -> Option<String>,
) -> Result<std::result::Result<Inferred, String>> {
    const LISTS: [&str; 3] = [
        "SLURM_STEP_NODELIST",
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
    ];
    let Some((var, list)) = LISTS.iter().find_map(|&v| get(v).map(|l| (v, l))) else {
        return Ok(Err(format!(
            "no store address could be inferred: none of {} is set",
            LISTS.join(", ")
        )));
    };
    let host = hostlist::first(list.trim()).map_err(|e| Error::BadEnv {
        var,
        value: list.clone(),
        reason: format!("not a Slurm hostlist: {} (at byte {})", e.reason, e.at),
    })?;
    let (port, port_source) = match master_port {
        Some(p) => (p, format!("MASTER_PORT={p}")),
        None => {
            let job = match integer(get, "SLURM_JOB_ID")? {
                Some(j) => j,
                None => {
                    return Ok(Err(format!(
                        "the store's host is {host}, the first node of {var}, but SLURM_JOB_ID, \
                         which its port is derived from, is not set: set MASTER_PORT"
                    )));
                }
            };
            let step = integer(get, "SLURM_STEP_ID")?;
            let port = slurm_port(job, step.unwrap_or(0));
            let step = step.map_or("SLURM_STEP_ID unset".into(), |s| {
                format!("SLURM_STEP_ID={s}")
            });
            (port, format!("port {port} from SLURM_JOB_ID={job}, {step}"))
        }
    };
    let source = format!("the first node of {var}={list:?} and {port_source}");
    if rank == 0
        && let Some(me) = get("SLURMD_NODENAME").map(|n| n.trim().to_owned())
        && me != host
    {
        return Err(Error::Config(format!(
            "rank 0 runs on node {me} (SLURMD_NODENAME), but the store's host was inferred as \
             {host}, the first node of {var}={list:?}; rank 0 serves the store, so it must run \
             there (it does with srun's default block or cyclic distribution). Set MASTER_ADDR \
             to rank 0's host, e.g. MASTER_ADDR={me}, and MASTER_PORT, or OXCCL_STORE_ADDR"
        )));
    }
    Ok(Ok(Inferred {
        addr: join_host_port(&host, port),
        // A node's name may resolve to a loopback address on the node itself (Debian's
        // `127.0.1.1 hostname` in /etc/hosts) but not elsewhere: listen on every interface,
        // as torch's TCPStore does.
        bind: Some(format!("0.0.0.0:{port}")),
        source,
    }))
}

/// The addresses in an Open MPI 4 daemon's out-of-band URI,
/// `JOBID.VPID;tcp://IP,IP,...:PORT;tcp6://[IP],...:PORT`, in order: the host's interfaces
/// that `oob_tcp_if_include` allows (loopback only when it has no other).
fn uri_addresses(uri: &str) -> std::result::Result<Vec<std::net::IpAddr>, String> {
    let mut out = Vec::new();
    for part in uri.split(';').skip(1) {
        let Some((scheme, rest)) = part.trim().split_once("://") else {
            continue;
        };
        if !matches!(scheme, "tcp" | "tcp6") {
            continue;
        }
        let Some((ips, _port)) = rest.rsplit_once(':') else {
            return Err(format!("{part:?} has no port"));
        };
        for ip in ips.split(',') {
            let ip = ip.trim().trim_start_matches('[').trim_end_matches(']');
            out.push(
                ip.parse()
                    .map_err(|_| format!("{ip:?} in {part:?} is not an IP address"))?,
            );
        }
    }
    Ok(out)
}

/// The address to reach mpirun's host at: the first IPv4 address of its URI, else the first
/// IPv6 address that is not link-local.
fn hnp_address(uri: &str) -> std::result::Result<std::net::IpAddr, String> {
    use std::net::IpAddr;
    let all = uri_addresses(uri)?;
    all.iter()
        .find(|a| a.is_ipv4())
        .or_else(|| {
            all.iter()
                .find(|a| matches!(a, IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) != 0xfe80))
        })
        .copied()
        .ok_or_else(|| "it lists no tcp:// or tcp6:// address".into())
}

/// Open MPI 4 (ORTE): mpirun's host, which `OMPI_MCA_orte_hnp_uri` names; a port from its job
/// id. Rank 0 must run there: its local daemon (mpirun itself, or an orted that mpirun started
/// on its own host) lists that address.
fn infer_open_mpi(
    rank: usize,
    master_port: Option<u16>,
    get: &dyn Fn(&str) -> Option<String>,
) -> Result<std::result::Result<Inferred, String>> {
    const HNP: &str = "OMPI_MCA_orte_hnp_uri";
    let Some(uri) = get(HNP) else {
        return Ok(Err(format!(
            "no store address could be inferred: {HNP}, where Open MPI 4's mpirun names its \
             host, is not set"
        )));
    };
    let ip = hnp_address(&uri).map_err(|reason| Error::BadEnv {
        var: HNP,
        value: uri.clone(),
        reason,
    })?;
    let (port, port_source) = match master_port {
        Some(p) => (p, format!("MASTER_PORT={p}")),
        None => match integer(get, "OMPI_MCA_ess_base_jobid")? {
            Some(job) => {
                let port = port_in_range(u128::from(job));
                (
                    port,
                    format!("port {port} from OMPI_MCA_ess_base_jobid={job}"),
                )
            }
            None => {
                return Ok(Err(format!(
                    "the store's host is {ip}, mpirun's, but OMPI_MCA_ess_base_jobid, which its \
                     port is derived from, is not set: set MASTER_PORT (mpirun -x MASTER_PORT)"
                )));
            }
        },
    };
    let source = format!("mpirun's host in {HNP}={uri:?} and {port_source}");
    if rank == 0
        && let Some(local) = get("OMPI_MCA_orte_local_daemon_uri")
        && let Ok(here) = uri_addresses(&local)
        && !here.contains(&ip)
    {
        let me = get("PMIX_HOSTNAME").unwrap_or_else(|| "another host".into());
        return Err(Error::Config(format!(
            "rank 0 runs on {me}, not on mpirun's host {ip} (its daemon's \
             OMPI_MCA_orte_local_daemon_uri={local:?} does not list {ip}, which {HNP}={uri:?} \
             names); rank 0 serves the store, so it must run there. Pass rank 0's host: mpirun \
             -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<port> ..., or set OXCCL_STORE_ADDR"
        )));
    }
    Ok(Ok(Inferred {
        addr: join_host_port(&ip.to_string(), port),
        bind: None,
        source,
    }))
}

#[cfg(test)]
mod tests {
    #[test]
    fn launcher_in_vars_names_the_launcher_or_none() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(Launcher::in_vars(&vars(&[])), None);
        assert_eq!(Launcher::in_vars(&vars(&[("RANK", " ")])), None);
        assert_eq!(
            Launcher::in_vars(&vars(&[("RANK", "1")])),
            Some(Launcher::Torchrun)
        );
        assert_eq!(
            Launcher::in_vars(&vars(&[("SLURM_PROCID", "0")])),
            Some(Launcher::Slurm)
        );
        assert_eq!(
            Launcher::in_vars(&vars(&[("PMI_RANK", "3")])),
            Some(Launcher::Pmi)
        );
        assert_eq!(
            Launcher::in_vars(&vars(&[("OXCCL_RANK", "0")])),
            Some(Launcher::Explicit)
        );
    }

    use super::*;
    use std::collections::HashMap;

    fn from(pairs: &[(&str, &str)]) -> Result<Config> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_vars(&move |k| m.get(k).cloned())
    }

    #[test]
    fn torchrun() {
        let c = from(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
            ("TORCHELASTIC_RUN_ID", "job7"),
            ("OXCCL_SECRET", "s"),
        ])
        .unwrap();
        assert_eq!(c.launcher, Launcher::Torchrun);
        assert_eq!((c.rank, c.world_size), (3, 8));
        assert_eq!((c.local_rank, c.local_world_size), (Some(1), Some(2)));
        assert_eq!(c.store_addr, "10.0.0.1:1234");
        assert_eq!(c.job_id, "job7");
        assert!(c.serve_store);
        assert_eq!(c.secret.unwrap().as_bytes(), b"s");
        assert_eq!(c.timeout, DEFAULT_TIMEOUT);
    }

    #[test]
    fn slurm_open_mpi_and_pmi() {
        let c = from(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "6"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_JOB_ID", "99"),
            ("SLURM_STEP_ID", "0"),
            ("MASTER_ADDR", "node1"),
        ])
        .unwrap();
        assert_eq!(c.launcher, Launcher::Slurm);
        assert_eq!((c.rank, c.world_size, c.local_rank), (5, 6, Some(2)));
        assert_eq!(c.local_world_size, None);
        assert_eq!(c.store_addr, "node1:29500");
        assert_eq!(c.job_id, "99.0");
        assert!(c.secret.is_none());

        let c = from(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("OXCCL_STORE_ADDR", "[::1]:7000"),
        ])
        .unwrap();
        assert_eq!(c.launcher, Launcher::OpenMpi);
        assert_eq!(
            (c.rank, c.world_size, c.local_rank, c.local_world_size),
            (1, 4, Some(1), Some(4))
        );
        assert_eq!(c.store_addr, "[::1]:7000");

        let c = from(&[
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "0"),
            ("MASTER_ADDR", "::1"),
            ("MASTER_PORT", "80"),
        ])
        .unwrap();
        assert_eq!(c.launcher, Launcher::Pmi);
        assert_eq!((c.rank, c.world_size, c.local_rank), (0, 2, Some(0)));
        assert_eq!(c.store_addr, "[::1]:80");
    }

    #[test]
    fn precedence_and_overrides() {
        // torchrun inside a Slurm allocation: torchrun wins.
        let c = from(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "h"),
        ])
        .unwrap();
        assert_eq!(
            (c.launcher, c.rank, c.world_size),
            (Launcher::Torchrun, 2, 4)
        );
        // Explicit options override field by field.
        let c = from(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("OXCCL_RANK", "3"),
            ("OXCCL_LOCAL_RANK", "0"),
            ("MASTER_ADDR", "h"),
            ("OXCCL_STORE_ADDR", "store:1"),
            ("OXCCL_STORE_STANDALONE", "1"),
            ("OXCCL_BOOTSTRAP_TIMEOUT", "2.5"),
            ("OXCCL_JOB_ID", "j"),
            ("OXCCL_STORE_BIND", "0.0.0.0:1"),
        ])
        .unwrap();
        assert_eq!(
            (c.launcher, c.rank, c.world_size),
            (Launcher::Torchrun, 3, 4)
        );
        assert_eq!(c.local_rank, Some(0));
        assert_eq!(c.store_addr, "store:1");
        assert!(!c.serve_store);
        assert_eq!(c.timeout, Duration::from_millis(2500));
        assert_eq!(c.job_id, "j");
        assert_eq!(c.bind_addr.as_deref(), Some("0.0.0.0:1"));
        // Explicit only.
        let c = from(&[
            ("OXCCL_RANK", "0"),
            ("OXCCL_WORLD_SIZE", "1"),
            ("OXCCL_STORE_ADDR", "127.0.0.1:5"),
        ])
        .unwrap();
        assert_eq!(c.launcher, Launcher::Explicit);
        // A launcher half-set is not a launcher.
        let c = from(&[
            ("RANK", "1"),
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OXCCL_STORE_ADDR", "h:1"),
        ])
        .unwrap();
        assert_eq!(c.launcher, Launcher::OpenMpi);
    }

    #[test]
    fn errors_say_what_was_looked_for() {
        let e = from(&[]).unwrap_err().to_string();
        for v in [
            "OXCCL_RANK",
            "RANK",
            "WORLD_SIZE",
            "SLURM_PROCID",
            "SLURM_NTASKS",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "PMI_RANK",
            "PMI_SIZE",
        ] {
            assert!(e.contains(v), "{v} missing from: {e}");
        }
        let e = from(&[("RANK", "x"), ("WORLD_SIZE", "2")]).unwrap_err();
        assert!(e.to_string().contains("RANK=\"x\""), "{e}");
        let e = from(&[("RANK", "0"), ("WORLD_SIZE", "2")]).unwrap_err();
        assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
        let e = from(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "99999"),
        ])
        .unwrap_err();
        assert!(e.to_string().contains("MASTER_PORT"), "{e}");
        let e = from(&[("OXCCL_RANK", "0")]).unwrap_err();
        assert!(e.to_string().contains("OXCCL_WORLD_SIZE"), "{e}");
        let e = from(&[
            ("OXCCL_RANK", "0"),
            ("OXCCL_WORLD_SIZE", "1"),
            ("OXCCL_STORE_ADDR", "h:1"),
            ("OXCCL_BOOTSTRAP_TIMEOUT", "-1"),
        ])
        .unwrap_err();
        assert!(e.to_string().contains("OXCCL_BOOTSTRAP_TIMEOUT"), "{e}");
    }

    /// What `srun -n 4` on nodes node[03-04] of job 42 gives its tasks (step 1).
    const SLURM_STEP: &[(&str, &str)] = &[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_STEP_NODELIST", "node[03-04]"),
        ("SLURM_JOB_NODELIST", "node[01-04]"),
        ("SLURM_NODELIST", "node[01-04]"),
        ("SLURM_JOB_ID", "42"),
        ("SLURM_STEP_ID", "1"),
        ("SLURMD_NODENAME", "node03"),
    ];

    /// `base` with `changes` applied: `(name, Some(value))` sets, `(name, None)` removes.
    fn with(base: &[(&str, &str)], changes: &[(&str, Option<&str>)]) -> Result<Config> {
        let mut m: Vec<(String, String)> = base
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        for (k, v) in changes {
            m.retain(|(n, _)| n != k);
            if let Some(v) = v {
                m.push((k.to_string(), v.to_string()));
            }
        }
        let pairs: Vec<(&str, &str)> = m.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        from(&pairs)
    }

    #[test]
    fn slurm_store_is_the_first_node_of_the_step() {
        let c = from(SLURM_STEP).unwrap();
        assert_eq!(c.launcher, Launcher::Slurm);
        // 20000 + (42 × 32 + 1) mod 9500 = 20000 + 1345.
        assert_eq!(c.store_addr, "node03:21345");
        assert_eq!(c.bind_addr.as_deref(), Some("0.0.0.0:21345"));
        let why = c.store_addr_inferred.unwrap();
        assert!(
            why.contains("SLURM_STEP_NODELIST=\"node[03-04]\"") && why.contains("SLURM_JOB_ID=42"),
            "{why}"
        );
        // Rank 3 runs elsewhere and does not check.
        let c = with(
            SLURM_STEP,
            &[
                ("SLURM_PROCID", Some("3")),
                ("SLURMD_NODENAME", Some("node04")),
            ],
        )
        .unwrap();
        assert_eq!((c.rank, c.store_addr.as_str()), (3, "node03:21345"));
        // Without a step list, the job's; then SLURM_NODELIST; a step id unset counts as 0.
        let c = with(
            SLURM_STEP,
            &[
                ("SLURM_STEP_NODELIST", None),
                ("SLURMD_NODENAME", Some("node01")),
            ],
        )
        .unwrap();
        assert_eq!(c.store_addr, "node01:21345");
        assert!(
            c.store_addr_inferred
                .unwrap()
                .contains("SLURM_JOB_NODELIST")
        );
        let c = with(
            SLURM_STEP,
            &[
                ("SLURM_STEP_NODELIST", None),
                ("SLURM_JOB_NODELIST", None),
                ("SLURM_NODELIST", Some("gpu-[7-9],login")),
                ("SLURM_STEP_ID", None),
                ("SLURMD_NODENAME", Some("gpu-7")),
            ],
        )
        .unwrap();
        // 20000 + 42 × 32 = 21344.
        assert_eq!(c.store_addr, "gpu-7:21344");
        // MASTER_PORT alone sets the port; OXCCL_STORE_BIND what rank 0 binds.
        let c = with(
            SLURM_STEP,
            &[
                ("MASTER_PORT", Some("7777")),
                ("OXCCL_STORE_BIND", Some("10.0.0.3:7777")),
            ],
        )
        .unwrap();
        assert_eq!(c.store_addr, "node03:7777");
        assert_eq!(c.bind_addr.as_deref(), Some("10.0.0.3:7777"));
        assert!(c.store_addr_inferred.unwrap().contains("MASTER_PORT=7777"));
        // A variable that names the store wins, and nothing is inferred.
        for (var, value, addr) in [
            ("MASTER_ADDR", "node09", "node09:29500"),
            ("OXCCL_STORE_ADDR", "h:5", "h:5"),
        ] {
            let c = with(SLURM_STEP, &[(var, Some(value))]).unwrap();
            assert_eq!(c.store_addr, addr);
            assert_eq!((c.store_addr_inferred, c.bind_addr), (None, None));
        }
    }

    #[test]
    fn slurm_inference_errors_name_the_variable_and_the_fix() {
        let err =
            |changes: &[(&str, Option<&str>)]| with(SLURM_STEP, changes).unwrap_err().to_string();
        // Rank 0 is not on the first node.
        let e = err(&[("SLURMD_NODENAME", Some("node04"))]);
        for part in [
            "rank 0 runs on node node04",
            "SLURMD_NODENAME",
            "node03",
            "SLURM_STEP_NODELIST=\"node[03-04]\"",
            "MASTER_ADDR=node04",
        ] {
            assert!(e.contains(part), "{part:?} missing from: {e}");
        }
        let e = err(&[("SLURM_STEP_NODELIST", Some("node[04-03]"))]);
        assert!(
            e.contains("SLURM_STEP_NODELIST=\"node[04-03]\"")
                && e.contains("range 04-03 goes down"),
            "{e}"
        );
        let e = err(&[("SLURM_JOB_ID", Some("4x"))]);
        assert!(e.contains("SLURM_JOB_ID=\"4x\""), "{e}");
        let e = err(&[("SLURM_JOB_ID", None)]);
        assert!(
            e.contains("SLURM_JOB_ID") && e.contains("set MASTER_PORT"),
            "{e}"
        );
        let e = err(&[("SLURM_JOB_ID", Some("42")), ("MASTER_PORT", Some("x"))]);
        assert!(e.contains("MASTER_PORT=\"x\""), "{e}");
        let e = err(&[
            ("SLURM_STEP_NODELIST", None),
            ("SLURM_JOB_NODELIST", None),
            ("SLURM_NODELIST", None),
        ]);
        for part in [
            "no store address",
            "MASTER_ADDR",
            "SLURM_STEP_NODELIST",
            "SLURM_JOB_NODELIST",
            "SLURM_NODELIST",
            "Slurm environment",
        ] {
            assert!(e.contains(part), "{part:?} missing from: {e}");
        }
        // A standalone store is somewhere else: nothing to infer.
        let e = err(&[("OXCCL_STORE_STANDALONE", Some("1"))]);
        assert!(
            e.contains("no store address") && e.contains("OXCCL_STORE_STANDALONE"),
            "{e}"
        );
    }

    /// What Open MPI 4.1.4's `mpirun -np 2` gave its rank 0 on this machine (2026-12-01).
    const OMPI_RANK0: &[(&str, &str)] = &[
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("OMPI_MCA_ess_base_jobid", "1523777537"),
        (
            "OMPI_MCA_orte_hnp_uri",
            "1523777536.0;tcp://192.0.2.2:32947;tcp6://[fd00::2]:60275",
        ),
        (
            "OMPI_MCA_orte_local_daemon_uri",
            "1523777536.0;tcp://192.0.2.2:32947;tcp6://[fd00::2]:60275",
        ),
        ("PMIX_HOSTNAME", "vm"),
        ("PMIX_NAMESPACE", "1523777537"),
        ("PMIX_SERVER_URI4", "1523777536.0;tcp4://127.0.0.1:50813"),
    ];

    #[test]
    fn open_mpi_store_is_on_mpiruns_host() {
        let c = from(OMPI_RANK0).unwrap();
        assert_eq!(c.launcher, Launcher::OpenMpi);
        assert_eq!(
            c.store_addr,
            format!("192.0.2.2:{}", 20000 + 1523777537 % 9500)
        );
        assert_eq!(c.bind_addr, None);
        let why = c.store_addr_inferred.unwrap();
        assert!(
            why.contains("OMPI_MCA_orte_hnp_uri=")
                && why.contains("OMPI_MCA_ess_base_jobid=1523777537"),
            "{why}"
        );
        // Several interfaces (as `mpirun` lists them in a namespace with two): the first.
        let c = with(
            OMPI_RANK0,
            &[
                (
                    "OMPI_MCA_orte_hnp_uri",
                    Some("551223296.0;tcp://10.231.0.1,10.232.0.1:48975"),
                ),
                (
                    "OMPI_MCA_orte_local_daemon_uri",
                    Some("551223296.0;tcp://10.231.0.1,10.232.0.1:48975"),
                ),
                ("MASTER_PORT", Some("6000")),
            ],
        )
        .unwrap();
        assert_eq!(c.store_addr, "10.231.0.1:6000");
        // IPv6 only: the first address that is not link-local.
        let uri = "7.0;tcp6://[fe80::1],[fd00::7]:5";
        let c = with(
            OMPI_RANK0,
            &[
                ("OMPI_MCA_orte_hnp_uri", Some(uri)),
                ("OMPI_MCA_orte_local_daemon_uri", Some(uri)),
            ],
        )
        .unwrap();
        assert!(c.store_addr.starts_with("[fd00::7]:"), "{}", c.store_addr);
        // Rank 0 under an orted that mpirun started on its own host (as `mpirun --host a,b`
        // run on a does when it does not know a for itself): the same address.
        let c = with(
            OMPI_RANK0,
            &[
                (
                    "OMPI_MCA_orte_hnp_uri",
                    Some("712114176.0;tcp://10.77.0.1:55961"),
                ),
                (
                    "OMPI_MCA_orte_local_daemon_uri",
                    Some("712114176.1;tcp://10.77.0.1:44523"),
                ),
            ],
        )
        .unwrap();
        assert!(c.store_addr.starts_with("10.77.0.1:"), "{}", c.store_addr);
        // Rank 1 on another host (its daemon is not mpirun) does not check.
        let c = with(
            OMPI_RANK0,
            &[
                ("OMPI_COMM_WORLD_RANK", Some("1")),
                (
                    "OMPI_MCA_orte_local_daemon_uri",
                    Some("1523777536.1;tcp://192.0.2.3:4000"),
                ),
            ],
        )
        .unwrap();
        assert!(c.store_addr.starts_with("192.0.2.2:"), "{}", c.store_addr);
    }

    #[test]
    fn open_mpi_inference_errors_name_the_variable_and_the_fix() {
        let err =
            |changes: &[(&str, Option<&str>)]| with(OMPI_RANK0, changes).unwrap_err().to_string();
        let e = err(&[
            (
                "OMPI_MCA_orte_local_daemon_uri",
                Some("1523777536.1;tcp://192.0.2.3:4000"),
            ),
            ("PMIX_HOSTNAME", Some("b")),
        ]);
        for part in [
            "rank 0 runs on b",
            "192.0.2.2",
            "OMPI_MCA_orte_local_daemon_uri",
            "-x MASTER_ADDR",
        ] {
            assert!(e.contains(part), "{part:?} missing from: {e}");
        }
        let e = err(&[("OMPI_MCA_orte_hnp_uri", None)]);
        for part in [
            "no store address",
            "MASTER_ADDR",
            "OMPI_MCA_orte_hnp_uri",
            "Open MPI environment",
        ] {
            assert!(e.contains(part), "{part:?} missing from: {e}");
        }
        for uri in [
            "1.0;tcp://300.1.1.1:5",
            "1.0",
            "1.0;tcp://10.0.0.1",
            "1.0;usock://x",
        ] {
            let e = err(&[
                ("OMPI_MCA_orte_hnp_uri", Some(uri)),
                ("OMPI_MCA_orte_local_daemon_uri", Some(uri)),
            ]);
            assert!(e.contains(&format!("OMPI_MCA_orte_hnp_uri={uri:?}")), "{e}");
        }
        let e = err(&[("OMPI_MCA_ess_base_jobid", None)]);
        assert!(
            e.contains("OMPI_MCA_ess_base_jobid") && e.contains("MASTER_PORT"),
            "{e}"
        );
    }

    #[test]
    fn mpirun_inside_a_slurm_job_is_open_mpi() {
        // What `sbatch -n 2` + `mpirun -np 2` gives rank 1: the batch script's Slurm task.
        let c = with(
            OMPI_RANK0,
            &[
                ("OMPI_COMM_WORLD_RANK", Some("1")),
                ("SLURM_PROCID", Some("0")),
                ("SLURM_NTASKS", Some("2")),
                ("SLURM_JOB_NODELIST", Some("vm")),
                ("SLURM_JOB_ID", Some("5")),
            ],
        )
        .unwrap();
        assert_eq!(
            (c.launcher, c.rank, c.world_size),
            (Launcher::OpenMpi, 1, 2)
        );
        assert!(c.store_addr.starts_with("192.0.2.2:"), "{}", c.store_addr);
    }

    #[test]
    fn other_launchers_still_need_an_address() {
        let e = from(&[("RANK", "0"), ("WORLD_SIZE", "2")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("MASTER_ADDR") && e.contains("torchrun environment"),
            "{e}"
        );
        let e = from(&[("PMI_RANK", "0"), ("PMI_SIZE", "2")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("OXCCL_STORE_ADDR") && e.contains("PMI environment"),
            "{e}"
        );
    }

    proptest::proptest! {
        #[test]
        fn slurm_ports_are_unprivileged_and_apart(job in 0..u64::MAX - 2375, step in 0u64..32, dj in 1u64..2375) {
            let p = slurm_port(job, step);
            proptest::prop_assert!((20000..29500).contains(&p));
            proptest::prop_assert_eq!(u64::from(p), 20000 + (u128::from(job) * 32 + u128::from(step)).rem_euclid(9500) as u64);
            // Another step of the same job; the same step of a job up to 2374 later.
            for other in 0..32 {
                if other != step {
                    proptest::prop_assert_ne!(slurm_port(job, other), p);
                }
            }
            proptest::prop_assert_ne!(slurm_port(job + dj, step), p);
        }
    }
}
