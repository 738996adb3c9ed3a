//! The segment handshake: an authenticated TCP side channel between engines.
//!
//! Every engine listens on its handshake address. A peer connects, and both prove the job secret
//! ([`oxccl_bootstrap::handshake`]: HMAC-SHA256 challenge-response in both directions, as the
//! bootstrap store does), so a stranger learns neither a descriptor nor a queue pair. Then the
//! peer asks, one message at a time: the segment's descriptor, queue pairs connected to its
//! own, or a call to a service the owner registered (the block store's lookups). Messages are
//! JSON, each after a 4-byte little-endian length, carried in [`oxccl_seal`] records
//! (AES-256-GCM, keys of this connection from the job secret and both sides' fresh nonces):
//! a stranger on the path reads no descriptor, rkey, endpoint or service payload, and a
//! changed, replayed, dropped or reordered record ends the connection with an error naming the
//! peer and the record (the side that caught it tells the other why, then closes; the
//! client's next request connects afresh).

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use oxccl_bootstrap::handshake::{self as proof, Labels};
use oxccl_bootstrap::{Secret, frame};
use oxccl_seal::{Role, SealedStream};
use oxccl_verbs::QpEndpoint;
use serde::{Deserialize, Serialize};

use crate::desc::SegmentDesc;
use crate::error::{Error, Result};

/// Largest handshake message accepted (a descriptor with many buffers, a service's reply).
pub(crate) const MAX_MSG: usize = 16 << 20;

/// How long a peer may take to prove the secret.
const AUTH_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections not yet authenticated, at most: more are closed at once.
const MAX_UNAUTHENTICATED: usize = 64;

const LABELS: Labels = Labels::new(
    "oxccl-kv v1 handshake client",
    "oxccl-kv v1 handshake server",
);

/// One message after the handshake ([`oxccl_bootstrap::handshake`]'s messages come first).
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub(crate) enum Msg {
    /// Client: the segment's descriptor, please.
    GetDesc,
    /// Server: the descriptor.
    Desc { desc: SegmentDesc },
    /// Client: connect queue pairs of `provider` to these (one per opened segment: its lanes
    /// are the connections of that queue pair).
    Connect {
        provider: String,
        endpoints: Vec<QpEndpoint>,
        /// Whether the client seals the queue pairs' connections (its `OXCCL_ENCRYPT` for
        /// this peer); the server refuses when it wants otherwise. Absent (an older
        /// client): in clear.
        #[serde(default)]
        encrypt: bool,
    },
    /// Server: its queue pairs, connected, in the same order, and the label of the rkeys
    /// each one's context registered (a descriptor's `rkeys` names).
    Connected {
        endpoints: Vec<QpEndpoint>,
        keys: Vec<String>,
    },
    /// Client: a call to the service registered under `service`.
    Call { service: String, body: Vec<u8> },
    /// Server: the service's answer.
    Reply { body: Vec<u8> },
    /// Server: the request failed.
    Failed { reason: String },
}

/// The handshake connection after the proof: every message in records sealed with keys of
/// this connection (derived from the job secret, both sides' fresh nonces and what they said
/// in the proof), so a stranger on the path reads nothing and changes, replays, drops or
/// reorders nothing unnoticed.
pub(crate) type Wire = SealedStream<TcpStream>;

/// Writes one message (sealed, and sent at once).
pub(crate) fn send(s: &mut Wire, m: &Msg) -> std::io::Result<()> {
    frame::send_json(s, m)?;
    s.flush()
}

/// Reads one message (at most [`MAX_MSG`] bytes).
pub(crate) fn recv(s: &mut Wire) -> std::io::Result<Msg> {
    frame::recv_json(s, MAX_MSG, "handshake message")
}

/// What the server does with an authenticated peer's requests.
pub(crate) trait Handler: Send + Sync + 'static {
    /// Answers one request from the peer that proved the name `peer` from address `addr`.
    fn handle(&self, peer: &str, addr: SocketAddr, msg: Msg) -> Msg;
}

/// Authenticated handshake connections per peer address, and their cap.
pub(crate) struct PeerConns {
    max: usize,
    open: std::sync::Mutex<std::collections::HashMap<IpAddr, usize>>,
}

impl PeerConns {
    /// At most `max` authenticated connections per peer address.
    pub fn new(max: usize) -> PeerConns {
        PeerConns {
            max,
            open: Default::default(),
        }
    }

