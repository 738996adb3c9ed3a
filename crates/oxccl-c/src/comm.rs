//! Communicators: the unique id, init, split, abort, destroy, queries, registration.

use std::ffi::{c_char, c_int, c_void};
use std::net::IpAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use oxccl::{Communicator, Options, Registration};
use oxccl_bootstrap::{Bootstrap, Config, Secret, StoreServer};

use crate::error::{Failure, guard};
use crate::types::oxcclResult_t::{self, *};
use crate::types::{OXCCL_SPLIT_NOCOLOR, OXCCL_UNIQUE_ID_BYTES, oxcclComm_t, oxcclUniqueId};

/// The job id of communicators made from a unique id (newcomers join under it).
pub(crate) const CAPI_JOB: &str = "capi";

/// Marks a live communicator (a best-effort check against a stale or foreign pointer).
const MAGIC: u64 = 0x6f78_6363_6c43_6f6d; // "oxcclCom"

/// What an [`oxcclComm_t`] points to.
pub struct oxcclComm {
    magic: u64,
    /// The communicator.
    pub(crate) comm: Communicator,
    /// The first error that broke the communicator (an `oxcclResult_t`; 0: none).
    async_error: AtomicI32,
}

impl oxcclComm {
    /// Remembers that `code` broke the communicator (the first such code stays).
    pub(crate) fn broken(&self, code: oxcclResult_t) {
        let _ =
            self.async_error
                .compare_exchange(0, code as i32, Ordering::AcqRel, Ordering::Acquire);
    }

    /// An oxccl error as a failure, remembered when it broke the communicator (every error
    /// but an invalid argument, which is found before anything moves). A call refused because
    /// the communicator is broken gets the code of what broke it.
    #[cold]
    pub(crate) fn failed(&self, e: oxccl::Error) -> Failure {
        let poisoned = matches!(e, oxccl::Error::Poisoned { .. });
        if !matches!(e, oxccl::Error::InvalidArgument { .. }) {
            self.broken(crate::error::code_of(&e));
        }
        let mut f = Failure::from(e);
        if poisoned {
            f.code = self.async_code();
        }
        f
    }

    /// The first error that broke the communicator (`oxcclSuccess`: none).
    fn async_code(&self) -> oxcclResult_t {
        match self.async_error.load(Ordering::Acquire) {
            0 => oxcclSuccess,
            1 => oxcclUnhandledError,
            2 => oxcclSystemError,
            3 => oxcclInternalError,
            4 => oxcclInvalidArgument,
            5 => oxcclInvalidUsage,
            6 => oxcclRemoteError,
            7 => oxcclInProgress,
            _ => oxcclTimeout,
        }
    }

    pub(crate) fn boxed(comm: Communicator) -> oxcclComm_t {
        Box::into_raw(Box::new(oxcclComm {
            magic: MAGIC,
            comm,
            async_error: AtomicI32::new(0),
        }))
    }
}

/// The communicator behind a handle, or an invalid-argument failure.
#[inline]
pub(crate) fn comm_ref<'a>(comm: oxcclComm_t) -> Result<&'a oxcclComm, Failure> {
    if comm.is_null() {
        return Err(Failure::invalid("comm is NULL"));
    }
    // SAFETY: a non-null handle was made by `oxcclComm::boxed` and not yet destroyed (the
    // caller's contract, as for any handle); the magic check catches some stale ones.
    let c = unsafe { &*comm };
    if c.magic != MAGIC {
        return Err(Failure::invalid(
            "comm is not a live communicator (destroyed, or not from oxcclCommInit*)",
        ));
    }
    Ok(c)
}

/// Stores `value` through an out-pointer, or fails when it is null.
pub(crate) fn write_out<T>(out: *mut T, name: &str, value: T) -> Result<(), Failure> {
    if out.is_null() {
        return Err(Failure::invalid(format!("{name} is NULL")));
    }
    // SAFETY: non-null, and the caller's contract is that it points to a writable `T`.
    unsafe { out.write(value) };
    Ok(())
}

