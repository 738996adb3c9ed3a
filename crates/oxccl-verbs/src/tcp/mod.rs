//! The tcp provider: RDMA semantics over TCP sockets, for hosts without RDMA hardware.
//!
//! Each connected queue pair owns one or more TCP connections ([`DeviceConfig::tcp_nsocks`]:
//! the smaller of the two sides' settings; TCP_NODELAY, keepalive, TCP_USER_TIMEOUT set to the
//! queue pair's timeout so a cut link is noticed). Both directions share them: a side's requests
//! (WRITE, WRITE_WITH_IMM, SEND, READ, atomics) and its responses to the other side's requests
//! (ACK, NAK, READ data, atomic results), each a [`frame`] header plus payload. Connection 0
//! carries every frame but the parts of striped WRITEs and READ data: a WRITE, or the data of a
//! READ, of at least [`STRIPE_MIN`] bytes is cut into one part per connection, as NCCL's
//! `NCCL_NSOCKS_PERTHREAD` does.
//!
//! # Who moves the bytes
//!
//! A context has one or more progress *shards* ([`DeviceConfig::tcp_progress_threads`];
//! automatic: `min(tcp_nsocks, 4)`, so one shard for one connection per queue pair). Each shard
//! has its own epoll set, *driver* token and progress thread, and connection `i` of every
//! queue pair is watched by shard `i % shards`: the parts of a striped WRITE (or READ data),
//! one per connection, are received by several threads at once, so striping scales the receive
//! side too (with one shard, one thread reads every socket of the context). Shard 0 also watches
//! the listener and the connections still saying hello.
//!
//! Reading a shard's sockets (and finishing writes the socket could not take at once) is done
//! by whoever holds its driver token. For shard 0, which holds every connection 0 and so every
//! frame but the later parts of striped transfers, that is an application thread polling or
//! waiting on a completion queue of the context, or else shard 0's progress thread. An
//! application that polls reads shard 0's sockets ([`Shared::app_progress`]: one `epoll_wait`
//! with no timeout, then the reads), and one that waits sleeps in `epoll_wait` on them
//! ([`Shared::app_block`]), so a message wakes the thread that waits for it and no other
//! (UCX's model); a completion made by another shard's thread kicks a thread sleeping there.
//! Shard 0's progress thread stands back while the application drives: it sleeps until no
//! application thread has driven for [`LINGER`], then blocks in `epoll_wait` itself, so
//! one-sided operations that arrive while nobody polls (a READ of a passive target) are still
//! served: at most two [`LINGER`]s late, or a [`SWEEP`] and a `LINGER` when the application
//! stopped while it held the driver token. The other shards' progress threads always drive their own
//! sockets (blocking in `epoll_wait`, or busy-polling with `tcp_busy_poll`): the small-message
//! path of an application thread costs what it cost with one shard.
//! Posting writes frames straight to the socket from the posting thread.
//!
//! Several shards read one queue pair's connections at once, so the target's state of a queue
//! pair (which request starts next, the requests under way, the ACK owed, whether it drops
//! requests after a NAK) is one lock, held from the decision to execute a request to its
//! effect: the first part of a striped request to arrive starts it (and claims its receive)
//! once, the others join it, and a request counts as done for every reader at once. A
//! connection whose next request must wait for an earlier one (on another connection) is
//! marked stalled before that lock is let go; the reader that starts or finishes the earlier
//! request reads it on, or, when another shard watches it, wakes that shard to read it. On the
//! initiator, READ data parts land in parallel, and one record of what the target answered
//! completes the requests in order.
//!
//! The target validates each request (rkey, bounds, access flags, lengths) against this
//! context's regions and receives payloads straight into the target memory (small frames pass
//! through a staging buffer, so a small message costs one `recv`).
//!
//! RC semantics: the target starts requests in order and finishes them in order (across
//! connections: a part of a later request waits until every earlier request has started). A
//! WRITE without an immediate may land while earlier such WRITEs still land, unless their
//! ranges overlap (so a stream of striped WRITEs keeps every connection busy, and two WRITEs to
//! the same bytes land in order); every other request (a WRITE_WITH_IMM or SEND, whose receive
//! completes; a READ; an atomic; a WRITE that fails its checks, whose NAK must not pass the
//! WRITEs before it) waits until every earlier request is done. ACKs are cumulative, due when
//! a request that asked for one ([`frame::ACK_REQ`]: signaled, or one in [`frame::ACK_EVERY`])
//! is done, and ride in the `ack` field of the next frame that goes back on connection 0 (a
//! credit, an answer); an ACK frame of its own goes when the application's poll finds nothing,
//! before it sleeps, when the progress thread drives (so late by as much as above), or when
//! the queue pair is destroyed, which first sends what it owes (the ACK, the frames still
//! queued; at most [`CLOSE_FLUSH`] waiting for room), so a peer whose last requests were
//! executed here completes them even though this side exits at once; a failed request is
//! NAKed, the target drops every later request of the queue pair, and the initiator's queue
//! pair goes to ERR (and closes the connections). A SEND or WRITE_WITH_IMM that finds no
//! receive posted stalls its connection (receiver not ready) until one is posted or the
//! initiator's RNR budget runs out, when the target NAKs it with `RnrRetryExceeded`. The
//! initiator completes its requests in order: one without data once an ACK (or a later answer)
//! covers it, a READ or atomic once its data has all landed, since an ACK of a later request
//! on connection 0 may overtake READ data striped over the others. A connection
//! that drops (process death, TCP user timeout, the peer's queue pair destroyed) moves the
//! queue pair to ERR once what the peer sent before on its other connections is executed
//! (once every connection's end is read, or after [`LOST_DRAIN`]): the first outstanding
//! request of each queue completes with `RetryExceeded`, the rest are flushed.
//!
//! # Sealed queue pairs
//!
//! A queue pair whose [`QpConfig::seal`](crate::QpConfig) holds a job key seals its
//! connections (both ends must, with the same key: a sealed side refuses a plain hello, and a
//! plain side a sealed one, each saying which wants what). The hello and its reply carry a
//! flag and a fresh nonce each way ([`frame::Hello`], [`frame::Reply`]); each connection's keys
//! are `JobKey::session` of both nonces and both messages' bytes (a hello or reply altered on
//! the path breaks them), so the stripes of a queue pair have keys of their own. Each side's
//! first record is [`frame::FINISHED`]: the acceptor sends it behind its reply, the initiator
//! reads and checks it in `connect` (a peer with another key fails the connect there, naming
//! its address) and answers with its own, which the acceptor's receive side checks before
//! anything else.
//!
//! Then every frame, both ways, travels in AEAD records (`oxccl_seal`): the sending side cuts
//! its queued frames into records of at most `MAX_RECORD` bytes (several small frames share
//! one, a payload is cut at record bounds), seals them into a buffer of the connection and
//! writes that (`Conn::flush_sealed`). The receiving side reads the ciphertext ahead,
//! non-blocking as before, authenticates and decrypts each whole record in place and only
//! then copies its plaintext into the stage the frame parser reads, which never receives
//! straight from the socket on a sealed connection: a payload's bytes reach target memory only
//! after their record authenticated, so a WRITE that fits in one record and is tampered with
//! never lands. A record that fails (tampered, replayed, dropped, reordered: the record's
//! sequence number is authenticated) fails the queue pair like a broken connection, with an
//! error naming the connection, the peer's address and what failed.
//!
//! A sealed connection costs memory: its receive side reads ahead up to four records
//! (256 KiB), its sending side seals up to eight records (512 KiB) ahead of the socket, each
//! allocated when first used. A read pass that finds its socket empty stops there and waits
//! for epoll (it does not poll `recv` until the next record comes).
//!
//! [`DeviceConfig::tcp_busy_poll`](crate::DeviceConfig) makes the progress thread busy-poll
//! when it drives; by default it blocks in `epoll_wait`. The listener binds
//! [`DeviceConfig::tcp_addr`](crate::DeviceConfig), which is also the address peers are given.
//!
//! [`DeviceConfig::tcp_nsocks`]: crate::DeviceConfig::tcp_nsocks
//! [`DeviceConfig::tcp_progress_threads`]: crate::DeviceConfig::tcp_progress_threads