    /// Counts one more connection from `ip`, or says why not.
    fn enter(&self, ip: IpAddr, name: &str) -> std::result::Result<(), String> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let n = open.entry(ip).or_insert(0);
        if *n >= self.max {
            return Err(format!(
                "peer {ip} (as {name:?}) refused: it has {n} handshake connections open here, \
                 the cap per peer address (EngineConfig::max_peer_conns, \
                 OXCCL_KV_MAX_PEER_CONNS)"
            ));
        }
        *n += 1;
        Ok(())
    }

    fn leave(&self, ip: IpAddr) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = open.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&ip);
            }
        }
    }
}

/// The listening side: a thread accepting connections, one thread per connection.
pub(crate) struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    /// Binds `addr` and serves `handler` to peers that prove `secret`; `name` is this engine's.
    pub fn start(
        addr: SocketAddr,
        name: String,
        secret: Secret,
        handler: Arc<dyn Handler>,
        timeout: Duration,
        conns: PeerConns,
    ) -> Result<Server> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| Error::io(format!("binding the handshake listener to {addr}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading the handshake listener's address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("setting the handshake listener non-blocking", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("oxccl-kv-handshake".into())
            .spawn(move || {
                accept_loop(
                    listener,
                    name,
                    secret,
                    handler,
                    timeout,
                    stop2,
                    Arc::new(conns),
                )
            })
            .map_err(|e| Error::io("spawning the handshake thread", e))?;
        Ok(Server {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// The address peers connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn accept_loop(
    listener: TcpListener,
    name: String,
    secret: Secret,
    handler: Arc<dyn Handler>,
    timeout: Duration,
    stop: Arc<AtomicBool>,
    conns: Arc<PeerConns>,
) {
    let pending = Arc::new(AtomicUsize::new(0));
    while !stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((s, peer)) => {
                if pending.fetch_add(1, Ordering::AcqRel) >= MAX_UNAUTHENTICATED {
                    pending.fetch_sub(1, Ordering::AcqRel);
                    tracing::debug!("oxccl-kv handshake: {peer} refused, too many unproven peers");
                    drop(s);
                    continue;
                }
                let (name, secret, handler, stop, pending, conns) = (
                    name.clone(),
                    secret.clone(),
                    handler.clone(),
                    stop.clone(),
                    pending.clone(),
                    conns.clone(),
                );
                let _ = std::thread::Builder::new()
                    .name("oxccl-kv-peer".into())
                    .spawn(move || {
                        let r = serve(
                            s, peer, &name, &secret, &*handler, timeout, &stop, &pending, &conns,
                        );
                        if let Err(e) = r {
                            tracing::debug!("oxccl-kv handshake with {peer}: {e}");
                        }
                    });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => {
                tracing::warn!("oxccl-kv handshake listener: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn serve(
    mut s: TcpStream,
    addr: SocketAddr,
    name: &str,
    secret: &Secret,
    handler: &dyn Handler,
    timeout: Duration,
    stop: &AtomicBool,
    pending: &AtomicUsize,
    conns: &PeerConns,
) -> std::io::Result<()> {
    // Counted as unproven until the proof is checked, whichever way this ends.
    struct Unproven<'a>(Option<&'a AtomicUsize>);
    impl Unproven<'_> {
        fn proven(&mut self) {
            if let Some(p) = self.0.take() {
                p.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
    impl Drop for Unproven<'_> {
        fn drop(&mut self) {
            self.proven();
        }
    }
    let mut unproven = Unproven(Some(pending));
    s.set_nonblocking(false)?;
    s.set_nodelay(true)?;
    let proven = proof::accept(
        &mut s,
        &LABELS,
        std::slice::from_ref(secret),
        name,
        AUTH_TIMEOUT.min(timeout),
    );
    let proven = proven.map_err(|e| {
        let kind = if e.is_auth() {
            std::io::ErrorKind::PermissionDenied
        } else {
            std::io::ErrorKind::InvalidData
        };
        std::io::Error::new(kind, e.to_string())
    })?;
    // From here on, every byte in records under this connection's keys.
    let session = proven.keying.session(&LABELS, secret, Role::Acceptor);
    let peer = proven.name;
    let mut s = SealedStream::new(s, session, format!("{addr} ({peer:?})"));
    s.get_ref().set_write_timeout(Some(timeout))?;
    unproven.proven();
    // Within the cap of connections per peer address, or refused: its first request is
    // answered with the reason (so that its error names the cap), then the connection closes.
    if let Err(reason) = conns.enter(addr.ip(), &peer) {
        tracing::warn!("oxccl-kv handshake: {reason}");
        s.get_ref()
            .set_read_timeout(Some(AUTH_TIMEOUT.min(timeout)))?;
        if recv(&mut s).is_ok() {
            send(&mut s, &Msg::Failed { reason })?;
        }
        return Ok(());
    }
    struct Counted<'a>(&'a PeerConns, IpAddr);
    impl Drop for Counted<'_> {
        fn drop(&mut self) {
            self.0.leave(self.1);
        }
    }
    let _counted = Counted(conns, addr.ip());
    // Authenticated: answer requests until the peer hangs up. Idle connections are kept, but
    // checked for the engine's shutdown once a second; a request that began is read with the
    // whole timeout (a timeout in the middle of a message would lose its place).
    loop {
        if stop.load(Ordering::Acquire) {
            return Ok(());
        }
        s.get_ref().set_read_timeout(Some(Duration::from_secs(1)))?;
        match s.get_ref().peek(&mut [0u8; 1]) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) =>
            {
                continue;
            }
            Err(e) => return Err(e),
        }
        s.get_ref().set_read_timeout(Some(timeout))?;
        let m = match recv(&mut s) {
            Ok(m) => m,
            // Hung up between messages (a connection that closes inside a record is an error
            // of the sealed stream, which names it).
            Err(e)
                if e.kind() == std::io::ErrorKind::UnexpectedEof
                    && !e.to_string().contains("sealed stream") =>
            {
                return Ok(());
            }
            Err(e) => {
                // A broken record (changed, replayed, dropped, reordered), a malformed message
                // or a timeout inside one: nothing more from this connection is trusted. The
                // peer is told why (its direction of the wire is intact), then it closes.
                if e.kind() == std::io::ErrorKind::InvalidData {
                    tracing::warn!("oxccl-kv handshake: {e}");
                }
                let reason = format!("engine {name:?} {CLOSING}: {e}");
                let _ = send(&mut s, &Msg::Failed { reason });
                linger(s.get_ref());
                return Err(e);
            }
        };
        let reply = handler.handle(&peer, addr, m);
        send(&mut s, &reply)?;
    }
}

/// Closes our side and reads what the peer still sends for up to a second, so that a reply
/// just written is not cut off by a reset (closing with unread bytes resets the connection).
fn linger(s: &TcpStream) {
    let _ = s.shutdown(std::net::Shutdown::Write);
    let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
    let end = std::time::Instant::now() + Duration::from_secs(1);
    let mut buf = [0u8; 4096];
    while std::time::Instant::now() < end {
        match (&mut &*s).read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return,
        }
    }
}

/// A TCP connection to `to`, leaving from `from` when given and possible (a source address
/// that cannot reach `to` falls back to the one the kernel picks).
fn open(to: SocketAddr, from: Option<IpAddr>, timeout: Duration) -> std::io::Result<TcpStream> {
    let Some(from) = from else {
        return TcpStream::connect_timeout(&to, timeout);
    };
    let bound = || -> std::io::Result<TcpStream> {
        let sock = socket2::Socket::new(
            socket2::Domain::for_address(to),
            socket2::Type::STREAM,
            Some(socket2::Protocol::TCP),
        )?;
        sock.bind(&SocketAddr::new(from, 0).into())?;
        sock.connect_timeout(&to.into(), timeout)?;
        Ok(sock.into())
    };
    match bound() {
        Err(e)
            if !matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::TimedOut
            ) =>
        {
            TcpStream::connect_timeout(&to, timeout)
        }
        r => r,
    }
}