/// Stores served for the unique ids this process made: they live until the process exits,
/// as NCCL's bootstrap root does (one thread and one socket each).
static SERVERS: Mutex<Vec<StoreServer>> = Mutex::new(Vec::new());

/// The id's first bytes, and the layout after them: the secret (32 bytes), the address's
/// length (1 byte), the address (`ip:port`, UTF-8).
const ID_MAGIC: &[u8; 4] = b"OXI1";
const SECRET_BYTES: usize = 32;

/// The address a unique id's store listens on: the first address of an interface that
/// `OXCCL_SOCKET_IFNAME` allows (else one that is not loopback, link-local or a container
/// bridge), else loopback.
fn id_ip() -> IpAddr {
    let filter: Option<oxccl::netif::IfnameFilter> = std::env::var("OXCCL_SOCKET_IFNAME")
        .ok()
        .and_then(|s| s.parse().ok());
    let ifaces = oxccl::netif::interfaces().unwrap_or_default();
    let usable = |i: &&oxccl::netif::Iface| match &filter {
        Some(f) => f.matches(&i.name),
        None => {
            let virt = ["docker", "virbr", "veth", "br-"];
            let link_local = match i.ip {
                IpAddr::V4(v) => v.is_link_local(),
                IpAddr::V6(v) => (v.segments()[0] & 0xffc0) == 0xfe80,
            };
            !i.ip.is_loopback() && !link_local && !virt.iter().any(|p| i.name.starts_with(p))
        }
    };
    ifaces
        .iter()
        .filter(usable)
        .find(|i| i.ip.is_ipv4())
        .or_else(|| ifaces.iter().find(usable))
        .map_or(IpAddr::from([127, 0, 0, 1]), |i| i.ip)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Makes a unique id: serves a store with a fresh secret, and writes both into the id.
fn make_unique_id() -> Result<oxcclUniqueId, Failure> {
    let mut raw = [0u8; SECRET_BYTES];
    getrandom::fill(&mut raw)
        .map_err(|e| Failure::usage(format!("no random bytes for the secret: {e}")))?;
    let secret = Secret::new(hex(&raw))?;
    let server = StoreServer::bind(&format!("{}:0", ip_for_bind(id_ip())), secret)?;
    let addr = server.addr().to_string();
    let mut id = [0u8; OXCCL_UNIQUE_ID_BYTES];
    let end = 4 + SECRET_BYTES + 1 + addr.len();
    if end > OXCCL_UNIQUE_ID_BYTES {
        return Err(Failure::usage(format!(
            "the address {addr} does not fit a unique id"
        )));
    }
    id[..4].copy_from_slice(ID_MAGIC);
    id[4..4 + SECRET_BYTES].copy_from_slice(&raw);
    id[4 + SECRET_BYTES] = addr.len() as u8;
    id[4 + SECRET_BYTES + 1..end].copy_from_slice(addr.as_bytes());
    SERVERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(server);
    Ok(oxcclUniqueId {
        internal: id.map(|b| b as c_char),
    })
}

fn ip_for_bind(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v) => v.to_string(),
        IpAddr::V6(v) => format!("[{v}]"),
    }
}

/// The store address and secret a unique id carries.
pub(crate) fn read_unique_id(id: &oxcclUniqueId) -> Result<(String, Secret), Failure> {
    let b = id.internal.map(|c| c as u8);
    let bad = || Failure::invalid("the unique id was not made by oxcclGetUniqueId");
    if &b[..4] != ID_MAGIC {
        return Err(bad());
    }
    let len = usize::from(b[4 + SECRET_BYTES]);
    let start = 4 + SECRET_BYTES + 1;
    let addr = b.get(start..start + len).ok_or_else(bad)?;
    let addr = std::str::from_utf8(addr).map_err(|_| bad())?.to_owned();
    let secret = Secret::new(hex(&b[4..4 + SECRET_BYTES]))?;
    Ok((addr, secret))
}

