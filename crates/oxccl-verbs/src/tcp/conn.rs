//! A queue pair's connections: setting them up, failing them, and the initiator's record of
//! the requests in flight.

use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use rustix::event::epoll;

use oxccl_seal::{JobKey, Session};

use super::frame::{self, Hello};
use super::rx::{Answers, Exec, Rx};
use super::tx::Tx;
use super::{LOST_DRAIN, Shared, read_reply, send_hello};
use crate::contract::QpInner;
use crate::contract::sendq::SendQueue;
use crate::model::{Error, Result};

/// One TCP connection of a queue pair.
pub(super) struct Sock {
    /// Its epoll key.
    pub key: u64,
    /// The progress shard whose epoll set watches it ([`Shared::shard_of`]).
    pub shard: usize,
    pub stream: OnceLock<TcpStream>,
    pub tx: Mutex<Tx>,
    pub rx: Mutex<Rx>,
    /// Input is not watched (the connection waits for a receive, or for another connection).
    pub stalled: AtomicBool,
    /// The peer's end of the stream was read, or the connection broke: nothing more comes.
    pub ended: AtomicBool,
}

/// An accepted connection waiting for `connect` to name its peer: its hello, epoll key, socket
/// and, when sealed, its keys.
type Parked = (Hello, u64, TcpStream, Option<Session>);

/// One queue pair's connections.
pub(crate) struct Conn {
    /// The context's settings (copied: read on every frame).
    pub(super) tuning: super::Tuning,
    pub(super) shared: Weak<Shared>,
    pub(super) qp: Weak<QpInner>,
    pub local_token: u64,
    /// The peer queue pair's token, once `connect` named it (0 before).
    remote_token: AtomicU64,
    /// The connections, made when `connect` names the peer (and so their number).
    socks: OnceLock<Box<[Sock]>>,
    /// How many of them are attached to a socket.
    attached: AtomicU32,
    /// Connections that arrived before `connect`: (hello, epoll key, socket, keys if sealed).
    parked: Mutex<Vec<Parked>>,
    /// The job key when the queue pair's connections are sealed ([`QpConfig::seal`]).
    ///
    /// [`QpConfig::seal`]: crate::QpConfig
    pub(super) seal: Option<JobKey>,
    /// Why the last connection from a peer not yet named was refused (said if the peer never
    /// connects).
    refusal: Mutex<Option<String>>,
    /// Our requests in flight.
    pub(super) sendq: SendQueue,
    pub(super) exec: Mutex<Exec>,
    /// What the target answered to our requests (the order they complete in).
    pub(super) answers: Mutex<Answers>,
    pub dead: AtomicBool,
    /// Why it died, for the queue pair's error detail.
    reason: Mutex<Option<String>>,
    /// Whether the queue pair was told.
    reported: AtomicBool,
    /// A send failed or a connection was lost (the peer closed or reset it): the driver reads
    /// what the peer sent before that, then fails the queue pair ([`Conn::drain_then_report`]).
    drain_first: AtomicBool,
    /// When the first such failure came.
    drain_since: OnceLock<Instant>,
    /// The peer's RNR budget (how long we may stall its SEND before NAKing it), µs; 0 = forever.
    pub(super) peer_rnr_us: AtomicU64,
    pub(super) my_rnr_us: u64,
    /// When the connections must be up (set by `connect`).
    attach_by: Mutex<Option<Instant>>,
    /// An ACK held back (the highest request executed; 0: none): the next frame to start on
    /// connection 0 carries it, or [`Conn::flush_ack`] sends it alone.
    pub(super) ack_out: AtomicU64,
    /// The context's flag that some connection holds back an ACK (`Shared::acks_due`), set
    /// without reaching the context through its weak reference.
    acks_due: Arc<AtomicBool>,
}