mod conn;
pub mod frame;
mod qp;
mod rx;
mod tx;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::epoll;

use crate::contract::{OpenArgs, ProviderContext, QpSetup, QpTransport, RegionMap};
use crate::model::{Error, Result};
use conn::Conn;
use frame::{HELLO_LEN, Hello, Reply, Verdict};

/// Opens the tcp half of a context: its listener and progress thread, configured by the
/// `tcp_*` fields of the context's [`DeviceConfig`](crate::DeviceConfig).
pub(crate) fn open(args: &OpenArgs<'_>) -> Result<Box<dyn ProviderContext>> {
    let c = args.config;
    Ok(Box::new(TcpContext {
        engine: Engine::start(
            args.regions.clone(),
            c.tcp_addr,
            Tuning {
                busy: c.tcp_busy_poll,
                inline_max: c.tcp_inline_max,
                nsocks: c.tcp_nsocks.clamp(1, frame::MAX_PARTS as usize) as u32,
                congestion: Congestion::from_config(&c.tcp_congestion),
            },
            c.progress_shards(),
        )?,
    }))
}

/// The tcp half of a context: the progress engine.
struct TcpContext {
    engine: Engine,
}

impl ProviderContext for TcpContext {
    fn create_qp(&self, setup: &QpSetup<'_>) -> Result<Box<dyn QpTransport>> {
        let rnr_us = setup.rnr_budget_us();
        let shared = self.engine.shared.clone();
        let conn = shared.conn(
            setup.qp.clone(),
            setup.token,
            rnr_us,
            setup.cfg.seal.clone(),
        );
        Ok(Box::new(qp::TcpQp {
            shared,
            conn,
            send: std::sync::Mutex::new(()),
        }))
    }