/// Makes a unique id for [`oxcclCommInitRank`] (`ncclGetUniqueId`): call it on one process
/// (usually the one that will be rank 0) and send the id to every rank.
///
/// It starts the job's rendezvous store in this process, listening on the first address of
/// an interface that `OXCCL_SOCKET_IFNAME` allows (by default the first that is not loopback,
/// link-local or a container bridge), and puts that address and a fresh secret into the id.
/// The store runs until this process exits, so the process must outlive the others' init.
///
/// # Safety
/// `unique_id` must be NULL or point to writable memory for an [`oxcclUniqueId`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclGetUniqueId(unique_id: *mut oxcclUniqueId) -> oxcclResult_t {
    guard(
        || "oxcclGetUniqueId".into(),
        || {
            if unique_id.is_null() {
                return Err(Failure::invalid("uniqueId is NULL"));
            }
            let id = make_unique_id()?;
            write_out(unique_id, "uniqueId", id)
        },
    )
}

/// The bootstrap timeout: `OXCCL_BOOTSTRAP_TIMEOUT` seconds, else the default (300 s).
pub(crate) fn bootstrap_timeout() -> Result<Duration, Failure> {
    match std::env::var("OXCCL_BOOTSTRAP_TIMEOUT") {
        Ok(s) if !s.trim().is_empty() => s
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|t| t.is_finite() && *t > 0.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| Failure::usage(format!("OXCCL_BOOTSTRAP_TIMEOUT={s} is not seconds"))),
        _ => Ok(oxccl_bootstrap::DEFAULT_TIMEOUT),
    }
}

/// Joins rank `rank` of `nranks` to the job `commId` names (`ncclCommInitRank`): collective
/// over the `nranks` ranks, which all pass the same id. Other settings come from the
/// `OXCCL_*` variables (`OXCCL_TIMEOUT`, `OXCCL_PROVIDER`, ...; `OXCCL_BOOTSTRAP_TIMEOUT` for
/// joining).
///
/// # Safety
/// `comm` must be NULL or point to writable memory for an [`oxcclComm_t`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclCommInitRank(
    comm: *mut oxcclComm_t,
    nranks: c_int,
    commId: oxcclUniqueId,
    rank: c_int,
) -> oxcclResult_t {
    guard(
        || format!("oxcclCommInitRank(nranks={nranks}, rank={rank})"),
        || {
            if comm.is_null() {
                return Err(Failure::invalid("comm is NULL"));
            }
            let world = usize::try_from(nranks)
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| Failure::invalid(format!("nranks {nranks} is not positive")))?;
            let r = usize::try_from(rank)
                .ok()
                .filter(|&r| r < world)
                .ok_or_else(|| Failure::invalid(format!("rank {rank} is outside 0..{nranks}")))?;
            let (addr, secret) = read_unique_id(&commId)?;
            let mut config = Config::new(r, world, addr, secret);
            config.serve_store = false;
            config.timeout = bootstrap_timeout()?;
            config.job_id = CAPI_JOB.into();
            let opts = Options::from_env()?;
            let c = Communicator::init(Bootstrap::new(config)?, opts)?;
            write_out(comm, "comm", oxcclComm::boxed(c))
        },
    )
}

/// Joins this process to the job its launcher describes (`oxccl run`, torchrun, Slurm's
/// `srun`, Open MPI's `mpirun`, PMI): rank and world size from the launcher's variables, the
/// store from `MASTER_ADDR`/`MASTER_PORT` or what the launcher implies, the secret from
/// `OXCCL_SECRET` or `OXCCL_SECRET_FILE` (see `oxccl_bootstrap::Config::from_vars`).
/// Collective over the job's ranks. No NCCL counterpart.
///
/// # Safety
/// `comm` must be NULL or point to writable memory for an [`oxcclComm_t`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclCommInitFromEnv(comm: *mut oxcclComm_t) -> oxcclResult_t {
    guard(
        || "oxcclCommInitFromEnv".into(),
        || {
            if comm.is_null() {
                return Err(Failure::invalid("comm is NULL"));
            }
            let c = Communicator::from_env()?;
            write_out(comm, "comm", oxcclComm::boxed(c))
        },
    )
}

