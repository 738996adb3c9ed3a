//! Non-blocking init and abort during init: [`Communicator::init_async`],
//! [`Communicator::init_config_async`], [`Communicator::init_abortable`] and [`PendingInit`]
//! (NCCL's `ncclCommInitRankConfig` with `blocking = 0`, `ncclCommGetAsyncError` and
//! `ncclCommAbort` during init, shaped for Rust).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use oxccl_bootstrap::{AbortHandle, Bootstrap, Config, Store};

use super::{Communicator, Options};
use crate::error::{Error, Result};
use crate::fault::{InitStage, in_init};

/// What the init thread leaves for the waiter.
#[derive(Default)]
struct Slot {
    result: Option<Result<Communicator>>,
    finished: bool,
    waker: Option<Waker>,
}

/// An init running on a thread of its own ([`Communicator::init_async`],
/// [`Communicator::init_config_async`]): wait for it ([`PendingInit::wait`], or `.await` it),
/// poll it ([`PendingInit::is_finished`]), or stop it from any thread
/// ([`PendingInit::abort`], or a clone of [`PendingInit::abort_handle`]).
///
/// An abort stops every wait of the init: the join and the store's all-gathers and barriers
/// within about [`ABORT_POLL`](oxccl_bootstrap::ABORT_POLL) plus a store round trip (4-20 ms
/// measured), the connects under way within 100 ms (a tcp connect attempt to an address that
/// does not answer within 1 s), and the first calls over the connections within their
/// polling plus 50 ms, which lets the peers read this rank's abort notice before its
/// connections close (50-90 ms measured). The init then returns
/// [`Error::Aborted`] with `op` "init", saying what it was waiting for (e.g. `for ranks [2]
/// of 3 to reach all-gather "oxccl/hello"`), and leaves no thread or connection behind. The
/// other ranks still in the store's part of the same init fail at once with an error naming
/// this rank; those past it, through the connections. On the rank that serves the store, the
/// abort returns only once the others have read that notice and left (their waits look at it
/// every [`ABORT_POLL`](oxccl_bootstrap::ABORT_POLL) when they watch an abort handle, every
/// half second otherwise; 5 s at most), since the store goes away with it.
///
/// Dropping a `PendingInit` that has not finished aborts it and waits for its thread.
///
/// ```
/// use std::time::Duration;
/// use oxccl::{Communicator, Error, Options};
/// use oxccl_bootstrap::{Config, Secret, StoreServer};
///
/// // A job of 2 ranks whose rank 1 never comes.
/// let secret = Secret::new("an example job's secret").unwrap();
/// let store = StoreServer::bind("127.0.0.1:0", secret.clone()).unwrap();
/// let mut config = Config::new(0, 2, store.addr().to_string(), secret);
/// config.serve_store = false;
/// let pending = Communicator::init_config_async(config, Options::default());
/// assert!(!pending.wait_for(Duration::from_millis(100)), "rank 1 is missing");
/// let handle = pending.abort_handle(); // Clone + Send: abort from anywhere
/// std::thread::spawn(move || handle.abort_with("the job was cancelled"));
/// match pending.wait() {
///     Err(Error::Aborted { op, reason, .. }) => {
///         assert_eq!(op, "init");
///         assert!(reason.contains("the job was cancelled"), "{reason}");
///         assert!(reason.contains("for ranks [1] of 2 to join"), "{reason}");
///     }
///     other => panic!("{:?}", other.map(|c| c.rank())),
/// }
/// ```
pub struct PendingInit {
    abort: AbortHandle,
    slot: Arc<(Mutex<Slot>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for PendingInit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingInit")
            .field("finished", &self.is_finished())
            .field("aborted", &self.abort.is_aborted())
            .finish_non_exhaustive()
    }
}