    fn listen_addr(&self) -> Option<SocketAddr> {
        Some(self.engine.shared.addr)
    }

    fn progress(&self) {
        self.engine.shared.app_progress();
    }

    fn polled(&self, completions: usize) {
        if completions == 0 {
            self.engine.shared.flush_acks();
        }
    }

    fn block(&self, nap: Duration) -> bool {
        self.engine.shared.app_block(nap)
    }

    fn notify(&self) {
        let sh = &self.engine.shared;
        if sh.shards[0].blocked.load(Ordering::SeqCst) {
            sh.kick();
        }
    }
}

/// The settings of a tcp context.
#[derive(Clone, Copy)]
struct Tuning {
    /// The progress thread busy-polls when it drives.
    busy: bool,
    /// Frames larger than this are written by the driver, not the poster.
    inline_max: usize,
    /// Connections per queue pair this side asks for.
    nsocks: u32,
    /// The congestion control its connections get.
    congestion: Congestion,
}

/// [`TcpCongestion`](crate::TcpCongestion) in a form a `Copy` [`Tuning`] holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Congestion {
    /// `reno` on loopback connections, the system's default elsewhere.
    Auto,
    /// The system's default.
    System,
    /// This name (`len` bytes) on every connection.
    Named { name: [u8; 15], len: u8 },
}

/// The congestion control [`Congestion::Auto`] gives a loopback connection.
const LOOPBACK_CONGESTION: &str = "reno";

impl Congestion {
    fn from_config(c: &crate::TcpCongestion) -> Congestion {
        match c {
            crate::TcpCongestion::Auto => Congestion::Auto,
            crate::TcpCongestion::System => Congestion::System,
            crate::TcpCongestion::Named(n) => {
                // `TcpCongestion::parse` keeps names to 15 bytes; a longer one set in code is
                // cut here and refused by the kernel, naming what was asked.
                let mut name = [0u8; 15];
                let len = n.len().min(15);
                name[..len].copy_from_slice(&n.as_bytes()[..len]);
                Congestion::Named {
                    name,
                    len: len as u8,
                }
            }
        }
    }

    /// The algorithm a connection between `local` and `peer` gets (`None`: the system's
    /// default), and whether a refusal fails the connection (asked for by name) or is ignored
    /// (chosen automatically).
    fn choose(&self, local: Option<SocketAddr>, peer: Option<SocketAddr>) -> Option<(&str, bool)> {
        match self {
            Congestion::System => None,
            Congestion::Auto => {
                let lo = |a: Option<SocketAddr>| a.is_some_and(|a| a.ip().is_loopback());
                (lo(local) && lo(peer)).then_some((LOOPBACK_CONGESTION, false))
            }
            Congestion::Named { name, len } => Some((
                std::str::from_utf8(&name[..*len as usize]).unwrap_or("?"),
                true,
            )),
        }
    }
}

// Epoll keys: sockets get keys from `Shared::next_key` (which starts above these).
const LISTENER: u64 = 0;
const WAKE: u64 = 1;
/// How long the progress thread stays back once no application thread drives: it takes over
/// when the application's poll count has not changed for this long (between one and two
/// `LINGER`s after the last poll, as it looks once a `LINGER`).
pub(crate) const LINGER: Duration = Duration::from_micros(500);
/// WRITEs of at least this many bytes are striped over a queue pair's connections.
pub(crate) const STRIPE_MIN: usize = 256 << 10;
/// The sweep's period: attach deadlines, receiver-not-ready retries, dead connections.
const SWEEP: Duration = Duration::from_millis(20);
/// How long a destroyed queue pair waits, at most, for room in its sockets to send what it
/// owes the peer ([`Conn::flush_before_close`]).
const CLOSE_FLUSH: Duration = Duration::from_millis(200);
/// How long a queue pair whose connection was lost waits, at most, for the ends of its other
/// connections (reading what the peer sent before on them) before it fails.
const LOST_DRAIN: Duration = Duration::from_secs(1);
/// How long an accepted connection may take to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(2);
/// An application's polls of shard 0 read its hot connection directly (one `recv`, no
/// `epoll_wait`) this many times in a row, then ask `epoll_wait` again (the other sockets, the
/// wake-ups, room to write): see [`Shared::read_hot`].
const HOT_POLLS: u32 = 8;

// Who holds the driver token.
const FREE: u8 = 0;
const THREAD: u8 = 1;
const APP: u8 = 2;