/// An authenticated connection to a peer engine's handshake listener.
pub(crate) struct Client {
    stream: Wire,
    /// The peer's address, for messages.
    pub addr: String,
    /// What connects again: this engine's name, the secret, the timeout, the source address.
    redial: (String, Secret, Duration, Option<IpAddr>),
    /// The connection broke (a broken record, a closed or timed-out stream, or the peer closed
    /// it after telling why): the next call connects afresh.
    broken: bool,
}

/// What a server's last answer says before it closes a connection it no longer trusts.
const CLOSING: &str = "closed the handshake connection";

/// Why [`Client::dial`] failed: the error, and whether nobody listens there (connection
/// refused), which a lookup retries only briefly.
pub(crate) struct DialError {
    pub error: Error,
    pub refused: bool,
}

impl Client {
    /// Connects to `addr` and runs the mutual proof; `name` is this engine's. With `from`, the
    /// connection leaves from that IP (the engine's own address, which the peer counts its
    /// queue pairs and lanes by) when it can: a loopback source for a loopback peer, another
    /// for the others.
    pub fn connect(
        addr: &str,
        name: &str,
        secret: &Secret,
        timeout: Duration,
        from: Option<IpAddr>,
    ) -> Result<Client> {
        Client::dial(addr, name, secret, timeout, from).map_err(|e| e.error)
    }

