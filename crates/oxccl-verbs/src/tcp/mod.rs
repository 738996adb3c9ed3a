//! The tcp provider: RDMA semantics over TCP sockets, for hosts without RDMA hardware.
//!
//! Each connected queue pair owns one TCP connection (TCP_NODELAY, keepalive, TCP_USER_TIMEOUT set
//! to the queue pair's timeout so a cut link is noticed). Both directions share it: a side's
//! requests (WRITE, WRITE_WITH_IMM, SEND, READ, atomics) and its responses to the other side's
//! requests (ACK, NAK, READ data, atomic results), each a [`frame`] header plus payload.
//!
//! A progress thread per context (the "NIC") owns the receive side of every connection: it reads
//! headers, validates them against this context's regions (rkey, bounds, access flags, lengths),
//! and receives payloads straight into the target memory (no intermediate buffer), so one-sided
//! operations need no call from the target application. Senders write frames straight from the
//! source regions with vectored, non-blocking writes under the connection's transmit lock; what
//! does not fit in the socket is finished by the progress thread when the socket drains.
//!
//! RC semantics: the target executes requests in order; ACKs are cumulative; a failed request is
//! NAKed, the target drops every later request of that connection, and the initiator's queue pair
//! goes to ERR (and closes the connection). A SEND or WRITE_WITH_IMM that finds no receive posted
//! stalls the connection (receiver not ready) until one is posted or the initiator's RNR budget
//! runs out, when the target NAKs it with `RnrRetryExceeded`. A connection that drops (process
//! death, TCP user timeout) moves the queue pair to ERR: the first outstanding request of each queue
//! completes with `RetryExceeded`, the rest are flushed.
//!
//! [`DeviceConfig::tcp_busy_poll`](crate::DeviceConfig) makes the progress thread busy-poll
//! (latency mode); the default blocks in `epoll_wait`. The listener binds
//! [`DeviceConfig::tcp_addr`](crate::DeviceConfig), which is also the address peers are given.

pub mod frame;
mod qp;

use std::collections::{HashMap, VecDeque};
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::epoll;
use rustix::net::SendFlags;

use crate::context::RegionMap;
use crate::error::{Error, Result};
use crate::mr::{MrInner, Span, key_index};
use crate::provider::{OpenArgs, ProviderContext, QpSetup, QpTransport};
use crate::qp::QpInner;
use crate::types::{AccessFlags, MAX_SGE, WcOpcode, WcStatus, WrOp};
use frame::{HEADER_LEN, HELLO_LEN, Header, Opcode};

/// Opens the tcp half of a context: its listener and progress thread, configured by the
/// `tcp_*` fields of the context's [`DeviceConfig`](crate::DeviceConfig).
pub(crate) fn open(args: &OpenArgs<'_>) -> Result<Box<dyn ProviderContext>> {
    let c = args.config;
    Ok(Box::new(TcpContext {
        engine: Engine::start(
            args.regions.clone(),
            c.tcp_addr,
            c.tcp_busy_poll,
            c.tcp_inline_max,
        )?,
    }))
}

/// The tcp half of a context: the progress engine.
struct TcpContext {
    engine: Engine,
}

impl ProviderContext for TcpContext {
    fn create_qp(&self, setup: &QpSetup<'_>) -> Result<Box<dyn QpTransport>> {
        let cfg = setup.cfg;
        let rnr_us = if cfg.rnr_retry >= 7 {
            0
        } else {
            (cfg.rnr_timer * (cfg.rnr_retry as u32 + 1))
                .as_micros()
                .max(1) as u64
        };
        let shared = self.engine.shared().clone();
        let conn = shared.conn(setup.qp.clone(), setup.token, rnr_us);
        Ok(Box::new(qp::TcpQp {
            shared,
            conn,
            send: std::sync::Mutex::new(()),
        }))
    }

    fn listen_addr(&self) -> Option<SocketAddr> {
        Some(self.engine.shared().addr)
    }
}

// Epoll keys: connections use their queue pair's token (never one of these two).
const LISTENER: u64 = u64::MAX;
const WAKE: u64 = u64::MAX - 1;
/// Payload bytes a discarded frame is read through.
const SCRATCH: usize = 64 * 1024;