/// The progress engine of a tcp context.
pub(crate) struct Engine {
    shared: Arc<Shared>,
    /// The progress threads, one per shard.
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// What an epoll key names.
enum Keyed {
    /// An accepted connection that has not said hello yet.
    Pending(Box<Pending>),
    /// Connection `.1` of a queue pair.
    Sock(Arc<Conn>, usize),
}

/// An accepted connection reading its hello.
struct Pending {
    sock: TcpStream,
    from: SocketAddr,
    buf: [u8; HELLO_LEN],
    got: usize,
    since: Instant,
}

/// One progress shard: an epoll set, its driver token and its progress thread. Connection `i`
/// of every queue pair is watched by shard `i % shards` ([`Shared::shard_of`]); shard 0 also
/// watches the listener and the connections still saying hello.
pub(crate) struct Shard {
    pub(super) epoll: OwnedFd,
    wake: OwnedFd,
    /// FREE, THREAD or APP: who reads this shard's sockets now.
    driver: AtomicU8,
    /// Bumped whenever an application thread drives this shard: the progress thread takes
    /// over once it has not changed for [`LINGER`] (a count, not a time: a poll then costs a
    /// store, not a clock read).
    app_polls: AtomicU64,
    /// An application thread sleeps in this shard's `epoll_wait` (completions made by other
    /// threads kick it).
    blocked: AtomicBool,
    /// The progress thread was asked to stand back (it was driving when an application came).
    standby: AtomicBool,
    /// The progress thread sleeps long (an application thread blocks in `epoll_wait`).
    deep: AtomicBool,
    thread: OnceLock<std::thread::Thread>,
    /// When this shard's sweep last ran, in µs since `Shared::epoch`.
    last_sweep: AtomicU64,
    /// The connection (and its index) that the last `epoll_wait` found alone readable: the
    /// application's polls read it directly in between ([`Shared::read_hot`]). Locked only by
    /// the driver.
    hot: Mutex<Option<(Arc<Conn>, usize)>>,
    /// Application polls that read `hot` directly since the last `epoll_wait`.
    direct: AtomicU32,
}

impl Shard {
    fn new() -> Result<Shard> {
        let epoll =
            epoll::create(epoll::CreateFlags::CLOEXEC).map_err(|e| Error::os("epoll", e))?;
        let wake = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )
        .map_err(|e| Error::os("eventfd", e))?;
        epoll::add(
            &epoll,
            &wake,
            epoll::EventData::new_u64(WAKE),
            epoll::EventFlags::IN,
        )
        .map_err(|e| Error::os("registering the tcp engine's wake-up with epoll", e))?;
        Ok(Shard {
            epoll,
            wake,
            driver: AtomicU8::new(FREE),
            app_polls: AtomicU64::new(0),
            blocked: AtomicBool::new(false),
            standby: AtomicBool::new(false),
            deep: AtomicBool::new(false),
            thread: OnceLock::new(),
            last_sweep: AtomicU64::new(0),
            hot: Mutex::new(None),
            direct: AtomicU32::new(0),
        })
    }

    fn kick(&self) {
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }

    fn unpark(&self) {
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }

    /// An application thread drives (or would): counted, with a plain load and store, not a
    /// locked add. Threads that race may count once, which still says that one came; a thread
    /// preempted between the two may write back an older count, which at worst lets the
    /// progress thread take a turn at driving while the application polls (the driver token
    /// keeps the two from reading at once).
    fn app_polled(&self) {
        let n = self.app_polls.load(Ordering::Relaxed);
        self.app_polls.store(n.wrapping_add(1), Ordering::Relaxed);
    }

    /// Takes the driver token for an application thread: `Ok` when it was free, otherwise
    /// who holds it.
    fn take_for_app(&self) -> std::result::Result<(), u8> {
        self.driver
            .compare_exchange(FREE, APP, Ordering::Acquire, Ordering::Relaxed)
            .map(|_| ())
    }
}

/// What the engine threads, the application threads and the queue pairs share.
pub(crate) struct Shared {
    /// The progress shards (at least one).
    pub(super) shards: Box<[Shard]>,
    listener: TcpListener,
    /// The address peers connect to.
    pub addr: SocketAddr,
    /// Connections by the local queue pair's token (incoming hellos name it).
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
    /// What each epoll key names.
    keys: Mutex<HashMap<u64, Keyed>>,
    next_key: AtomicU64,
    /// Registered regions of the context, by table index (the target validates against them).
    pub regions: RegionMap,
    stop: AtomicBool,
    tuning: Tuning,
    epoch: Instant,
    /// Some connection holds back an ACK ([`Conn::ack_out`]).
    acks_due: Arc<AtomicBool>,
}

