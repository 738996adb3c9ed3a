//! Bootstrap configuration: explicit, or read from a launcher's environment.

use std::fmt;
use std::time::Duration;

use crate::error::{Error, Result};
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

/// Each launcher's variables: rank, world size, local rank, local world size ("" for none).
const LAUNCHERS: [(Launcher, [&str; 4]); 4] = [
    (
        Launcher::Torchrun,
        ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
    ),
    (
        Launcher::Slurm,
        ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", ""],
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
    /// `LOCAL_WORLD_SIZE`), Slurm (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`), Open MPI
    /// (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`,
    /// `OMPI_COMM_WORLD_LOCAL_SIZE`) and PMI (`PMI_RANK`, `PMI_SIZE`, and hydra's
    /// `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`). Explicit options override it field by field:
    ///
    /// - `OXCCL_RANK`, `OXCCL_WORLD_SIZE`, `OXCCL_LOCAL_RANK`, `OXCCL_LOCAL_WORLD_SIZE`;
    /// - `OXCCL_STORE_ADDR` (`host:port`), else `MASTER_ADDR` and `MASTER_PORT` (default
    ///   29500);
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

        let store_addr = match (get("OXCCL_STORE_ADDR"), get("MASTER_ADDR")) {
            (Some(a), _) => a.trim().to_owned(),
            (None, Some(host)) => {
                let port = match get("MASTER_PORT") {
                    None => DEFAULT_PORT,
                    Some(p) => p.trim().parse::<u16>().map_err(|_| Error::BadEnv {
                        var: "MASTER_PORT",
                        value: p,
                        reason: "not a port number".into(),
                    })?,
                };
                join_host_port(host.trim(), port)
            }
            (None, None) => {
                return Err(Error::Config(format!(
                    "no store address: set OXCCL_STORE_ADDR=host:port, or MASTER_ADDR and \
                     MASTER_PORT (rank {rank} of {world_size} from the {launcher} environment)"
                )));
            }
        };
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
            serve_store,
            bind_addr: get("OXCCL_STORE_BIND"),
            secret: Secret::from_vars(var)?,
            timeout,
            job_id,
            launcher,
        })
    }
}

/// `host:port`, bracketing IPv6 literals.
fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
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
}