/// Splits `comm` into communicators of the ranks that pass the same `color`, ordered by
/// `key` then rank (`ncclCommSplit`, without its config). `color` is
/// [`OXCCL_SPLIT_NOCOLOR`] or non-negative: with `OXCCL_SPLIT_NOCOLOR` the rank takes part
/// but gets `*newcomm = NULL`. `key` is non-negative. Collective over `comm`.
///
/// # Safety
/// `comm` must be NULL or a live communicator; `newcomm` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclCommSplit(
    comm: oxcclComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut oxcclComm_t,
) -> oxcclResult_t {
    guard(
        || format!("oxcclCommSplit(color={color}, key={key})"),
        || {
            let c = comm_ref(comm)?;
            if newcomm.is_null() {
                return Err(Failure::invalid("newcomm is NULL"));
            }
            let color = match color {
                OXCCL_SPLIT_NOCOLOR => None,
                c if c >= 0 => Some(c as u32),
                c => return Err(Failure::invalid(format!("color {c} is negative"))),
            };
            let key = u32::try_from(key)
                .map_err(|_| Failure::invalid(format!("key {key} is negative")))?;
            let child = c.comm.split(color, key).map_err(|e| c.failed(e))?;
            let out = child.map_or(std::ptr::null_mut(), oxcclComm::boxed);
            write_out(newcomm, "newcomm", out)
        },
    )
}

/// Waits for every rank of `comm` (a barrier, skipped when the communicator is broken), then
/// frees it (`ncclCommDestroy`). No call may run on `comm` meanwhile, or use it afterwards.
/// Destroy communicators made by `oxcclCommSplit` before their parent's last use ends.
///
/// # Safety
/// `comm` must be NULL or a live communicator, not in use on another thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclCommDestroy(comm: oxcclComm_t) -> oxcclResult_t {
    guard(
        || "oxcclCommDestroy".into(),
        || {
            comm_ref(comm)?;
            // SAFETY: made by `oxcclComm::boxed` (checked above, as far as it can be) and,
            // by the caller's contract, used by no one else from now on.
            let mut b = unsafe { Box::from_raw(comm) };
            b.magic = 0;
            b.comm.destroy()?;
            Ok(())
        },
    )
}

/// Stops `comm`: calls running on it on other threads return `oxcclRemoteError` soon (within
/// about 50 ms), the peers are told (their calls fail the same way), and later calls fail at
/// once. Unlike `ncclCommAbort` it does not free `comm`: call [`oxcclCommDestroy`] once no
/// other thread uses it (it then skips the barrier).
///
/// # Safety
/// `comm` must be NULL or a live communicator.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclCommAbort(comm: oxcclComm_t) -> oxcclResult_t {
    guard(
        || "oxcclCommAbort".into(),
        || {
            let c = comm_ref(comm)?;
            c.comm.abort();
            c.broken(oxcclRemoteError);
            Ok(())
        },
    )
}

/// Writes the first error that broke `comm` to `*asyncError` (`ncclCommGetAsyncError`):
/// `oxcclSuccess` while it works; after a call failed with anything but an invalid argument,
/// or after [`oxcclCommAbort`], that call's code (`oxcclRemoteError` for an abort).
///
/// # Safety
/// `comm` must be NULL or a live communicator; `asyncError` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclCommGetAsyncError(
    comm: oxcclComm_t,
    asyncError: *mut oxcclResult_t,
) -> oxcclResult_t {
    guard(
        || "oxcclCommGetAsyncError".into(),
        || {
            let c = comm_ref(comm)?;
            write_out(asyncError, "asyncError", c.async_code())
        },
    )
}

/// Writes the number of ranks of `comm` to `*count` (`ncclCommCount`).
///
/// # Safety
/// `comm` must be NULL or a live communicator; `count` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclCommCount(comm: oxcclComm_t, count: *mut c_int) -> oxcclResult_t {
    guard(
        || "oxcclCommCount".into(),
        || {
            let n = comm_ref(comm)?.comm.world_size();
            write_out(count, "count", n as c_int)
        },
    )
}