/// The progress engine of a tcp context.
pub(crate) struct Engine {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// What the engine thread and the queue pairs share.
pub(crate) struct Shared {
    epoll: OwnedFd,
    wake: OwnedFd,
    listener: TcpListener,
    /// The address peers connect to.
    pub addr: SocketAddr,
    /// Connections by the local queue pair's token (incoming hellos name it).
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
    /// Registered regions of the context, by table index (the target validates against them).
    pub regions: RegionMap,
    stop: AtomicBool,
    busy: bool,
    /// Frames larger than this are written by the progress thread, not the poster.
    inline_max: usize,
}

impl Engine {
    /// Starts the engine: a listener on `bind` (port 0: any) and the progress thread, which
    /// busy-polls when `busy`.
    pub(crate) fn start(
        regions: RegionMap,
        bind: SocketAddr,
        busy: bool,
        inline_max: usize,
    ) -> Result<Engine> {
        let listener = TcpListener::bind(bind)
            .map_err(|e| Error::os(format!("binding the tcp provider's listener on {bind}"), e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::os("listener", e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::os("listener address", e))?;
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(|e| Error::os("epoll", e))?;
        let wake = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )
        .map_err(|e| Error::os("eventfd", e))?;
        for (fd, key) in [(listener.as_fd(), LISTENER), (wake.as_fd(), WAKE)] {
            epoll::add(
                &ep,
                fd,
                epoll::EventData::new_u64(key),
                epoll::EventFlags::IN,
            )
            .map_err(|e| Error::os("registering the tcp engine's descriptors with epoll", e))?;
        }
        let shared = Arc::new(Shared {
            epoll: ep,
            wake,
            listener,
            addr,
            conns: Mutex::new(HashMap::new()),
            regions,
            stop: AtomicBool::new(false),
            busy,
            inline_max,
        });
        let thread = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("oxccl-tcp-progress".into())
                .spawn(move || shared.run())
                .map_err(|e| Error::os("spawning the tcp progress thread", e))?
        };
        Ok(Engine {
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.kick();
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            // The progress thread itself may drop the last handle (it briefly holds queue pairs
            // and regions): it then exits on its own after this returns; joining would deadlock.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
        for c in self
            .shared
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
        {
            c.shutdown();
        }
    }
}

/// One frame waiting to be written.
struct TxFrame {
    hdr: [u8; HEADER_LEN],
    payload: Vec<Span>,
    keep: Vec<Arc<MrInner>>,
    /// The payload's own copy, once [`TxFrame::detach`] made one (the spans point into it).
    owned: Vec<u8>,
    sent: usize,
}

impl TxFrame {
    /// A frame that is only a header (ACK, NAK, atomic result).
    fn header(hdr: [u8; HEADER_LEN]) -> TxFrame {
        TxFrame {
            hdr,
            payload: Vec::new(),
            keep: Vec::new(),
            owned: Vec::new(),
            sent: 0,
        }
    }

    /// Copies the payload into the frame itself, so that it no longer reads the memory it was
    /// posted from: a frame that must still be finished (to keep the stream framed) after its
    /// request was flushed would otherwise read a buffer its owner may free or reuse as soon
    /// as the flush is reported (a user buffer registered for the call that failed).
    fn detach(&mut self) {
        if !self.owned.is_empty() || self.payload.is_empty() {
            return;
        }
        let mut owned = Vec::with_capacity(self.payload.iter().map(|s| s.1).sum());
        for s in &self.payload {
            // SAFETY: the span lies in a registered region kept alive by `keep`, and its
            // owner has not been told that the request ended (this runs in the flush that
            // tells it), so the memory is still the caller's buffer.
            owned.extend_from_slice(unsafe { std::slice::from_raw_parts(s.0, s.1) });
        }
        self.payload = vec![Span(owned.as_mut_ptr(), owned.len())];
        self.owned = owned;
        self.keep.clear();
    }

    fn total(&self) -> usize {
        HEADER_LEN + self.payload.iter().map(|s| s.1).sum::<usize>()
    }

    /// The frame, for an error: what it is, how far it got, and where its payload lies (which
    /// region holds each span, and whether that region is still registered).
    fn describe(&self) -> String {
        let head = match Header::decode(&self.hdr) {
            Ok(h) => format!("{:?} frame, request {}", h.opcode, h.seq),
            Err(_) => "frame".to_string(),
        };
        let spans: Vec<String> = self
            .payload
            .iter()
            .map(|s| {
                let (p, n) = (s.0 as u64, s.1 as u64);
                let region = if !self.owned.is_empty() {
                    "its own copy".to_string()
                } else {
                    self.keep
                        .iter()
                        .find(|m| p >= m.addr && p + n <= m.addr + m.len as u64)
                        .map_or("no region".to_string(), |m| {
                            format!(
                                "region lkey {:#x}{}",
                                m.lkey,
                                if m.is_registered() {
                                    ""
                                } else {
                                    " (deregistered)"
                                }
                            )
                        })
                };
                format!("{n} bytes at {p:#x} in {region}")
            })
            .collect();
        format!(
            "{head}, {} of {} bytes sent, payload: [{}]",
            self.sent,
            self.total(),
            spans.join("; ")
        )
    }
}

#[derive(Default)]
struct Tx {
    frames: VecDeque<TxFrame>,
    next_seq: u64,
    want_out: bool,
    /// The queue pair failed and flushed its requests: nothing more is sent.
    flushed: bool,
}

/// A request this side sent and has not seen answered.
struct Outstanding {
    seq: u64,
    wr_id: u64,
    opcode: WcOpcode,
    len: u32,
    signaled: bool,
    /// Where READ data or an atomic's old value lands.
    dst: Vec<Span>,
    _keep: Vec<Arc<MrInner>>,
    /// A request that failed locally (or follows one) and was never sent: it completes with
    /// this status once every earlier request has, so completions stay in order.
    error: Option<WcStatus>,
}

impl Outstanding {
    /// A request never sent that completes with `status` in its turn.
    fn unsent(seq: u64, wr_id: u64, opcode: WcOpcode, status: WcStatus) -> Outstanding {
        Outstanding {
            seq,
            wr_id,
            opcode,
            len: 0,
            signaled: true,
            dst: Vec::new(),
            _keep: Vec::new(),
            error: Some(status),
        }
    }
}

enum After {
    /// A WRITE placed: nothing else to do.
    Nothing,
    /// Complete receive `slot` (WRITE_WITH_IMM or SEND).
    Recv {
        slot: u64,
        opcode: WcOpcode,
        imm: Option<u32>,
    },
    /// READ `seq` has all its data.
    ReadDone { seq: u64 },
}

enum RxState {
    Header {
        buf: [u8; HEADER_LEN],
        got: usize,
    },
    Payload {
        dst: Vec<Span>,
        got: usize,
        total: usize,
        then: After,
        /// The request this payload belongs to: done (and acknowledged) once it has all landed.
        seq: Option<u64>,
        _keep: Vec<Arc<MrInner>>,
    },
    /// Waiting for a receive to be posted (receiver not ready) since `since`.
    Stalled {
        hdr: Header,
        since: Instant,
    },
    Discard {
        left: usize,
    },
}

struct Rx {
    state: RxState,
    done_seq: u64,
    acked_seq: u64,
    /// After a NAK every later request of the connection is dropped.
    dropping: bool,
    scratch: Vec<u8>,
}

/// One queue pair's connection.
pub(crate) struct Conn {
    /// [`Shared::inline_max`].
    inline_max: usize,
    shared: Weak<Shared>,
    qp: Weak<QpInner>,
    pub local_token: u64,
    /// The peer queue pair's token, once `to_rtr` named it (0 before).
    remote_token: AtomicU64,
    sock: OnceLock<TcpStream>,
    /// A connection that arrived before `to_rtr`: (initiator token, socket).
    parked: Mutex<Option<(u64, TcpStream)>>,
    tx: Mutex<Tx>,
    rx: Mutex<Rx>,
    out: Mutex<VecDeque<Outstanding>>,
    pub dead: AtomicBool,
    /// Why it died, for the queue pair's error detail.
    reason: Mutex<Option<String>>,
    /// Whether the queue pair was told.
    reported: AtomicBool,
    stalled: AtomicBool,
    /// A send failed (the peer closed or reset the connection): the progress thread reads what
    /// the peer sent before that, then fails the queue pair.
    drain_first: AtomicBool,
    /// The peer's RNR budget (how long we may stall its SEND before NAKing it), µs; 0 = forever.
    peer_rnr_us: AtomicU64,
    my_rnr_us: u64,
    /// When the connection must be up (set by `to_rtr`).
    attach_by: Mutex<Option<Instant>>,
}

impl Shared {
    fn kick(&self) {
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }

    /// Creates the connection object of a new queue pair. It accepts the peer's connection from
    /// now on (parking it until `to_rtr` names the peer), or connects in `connect_to`.
    pub(crate) fn conn(
        self: &Arc<Self>,
        qp: Weak<QpInner>,
        local_token: u64,
        rnr_us: u64,
    ) -> Arc<Conn> {
        let c = Arc::new(Conn {
            inline_max: self.inline_max,
            shared: Arc::downgrade(self),
            qp,
            local_token,
            remote_token: AtomicU64::new(0),
            sock: OnceLock::new(),
            parked: Mutex::new(None),
            tx: Mutex::new(Tx::default()),
            rx: Mutex::new(Rx {
                state: RxState::Header {
                    buf: [0; HEADER_LEN],
                    got: 0,
                },
                done_seq: 0,
                acked_seq: 0,
                dropping: false,
                scratch: Vec::new(),
            }),
            out: Mutex::new(VecDeque::new()),
            dead: AtomicBool::new(false),
            reason: Mutex::new(None),
            reported: AtomicBool::new(false),
            stalled: AtomicBool::new(false),
            drain_first: AtomicBool::new(false),
            peer_rnr_us: AtomicU64::new(0),
            my_rnr_us: rnr_us,
            attach_by: Mutex::new(None),
        });
        self.conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(local_token, c.clone());
        c
    }

    pub(crate) fn forget(&self, local_token: u64) {
        if let Some(c) = self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&local_token)
        {
            c.shutdown();
        }
    }

    /// The connection an epoll event names (events carry the local queue pair's token).
    fn by_token(&self, token: u64) -> Option<Arc<Conn>> {
        self.conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&token)
            .cloned()
    }

