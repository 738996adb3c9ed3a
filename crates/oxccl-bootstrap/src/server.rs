//! The store server: a [`MemoryStore`] served over TCP to authenticated clients.

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::error::{Error, Result};
use crate::handshake::STORE;
use crate::secret::{Secret, random_bytes};
use crate::store::{MemoryStore, StoreCaps, WaitFail};
use crate::wire::{
    DecodeError, MAX_FRAME_LEN, MAX_HANDSHAKE_FRAME_LEN, MAX_TEXT_LEN, Msg, PROTOCOL_VERSION,
    ReadError, encode, read_msg, write_msg,
};
use oxccl_seal::{JobKey, NONCE_LEN as SEAL_NONCE_LEN, Role, SealedStream, Session};

/// The purpose the store's record keys are derived for ([`JobKey::derive`]).
pub const STORE_PURPOSE: &str = "oxccl-store v2 records";

/// What both ends saw of the handshake, which the record keys are bound to: the three
/// messages' frames, as [`encode`] writes them.
pub(crate) fn transcript(hello: &Msg, auth: &Msg, ok: &Msg) -> Result<Vec<u8>, DecodeError> {
    let mut t = encode(hello)?;
    t.extend(encode(auth)?);
    t.extend(encode(ok)?);
    Ok(t)
}

/// The keys of one store connection's records, both directions: from the secret, both
/// sides' challenges and the handshake's transcript. The client is the initiator.
pub(crate) fn session(
    secret: &Secret,
    role: Role,
    client_nonce: &[u8; SEAL_NONCE_LEN],
    server_nonce: &[u8; SEAL_NONCE_LEN],
    transcript: &[u8],
) -> Session {
    JobKey::derive(secret.as_bytes(), STORE_PURPOSE).session(
        role,
        client_nonce,
        server_nonce,
        transcript,
    )
}

/// How long a new connection has to authenticate.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a reply may take to be written (a client that stops reading is dropped).
const WRITE_TIMEOUT: Duration = Duration::from_secs(60);
/// Most connections served at once; more are refused.
const MAX_CONNECTIONS: usize = 4096;

/// How a client that serves others through the store (e.g. oxccl's status service, which
/// blocks in long waits for requests) starts its label: rank 0 does not wait for such clients
/// to leave before it stops the store ([`StoreServer::wait_for_clients_to_leave`]).
pub const SERVICE_LABEL_PREFIX: &str = "service: ";
/// Longest wait a request may ask for.
const MAX_WAIT: Duration = Duration::from_secs(7 * 24 * 3600);
/// Stack of a connection thread (they hold little).
const CONN_STACK: usize = 256 << 10;

struct Conn {
    stream: TcpStream,
    thread: Option<JoinHandle<()>>,
    /// The client's label, once authenticated.
    label: Option<String>,
}

#[derive(Default)]
struct Conns {
    next_id: u64,
    map: HashMap<u64, Conn>,
}

struct Shared {
    secret: Secret,
    store: MemoryStore,
    stopping: AtomicBool,
    conns: Mutex<Conns>,
    conns_changed: Condvar,
}

impl Shared {
    fn conns(&self) -> MutexGuard<'_, Conns> {
        self.conns
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }
}

/// A store server: serves a [`MemoryStore`] on a TCP address, to clients that prove they know
/// the [`Secret`].
///
/// One thread accepts; one thread serves each connection. A connection that fails to
/// authenticate, or sends a malformed or oversized message, is closed and the reason logged
/// (`tracing` warning); other connections are not disturbed. After the handshake every
/// request and reply travels in sealed records (AES-256-GCM, `oxccl_seal`) under keys bound
/// to the secret, both challenges and the handshake: a record changed, replayed, dropped or
/// reordered on the way closes that connection, its request unapplied, and the warning names
/// the client and the record. Dropping the server stops it:
/// every connection is closed and pending requests fail on the client side.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

/// Binds a listener, with errors that name the address.
pub(crate) fn bind_listener(addr: &str) -> Result<TcpListener> {
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| Error::BadAddr {
            addr: addr.to_owned(),
            reason: e.to_string(),
        })?
        .collect();
    let mut last = None;
    for a in &addrs {
        match TcpListener::bind(a) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    match last {
        Some(e) if e.kind() == io::ErrorKind::AddrInUse => Err(Error::AddrInUse {
            addr: addr.to_owned(),
        }),
        Some(source) => Err(Error::Bind {
            addr: addr.to_owned(),
            source,
        }),
        None => Err(Error::BadAddr {
            addr: addr.to_owned(),
            reason: "resolves to no address".into(),
        }),
    }
}