/// Writes this process's rank in `comm` to `*rank` (`ncclCommUserRank`).
///
/// # Safety
/// `comm` must be NULL or a live communicator; `rank` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclCommUserRank(comm: oxcclComm_t, rank: *mut c_int) -> oxcclResult_t {
    guard(
        || "oxcclCommUserRank".into(),
        || {
            let r = comm_ref(comm)?.comm.rank();
            write_out(rank, "rank", r as c_int)
        },
    )
}

/// Registers `size` bytes at `buff` with every connection of `comm` (`ncclCommRegister`):
/// calls on them skip the registration an unregistered buffer gets on every call, and over
/// tcp a receive into them is written in place. `*handle` is for [`oxcclCommDeregister`].
/// Local to this rank.
///
/// # Safety
/// `comm` must be NULL or a live communicator; `buff..buff + size` readable and writable
/// memory that stays allocated until the handle is deregistered (peers may write it while a
/// call runs on it); `handle` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclCommRegister(
    comm: oxcclComm_t,
    buff: *mut c_void,
    size: usize,
    handle: *mut *mut c_void,
) -> oxcclResult_t {
    guard(
        || format!("oxcclCommRegister(buff={buff:p}, size={size})"),
        || {
            let c = comm_ref(comm)?;
            if handle.is_null() {
                return Err(Failure::invalid("handle is NULL"));
            }
            if buff.is_null() {
                return Err(Failure::invalid("buff is NULL"));
            }
            // SAFETY: the caller's contract above is `register_raw`'s.
            let reg = unsafe { c.comm.register_raw(buff.cast(), size) }?;
            let h = Box::into_raw(Box::new(reg)).cast::<c_void>();
            write_out(handle, "handle", h)
        },
    )
}

/// Deregisters a buffer [`oxcclCommRegister`] registered (`ncclCommDeregister`): no peer
/// can write it afterwards. No call may be running on it.
///
/// # Safety
/// `comm` must be NULL or a live communicator; `handle` NULL or a handle from
/// `oxcclCommRegister` on `comm`, not yet deregistered.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclCommDeregister(
    comm: oxcclComm_t,
    handle: *mut c_void,
) -> oxcclResult_t {
    guard(
        || format!("oxcclCommDeregister(handle={handle:p})"),
        || {
            comm_ref(comm)?;
            if handle.is_null() {
                return Err(Failure::invalid("handle is NULL"));
            }
            // SAFETY: by the caller's contract, a `Box<Registration>` from `oxcclCommRegister`
            // that nothing else frees.
            drop(unsafe { Box::from_raw(handle.cast::<Registration>()) });
            Ok(())
        },
    )
}

/// The text of a result code (`ncclGetErrorString`); a static string, never NULL.
#[unsafe(no_mangle)]
pub extern "C" fn oxcclGetErrorString(result: crate::types::ResultArg) -> *const c_char {
    // Read as a plain number: C may pass any int here.
    crate::error::error_string(i64::from(result.0)).as_ptr()
}

/// The message of the last call that failed on this thread, naming the call, its arguments,
/// the rank and, where one is involved, the peer (`ncclGetLastError`); `""` when none has.
/// `comm` is not used (it may be NULL). The string stays valid until the next failing oxccl
/// call on this thread.
#[unsafe(no_mangle)]
pub extern "C" fn oxcclGetLastError(comm: oxcclComm_t) -> *const c_char {
    let _ = comm;
    crate::error::last_error_ptr()
}

/// Writes this library's version to `*version`: `major * 10000 + minor * 100 + patch`
/// (`OXCCL_VERSION_CODE`; `ncclGetVersion`).
///
/// # Safety
/// `version` must be NULL or point to a writable `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclGetVersion(version: *mut c_int) -> oxcclResult_t {
    use crate::types::{OXCCL_MAJOR, OXCCL_MINOR, OXCCL_PATCH};
    guard(
        || "oxcclGetVersion".into(),
        || {
            let v = OXCCL_MAJOR * 10000 + OXCCL_MINOR * 100 + OXCCL_PATCH;
            write_out(version, "version", v)
        },
    )
}