    fn run(self: Arc<Self>) {
        let mut events: Vec<epoll::Event> = Vec::with_capacity(64);
        let mut last_activity = Instant::now();
        let mut last_sweep = Instant::now();
        while !self.stop.load(Ordering::SeqCst) {
            events.clear();
            let spin = self.busy && last_activity.elapsed() < Duration::from_millis(50);
            let timeout = if spin {
                rustix::time::Timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                }
            } else {
                rustix::time::Timespec {
                    tv_sec: 0,
                    tv_nsec: 20_000_000,
                }
            };
            if epoll::wait(
                &self.epoll,
                rustix::buffer::spare_capacity(&mut events),
                Some(&timeout),
            )
            .is_err()
            {
                continue;
            }
            if !events.is_empty() {
                last_activity = Instant::now();
            } else if spin {
                // Busy-polling, but never at the expense of a runnable thread on this core (the
                // application spinning on memory, a peer process): with more spinners than cores
                // a pure spin would only run at scheduler ticks.
                std::thread::yield_now();
            }
            let mut recheck = false;
            for ev in &events {
                match ev.data.u64() {
                    LISTENER => self.accept_all(),
                    WAKE => {
                        let mut b = [0u8; 8];
                        let _ = rustix::io::read(&self.wake, &mut b);
                        recheck = true;
                    }
                    id => {
                        let Some(c) = self.by_token(id) else { continue };
                        let flags = ev.flags;
                        if flags.contains(epoll::EventFlags::OUT) {
                            c.flush_tx();
                        }
                        if flags.intersects(
                            epoll::EventFlags::IN | epoll::EventFlags::HUP | epoll::EventFlags::ERR,
                        ) {
                            c.on_readable();
                        }
                    }
                }
            }
            if recheck || last_sweep.elapsed() >= Duration::from_millis(20) {
                last_sweep = Instant::now();
                self.sweep();
            }
        }
    }

    /// Retries stalled receives, fails connections that never attached or stalled too long.
    fn sweep(&self) {
        let conns: Vec<Arc<Conn>> = self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        for c in conns {
            if c.dead.load(Ordering::Acquire) {
                c.drain_then_report();
                continue;
            }
            if c.sock.get().is_none() {
                let by = *c.attach_by.lock().unwrap_or_else(|e| e.into_inner());
                if by.is_some_and(|by| Instant::now() >= by) {
                    c.fail("the peer never connected within the queue pair's timeout");
                }
                continue;
            }
            if c.stalled.load(Ordering::Acquire) {
                c.on_readable();
            }
        }
    }

    fn accept_all(&self) {
        while let Ok((sock, from)) = self.listener.accept() {
            if let Err(why) = self.handshake(sock) {
                eprintln!("oxccl tcp: refused a connection from {from}: {why}");
            }
        }
    }

    fn handshake(&self, mut sock: TcpStream) -> std::result::Result<(), String> {
        sock.set_nonblocking(false).map_err(|e| e.to_string())?;
        sock.set_read_timeout(Some(Duration::from_secs(2)))
            .map_err(|e| e.to_string())?;
        let mut hello = [0u8; HELLO_LEN];
        sock.read_exact(&mut hello)
            .map_err(|e| format!("no hello: {e}"))?;
        let Some((target, initiator, rnr_us)) = frame::decode_hello(&hello) else {
            return Err("malformed hello".into());
        };
        let conn = self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&target)
            .cloned();
        let Some(conn) = conn.filter(|c| c.sock.get().is_none() && !c.dead.load(Ordering::Acquire))
        else {
            let _ = sock.write_all(&[0u8; 16]);
            return Err("no queue pair is waiting for this peer (wrong or stale token)".into());
        };
        let remote = conn.remote_token.load(Ordering::Acquire);
        if remote != 0 && remote != initiator {
            let _ = sock.write_all(&[0u8; 16]);
            return Err("the queue pair is connected to another peer".into());
        }
        let mut reply = [0u8; 16];
        reply[0..8].copy_from_slice(&1u64.to_le_bytes());
        reply[8..16].copy_from_slice(&conn.my_rnr_us.to_le_bytes());
        sock.write_all(&reply).map_err(|e| e.to_string())?;
        conn.peer_rnr_us.store(rnr_us, Ordering::Relaxed);
        if remote == 0 {
            // Arrived before our `to_rtr`: keep it until the peer is named.
            *conn.parked.lock().unwrap_or_else(|e| e.into_inner()) = Some((initiator, sock));
            if conn.remote_token.load(Ordering::Acquire) == initiator {
                conn.unpark();
            }
            return Ok(());
        }
        conn.attach(sock).map_err(|e| e.to_string())
    }
}