impl StoreServer {
    /// Binds `addr` (`host:port`; port 0 picks a free one, see [`StoreServer::addr`]) and
    /// starts serving an empty store.
    ///
    /// A port held by another socket is [`Error::AddrInUse`], naming the address. The job
    /// may keep what [`StoreCaps::from_env`] allows (`OXCCL_STORE_MAX_KEYS`,
    /// `OXCCL_STORE_MAX_BYTES`); a bad value of either is [`Error::BadEnv`].
    pub fn bind(addr: &str, secret: Secret) -> Result<StoreServer> {
        let caps = StoreCaps::from_env(StoreCaps::job_of(&secret))?;
        StoreServer::bind_with(addr, secret, caps)
    }

    /// [`StoreServer::bind`] with the caps given (the variables are not read).
    pub fn bind_with(addr: &str, secret: Secret, caps: StoreCaps) -> Result<StoreServer> {
        StoreServer::serve(bind_listener(addr)?, secret, MemoryStore::with_caps(caps))
    }

    /// Serves `store` on an already bound listener.
    pub fn serve(listener: TcpListener, secret: Secret, store: MemoryStore) -> Result<StoreServer> {
        let addr = listener.local_addr().map_err(|source| Error::Bind {
            addr: "the listener".into(),
            source,
        })?;
        let shared = Arc::new(Shared {
            secret,
            store,
            stopping: AtomicBool::new(false),
            conns: Mutex::new(Conns::default()),
            conns_changed: Condvar::new(),
        });
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("oxccl-store-accept".into())
            .spawn(move || accept_loop(listener, s))
            .map_err(|source| Error::Bind {
                addr: addr.to_string(),
                source,
            })?;
        debug!("oxccl store serving on {addr}");
        Ok(StoreServer {
            addr,
            shared,
            accept: Some(accept),
        })
    }

    /// The address the server listens on (with the port chosen when bound to port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The store served: the server's own process uses it directly.
    pub fn store(&self) -> &MemoryStore {
        &self.shared.store
    }

    /// Labels of the authenticated clients connected now (each client names itself, e.g.
    /// "rank 3 pid 1234 on node7").
    pub fn clients(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .shared
            .conns()
            .map
            .values()
            .filter_map(|c| c.label.clone())
            .collect();
        v.sort();
        v
    }

    /// Waits up to `timeout` until no authenticated client is connected (services, labelled
    /// [`SERVICE_LABEL_PREFIX`], aside); returns the labels of those still connected (empty:
    /// all left).
    ///
    /// Rank 0 calls this before it stops the store, so that the others' last requests get
    /// their replies.
    pub fn wait_for_clients_to_leave(&self, timeout: Duration) -> Vec<String> {
        let deadline = Instant::now() + timeout.min(MAX_WAIT);
        let mut conns = self.shared.conns();
        loop {
            let left: Vec<String> = conns
                .map
                .values()
                .filter_map(|c| c.label.clone())
                .filter(|l| !l.starts_with(SERVICE_LABEL_PREFIX))
                .collect();
            let now = Instant::now();
            if left.is_empty() || now >= deadline {
                return left;
            }
            conns = self
                .shared
                .conns_changed
                .wait_timeout(conns, deadline - now)
                .unwrap_or_else(|poison| poison.into_inner())
                .0;
        }
    }

    /// Stops the server (as dropping it does): closes every connection and waits for the
    /// server's threads to end.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let Some(accept) = self.accept.take() else {
            return;
        };
        self.shared.stopping.store(true, Ordering::SeqCst);
        self.shared.store.close();
        // Wake the accept thread with a connection of our own.
        let wake = match self.addr {
            SocketAddr::V4(a) if a.ip().is_unspecified() => {
                SocketAddr::from(([127, 0, 0, 1], a.port()))
            }
            SocketAddr::V6(a) if a.ip().is_unspecified() => {
                SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, a.port()))
            }
            a => a,
        };
        let woke = TcpStream::connect_timeout(&wake, Duration::from_secs(1)).is_ok();
        let threads: Vec<JoinHandle<()>> = {
            let mut conns = self.shared.conns();
            conns
                .map
                .values_mut()
                .filter_map(|c| {
                    let _ = c.stream.shutdown(Shutdown::Both);
                    c.thread.take()
                })
                .collect()
        };
        for t in threads {
            let _ = t.join();
        }
        if woke {
            let _ = accept.join();
        } else {
            warn!(
                "oxccl store on {}: could not wake the accept thread; leaving it",
                self.addr
            );
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let (stream, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) => {
                if shared.stopping.load(Ordering::SeqCst) {
                    return;
                }
                // Out of file descriptors and the like: back off, keep serving.
                warn!("oxccl store: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
        };
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let Ok(registered) = stream.try_clone() else {
            warn!("refused store connection from {peer}: cannot clone the socket");
            continue;
        };
        // Register before the thread runs: the thread removes its entry under the same lock.
        let mut conns = shared.conns();
        if conns.map.len() >= MAX_CONNECTIONS {
            drop(conns);
            warn!("refused store connection from {peer}: {MAX_CONNECTIONS} connections are open");
            continue;
        }
        let id = conns.next_id;
        conns.next_id += 1;
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("oxccl-store-conn".into())
            .stack_size(CONN_STACK)
            .spawn(move || {
                serve_conn(&s, id, stream, peer);
                let mut conns = s.conns();
                conns.map.remove(&id);
                drop(conns);
                s.conns_changed.notify_all();
            });
        match thread {
            Ok(t) => {
                conns.map.insert(
                    id,
                    Conn {
                        stream: registered,
                        thread: Some(t),
                        label: None,
                    },
                );
            }
            Err(e) => {
                drop(conns);
                warn!("refused store connection from {peer}: cannot start a thread: {e}");
            }
        }
    }
}