    /// [`Client::connect`], saying whether the connection was refused.
    pub fn dial(
        addr: &str,
        name: &str,
        secret: &Secret,
        timeout: Duration,
        from: Option<IpAddr>,
    ) -> std::result::Result<Client, DialError> {
        let failed = |error: Error| DialError {
            error,
            refused: false,
        };
        let herr = |detail: String| Error::Handshake {
            peer: addr.to_string(),
            detail,
        };
        let sa: SocketAddr = addr
            .parse()
            .or_else(|_| {
                use std::net::ToSocketAddrs;
                addr.to_socket_addrs()
                    .ok()
                    .and_then(|mut a| a.next())
                    .ok_or(())
            })
            .map_err(|_| failed(herr("not an IP:port or host:port that resolves".into())))?;
        let from = from.filter(|f| {
            !f.is_unspecified()
                && f.is_loopback() == sa.ip().is_loopback()
                && f.is_ipv4() == sa.is_ipv4()
        });
        let mut s = open(sa, from, timeout).map_err(|e| DialError {
            refused: e.kind() == std::io::ErrorKind::ConnectionRefused,
            error: herr(format!("cannot connect: {e}")),
        })?;
        s.set_nodelay(true)
            .map_err(|e| failed(herr(e.to_string())))?;
        let connected =
            proof::connect_keyed(&mut s, &LABELS, secret, name, timeout).map_err(|e| {
                failed(match e {
                    e if e.is_auth() => Error::Auth {
                        peer: addr.to_string(),
                        detail: e.to_string(),
                    },
                    // The server closes on a client that did not prove the secret.
                    e if e.awaited() == Some("the server's proof") => Error::Auth {
                        peer: addr.to_string(),
                        detail: format!(
                            "the peer closed the handshake ({e}): the job secret is likely wrong"
                        ),
                    },
                    e => herr(e.to_string()),
                })
            })?;
        let session = connected.keying.session(&LABELS, secret, Role::Initiator);
        let server = connected.server;
        Ok(Client {
            stream: SealedStream::new(s, session, format!("{addr} ({server:?})")),
            addr: addr.to_string(),
            redial: (name.to_string(), secret.clone(), timeout, from),
            broken: false,
        })
    }

    /// The address of the peer's end of the connection.
    pub fn peer_ip(&self) -> Option<IpAddr> {
        self.stream.get_ref().peer_addr().ok().map(|a| a.ip())
    }

    /// Sends one request and reads its answer; a `Failed` answer becomes an error.
    /// A connection that broke before is replaced by a fresh one first (new keys; nothing of
    /// the old one is read again).
    pub fn call(&mut self, m: &Msg) -> Result<Msg> {
        if self.broken {
            let (name, secret, timeout, from) = self.redial.clone();
            *self = Client::connect(&self.addr, &name, &secret, timeout, from)?;
        }
        let peer = self.addr.clone();
        let herr = |detail: String| Error::Handshake { peer, detail };
        let answer = send(&mut self.stream, m)
            .map_err(|e| format!("sending a request: {e}"))
            .and_then(|()| recv(&mut self.stream).map_err(|e| format!("reading the answer: {e}")));
        match answer {
            Ok(Msg::Failed { reason }) => {
                self.broken = reason.contains(CLOSING);
                Err(herr(reason))
            }
            Ok(m) => Ok(m),
            Err(e) => {
                self.broken = true;
                Err(herr(e))
            }
        }
    }

    /// The peer's segment descriptor.
    pub fn get_desc(&mut self) -> Result<SegmentDesc> {
        match self.call(&Msg::GetDesc)? {
            Msg::Desc { desc } => Ok(desc),
            m => Err(Error::Handshake {
                peer: self.addr.clone(),
                detail: format!("expected a descriptor, got {m:?}"),
            }),
        }
    }
}