impl Conn {
    /// Names the peer (`to_rtr`): from now on the connection must come up within `timeout`.
    pub(crate) fn set_remote(&self, remote_token: u64, timeout: Duration) {
        *self.attach_by.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + timeout);
        self.remote_token.store(remote_token, Ordering::Release);
        self.unpark();
    }

    /// Attaches a connection that arrived before `to_rtr`, if it is from the named peer.
    fn unpark(&self) {
        let remote = self.remote_token.load(Ordering::Acquire);
        let parked = self.parked.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some((initiator, sock)) = parked
            && initiator == remote
            && let Err(e) = self.attach(sock)
        {
            self.fail(&format!("attaching the connection: {e}"));
        }
    }

    /// Connects actively to `addr` (the side with the smaller token connects).
    pub(crate) fn connect_to(&self, addr: SocketAddr, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut sock = loop {
            match TcpStream::connect_timeout(&addr, timeout.min(Duration::from_secs(5))) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(Error::os(format!("connecting to {addr}"), e)),
            }
        };
        let io = |e: std::io::Error| Error::os(format!("handshake with {addr}"), e);
        sock.set_read_timeout(Some(timeout.max(Duration::from_millis(100))))
            .map_err(io)?;
        sock.write_all(&frame::encode_hello(
            self.remote_token.load(Ordering::Acquire),
            self.local_token,
            self.my_rnr_us,
        ))
        .map_err(io)?;
        let mut reply = [0u8; 16];
        sock.read_exact(&mut reply).map_err(io)?;
        if u64::from_le_bytes(reply[0..8].try_into().unwrap_or_default()) != 1 {
            return Err(Error::arg(format!(
                "the peer at {addr} refused the connection: its queue pair is gone or not \
                 connecting to us"
            )));
        }
        self.peer_rnr_us.store(
            u64::from_le_bytes(reply[8..16].try_into().unwrap_or_default()),
            Ordering::Relaxed,
        );
        self.attach(sock)
    }

    fn attach(&self, sock: TcpStream) -> Result<()> {
        let io = |e: std::io::Error| Error::os("configuring the queue pair's socket", e);
        sock.set_nodelay(true).map_err(io)?;
        sock.set_read_timeout(None).map_err(io)?;
        sock.set_nonblocking(true).map_err(io)?;
        let timeout = self
            .qp
            .upgrade()
            .map(|q| q.timeout())
            .unwrap_or(Duration::from_secs(5));
        // A dead link (no FIN ever comes) is noticed within the queue pair's timeout.
        let _ = rustix::net::sockopt::set_socket_keepalive(&sock, true);
        let third = (timeout / 3).max(Duration::from_secs(1));
        let _ = rustix::net::sockopt::set_tcp_keepidle(&sock, third);
        let _ = rustix::net::sockopt::set_tcp_keepintvl(&sock, third / 2);
        let _ = rustix::net::sockopt::set_tcp_keepcnt(&sock, 2);
        let _ = rustix::net::sockopt::set_tcp_user_timeout(&sock, timeout.as_millis() as u32);
        let shared = self
            .shared
            .upgrade()
            .ok_or_else(|| Error::arg("context closed"))?;
        if self.sock.set(sock).is_err() {
            return Err(Error::arg("queue pair already connected"));
        }
        let sock = self.sock.get().expect("just set");
        let mut tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let flags = epoll::EventFlags::IN | epoll::EventFlags::OUT;
        epoll::add(
            &shared.epoll,
            sock,
            epoll::EventData::new_u64(self.local_token),
            flags,
        )
        .map_err(|e| Error::os("epoll add", e))?;
        tx.want_out = true;
        drop(tx);
        self.flush_tx();
        Ok(())
    }

    /// Closes the socket (the peer sees EOF) and stops polling it.
    pub(crate) fn shutdown(&self) {
        // Closed on purpose (the queue pair failed or is destroyed): nothing left to report.
        self.reported.store(true, Ordering::Release);
        self.dead.store(true, Ordering::Release);
        if let Some(s) = self.sock.get() {
            if let Some(sh) = self.shared.upgrade() {
                let _ = epoll::delete(&sh.epoll, s);
            }
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        let mut tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        tx.frames.clear();
    }

    /// Fails the connection from the progress thread (which holds no queue-pair lock).
    fn fail(&self, why: &str) {
        self.mark_failed(why);
        self.report();
    }

    /// Records why the connection failed; the queue pair learns it on its next progress call or
    /// the progress thread's next sweep (callers may hold queue-pair locks).
    fn mark_failed(&self, why: &str) {
        let mut reason = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        if reason.is_none() {
            *reason = Some(why.to_string());
        }
        drop(reason);
        self.dead.store(true, Ordering::Release);
        if let Some(sh) = self.shared.upgrade() {
            sh.kick();
        }
    }

    /// Moves the queue pair to ERR, once, with the recorded reason.
    pub(crate) fn report(&self) {
        if !self.dead.load(Ordering::Acquire)
            || self.drain_first.load(Ordering::Acquire)
            || self.reported.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let why = self
            .reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_else(|| "connection closed".into());
        if let Some(qp) = self.qp.upgrade() {
            qp.connection_failed(&why);
        }
        self.shutdown();
    }

    fn set_out_interest(&self, tx: &mut Tx, want: bool) {
        if tx.want_out == want {
            return;
        }
        if let (Some(s), Some(sh)) = (self.sock.get(), self.shared.upgrade()) {
            let mut flags = epoll::EventFlags::IN;
            if want {
                flags |= epoll::EventFlags::OUT;
            }
            if !self.stalled.load(Ordering::Acquire) || want {
                let _ = epoll::modify(
                    &sh.epoll,
                    s,
                    epoll::EventData::new_u64(self.local_token),
                    flags,
                );
            }
        }
        tx.want_out = want;
    }

    /// Writes queued frames until the socket would block.
    fn flush_tx(&self) {
        let mut tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let r = self.flush_locked(&mut tx);
        drop(tx);
        self.check(r);
    }

    /// Records a failed flush (callers may hold queue-pair locks, so the queue pair is failed
    /// later, by the progress thread or the next poll).
    fn check(&self, r: std::result::Result<(), String>) {
        if let Err(why) = r {
            // What the peer sent before it closed (its last messages: often why it closed)
            // is still in the socket: the progress thread delivers it first.
            self.drain_first.store(true, Ordering::Release);
            self.mark_failed(&why);
        }
    }

    fn flush_locked(&self, tx: &mut Tx) -> std::result::Result<(), String> {
        let Some(sock) = self.sock.get() else {
            return Ok(());
        };
        while let Some(f) = tx.frames.front_mut() {
            let total = f.total();
            // Gather the unsent part: header rest, then payload spans.
            let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(1 + f.payload.len());
            let mut skip = f.sent;
            if skip < HEADER_LEN {
                iov.push(IoSlice::new(&f.hdr[skip..]));
                skip = 0;
            } else {
                skip -= HEADER_LEN;
            }
            for s in &f.payload {
                if skip >= s.1 {
                    skip -= s.1;
                    continue;
                }
                // SAFETY: the span lies in a region kept alive by `f.keep` (or the target's
                // registered region); `skip < s.1`.
                iov.push(IoSlice::new(unsafe {
                    std::slice::from_raw_parts(s.0.add(skip), s.1 - skip)
                }));
                skip = 0;
            }
            let r = rustix::net::sendmsg(
                sock,
                &iov,
                &mut rustix::net::SendAncillaryBuffer::default(),
                SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
            );
            drop(iov);
            match r {
                Ok(n) => {
                    f.sent += n;
                    if f.sent >= total {
                        tx.frames.pop_front();
                    }
                }
                Err(rustix::io::Errno::AGAIN) => break,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    let what = tx.frames.front().map(TxFrame::describe).unwrap_or_default();
                    tx.frames.clear();
                    return Err(format!("sending to the peer failed: {e} ({what})"));
                }
            }
        }
        let want = !tx.frames.is_empty();
        self.set_out_interest(tx, want);
        Ok(())
    }

    fn queue(&self, f: TxFrame) {
        let mut tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let r = self.push_locked(&mut tx, f);
        drop(tx);
        self.check(r);
    }

    /// Appends a frame; writes it at once when nothing is queued before it, otherwise leaves it
    /// to the progress thread (which is asked to watch for room in the socket).
    fn push_locked(&self, tx: &mut Tx, f: TxFrame) -> std::result::Result<(), String> {
        let inline = tx.frames.is_empty() && f.total() <= self.inline_max;
        tx.frames.push_back(f);
        if inline {
            self.flush_locked(tx)
        } else {
            self.set_out_interest(tx, true);
            Ok(())
        }
    }

    /// Posts one send-queue request (the caller validated the QP state and local SGEs).
    pub(crate) fn post(
        &self,
        wr_id: u64,
        op: &WrOp,
        local: &[(Arc<MrInner>, *mut u8, usize)],
        signaled: bool,
        qp_failed: impl Fn() -> bool,
    ) -> Result<(), WcStatus> {
        let total: usize = local.iter().map(|l| l.2).sum();
        let keep: Vec<Arc<MrInner>> = local.iter().map(|l| l.0.clone()).collect();
        let spans: Vec<Span> = local.iter().map(|l| Span(l.1, l.2)).collect();
        let (opcode, mut h, payload, dst) = match *op {
            WrOp::Write { remote } | WrOp::WriteWithImm { remote, .. } => {
                let (code, imm) = match *op {
                    WrOp::WriteWithImm { imm, .. } => (Opcode::WriteImm, imm),
                    _ => (Opcode::Write, 0),
                };
                let mut h = Header::new(code, 0, total as u32);
                h.addr = remote.addr;
                h.rkey = remote.rkey;
                h.imm = imm;
                (WcOpcode::Write, h, spans, Vec::new())
            }
            WrOp::Send | WrOp::SendWithImm { .. } => {
                let (code, imm) = match *op {
                    WrOp::SendWithImm { imm } => (Opcode::SendImm, imm),
                    _ => (Opcode::Send, 0),
                };
                let mut h = Header::new(code, 0, total as u32);
                h.imm = imm;
                (WcOpcode::Send, h, spans, Vec::new())
            }
            WrOp::Read { remote } => {
                let mut h = Header::new(Opcode::ReadReq, 0, total as u32);
                h.addr = remote.addr;
                h.rkey = remote.rkey;
                (WcOpcode::Read, h, Vec::new(), spans)
            }
            WrOp::CompareSwap {
                remote,
                compare,
                swap,
            } => {
                let mut h = Header::new(Opcode::Cas, 0, 8);
                h.addr = remote.addr;
                h.rkey = remote.rkey;
                h.a = compare;
                h.b = swap;
                (WcOpcode::CompareSwap, h, Vec::new(), spans)
            }
            WrOp::FetchAdd { remote, add } => {
                let mut h = Header::new(Opcode::Faa, 0, 8);
                h.addr = remote.addr;
                h.rkey = remote.rkey;
                h.a = add;
                (WcOpcode::FetchAdd, h, Vec::new(), spans)
            }
        };
        // Sequence assignment and queueing happen under the transmit lock so frames go out in
        // sequence order; the outstanding entry exists before any answer can arrive.
        let mut tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        if tx.flushed {
            // The queue pair failed and flushed: this one completes (flushed) after those.
            return Err(WcStatus::WorkRequestFlushed);
        }
        if qp_failed() || self.dead.load(Ordering::Acquire) {
            // Failing right now (or about to be told the peer is gone): never sent; the flush
            // that is on its way completes it in order.
            drop(tx);
            return if self.post_flushed(wr_id, opcode) {
                Ok(())
            } else {
                Err(WcStatus::WorkRequestFlushed)
            };
        }
        tx.next_seq += 1;
        h.seq = tx.next_seq;
        self.out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(Outstanding {
                seq: h.seq,
                wr_id,
                opcode,
                len: total as u32,
                signaled,
                dst,
                _keep: keep.clone(),
                error: None,
            });
        let frame = TxFrame {
            hdr: h.encode(),
            payload,
            keep,
            owned: Vec::new(),
            sent: 0,
        };
        let r = self.push_locked(&mut tx, frame);
        drop(tx);
        self.check(r);
        Ok(())
    }

    /// A receive was posted: if the connection waits for one, let the progress thread retry.
    pub(crate) fn receive_posted(&self) {
        if self.stalled.load(Ordering::Acquire)
            && let Some(sh) = self.shared.upgrade()
        {
            sh.kick();
        }
    }

    /// Completes every outstanding request, oldest first (the queue pair failed), and stops
    /// sending. Runs under the transmit lock, so a request being posted concurrently completes
    /// (flushed) after these, keeping completions in order.
    pub(crate) fn flush_outstanding(
        &self,
        mut status_of: impl FnMut() -> WcStatus,
        mut complete: impl FnMut(u64, WcOpcode, WcStatus),
    ) {
        let mut tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        tx.flushed = true;
        // Frames not yet started are never sent; one half-sent stays to keep the stream framed,
        // with its own copy of what it has left to send.
        tx.frames.retain(|f| f.sent > 0 && f.sent < f.total());
        tx.frames.iter_mut().for_each(TxFrame::detach);
        let drained: Vec<Outstanding> = self
            .out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect();
        for o in drained {
            // A request that failed locally keeps its own status.
            let status = match o.error {
                Some(e) if e != WcStatus::WorkRequestFlushed => e,
                _ => status_of(),
            };
            complete(o.wr_id, o.opcode, status);
        }
        drop(tx);
    }

    /// Gives every frame still queued its own copy of its payload ([`TxFrame::detach`]).
    fn detach_queued(&self) {
        let mut tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        tx.frames.iter_mut().for_each(TxFrame::detach);
    }

    /// Completes outstanding requests up to `seq` (inclusive) as successful.
    fn complete_upto(&self, qp: &QpInner, seq: u64) {
        let mut done = Vec::new();
        {
            let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
            while out
                .front()
                .is_some_and(|o| o.seq <= seq && o.error.is_none())
            {
                done.push(out.pop_front().expect("front"));
            }
        }
        for o in done {
            qp.complete_send(o.wr_id, o.opcode, WcStatus::Success, o.len, o.signaled);
        }
        self.complete_local_failures(qp);
    }

    /// Completes the locally failed request at the front, if every earlier one has completed; the
    /// queue pair then fails and flushes the rest.
    fn complete_local_failures(&self, qp: &QpInner) {
        let failed = {
            let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
            if out.front().is_some_and(|o| o.error.is_some()) {
                out.pop_front()
            } else {
                None
            }
        };
        if let Some(o) = failed {
            let status = o.error.unwrap_or(WcStatus::WorkRequestFlushed);
            qp.complete_send(o.wr_id, o.opcode, status, 0, true);
            qp.request_failed();
        }
    }

    /// A request failed before it could be sent (a local error). With requests still in flight
    /// it queues behind them (returns true); otherwise the caller fails the queue pair now.
    pub(crate) fn post_failed(&self, wr_id: u64, opcode: WcOpcode, status: WcStatus) -> bool {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        if tx.flushed || out.is_empty() || self.dead.load(Ordering::Acquire) {
            return false;
        }
        // Requests posted after it are never sent either: they are flushed when it completes.
        let status = if out.iter().any(|o| o.error.is_some()) {
            WcStatus::WorkRequestFlushed
        } else {
            status
        };
        out.push_back(Outstanding::unsent(tx.next_seq, wr_id, opcode, status));
        true
    }

    /// Queues a request of a failed queue pair to complete as flushed once the flush under way
    /// reaches it; false when the flush already happened (the caller completes it now).
    pub(crate) fn post_flushed(&self, wr_id: u64, opcode: WcOpcode) -> bool {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        if tx.flushed {
            return false;
        }
        self.out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(Outstanding::unsent(
                tx.next_seq,
                wr_id,
                opcode,
                WcStatus::WorkRequestFlushed,
            ));
        true
    }

    /// Whether a locally failed request is waiting for earlier ones (later posts queue too).
    pub(crate) fn failing(&self) -> bool {
        self.out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|o| o.error.is_some())
    }

    /// Reads and executes frames until the socket would block.
    fn on_readable(&self) {
        if self.dead.load(Ordering::Acquire) {
            return;
        }
        self.read_frames();
    }

    /// On the progress thread, after a failed send: executes the frames the peer sent before
    /// the connection broke, then fails the queue pair.
    fn drain_then_report(&self) {
        if self.drain_first.swap(false, Ordering::AcqRel) {
            self.read_frames();
        }
        self.report();
    }

    /// Reads and executes frames until the socket would block, fails or closes.
    fn read_frames(&self) {
        let Some(qp) = self.qp.upgrade() else {
            return;
        };
        let Some(sock) = self.sock.get() else { return };
        let mut rx = self.rx.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let state = std::mem::replace(&mut rx.state, RxState::Discard { left: 0 });
            match state {
                RxState::Header { mut buf, mut got } => {
                    match read_some(sock, &mut buf[got..]) {
                        Ok(0) => {
                            drop(rx);
                            self.fail("the peer closed the connection (process exited or queue pair destroyed)");
                            return;
                        }
                        Ok(n) => got += n,
                        Err(rustix::io::Errno::AGAIN) => {
                            rx.state = RxState::Header { buf, got };
                            break;
                        }
                        Err(rustix::io::Errno::INTR) => {
                            rx.state = RxState::Header { buf, got };
                            continue;
                        }
                        Err(e) => {
                            drop(rx);
                            self.fail(&format!("receiving from the peer failed: {e}"));
                            return;
                        }
                    }
                    if got < HEADER_LEN {
                        rx.state = RxState::Header { buf, got };
                        continue;
                    }
                    match Header::decode(&buf) {
                        Ok(h) => {
                            if let Err(why) = self.begin(&qp, &mut rx, h) {
                                drop(rx);
                                self.fail(&why);
                                return;
                            }
                        }
                        Err(e) => {
                            drop(rx);
                            self.fail(&format!("malformed frame from the peer: {e}"));
                            return;
                        }
                    }
                }
                RxState::Stalled { hdr, since } => {
                    let budget = self.peer_rnr_us.load(Ordering::Relaxed);
                    if qp.recv_available() {
                        self.set_stalled(false);
                        if let Err(why) = self.begin(&qp, &mut rx, hdr) {
                            drop(rx);
                            self.fail(&why);
                            return;
                        }
                    } else if budget != 0 && since.elapsed() >= Duration::from_micros(budget) {
                        self.set_stalled(false);
                        self.nak(&mut rx, hdr.seq, WcStatus::RnrRetryExceeded);
                        rx.state = RxState::Discard {
                            left: hdr.payload_len(),
                        };
                    } else {
                        rx.state = RxState::Stalled { hdr, since };
                        self.set_stalled(true);
                        break;
                    }
                }
                RxState::Payload {
                    dst,
                    mut got,
                    total,
                    then,
                    seq,
                    _keep,
                } => {
                    if got < total {
                        match read_spans(sock, &dst, got, total) {
                            Ok(0) => {
                                drop(rx);
                                self.fail("the peer closed the connection mid-frame");
                                return;
                            }
                            Ok(n) => got += n,
                            Err(rustix::io::Errno::AGAIN) => {
                                rx.state = RxState::Payload {
                                    dst,
                                    got,
                                    total,
                                    then,
                                    seq,
                                    _keep,
                                };
                                break;
                            }
                            Err(rustix::io::Errno::INTR) => {}
                            Err(e) => {
                                drop(rx);
                                self.fail(&format!("receiving from the peer failed: {e}"));
                                return;
                            }
                        }
                    }
                    if got < total {
                        rx.state = RxState::Payload {
                            dst,
                            got,
                            total,
                            then,
                            seq,
                            _keep,
                        };
                        continue;
                    }
                    if let Some(seq) = seq {
                        rx.done_seq = seq;
                    }
                    self.finish(&qp, &mut rx, then, total);
                    rx.state = RxState::Header {
                        buf: [0; HEADER_LEN],
                        got: 0,
                    };
                }
                RxState::Discard { left } => {
                    if left == 0 {
                        rx.state = RxState::Header {
                            buf: [0; HEADER_LEN],
                            got: 0,
                        };
                        continue;
                    }
                    if rx.scratch.len() < SCRATCH {
                        rx.scratch.resize(SCRATCH, 0);
                    }
                    let k = left.min(SCRATCH);
                    let mut scratch = std::mem::take(&mut rx.scratch);
                    let r = read_some(sock, &mut scratch[..k]);
                    rx.scratch = scratch;
                    match r {
                        Ok(0) => {
                            drop(rx);
                            self.fail("the peer closed the connection mid-frame");
                            return;
                        }
                        Ok(n) => rx.state = RxState::Discard { left: left - n },
                        Err(rustix::io::Errno::AGAIN) => {
                            rx.state = RxState::Discard { left };
                            break;
                        }
                        Err(rustix::io::Errno::INTR) => rx.state = RxState::Discard { left },
                        Err(e) => {
                            drop(rx);
                            self.fail(&format!("receiving from the peer failed: {e}"));
                            return;
                        }
                    }
                }
            }
        }
        // Drained: acknowledge what was executed.
        if rx.done_seq > rx.acked_seq {
            let h = Header::new(Opcode::Ack, rx.done_seq, 0);
            rx.acked_seq = rx.done_seq;
            self.queue(TxFrame::header(h.encode()));
        }
    }

    fn set_stalled(&self, on: bool) {
        if self.stalled.swap(on, Ordering::AcqRel) == on {
            return;
        }
        // While stalled, stop polling for input (level-triggered IN would spin).
        if let (Some(s), Some(sh)) = (self.sock.get(), self.shared.upgrade()) {
            let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
            let mut flags = if on {
                epoll::EventFlags::empty()
            } else {
                epoll::EventFlags::IN
            };
            if tx.want_out {
                flags |= epoll::EventFlags::OUT;
            }
            let _ = epoll::modify(
                &sh.epoll,
                s,
                epoll::EventData::new_u64(self.local_token),
                flags,
            );
        }
    }

    fn nak(&self, rx: &mut Rx, seq: u64, status: WcStatus) {
        let mut h = Header::new(Opcode::Nak, seq, 0);
        h.a = status as u64;
        rx.dropping = true;
        rx.acked_seq = seq;
        self.queue(TxFrame::header(h.encode()));
    }

    /// Looks up a target region for a request and checks access and bounds.
    fn target(&self, h: &Header, len: usize, need: AccessFlags) -> Option<(Arc<MrInner>, *mut u8)> {
        let shared = self.shared.upgrade()?;
        let mr = shared
            .regions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key_index(h.rkey))
            .and_then(Weak::upgrade)?;
        if mr.rkey != h.rkey || !mr.is_registered() || !mr.access.contains(need) {
            return None;
        }
        let off = h.addr.checked_sub(mr.addr)?;
        if off.checked_add(len as u64)? > mr.len as u64 {
            return None;
        }
        let p = (mr.addr + off) as usize as *mut u8;
        Some((mr, p))
    }

    /// Starts executing a frame whose header just arrived.
    fn begin(&self, qp: &QpInner, rx: &mut Rx, h: Header) -> std::result::Result<(), String> {
        let header_next = RxState::Header {
            buf: [0; HEADER_LEN],
            got: 0,
        };
        if h.opcode.is_request() {
            if rx.dropping {
                rx.state = RxState::Discard {
                    left: h.payload_len(),
                };
                return Ok(());
            }
            if h.seq != rx.done_seq + 1 {
                return Err(format!(
                    "request sequence {} out of order (expected {})",
                    h.seq,
                    rx.done_seq + 1
                ));
            }
        }
        match h.opcode {
            Opcode::Write | Opcode::WriteImm => {
                let Some((mr, p)) = self.target(&h, h.len as usize, AccessFlags::REMOTE_WRITE)
                else {
                    self.nak(rx, h.seq, WcStatus::RemoteAccessError);
                    rx.state = RxState::Discard {
                        left: h.payload_len(),
                    };
                    return Ok(());
                };
                let then = if h.opcode == Opcode::WriteImm {
                    let Some(slot) = qp.claim_recv() else {
                        rx.state = RxState::Stalled {
                            hdr: h,
                            since: Instant::now(),
                        };
                        return Ok(());
                    };
                    After::Recv {
                        slot,
                        opcode: WcOpcode::RecvRdmaWithImm,
                        imm: Some(h.imm),
                    }
                } else {
                    After::Nothing
                };
                rx.state = RxState::Payload {
                    dst: vec![Span(p, h.len as usize)],
                    got: 0,
                    total: h.len as usize,
                    then,
                    seq: Some(h.seq),
                    _keep: vec![mr],
                };
            }
            Opcode::Send | Opcode::SendImm => {
                let Some(slot) = qp.claim_recv() else {
                    rx.state = RxState::Stalled {
                        hdr: h,
                        since: Instant::now(),
                    };
                    return Ok(());
                };
                let imm = (h.opcode == Opcode::SendImm).then_some(h.imm);
                match qp.recv_spans(slot) {
                    Err(st) => {
                        qp.complete_recv(slot, st, WcOpcode::Recv, h.len, imm);
                        let sender = if st == WcStatus::LocalLengthError {
                            WcStatus::RemoteInvalidRequest
                        } else {
                            WcStatus::RemoteOperationError
                        };
                        self.nak(rx, h.seq, sender);
                        rx.state = RxState::Discard {
                            left: h.payload_len(),
                        };
                    }
                    Ok((spans, keep, room)) => {
                        if h.len as usize > room {
                            qp.complete_recv(
                                slot,
                                WcStatus::LocalLengthError,
                                WcOpcode::Recv,
                                h.len,
                                imm,
                            );
                            self.nak(rx, h.seq, WcStatus::RemoteInvalidRequest);
                            rx.state = RxState::Discard {
                                left: h.payload_len(),
                            };
                            return Ok(());
                        }
                        rx.state = RxState::Payload {
                            dst: spans,
                            got: 0,
                            total: h.len as usize,
                            then: After::Recv {
                                slot,
                                opcode: WcOpcode::Recv,
                                imm,
                            },
                            seq: Some(h.seq),
                            _keep: keep,
                        };
                    }
                }
            }
            Opcode::ReadReq => {
                let Some((mr, p)) = self.target(&h, h.len as usize, AccessFlags::REMOTE_READ)
                else {
                    self.nak(rx, h.seq, WcStatus::RemoteAccessError);
                    rx.state = header_next;
                    return Ok(());
                };
                rx.done_seq = h.seq;
                rx.acked_seq = h.seq;
                self.queue(TxFrame {
                    hdr: Header::new(Opcode::ReadResp, h.seq, h.len).encode(),
                    payload: vec![Span(p, h.len as usize)],
                    keep: vec![mr],
                    owned: Vec::new(),
                    sent: 0,
                });
                rx.state = header_next;
            }
            Opcode::Cas | Opcode::Faa => {
                if !h.addr.is_multiple_of(8) {
                    self.nak(rx, h.seq, WcStatus::RemoteInvalidRequest);
                    rx.state = header_next;
                    return Ok(());
                }
                let Some((_mr, p)) = self.target(&h, 8, AccessFlags::REMOTE_ATOMIC) else {
                    self.nak(rx, h.seq, WcStatus::RemoteAccessError);
                    rx.state = header_next;
                    return Ok(());
                };
                // SAFETY: `p` is 8-byte aligned (region bases are, the address is checked) and
                // inside a live registered region of this process (held by `_mr`).
                let word = unsafe { &*(p as *const std::sync::atomic::AtomicU64) };
                let old = if h.opcode == Opcode::Cas {
                    match word.compare_exchange(h.a, h.b, Ordering::SeqCst, Ordering::SeqCst) {
                        Ok(v) | Err(v) => v,
                    }
                } else {
                    word.fetch_add(h.a, Ordering::SeqCst)
                };
                rx.done_seq = h.seq;
                rx.acked_seq = h.seq;
                let mut r = Header::new(Opcode::AtomicResp, h.seq, 0);
                r.a = old;
                self.queue(TxFrame::header(r.encode()));
                rx.state = header_next;
            }
            _ if !h.opcode.is_request() && qp.is_failed() => {
                // Our queue pair failed and flushed its requests: late answers are dropped.
                rx.state = RxState::Discard {
                    left: h.payload_len(),
                };
            }
            Opcode::Ack => {
                self.complete_upto(qp, h.seq);
                rx.state = header_next;
            }
            Opcode::Nak => {
                self.complete_upto(qp, h.seq.saturating_sub(1));
                let status =
                    WcStatus::from_u32(h.a as u32).unwrap_or(WcStatus::RemoteOperationError);
                let failed = {
                    let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
                    if out.front().is_some_and(|o| o.seq == h.seq) {
                        out.pop_front()
                    } else {
                        None
                    }
                };
                let Some(o) = failed else {
                    return Err(format!("NAK for request {} that is not outstanding", h.seq));
                };
                // The target NAKs on a request's header: its payload (and what follows it)
                // may still be on its way out, and once the failure is polled the caller may
                // free the buffers it is sent from.
                self.detach_queued();
                qp.complete_send(o.wr_id, o.opcode, status, 0, true);
                qp.request_failed();
                rx.state = header_next;
            }
            Opcode::ReadResp => {
                self.complete_upto(qp, h.seq.saturating_sub(1));
                let out = self.out.lock().unwrap_or_else(|e| e.into_inner());
                let Some(o) = out
                    .front()
                    .filter(|o| o.seq == h.seq && o.opcode == WcOpcode::Read)
                else {
                    return Err(format!(
                        "READ data for request {} that is not outstanding",
                        h.seq
                    ));
                };
                if o.len != h.len {
                    return Err(format!(
                        "READ data of {} bytes for a READ of {}",
                        h.len, o.len
                    ));
                }
                let dst = o.dst.clone();
                drop(out);
                rx.state = RxState::Payload {
                    dst,
                    got: 0,
                    total: h.len as usize,
                    then: After::ReadDone { seq: h.seq },
                    seq: None,
                    _keep: Vec::new(),
                };
            }
            Opcode::AtomicResp => {
                self.complete_upto(qp, h.seq.saturating_sub(1));
                let o = {
                    let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
                    if out.front().is_some_and(|o| {
                        o.seq == h.seq
                            && matches!(o.opcode, WcOpcode::CompareSwap | WcOpcode::FetchAdd)
                    }) {
                        out.pop_front()
                    } else {
                        None
                    }
                };
                let Some(o) = o else {
                    return Err(format!(
                        "atomic result for request {} that is not outstanding",
                        h.seq
                    ));
                };
                if let Some(d) = o.dst.first().filter(|d| d.1 == 8) {
                    let bytes = h.a.to_ne_bytes();
                    // SAFETY: the 8-byte local SGE was validated at post time and is kept alive
                    // by `o._keep`.
                    unsafe { crate::segment::copy_bytes(bytes.as_ptr(), d.0, 8) };
                }
                qp.complete_send(o.wr_id, o.opcode, WcStatus::Success, 8, o.signaled);
                self.complete_local_failures(qp);
                rx.state = header_next;
            }
        }
        Ok(())
    }

    fn finish(&self, qp: &QpInner, _rx: &mut Rx, then: After, total: usize) {
        match then {
            After::Nothing => {}
            After::Recv { slot, opcode, imm } => {
                qp.complete_recv(slot, WcStatus::Success, opcode, total as u32, imm);
            }
            After::ReadDone { seq } => {
                let o = {
                    let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
                    if out.front().is_some_and(|o| o.seq == seq) {
                        out.pop_front()
                    } else {
                        None
                    }
                };
                if let Some(o) = o {
                    qp.complete_send(o.wr_id, o.opcode, WcStatus::Success, o.len, o.signaled);
                }
                self.complete_local_failures(qp);
            }
        }
    }
}