/// Runs one connection: handshake, then requests until the peer leaves or misbehaves.
fn serve_conn(shared: &Shared, id: u64, mut stream: TcpStream, peer: SocketAddr) {
    let _ = stream.set_nodelay(true);
    let Ok((label, session)) = handshake(shared, &mut stream, peer) else {
        return;
    };
    let set_label = |label: &str| {
        if let Some(c) = shared.conns().map.get_mut(&id) {
            c.label = Some(label.to_owned());
        }
    };
    // Authenticated; its name comes sealed, first (a version 1 label, if any, until then).
    set_label(&label);
    let mut stream = SealedStream::new(stream, session, format!("store client at {peer}"));
    let label = match read_msg(&mut stream, MAX_HANDSHAKE_FRAME_LEN) {
        Ok(Msg::Name { label }) => label,
        Ok(m) => {
            warn!(
                "closing store connection from {peer}: a {} message where its name belongs",
                m.kind()
            );
            return;
        }
        Err(e) => {
            if !shared.stopping.load(Ordering::SeqCst) {
                warn!("closing store connection from {peer}: no name: {e}");
            }
            return;
        }
    };
    set_label(&label);
    debug!("store client {label:?} connected from {peer}");
    let raw = stream.get_ref();
    if raw.set_read_timeout(None).is_err() || raw.set_write_timeout(Some(WRITE_TIMEOUT)).is_err() {
        return;
    }
    loop {
        let req = match read_msg(&mut stream, MAX_FRAME_LEN) {
            Ok(m) => m,
            Err(ReadError::Closed) => {
                debug!("store client {label:?} ({peer}) disconnected");
                return;
            }
            Err(e) => {
                if !shared.stopping.load(Ordering::SeqCst) {
                    warn!("closing store connection of {label:?} from {peer}: {e}");
                    // A record that failed to open: say which, sealed, before closing (the
                    // client then knows why; someone on the path can only drop it).
                    if let ReadError::Io(io) = &e
                        && io.kind() == io::ErrorKind::InvalidData
                    {
                        let why = Msg::Failed {
                            message: truncate(format!("the store closed this connection: {e}")),
                        };
                        let _ = write_msg(&mut stream, &why);
                    }
                }
                return;
            }
        };
        let Some(reply) = handle(&shared.store, req) else {
            warn!(
                "closing store connection of {label:?} from {peer}: a reply or handshake \
                 message where a request belongs"
            );
            return;
        };
        if shared.stopping.load(Ordering::SeqCst) {
            // Stopping: close without a reply, so the client sees the store go away.
            return;
        }
        if let Err(e) = write_msg(&mut stream, &reply) {
            warn!("closing store connection of {label:?} from {peer}: cannot reply: {e}");
            return;
        }
    }
}

/// Mutual challenge-response. Returns the client's label, or why it was refused.
/// The connection was refused, and the refusal logged.
struct Refused;

/// Logs a refusal, then tells the peer (so that the log has it before the peer knows).
fn refuse(stream: &mut TcpStream, peer: SocketAddr, why: &str, tell: &str) {
    warn!("refused store connection from {peer}: {why}");
    if !tell.is_empty() {
        let _ = write_msg(
            stream,
            &Msg::AuthFail {
                reason: tell.into(),
            },
        );
    }
}