impl PendingInit {
    /// Runs `init(&abort)` on a thread of its own.
    fn spawn(
        rank: usize,
        init: impl FnOnce(&AbortHandle) -> Result<Communicator> + Send + 'static,
    ) -> PendingInit {
        let abort = AbortHandle::new();
        let slot = Arc::new((Mutex::new(Slot::default()), Condvar::new()));
        let (a, s) = (abort.clone(), slot.clone());
        let thread = std::thread::Builder::new()
            .name(format!("oxccl-init-{rank}"))
            .spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| init(&a)))
                    .unwrap_or_else(|p| {
                        let msg = p
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| p.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "a panic".into());
                        Err(Error::Config(format!("rank {rank}: init panicked: {msg}")))
                    });
                let mut g = s.0.lock().unwrap_or_else(|e| e.into_inner());
                g.result = Some(r);
                g.finished = true;
                if let Some(w) = g.waker.take() {
                    w.wake();
                }
                s.1.notify_all();
            });
        let thread = match thread {
            Ok(t) => Some(t),
            Err(e) => {
                let mut g = slot.0.lock().unwrap_or_else(|e| e.into_inner());
                g.result = Some(Err(Error::Config(format!(
                    "rank {rank}: cannot start the init thread: {e}"
                ))));
                g.finished = true;
                drop(g);
                None
            }
        };
        PendingInit {
            abort,
            slot,
            thread,
        }
    }

    /// A handle that aborts this init from any thread (clones share it).
    pub fn abort_handle(&self) -> AbortHandle {
        self.abort.clone()
    }

    /// Aborts the init (nothing, once it has finished): see [`PendingInit`].
    pub fn abort(&self) {
        self.abort.abort_with("PendingInit::abort was called");
    }

    /// Whether the init has finished (its result is ready for [`PendingInit::wait`]), like
    /// `ncclCommGetAsyncError` no longer reporting `ncclInProgress`.
    pub fn is_finished(&self) -> bool {
        self.slot
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .finished
    }

    /// Waits up to `timeout` for the init to finish; whether it has.
    pub fn wait_for(&self, timeout: Duration) -> bool {
        // `None`: no deadline (a timeout too long to add).
        let deadline = Instant::now().checked_add(timeout);
        let mut g = self.slot.0.lock().unwrap_or_else(|e| e.into_inner());
        while !g.finished {
            let left = deadline.map_or(Duration::from_secs(3600), |d| {
                d.saturating_duration_since(Instant::now())
            });
            if left.is_zero() {
                return false;
            }
            g = self
                .slot
                .1
                .wait_timeout(g, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// Waits for the init to finish and returns the communicator, or why there is none. The
    /// init's own timeouts bound the wait (the bootstrap's for the join,
    /// [`Options::timeout`] for the rest).
    pub fn wait(mut self) -> Result<Communicator> {
        self.wait_for(Duration::MAX);
        self.finish()
    }

    /// The result, once finished; joins the thread.
    fn finish(&mut self) -> Result<Communicator> {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let taken = self
            .slot
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .result
            .take();
        taken.unwrap_or_else(|| {
            Err(Error::Config(
                "this init's result was already taken (a PendingInit polled after it completed)"
                    .into(),
            ))
        })
    }
}

impl Future for PendingInit {
    type Output = Result<Communicator>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        {
            let mut g = self.slot.0.lock().unwrap_or_else(|e| e.into_inner());
            if !g.finished {
                g.waker = Some(cx.waker().clone());
                return Poll::Pending;
            }
        }
        Poll::Ready(self.finish())
    }
}

impl Drop for PendingInit {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            if !t.is_finished() {
                self.abort.abort_with("the PendingInit was dropped");
            }
            let _ = t.join();
        }
    }
}

impl Communicator {
    /// [`Communicator::init`] that `abort` can stop from another thread (see
    /// [`PendingInit`] for what an abort does): the blocking form of
    /// [`Communicator::init_async`]. An abort before the call makes it fail at once.
    ///
    /// ```
    /// use oxccl::{AbortHandle, Communicator, Options};
    /// use oxccl_bootstrap::{Bootstrap, MemoryStore};
    /// use std::time::Duration;
    ///
    /// let boot = Bootstrap::with_store(0, 1, Box::new(MemoryStore::new()), "doc", Duration::from_secs(5)).unwrap();
    /// let abort = AbortHandle::new();
    /// let comm = Communicator::init_abortable(boot, Options::default(), &abort).unwrap();
    /// abort.abort(); // after init: no effect on the communicator
    /// let mut x = [1.0f32; 4];
    /// comm.all_reduce_in_place(&mut x, oxccl::ReduceOp::Sum).unwrap();
    /// ```
    pub fn init_abortable(
        bootstrap: Bootstrap,
        options: Options,
        abort: &AbortHandle,
    ) -> Result<Communicator> {
        Communicator::init_watched(&Arc::new(bootstrap), options, Some(abort))
    }

    /// Starts [`Communicator::init`] on a thread of its own and returns at once; see
    /// [`PendingInit`].
    pub fn init_async(bootstrap: Bootstrap, options: Options) -> PendingInit {
        let rank = bootstrap.rank();
        PendingInit::spawn(rank, move |abort| {
            Communicator::init_abortable(bootstrap, options, abort)
        })
    }

    /// Starts the whole of an init on a thread of its own and returns at once: the join
    /// ([`Bootstrap::new_abortable`], which connects to the store or serves it) and then
    /// [`Communicator::init`]. Unlike [`Communicator::init_async`], an abort also stops a
    /// join that waits for ranks that never come. See [`PendingInit`].
    pub fn init_config_async(config: Config, options: Options) -> PendingInit {
        let rank = config.rank;
        PendingInit::spawn(rank, move |abort| {
            in_init(options.faults.as_ref(), rank, InitStage::Join);
            let boot = Bootstrap::new_abortable(config, abort).map_err(|e| join_error(rank, e))?;
            Communicator::init_abortable(boot, options, abort)
        })
    }

    /// [`Communicator::init_config_async`] over a store already connected (a store handed in
    /// from Python, as [`Bootstrap::with_store`] takes): rank `rank` of `world_size` joins
    /// under `job_id`, then inits; an abort stops the join too.
    pub fn init_store_async(
        rank: usize,
        world_size: usize,
        store: Box<dyn Store>,
        job_id: &str,
        options: Options,
    ) -> PendingInit {
        let job = job_id.to_string();
        PendingInit::spawn(rank, move |abort| {
            in_init(options.faults.as_ref(), rank, InitStage::Join);
            let boot = Bootstrap::with_store_abortable(
                rank,
                world_size,
                store,
                &job,
                options.timeout,
                abort,
            )
            .map_err(|e| join_error(rank, e))?;
            Communicator::init_abortable(boot, options, abort)
        })
    }
}

/// A join's error: an abort is the init's [`Error::Aborted`], saying what it waited for.
fn join_error(rank: usize, e: oxccl_bootstrap::Error) -> Error {
    match e {
        oxccl_bootstrap::Error::Aborted {
            reason, waiting, ..
        } => Error::Aborted {
            rank,
            op: "init".into(),
            reason: format!("{reason}, while waiting {waiting}"),
        },
        e => e.into(),
    }
}