impl Conn {
    pub(super) fn new(
        shared: &Arc<Shared>,
        qp: Weak<QpInner>,
        local_token: u64,
        rnr: u64,
        seal: Option<JobKey>,
    ) -> Conn {
        Conn {
            tuning: shared.tuning,
            shared: Arc::downgrade(shared),
            qp,
            local_token,
            remote_token: AtomicU64::new(0),
            socks: OnceLock::new(),
            attached: AtomicU32::new(0),
            parked: Mutex::new(Vec::new()),
            seal,
            refusal: Mutex::new(None),
            sendq: SendQueue::default(),
            exec: Mutex::new(Exec::default()),
            answers: Mutex::new(Answers::default()),
            dead: AtomicBool::new(false),
            reason: Mutex::new(None),
            reported: AtomicBool::new(false),
            drain_first: AtomicBool::new(false),
            drain_since: OnceLock::new(),
            peer_rnr_us: AtomicU64::new(0),
            my_rnr_us: rnr,
            attach_by: Mutex::new(None),
            ack_out: AtomicU64::new(0),
            acks_due: shared.acks_due.clone(),
        }
    }

    /// The connections (none before `connect`).
    pub(super) fn socks(&self) -> &[Sock] {
        self.socks.get().map_or(&[], |s| &s[..])
    }

    /// The epoll keys of the connections.
    pub(super) fn keys(&self) -> Vec<u64> {
        self.socks().iter().map(|s| s.key).collect()
    }

    /// How many connections this side asks for.
    pub(super) fn wanted(&self) -> u32 {
        self.tuning.nsocks
    }