fn handshake(
    shared: &Shared,
    stream: &mut TcpStream,
    peer: SocketAddr,
) -> Result<(String, Session), Refused> {
    let fail = |stream: &mut TcpStream, why: String| {
        if !shared.stopping.load(Ordering::SeqCst) {
            refuse(stream, peer, &why, "");
        }
        Refused
    };
    if let Err(e) = stream
        .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT)))
    {
        return Err(fail(stream, format!("cannot set socket timeouts: {e}")));
    }
    let server_nonce = match random_bytes() {
        Ok(n) => n,
        Err(e) => return Err(fail(stream, e.to_string())),
    };
    let hello = Msg::Hello {
        version: PROTOCOL_VERSION,
        nonce: server_nonce,
    };
    if let Err(e) = write_msg(stream, &hello) {
        return Err(fail(stream, format!("cannot send the challenge: {e}")));
    }
    let msg = match read_msg(stream, MAX_HANDSHAKE_FRAME_LEN) {
        Ok(m) => m,
        Err(e) => {
            return Err(fail(
                stream,
                format!("no valid authentication message: {e}"),
            ));
        }
    };
    let auth = msg.clone();
    let Msg::Auth { mac, nonce, label } = msg else {
        refuse(
            stream,
            peer,
            &format!("sent a {} message instead of authenticating", msg.kind()),
            "authenticate first",
        );
        return Err(Refused);
    };
    if !STORE.client_proven(
        &shared.secret,
        &server_nonce,
        &nonce,
        label.as_bytes(),
        &mac,
    ) {
        refuse(
            stream,
            peer,
            &format!(
                "{} does not know the secret (wrong OXCCL_SECRET or OXCCL_SECRET_FILE?)",
                who(&label)
            ),
            "wrong secret",
        );
        return Err(Refused);
    }
    let proof = STORE.server_proof(&shared.secret, &server_nonce, &nonce);
    let ok = Msg::AuthOk { mac: proof };
    let transcript = match transcript(&hello, &auth, &ok) {
        Ok(t) => t,
        Err(e) => return Err(fail(stream, format!("the handshake's messages: {e}"))),
    };
    if let Err(e) = write_msg(stream, &ok) {
        return Err(fail(
            stream,
            format!("{} authenticated, but the reply failed: {e}", who(&label)),
        ));
    }
    let session = session(
        &shared.secret,
        Role::Acceptor,
        &nonce,
        &server_nonce,
        &transcript,
    );
    Ok((label, session))
}

/// How a refusal names a client: by its label when it gave one in clear (version 1).
fn who(label: &str) -> String {
    if label.is_empty() {
        "the client".into()
    } else {
        format!("{label:?}")
    }
}

/// Cuts a message to what the wire carries.
fn truncate(mut s: String) -> String {
    if s.len() > MAX_TEXT_LEN {
        let mut end = MAX_TEXT_LEN - 3;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str("...");
    }
    s
}

/// Serves one request; `None` when the message is not a request.
fn handle(store: &MemoryStore, req: Msg) -> Option<Msg> {
    let timeout = |ms: u64| Duration::from_millis(ms).min(MAX_WAIT);
    let wait_reply = |r: std::result::Result<Vec<Vec<u8>>, WaitFail>, values: bool| match r {
        Ok(v) if values => {
            let size: usize = v.iter().map(|x| x.len() + 4).sum();
            if size + 64 > MAX_FRAME_LEN {
                Msg::Failed {
                    message: format!(
                        "the values add up to {size} bytes, over the reply limit of \
                         {MAX_FRAME_LEN}; get fewer keys at a time"
                    ),
                }
            } else {
                Msg::Values(v)
            }
        }
        Ok(_) => Msg::Done,
        Err(WaitFail::Missing(missing)) => Msg::TimedOut { missing },
        Err(WaitFail::Closed) => Msg::Failed {
            message: "the store is shutting down".into(),
        },
    };
    Some(match req {
        Msg::Set { key, value } => match store.set_raw(&key, &value) {
            Ok(()) => Msg::Done,
            Err(message) => Msg::Failed {
                message: truncate(message),
            },
        },
        Msg::Get { keys, timeout_ms } => {
            wait_reply(store.wait_raw(&keys, timeout(timeout_ms), true), true)
        }
        Msg::Wait { keys, timeout_ms } => {
            wait_reply(store.wait_raw(&keys, timeout(timeout_ms), false), false)
        }
        Msg::Add { key, delta } => match store.add_raw(&key, delta) {
            Ok(v) => Msg::Int(v),
            Err(message) => Msg::Failed {
                message: truncate(message),
            },
        },
        Msg::CompareSet {
            key,
            expected,
            desired,
        } => match store.compare_set_raw(&key, expected.as_deref(), &desired) {
            Ok(o) => Msg::Cas {
                swapped: o.swapped,
                current: o.current,
            },
            Err(message) => Msg::Failed {
                message: truncate(message),
            },
        },
        Msg::Delete { key } => Msg::Bool(store.delete_raw(&key)),
        Msg::Hello { .. }
        | Msg::Auth { .. }
        | Msg::AuthOk { .. }
        | Msg::AuthFail { .. }
        | Msg::Name { .. }
        | Msg::Done
        | Msg::Values(_)
        | Msg::Int(_)
        | Msg::Bool(_)
        | Msg::Cas { .. }
        | Msg::TimedOut { .. }
        | Msg::Failed { .. } => return None,
    })
}