fn read_some(sock: &TcpStream, buf: &mut [u8]) -> std::result::Result<usize, rustix::io::Errno> {
    rustix::net::recv(sock, buf, rustix::net::RecvFlags::DONTWAIT).map(|(n, _)| n)
}

/// Receives the rest of a `total`-byte payload into the spans, skipping the `got` bytes already
/// received; never reads past the payload (the spans may have more room than it needs).
fn read_spans(
    sock: &TcpStream,
    dst: &[Span],
    got: usize,
    total: usize,
) -> std::result::Result<usize, rustix::io::Errno> {
    let mut skip = got;
    let mut want = total - got;
    let mut iov: Vec<IoSliceMut<'_>> = Vec::with_capacity(dst.len().min(MAX_SGE + 1));
    for s in dst {
        if want == 0 {
            break;
        }
        if skip >= s.1 {
            skip -= s.1;
            continue;
        }
        let k = (s.1 - skip).min(want);
        // SAFETY: each span is a validated range of a live registered region (kept alive by the
        // frame state that owns `dst`); `skip + k <= s.1`.
        iov.push(IoSliceMut::new(unsafe {
            std::slice::from_raw_parts_mut(s.0.add(skip), k)
        }));
        want -= k;
        skip = 0;
    }
    rustix::net::recvmsg(
        sock,
        &mut iov,
        &mut rustix::net::RecvAncillaryBuffer::default(),
        rustix::net::RecvFlags::DONTWAIT,
    )
    .map(|r| r.bytes)
}

/// The listener address a tcp endpoint advertises.
pub(crate) fn advertised(shared: &Shared) -> String {
    shared.addr.to_string()
}