    /// Names the peer (`connect`) and makes `count` connections; from now on they must come up
    /// within `timeout`.
    pub(crate) fn set_remote(&self, remote_token: u64, count: u32, timeout: Duration) {
        let Some(sh) = self.shared.upgrade() else {
            return;
        };
        let socks: Box<[Sock]> = (0..count as usize)
            .map(|i| Sock {
                key: sh.key(),
                shard: sh.shard_of(i),
                stream: OnceLock::new(),
                tx: Mutex::new(Tx::default()),
                rx: Mutex::new(Rx::new()),
                stalled: AtomicBool::new(false),
                ended: AtomicBool::new(false),
            })
            .collect();
        let _ = self.socks.set(socks);
        *self.attach_by.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + timeout);
        self.remote_token.store(remote_token, Ordering::Release);
        self.unpark();
    }

    /// Whether an arriving connection may be ours: from the named peer (if named yet), a
    /// connection we do not have yet.
    pub(super) fn accepts(&self, h: &Hello) -> std::result::Result<(), String> {
        let remote = self.remote_token.load(Ordering::Acquire);
        if remote != 0 && remote != h.initiator {
            return Err("the queue pair is connected to another peer".into());
        }
        if let Some(s) = self.socks.get() {
            if s.len() != h.count as usize {
                return Err(format!(
                    "the peer opens {} connections, the queue pair has {}",
                    h.count,
                    s.len()
                ));
            }
            if s[h.index as usize].stream.get().is_some() {
                return Err(format!("connection {} is already up", h.index));
            }
        }
        Ok(())
    }

    /// An accepted connection said hello: attach it, or park it until `connect` names the peer.
    pub(super) fn arrived(
        self: &Arc<Self>,
        h: Hello,
        key: u64,
        sock: TcpStream,
        session: Option<Session>,
    ) {
        self.parked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((h, key, sock, session));
        if self.remote_token.load(Ordering::Acquire) != 0 {
            self.unpark();
        }
    }

    /// A connection from the peer `initiator` was refused for `why` (its sealing differs from
    /// ours): the queue pair fails at once when that is its named peer; otherwise the reason is
    /// kept for the error if the peer never connects.
    pub(super) fn refused(&self, initiator: u64, why: &str) {
        let why = format!("refused the peer's connection: {why}");
        if self.remote_token.load(Ordering::Acquire) == initiator {
            self.fail(&why);
        } else {
            *self.refusal.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
        }
    }

    /// Attaches the connections that arrived from the named peer.
    fn unpark(&self) {
        let remote = self.remote_token.load(Ordering::Acquire);
        let parked = std::mem::take(&mut *self.parked.lock().unwrap_or_else(|e| e.into_inner()));
        for (h, key, sock, session) in parked {
            let ok = h.initiator == remote && h.count as usize == self.socks().len();
            if !ok {
                if let Some(sh) = self.shared.upgrade() {
                    // Still in shard 0's set, where it said hello.
                    let _ = epoll::delete(&sh.shards[0].epoll, &sock);
                }
                continue;
            }
            // The acceptor confirms the keys on the initiator's first record.
            if let Err(e) = self.attach(h.index as usize, Some(key), sock, session, false) {
                self.fail(&format!("attaching connection {}: {e}", h.index));
            }
        }
    }

    /// Connects actively to `addr` (the side with the smaller token connects), every
    /// connection in turn.
    pub(crate) fn connect_to(
        &self,
        addr: SocketAddr,
        timeout: Duration,
        cancel: Option<&crate::Cancel>,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let count = self.socks().len() as u32;
        let attempt = if cancel.is_some() {
            Duration::from_secs(1)
        } else {
            Duration::from_secs(5)
        };
        for index in 0..count {
            let mut sock = loop {
                if cancel.is_some_and(crate::Cancel::is_cancelled) {
                    return Err(Error::arg(format!(
                        "connecting to {addr}: cancelled (connection {index} of {count})"
                    )));
                }
                match TcpStream::connect_timeout(&addr, timeout.min(attempt)) {
                    Ok(s) => break s,
                    Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => return Err(Error::os(format!("connecting to {addr}"), e)),
                }
            };
            sock.set_read_timeout(Some(timeout.max(Duration::from_millis(100))))
                .map_err(|e| Error::os(format!("handshake with {addr}"), e))?;
            let nonce = self
                .seal
                .as_ref()
                .map(|_| oxccl_seal::fresh_nonce())
                .transpose()
                .map_err(|e| {
                    Error::seal(
                        format!(
                            "handshake with {addr} (sealed connection {index} of {count}): \
                             drawing this side's nonce"
                        ),
                        e,
                    )
                })?;
            let hello = Hello {
                target: self.remote_token.load(Ordering::Acquire),
                initiator: self.local_token,
                rnr_us: self.my_rnr_us,
                index,
                count,
                nonce,
            };
            send_hello(&mut sock, addr, &hello)?;
            if let Some(c) = cancel {
                wait_reply(&sock, addr, deadline, c)?;
            }
            let (reply, reply_bytes) = read_reply(&mut sock, addr)?;
            self.peer_rnr_us.store(reply.rnr_us, Ordering::Relaxed);
            let session = match (&self.seal, nonce) {
                (Some(k), Some(ours)) => {
                    let Some(theirs) = reply.nonce else {
                        return Err(Error::arg(format!(
                            "the peer at {addr} accepted a sealed connection with a plain reply \
                             (connection {index})"
                        )));
                    };
                    let transcript = super::transcript(&frame::encode_hello(&hello), &reply_bytes);
                    let s = k.session(oxccl_seal::Role::Initiator, &ours, &theirs, &transcript);
                    Some(confirm_keys(&mut sock, addr, index, s)?)
                }
                _ if reply.nonce.is_some() => {
                    return Err(Error::arg(format!(
                        "the peer at {addr} answered a plain hello with a sealed reply \
                         (connection {index})"
                    )));
                }
                _ => None,
            };
            self.attach(index as usize, None, sock, session, true)?;
        }
        Ok(())
    }

    /// Makes `sock` connection `idx`: configures it and watches it (under `key` when epoll
    /// already has it: an accepted connection).
    ///
    /// A sealed connection (`session`) sends and receives records from now on; `confirmed`
    /// says whether the peer's key confirmation was already read (the initiator reads it in
    /// the handshake; the acceptor's first record must be it).
    fn attach(
        &self,
        idx: usize,
        key: Option<u64>,
        sock: TcpStream,
        session: Option<Session>,
        confirmed: bool,
    ) -> Result<()> {
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
        if let Some((cc, required)) = self
            .tuning
            .congestion
            .choose(sock.local_addr().ok(), sock.peer_addr().ok())
            && let Err(e) = rustix::net::sockopt::set_tcp_congestion(&sock, cc)
            && required
        {
            return Err(Error::os(
                format!(
                    "setting TCP congestion control {cc:?} on connection {idx} with {} \
                     (tcp_congestion; the kernel allows those in \
                     /proc/sys/net/ipv4/tcp_allowed_congestion_control)",
                    sock.peer_addr()
                        .map_or_else(|_| "an unknown address".to_string(), |a| a.to_string())
                ),
                e,
            ));
        }
        let shared = self
            .shared
            .upgrade()
            .ok_or_else(|| Error::arg("context closed"))?;
        let Some(s) = self.socks().get(idx) else {
            return Err(Error::arg(format!("no connection {idx}")));
        };
        let me = shared
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&self.local_token)
            .cloned()
            .ok_or_else(|| Error::arg("queue pair destroyed"))?;
        let peer = sock
            .peer_addr()
            .map_or_else(|_| "an unknown address".to_string(), |a| a.to_string());
        if s.stream.get().is_some() {
            return Err(Error::arg("queue pair already connected"));
        }
        if let Some(session) = session {
            let what = format!("sealed connection {idx} with {peer}");
            s.rx.lock()
                .unwrap_or_else(|e| e.into_inner())
                .seal(session.rx, confirmed, what);
            s.tx.lock()
                .unwrap_or_else(|e| e.into_inner())
                .seal(session.tx);
        }
        if s.stream.set(sock).is_err() {
            return Err(Error::arg("queue pair already connected"));
        }
        let sock = s.stream.get().expect("just set");
        shared.register_sock(s.key, &me, idx);
        let mut tx = s.tx.lock().unwrap_or_else(|e| e.into_inner());
        let data = epoll::EventData::new_u64(s.key);
        let flags = epoll::EventFlags::IN | epoll::EventFlags::OUT;
        let set = &shared.shards[s.shard].epoll;
        match key {
            // An accepted connection said hello in shard 0's set: it moves to its own shard's.
            Some(_) if s.shard == 0 => epoll::modify(set, sock, data, flags),
            Some(_) => epoll::delete(&shared.shards[0].epoll, sock)
                .and_then(|()| epoll::add(set, sock, data, flags)),
            None => epoll::add(set, sock, data, flags),
        }
        .map_err(|e| Error::os(format!("watching connection {idx} (epoll)"), e))?;
        tx.want_out = true;
        drop(tx);
        self.attached.fetch_add(1, Ordering::AcqRel);
        self.flush_tx(idx);
        Ok(())
    }

    /// Holds back an ACK of every request up to `seq`, for a frame going back to carry.
    pub(super) fn ack_later(&self, seq: u64) {
        self.ack_out.fetch_max(seq, Ordering::AcqRel);
        self.acks_due.store(true, Ordering::Release);
    }

    /// Sends the held-back ACK, if no frame took it.
    pub(super) fn flush_ack(&self) {
        let seq = self.ack_out.load(Ordering::Acquire);
        if seq != 0 && !self.dead.load(Ordering::Acquire) {
            // The frame's own stamp (in `flush_locked`) takes the held-back value.
            self.queue(
                0,
                super::tx::TxFrame::header(&super::frame::Header::new(
                    super::frame::Opcode::Ack,
                    seq,
                    0,
                )),
            );
        }
    }

    /// Whether every connection is attached.
    pub(super) fn is_up(&self) -> bool {
        let n = self.socks().len();
        n > 0 && self.attached.load(Ordering::Acquire) as usize == n
    }

    /// The queue pair is destroyed (not cut off): sends what it owes the peer before the
    /// sockets close, as a NIC's queue pair would have sent it by then. That is the ACK held
    /// back for a frame going back to carry (without it the peer's requests executed here
    /// would fail as if this side had died), and the frames already queued (requests posted
    /// without a completion, credits, notices). Waits at most `bound` in all for room in the
    /// sockets: a peer that stopped reading loses the rest, as it would on a NIC.
    pub(super) fn flush_before_close(&self, bound: Duration) {
        use rustix::event::{PollFd, PollFlags};
        if self.dead.load(Ordering::Acquire) {
            return;
        }
        let deadline = Instant::now() + bound;
        // A read pass under way (a progress thread's) may have landed what the application
        // saw, and not yet noted the ACK it makes due: it notes it before it lets go. (A pass
        // that a peer keeps busy is not waited for past the bound.)
        for s in self.socks() {
            while let Err(std::sync::TryLockError::WouldBlock) = s.rx.try_lock() {
                if Instant::now() >= deadline {
                    break;
                }
                std::thread::yield_now();
            }
        }
        #[cfg(test)]
        crate::contract::hooks::before_close_flush(
            self.socks().iter().filter_map(|s| s.stream.get()),
        );
        self.flush_ack();
        for (i, s) in self.socks().iter().enumerate() {
            let Some(sock) = s.stream.get() else { continue };
            loop {
                let mut tx = s.tx.lock().unwrap_or_else(|e| e.into_inner());
                let r = self.flush_locked(i, &mut tx);
                let idle = tx.is_idle();
                drop(tx);
                let left = deadline.saturating_duration_since(Instant::now());
                if r.is_err() || idle || left.is_zero() {
                    break;
                }
                // `left` is at most `bound`: it converts.
                let ts = rustix::time::Timespec::try_from(left).unwrap_or_default();
                let mut room = [PollFd::new(sock, PollFlags::OUT)];
                if rustix::event::poll(&mut room, Some(&ts))
                    .is_err_and(|e| e != rustix::io::Errno::INTR)
                {
                    break;
                }
            }
        }
    }

    /// Closes the sockets (the peer sees EOF) and stops polling them.
    pub(crate) fn shutdown(&self) {
        // Closed on purpose (the queue pair failed or is destroyed): nothing left to report.
        self.reported.store(true, Ordering::Release);
        self.dead.store(true, Ordering::Release);
        let sh = self.shared.upgrade();
        for s in self.socks() {
            if let Some(st) = s.stream.get() {
                if let Some(sh) = &sh {
                    let _ = epoll::delete(&sh.shards[s.shard].epoll, st);
                }
                let _ = st.shutdown(std::net::Shutdown::Both);
            }
            s.tx.lock()
                .unwrap_or_else(|e| e.into_inner())
                .frames
                .clear();
        }
        let parked = std::mem::take(&mut *self.parked.lock().unwrap_or_else(|e| e.into_inner()));
        for (_, _, st, _) in parked {
            if let Some(sh) = &sh {
                let _ = epoll::delete(&sh.shards[0].epoll, &st);
            }
        }
    }

    /// Fails the connection from the driver (which holds no queue-pair lock).
    pub(super) fn fail(&self, why: &str) {
        self.mark_failed(why);
        self.report();
    }

    /// Records why the connection failed; the queue pair learns it on its next progress call or
    /// the next sweep (callers may hold queue-pair locks).
    pub(super) fn mark_failed(&self, why: &str) {
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

    /// Connection `i`'s peer closed it, or it broke: the queue pair fails once what the peer
    /// sent before on its other connections is executed (the driver's sweep, kicked here). A
    /// peer that executed our last requests and closed at once has its ACK on connection 0
    /// while another connection's end may be read first.
    pub(super) fn lost(&self, i: usize, why: &str) {
        let Some(s) = self.socks().get(i) else { return };
        if s.ended.swap(true, Ordering::AcqRel) {
            return;
        }
        // Nothing more comes on it: stop watching it (its end would wake its driver on every
        // turn until the queue pair is failed).
        if let (Some(st), Some(sh)) = (s.stream.get(), self.shared.upgrade()) {
            let _ = epoll::delete(&sh.shards[s.shard].epoll, st);
        }
        if !self.dead.load(Ordering::Acquire) {
            self.start_drain();
        }
        self.mark_failed(why);
        self.report();
    }

    /// Whether the connection failed and what the peer sent before is still being read.
    pub(super) fn draining(&self) -> bool {
        self.drain_first.load(Ordering::Acquire)
    }

    /// Defers failing the queue pair until what the peer sent before is read.
    fn start_drain(&self) {
        self.drain_since.get_or_init(Instant::now);
        self.drain_first.store(true, Ordering::Release);
    }

    /// Records a failed send (callers may hold queue-pair locks, so the queue pair is failed
    /// later, by the driver or the next poll).
    pub(super) fn check(&self, r: std::result::Result<(), String>) {
        if let Err(why) = r {
            // What the peer sent before it closed (its last messages: often why it closed)
            // is still in the socket: the driver delivers it first.
            self.start_drain();
            self.mark_failed(&why);
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

    /// Sets what epoll watches on connection `i`: input unless it is stalled, output when
    /// `want_out`.
    pub(super) fn set_interest(&self, i: usize, want_out: bool) {
        let (Some(s), Some(sh)) = (self.socks().get(i), self.shared.upgrade()) else {
            return;
        };
        let Some(st) = s.stream.get() else { return };
        let mut flags = epoll::EventFlags::empty();
        if !s.stalled.load(Ordering::Acquire) {
            flags |= epoll::EventFlags::IN;
        }
        if want_out {
            flags |= epoll::EventFlags::OUT;
        }
        let _ = epoll::modify(
            &sh.shards[s.shard].epoll,
            st,
            epoll::EventData::new_u64(s.key),
            flags,
        );
    }

    /// Shard `shard`'s periodic sweep: fail a connection that never came up, deliver what a
    /// failed one still holds, retry the stalled connections the shard watches.
    pub(super) fn sweep(&self, shard: usize) {
        if self.dead.load(Ordering::Acquire) {
            self.drain_then_report();
            return;
        }
        if !self.is_up() {
            let by = *self.attach_by.lock().unwrap_or_else(|e| e.into_inner());
            if by.is_some_and(|by| Instant::now() >= by) {
                let refusal = self
                    .refusal
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take();
                self.fail(&match refusal {
                    Some(r) => format!(
                        "the peer never connected within the queue pair's timeout (this side {r})"
                    ),
                    None => "the peer never connected within the queue pair's timeout".into(),
                });
            }
            return;
        }
        for i in 0..self.socks().len() {
            let s = &self.socks()[i];
            if s.shard == shard && s.stalled.load(Ordering::Acquire) {
                self.on_readable(i);
            }
        }
    }

    /// After a failed send or a lost connection: executes the frames the peer sent before,
    /// then fails the queue pair. That is once every connection's end was read (the peer's
    /// last frames on one connection may arrive after its end of another: the ends need not
    /// come in the order it closed them), or [`LOST_DRAIN`] after the first failure.
    fn drain_then_report(&self) {
        if self.drain_first.load(Ordering::Acquire) {
            for (i, s) in self.socks().iter().enumerate() {
                if !s.ended.load(Ordering::Acquire) {
                    self.read_frames(i);
                }
            }
            let ended = self
                .socks()
                .iter()
                .all(|s| s.ended.load(Ordering::Acquire) || s.stream.get().is_none());
            let waited = self
                .drain_since
                .get()
                .is_none_or(|t| t.elapsed() >= LOST_DRAIN);
            if !ended && !waited {
                return;
            }
            self.drain_first.store(false, Ordering::Release);
        }
        self.report();
    }

    /// The queue pair failed: frames not yet started are never sent; one half-sent stays to
    /// keep the stream framed, with its own copy of what it has left to send.
    pub(super) fn drop_unsent(&self) {
        for s in self.socks() {
            let mut tx = s.tx.lock().unwrap_or_else(|e| e.into_inner());
            tx.frames.retain(|f| f.sent > 0 && f.sent < f.total());
            tx.frames.iter_mut().for_each(|f| f.detach());
        }
    }

    /// Gives every frame still queued its own copy of its payload.
    pub(super) fn detach_queued(&self) {
        for s in self.socks() {
            let mut tx = s.tx.lock().unwrap_or_else(|e| e.into_inner());
            tx.frames.iter_mut().for_each(|f| f.detach());
        }
    }
}

/// The initiator's key confirmation on a sealed connection (its socket still blocking, with
/// the handshake's read timeout): reads the acceptor's first record, which must open to
/// [`frame::FINISHED`] (a peer with another job key, or a hello or reply altered on the path,
/// fails here, at connect), then sends its own.
fn confirm_keys(
    sock: &mut TcpStream,
    addr: SocketAddr,
    index: u32,
    mut s: Session,
) -> Result<Session> {
    use std::io::{Read, Write};
    let io = |e: std::io::Error| {
        Error::os(
            format!("key confirmation with {addr} (sealed connection {index})"),
            e,
        )
    };
    let refused = |e: oxccl_seal::SealError| {
        Error::arg(format!(
            "key confirmation with the peer at {addr} failed (sealed connection {index}): {e}: \
             the peer has another job key, or the handshake was altered on the path"
        ))
    };
    let mut header = [0u8; oxccl_seal::HEADER_LEN];
    sock.read_exact(&mut header).map_err(io)?;
    let len = s.rx.check_header(&header).map_err(refused)?;
    let mut body = vec![0u8; len];
    sock.read_exact(&mut body).map_err(io)?;
    let plain = s.rx.open_record(&header, &mut body).map_err(refused)?;
    if plain != frame::FINISHED {
        return Err(Error::arg(format!(
            "key confirmation with the peer at {addr} failed (sealed connection {index}): its \
             first record is not the handshake's end"
        )));
    }
    let mut out = Vec::with_capacity(64);
    s.tx.seal(frame::FINISHED, &mut out).map_err(|e| {
        Error::seal(
            format!("key confirmation with {addr} (sealed connection {index}): sealing ours"),
            e,
        )
    })?;
    sock.write_all(&out).map_err(io)?;
    Ok(s)
}

/// Waits until the handshake's reply can be read, looking at `cancel` every 100 ms (a peer
/// that accepted but does not answer, e.g. a stopped process, would otherwise hold the
/// connect until its timeout). An error of the socket is left to the read that follows.
fn wait_reply(
    sock: &TcpStream,
    addr: SocketAddr,
    deadline: Instant,
    cancel: &crate::Cancel,
) -> Result<()> {
    let io = |e: std::io::Error| Error::os(format!("handshake with {addr}"), e);
    let before = sock.read_timeout().map_err(io)?;
    sock.set_read_timeout(Some(Duration::from_millis(100)))
        .map_err(io)?;
    let r = loop {
        match sock.peek(&mut [0u8; 1]) {
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                if cancel.is_cancelled() {
                    break Err(Error::arg(format!(
                        "handshake with {addr}: cancelled while waiting for its reply"
                    )));
                }
                if Instant::now() >= deadline {
                    break Err(io(std::io::ErrorKind::TimedOut.into()));
                }
            }
            _ => break Ok(()),
        }
    };
    sock.set_read_timeout(before).map_err(io)?;
    r
}