impl Engine {
    /// Starts the engine: a listener on `bind` (port 0: any) and `shards` progress shards,
    /// each with its progress thread.
    fn start(
        regions: RegionMap,
        bind: SocketAddr,
        tuning: Tuning,
        shards: usize,
    ) -> Result<Engine> {
        let listener = TcpListener::bind(bind)
            .map_err(|e| Error::os(format!("binding the tcp provider's listener on {bind}"), e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::os("listener", e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::os("listener address", e))?;
        let shards = (0..shards.max(1))
            .map(|_| Shard::new())
            .collect::<Result<Box<[Shard]>>>()?;
        epoll::add(
            &shards[0].epoll,
            listener.as_fd(),
            epoll::EventData::new_u64(LISTENER),
            epoll::EventFlags::IN,
        )
        .map_err(|e| Error::os("registering the tcp listener with epoll", e))?;
        let shared = Arc::new(Shared {
            shards,
            listener,
            addr,
            conns: Mutex::new(HashMap::new()),
            keys: Mutex::new(HashMap::new()),
            next_key: AtomicU64::new(16),
            regions,
            stop: AtomicBool::new(false),
            tuning,
            epoch: Instant::now(),
            acks_due: Arc::new(AtomicBool::new(false)),
        });
        let engine = Engine {
            shared: shared.clone(),
            threads: Mutex::new(Vec::new()),
        };
        for k in 0..shared.shards.len() {
            let sh = shared.clone();
            let name = match k {
                0 => "oxccl-tcp-progress".to_string(),
                k => format!("oxccl-tcp-progress-{k}"),
            };
            // On an error the engine's drop stops the threads already started.
            let t = std::thread::Builder::new()
                .name(name)
                .spawn(move || sh.run(k))
                .map_err(|e| Error::os(format!("spawning tcp progress thread {k}"), e))?;
            let _ = shared.shards[k].thread.set(t.thread().clone());
            engine
                .threads
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(t);
        }
        Ok(engine)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        for s in self.shared.shards.iter() {
            s.kick();
            s.unpark();
        }
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        for t in threads {
            // A progress thread itself may drop the last handle (it briefly holds queue pairs
            // and regions): it then exits on its own after this returns; joining would deadlock.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
        let conns: Vec<Arc<Conn>> = self
            .shared
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        for c in conns {
            c.shutdown();
        }
    }
}

impl Shared {
    /// Wakes shard 0's driver (it then sweeps: dead connections, stalled ones of its shard).
    pub(crate) fn kick(&self) {
        self.shards[0].kick();
    }

    /// Wakes shard `k`'s driver: it retries its stalled connections.
    pub(super) fn kick_shard(&self, k: usize) {
        if let Some(s) = self.shards.get(k) {
            s.kick();
        }
    }

    /// The shard that watches connection `idx` of a queue pair.
    pub(super) fn shard_of(&self, idx: usize) -> usize {
        idx % self.shards.len()
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// A new epoll key.
    fn key(&self) -> u64 {
        self.next_key.fetch_add(1, Ordering::Relaxed)
    }

    /// Creates the connection object of a new queue pair. It accepts the peer's connections from
    /// now on (parking them until `connect` names the peer), or connects in `connect_to`.
    fn conn(
        self: &Arc<Self>,
        qp: std::sync::Weak<crate::contract::QpInner>,
        local_token: u64,
        rnr_us: u64,
        seal: Option<oxccl_seal::JobKey>,
    ) -> Arc<Conn> {
        let c = Arc::new(Conn::new(self, qp, local_token, rnr_us, seal));
        self.conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(local_token, c.clone());
        c
    }

    /// Registers connection `idx` of `conn` under its key.
    fn register_sock(&self, key: u64, conn: &Arc<Conn>, idx: usize) {
        self.keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, Keyed::Sock(conn.clone(), idx));
    }

    /// Drops a queue pair's connections.
    pub(crate) fn forget(&self, local_token: u64) {
        let c = self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&local_token);
        if let Some(c) = c {
            let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
            for k in c.keys() {
                keys.remove(&k);
            }
            drop(keys);
            c.shutdown();
            for s in self.shards.iter() {
                let mut hot = s.hot.lock().unwrap_or_else(|e| e.into_inner());
                if hot.as_ref().is_some_and(|(h, _)| Arc::ptr_eq(h, &c)) {
                    *hot = None;
                }
            }
        }
    }

    /// An application thread polls a completion queue: read shard 0's sockets now, unless
    /// someone else drives it (its progress thread is then asked to stand back). Shard 0 holds
    /// every connection 0, which carries every frame but the later parts of striped transfers;
    /// the other shards' sockets are read by their own progress threads, in parallel.
    fn app_progress(&self) {
        let s = &self.shards[0];
        s.app_polled();
        match s.take_for_app() {
            Ok(()) => {
                if !self.read_hot(s) {
                    self.turn(0, Some(Duration::ZERO));
                }
                s.driver.store(FREE, Ordering::Release);
            }
            Err(THREAD) => self.ask_standby(),
            Err(_) => {}
        }
    }

    /// An application's poll of shard 0 (the caller holds its driver token): reads the hot
    /// connection, the one the last `epoll_wait` found alone readable, with one `recv` and no
    /// `epoll_wait`, [`HOT_POLLS`] times in a row. A waiting rank's message then costs one
    /// system call where it cost two (`epoll_wait`, then `recv`), and an empty poll still one.
    /// False when `epoll_wait` is due (no hot connection, or its turn came): the other sockets,
    /// the wake-ups and the sockets waiting for room are then seen at most [`HOT_POLLS`] polls
    /// late.
    fn read_hot(&self, s: &Shard) -> bool {
        let n = s.direct.load(Ordering::Relaxed);
        if n >= HOT_POLLS {
            s.direct.store(0, Ordering::Relaxed);
            return false;
        }
        let mut hot = s.hot.lock().unwrap_or_else(|e| e.into_inner());
        let Some((c, i)) = hot.as_ref() else {
            return false;
        };
        if c.dead.load(Ordering::Acquire) {
            *hot = None;
            return false;
        }
        s.direct.store(n + 1, Ordering::Relaxed);
        c.read_frames(*i);
        true
    }

    /// An application thread would sleep on a completion queue: sleep in `epoll_wait` on
    /// shard 0's sockets instead (at most `nap`), handling what arrives. False when another
    /// thread drives it (the caller sleeps on the completion queue's doorbell). Completions
    /// made by the other shards' threads kick it ([`TcpContext::notify`]).
    fn app_block(&self, nap: Duration) -> bool {
        let s = &self.shards[0];
        s.app_polled();
        match s.take_for_app() {
            Ok(()) => {}
            Err(THREAD) => {
                self.ask_standby();
                return false;
            }
            Err(_) => return false,
        }
        self.flush_acks();
        s.blocked.store(true, Ordering::SeqCst);
        self.turn(0, Some(nap));
        s.blocked.store(false, Ordering::SeqCst);
        s.app_polled();
        s.driver.store(FREE, Ordering::Release);
        if s.deep.load(Ordering::Acquire) {
            // The progress thread sleeps long: it must learn that nobody drives now.
            s.unpark();
        }
        true
    }

    /// Sends the ACKs that no frame took along (see [`Conn::ack_out`]).
    pub(crate) fn flush_acks(&self) {
        // Read first: an empty poll makes no write to the line (a swap is a locked write).
        if !self.acks_due.load(Ordering::Relaxed) || !self.acks_due.swap(false, Ordering::AcqRel) {
            return;
        }
        let conns: Vec<Arc<Conn>> = self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        for c in conns {
            c.flush_ack();
        }
    }

    /// Asks shard 0's progress thread to stand back (an application thread wants to drive).
    fn ask_standby(&self) {
        let s = &self.shards[0];
        if !s.standby.swap(true, Ordering::AcqRel) {
            s.kick();
        }
    }

    /// Shard `k`'s progress thread: drives when no application thread has for [`LINGER`]
    /// (application threads drive only shard 0: the others' threads always drive).
    fn run(self: Arc<Self>, k: usize) {
        let s = &self.shards[k];
        let mut last_activity = Instant::now();
        // The application's poll count as last seen, and when it was seen to change.
        let mut polls = (s.app_polls.load(Ordering::Relaxed), Instant::now());
        while !self.stop.load(Ordering::SeqCst) {
            let now = s.app_polls.load(Ordering::Relaxed);
            if now != polls.0 {
                polls = (now, Instant::now());
            }
            let since = polls.1.elapsed();
            let app = s.driver.load(Ordering::Acquire) == APP;
            if app || since < LINGER {
                // Stand back: the application reads its sockets.
                s.standby.store(false, Ordering::Release);
                if app {
                    s.deep.store(true, Ordering::Release);
                    if s.driver.load(Ordering::Acquire) == APP {
                        std::thread::park_timeout(SWEEP);
                    }
                    s.deep.store(false, Ordering::Release);
                } else {
                    std::thread::park_timeout(LINGER - since);
                }
                self.sweep_if_due(k);
                continue;
            }
            if s.driver
                .compare_exchange(FREE, THREAD, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
            {
                std::thread::park_timeout(Duration::from_micros(50));
                continue;
            }
            let spin = self.tuning.busy && last_activity.elapsed() < Duration::from_millis(50);
            let got = self.turn(k, Some(if spin { Duration::ZERO } else { SWEEP }));
            // Nobody here answers: acknowledge now.
            self.flush_acks();
            s.driver.store(FREE, Ordering::Release);
            if got {
                last_activity = Instant::now();
            } else if spin {
                // Busy-polling, but never at the expense of a runnable thread on this core (the
                // application spinning on memory, a peer process): with more spinners than cores
                // a pure spin would only run at scheduler ticks.
                std::thread::yield_now();
            }
        }
    }

    /// One `epoll_wait` on shard `k` (at most `timeout`) and the handling of what it returns,
    /// by the shard's driver. Returns whether anything was ready.
    fn turn(&self, k: usize, timeout: Option<Duration>) -> bool {
        let s = &self.shards[k];
        let mut buf = [const { std::mem::MaybeUninit::<epoll::Event>::uninit() }; 64];
        let ts = timeout.map(|t| rustix::time::Timespec {
            tv_sec: t.as_secs() as i64,
            tv_nsec: t.subsec_nanos() as i64,
        });
        let Ok((events, _)) = epoll::wait(&s.epoll, &mut buf, ts.as_ref()) else {
            return false;
        };
        let mut recheck = false;
        // The one connection found readable, if only one was (`None` inside: more than one).
        let mut readable: Option<Option<(Arc<Conn>, usize)>> = None;
        for ev in events.iter() {
            match ev.data.u64() {
                LISTENER => self.accept_all(),
                WAKE => {
                    let mut b = [0u8; 8];
                    let _ = rustix::io::read(&s.wake, &mut b);
                    recheck = true;
                }
                key => {
                    if let Some(r) = self.on_event(key, ev.flags) {
                        readable = Some(if readable.is_none() { Some(r) } else { None });
                    }
                }
            }
        }
        if let Some(Some(r)) = readable {
            *s.hot.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        }
        let got = !events.is_empty();
        if recheck {
            self.sweep(k);
        } else {
            self.sweep_if_due(k);
        }
        got
    }

    /// Handles an event of key `key`; returns the connection it found readable.
    fn on_event(&self, key: u64, flags: epoll::EventFlags) -> Option<(Arc<Conn>, usize)> {
        let keyed = {
            let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
            match keys.get(&key) {
                Some(Keyed::Sock(c, i)) => Some(Ok((c.clone(), *i))),
                Some(Keyed::Pending(_)) => keys.remove(&key).map(Err),
                None => None,
            }
        };
        match keyed {
            Some(Ok((c, i))) => {
                if flags.contains(epoll::EventFlags::OUT) {
                    c.flush_tx(i);
                }
                if flags.intersects(
                    epoll::EventFlags::IN | epoll::EventFlags::HUP | epoll::EventFlags::ERR,
                ) {
                    c.on_readable(i);
                    return Some((c, i));
                }
                None
            }
            Some(Err(Keyed::Pending(p))) => {
                self.hello(key, p);
                None
            }
            _ => None,
        }
    }

    fn sweep_if_due(&self, k: usize) {
        let s = &self.shards[k];
        let now = self.now_us();
        let last = s.last_sweep.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= SWEEP.as_micros() as u64
            && s.last_sweep
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            self.sweep(k);
        }
    }

    /// Shard `k`'s sweep: retries its stalled connections, fails connections that never
    /// attached or stalled too long; shard 0 also drops connections that never said hello.
    fn sweep(&self, k: usize) {
        let conns: Vec<Arc<Conn>> = self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        for c in conns {
            c.sweep(k);
        }
        if k != 0 {
            return;
        }
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        keys.retain(|_, key| match key {
            Keyed::Pending(p) if p.since.elapsed() >= HELLO_TIMEOUT => {
                eprintln!(
                    "oxccl tcp: refused a connection from {}: no hello within {HELLO_TIMEOUT:?}",
                    p.from
                );
                let _ = epoll::delete(&self.shards[0].epoll, &p.sock);
                false
            }
            _ => true,
        });
    }

    /// Accepts every waiting connection; each reads its hello without blocking anyone.
    fn accept_all(&self) {
        while let Ok((sock, from)) = self.listener.accept() {
            if sock.set_nonblocking(true).is_err() {
                continue;
            }
            let key = self.key();
            if epoll::add(
                &self.shards[0].epoll,
                &sock,
                epoll::EventData::new_u64(key),
                epoll::EventFlags::IN,
            )
            .is_err()
            {
                continue;
            }
            self.keys.lock().unwrap_or_else(|e| e.into_inner()).insert(
                key,
                Keyed::Pending(Box::new(Pending {
                    sock,
                    from,
                    buf: [0; HELLO_LEN],
                    got: 0,
                    since: Instant::now(),
                })),
            );
        }
    }

    /// Reads more of a pending connection's hello; when it is all there, hands the connection
    /// to its queue pair (or refuses it).
    fn hello(&self, key: u64, mut p: Box<Pending>) {
        loop {
            match (&p.sock).read(&mut p.buf[p.got..]) {
                Ok(0) => {
                    let _ = epoll::delete(&self.shards[0].epoll, &p.sock);
                    return;
                }
                Ok(n) => {
                    p.got += n;
                    if p.got == HELLO_LEN {
                        break;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    self.keys
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(key, Keyed::Pending(p));
                    return;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => {
                    let _ = epoll::delete(&self.shards[0].epoll, &p.sock);
                    return;
                }
            }
        }
        let Pending {
            sock, from, buf, ..
        } = *p;
        if let Err(why) = self.handshake(key, sock, &buf) {
            eprintln!("oxccl tcp: refused a connection from {from}: {why}");
        }
    }

    fn handshake(
        &self,
        key: u64,
        mut sock: TcpStream,
        buf: &[u8; HELLO_LEN],
    ) -> std::result::Result<(), String> {
        let refuse = |mut sock: &TcpStream, verdict: Verdict, why: &str| {
            let _ = epoll::delete(&self.shards[0].epoll, sock);
            let reply = Reply {
                verdict,
                rnr_us: 0,
                nonce: None,
            };
            let _ = sock.write_all(&frame::encode_reply(&reply));
            Err(why.to_string())
        };
        let Some(hello) = frame::decode_hello(buf) else {
            return refuse(&sock, Verdict::Refused, "malformed hello");
        };
        let conn = self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&hello.target)
            .cloned();
        let Some(conn) = conn.filter(|c| !c.dead.load(Ordering::Acquire)) else {
            return refuse(
                &sock,
                Verdict::Refused,
                "no queue pair is waiting for this peer (wrong or stale token)",
            );
        };
        if let Err(why) = conn.accepts(&hello) {
            return refuse(&sock, Verdict::Refused, &why);
        }
        let mismatch = match (&conn.seal, hello.nonce) {
            (Some(_), None) => Some((
                Verdict::WantsSealed,
                "its hello is plain, and this queue pair is sealed (encrypted): both ends must \
                 seal (OXCCL_ENCRYPT, QpConfig::seal)",
            )),
            (None, Some(_)) => Some((
                Verdict::WantsPlain,
                "its hello asks for a sealed (encrypted) connection, and this queue pair is \
                 plain: both ends must seal (OXCCL_ENCRYPT, QpConfig::seal)",
            )),
            _ => None,
        };
        if let Some((verdict, why)) = mismatch {
            conn.refused(hello.initiator, why);
            return refuse(&sock, verdict, why);
        }
        // A sealed handshake that cannot go on here (no randomness, no record number).
        let refuse_sealing = |step: &str, e: oxccl_seal::SealError| {
            let why = format!(
                "sealed handshake (connection {} of {}): {step}: {e}",
                hello.index, hello.count
            );
            conn.refused(hello.initiator, &why);
            refuse(&sock, Verdict::Refused, &why)
        };
        let nonce = match conn
            .seal
            .as_ref()
            .map(|_| oxccl_seal::fresh_nonce())
            .transpose()
        {
            Ok(n) => n,
            Err(e) => return refuse_sealing("drawing this side's nonce", e),
        };
        let reply = frame::encode_reply(&Reply {
            verdict: Verdict::Accepted,
            rnr_us: conn.my_rnr_us,
            nonce,
        });
        let mut out = reply.to_vec();
        // A sealed connection: keys bound to both nonces and both hellos, and this side's
        // first record (key confirmation) right behind the reply.
        let session = match (&conn.seal, hello.nonce, nonce) {
            (Some(k), Some(theirs), Some(ours)) => {
                let mut s = k.session(
                    oxccl_seal::Role::Acceptor,
                    &theirs,
                    &ours,
                    &transcript(buf, &reply),
                );
                if let Err(e) = s.tx.seal(frame::FINISHED, &mut out) {
                    return refuse_sealing("sealing the key confirmation", e);
                }
                Some(s)
            }
            _ => None,
        };
        // A fresh socket's send buffer takes the reply (and a first record) at once.
        sock.write_all(&out).map_err(|e| e.to_string())?;
        conn.peer_rnr_us.store(hello.rnr_us, Ordering::Relaxed);
        conn.arrived(hello, key, sock, session);
        Ok(())
    }
}

/// What both sides of a sealed connection saw of its handshake (the keys are bound to it, so
/// that a hello or reply altered on the path breaks them).
fn transcript(hello: &[u8; HELLO_LEN], reply: &[u8; frame::REPLY_LEN]) -> Vec<u8> {
    let mut t = Vec::with_capacity(HELLO_LEN + frame::REPLY_LEN);
    t.extend_from_slice(hello);
    t.extend_from_slice(reply);
    t
}

/// What a connecting side learns from the hello's reply: whether it was accepted, the
/// target's RNR budget and, on a sealed connection, its nonce (with the reply's bytes).
fn read_reply(sock: &mut TcpStream, addr: SocketAddr) -> Result<(Reply, [u8; frame::REPLY_LEN])> {
    let io = |e: std::io::Error| Error::os(format!("handshake with {addr}"), e);
    let mut bytes = [0u8; frame::REPLY_LEN];
    sock.read_exact(&mut bytes).map_err(io)?;
    let reply = frame::decode_reply(&bytes).ok_or_else(|| {
        Error::arg(format!(
            "the peer at {addr} answered the hello with a malformed reply (not an oxccl tcp \
             queue pair of this version?)"
        ))
    })?;
    let why = match reply.verdict {
        Verdict::Accepted => return Ok((reply, bytes)),
        Verdict::Refused => "its queue pair is gone or not connecting to us",
        Verdict::WantsSealed => {
            "its queue pair is sealed (encrypted) and ours is plain: both ends must seal \
             (OXCCL_ENCRYPT, QpConfig::seal)"
        }
        Verdict::WantsPlain => {
            "its queue pair is plain and ours is sealed (encrypted): both ends must seal \
             (OXCCL_ENCRYPT, QpConfig::seal)"
        }
    };
    Err(Error::arg(format!(
        "the peer at {addr} refused the connection: {why}"
    )))
}

/// The listener address a tcp endpoint advertises.
pub(crate) fn advertised(shared: &Shared) -> String {
    shared.addr.to_string()
}

/// Sends the hello of connection `index` of `count`.
fn send_hello(sock: &mut TcpStream, addr: SocketAddr, h: &Hello) -> Result<()> {
    sock.write_all(&frame::encode_hello(h))
        .map_err(|e| Error::os(format!("handshake with {addr}"), e))
}
