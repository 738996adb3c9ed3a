//! The store client: a [`Store`] over one authenticated TCP connection.

use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::handshake::STORE;
use crate::secret::{Secret, random_bytes};
use crate::store::{CasOutcome, Store, check_args};
use crate::wire::{
    MAX_FRAME_LEN, MAX_TEXT_LEN, Msg, PROTOCOL_VERSION, ReadError, read_msg, write_msg,
};
use oxccl_seal::{Role, SealedStream, Session};

/// Options of [`TcpStore::connect_with`].
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// How long to keep trying to reach the store (it may start later than this process).
    pub connect_timeout: Duration,
    /// How long a request may wait for its reply beyond the wait it asked for. A store that
    /// does not answer within it is treated as gone.
    pub reply_timeout: Duration,
    /// How this client names itself in the store's logs (e.g. "rank 3 pid 1234").
    pub label: String,
    /// Stops the retries to reach the store when aborted (they then fail with
    /// [`Error::Aborted`]).
    pub abort: Option<crate::AbortHandle>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            connect_timeout: Duration::from_secs(60),
            reply_timeout: Duration::from_secs(30),
            label: format!("pid {}", std::process::id()),
            abort: None,
        }
    }
}

/// Breaks a [`TcpStore`]'s connection from another thread ([`TcpStore::interrupter`]).
#[derive(Debug)]
pub struct Interrupter {
    stream: TcpStream,
}

impl Interrupter {
    /// Shuts the connection down both ways; the store's blocked and later calls fail.
    pub fn interrupt(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

struct Conn {
    /// Sealed records both ways after the handshake ([`crate::StoreServer`]).
    stream: SealedStream<TcpStream>,
    /// Set when the connection broke: every later call fails at once with it.
    broken: Option<String>,
}

/// A client of a [`StoreServer`](crate::StoreServer), authenticated both ways; every request
/// and reply after the handshake travels in AES-256-GCM records (`oxccl_seal`) keyed from the
/// secret and both sides' challenges, so that no one on the path reads or changes them.
///
/// Requests are serialized over one connection (the type is `Sync`; concurrent callers take
/// turns). If the connection breaks (the store exits, is killed or shuts down), the pending
/// call and every later one fail at once with [`Error::StoreGone`], naming the store's address.
pub struct TcpStore {
    addr: String,
    conn: Mutex<Conn>,
    reply_timeout: Duration,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStore")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

/// Whether a connect error may go away if we try again (the store is not up yet).
fn retryable(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::TimedOut
            | io::ErrorKind::WouldBlock
            | io::ErrorKind::AddrNotAvailable
            | io::ErrorKind::NotFound
            | io::ErrorKind::HostUnreachable
            | io::ErrorKind::NetworkUnreachable
            | io::ErrorKind::Interrupted
    )
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

impl TcpStore {
    /// Connects to the store at `addr` (`host:port`), retrying until `timeout` while nothing
    /// listens there, and authenticates with `secret`.
    pub fn connect(addr: &str, secret: &Secret, timeout: Duration) -> Result<TcpStore> {
        TcpStore::connect_with(
            addr,
            secret,
            &ClientOptions {
                connect_timeout: timeout,
                ..ClientOptions::default()
            },
        )
    }

    /// [`TcpStore::connect`] with all the options.
    pub fn connect_with(addr: &str, secret: &Secret, opts: &ClientOptions) -> Result<TcpStore> {
        let deadline = Instant::now() + opts.connect_timeout;
        let mut stream =
            connect_retrying(addr, deadline, opts.connect_timeout, opts.abort.as_ref())?;
        let _ = stream.set_nodelay(true);
        let label = truncate(opts.label.clone(), MAX_TEXT_LEN);
        // The handshake gets at least a few seconds, even when connecting took the timeout.
        let hs_timeout = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_secs(5));
        // The label goes sealed, after the handshake (the path learns nothing of the job).
        let session = handshake(&mut stream, addr, secret, "", hs_timeout)?;
        let mut stream = SealedStream::new(stream, session, format!("the store at {addr}"));
        write_msg(&mut stream, &Msg::Name { label }).map_err(|e| Error::StoreGone {
            addr: addr.to_owned(),
            reason: format!("cannot send this client's name: {e}"),
        })?;
        Ok(TcpStore {
            addr: addr.to_owned(),
            conn: Mutex::new(Conn {
                stream,
                broken: None,
            }),
            reply_timeout: opts.reply_timeout.max(Duration::from_millis(1)),
        })
    }

    /// The store's address, as given.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// A handle that breaks this connection from another thread: a call blocked in it (a
    /// long `wait`) then fails at once with [`Error::StoreGone`], and so does every later one.
    /// For a service thread that must stop promptly when its owner goes away.
    pub fn interrupter(&self) -> Result<Interrupter> {
        let stream = self
            .lock()
            .stream
            .get_ref()
            .try_clone()
            .map_err(|e| Error::StoreGone {
                addr: self.addr.clone(),
                reason: format!("cannot clone the connection's socket: {e}"),
            })?;
        Ok(Interrupter { stream })
    }

    /// The raw connection, for tests that misbehave on purpose.
    #[cfg(test)]
    pub(crate) fn conn_for_tests(&self) -> TcpStream {
        self.lock()
            .stream
            .get_ref()
            .try_clone()
            .expect("clone the socket")
    }

    fn lock(&self) -> MutexGuard<'_, Conn> {
        self.conn
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// Sends one request and reads its reply; `wait` is how long the server may wait.
    fn call(&self, req: &Msg, wait: Duration) -> Result<Msg> {
        let mut conn = self.lock();
        if let Some(reason) = &conn.broken {
            return Err(Error::StoreGone {
                addr: self.addr.clone(),
                reason: reason.clone(),
            });
        }
        let limit = wait
            .saturating_add(self.reply_timeout)
            .min(Duration::from_secs(365 * 24 * 3600));
        let raw = conn.stream.get_ref();
        let result = raw
            .set_read_timeout(Some(limit))
            .and_then(|()| raw.set_write_timeout(Some(limit)))
            .map_err(ReadError::Io)
            .and_then(|()| write_msg(&mut conn.stream, req).map_err(ReadError::Io))
            .and_then(|()| read_msg(&mut conn.stream, MAX_FRAME_LEN));
        match result {
            Ok(reply) => Ok(reply),
            Err(e) => {
                let reason = match &e {
                    ReadError::Io(io)
                        if matches!(
                            io.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                        ) =>
                    {
                        format!("no reply within {}", crate::error::secs(limit))
                    }
                    ReadError::Closed => {
                        "the connection was closed (the store process exited, was killed or \
                         shut down)"
                            .to_owned()
                    }
                    ReadError::Decode(d) => format!("unreadable reply: {d}"),
                    e => e.to_string(),
                };
                // The stream may be mid-message: never use it again.
                let _ = conn.stream.get_ref().shutdown(Shutdown::Both);
                conn.broken = Some(reason.clone());
                // A record that failed authentication (changed, replayed, dropped or
                // reordered on the way) is not the store going away: say what it was.
                if matches!(&e, ReadError::Io(io) if io.kind() == io::ErrorKind::InvalidData) {
                    return Err(Error::Protocol {
                        addr: self.addr.clone(),
                        reason: format!(
                            "a reply failed authentication, the connection is closed (someone \
                             on the path changed it?): {reason}"
                        ),
                    });
                }
                Err(Error::StoreGone {
                    addr: self.addr.clone(),
                    reason,
                })
            }
        }
    }

    fn unexpected(&self, what: &str, reply: Msg) -> Error {
        match reply {
            Msg::Failed { message } => Error::Rejected {
                addr: self.addr.clone(),
                message,
            },
            other => {
                let mut conn = self.lock();
                let reason = format!("a {} reply to a {what} request", other.kind());
                let _ = conn.stream.get_ref().shutdown(Shutdown::Both);
                conn.broken = Some(reason.clone());
                Error::Protocol {
                    addr: self.addr.clone(),
                    reason,
                }
            }
        }
    }

    fn wait_call(&self, keys: &[&str], timeout: Duration, values: bool) -> Result<Vec<Vec<u8>>> {
        check_args(keys.iter().copied(), None)?;
        let keys_owned: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let req = if values {
            Msg::Get {
                keys: keys_owned,
                timeout_ms,
            }
        } else {
            Msg::Wait {
                keys: keys_owned,
                timeout_ms,
            }
        };
        match self.call(&req, timeout)? {
            Msg::Values(v) if values && v.len() == keys.len() => Ok(v),
            Msg::Done if !values => Ok(Vec::new()),
            Msg::TimedOut { missing } => Err(Error::Timeout {
                addr: self.addr.clone(),
                timeout,
                missing,
            }),
            other => Err(self.unexpected(req.kind(), other)),
        }
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        check_args([key], Some(value))?;
        let req = Msg::Set {
            key: key.to_owned(),
            value: value.to_vec(),
        };
        match self.call(&req, Duration::ZERO)? {
            Msg::Done => Ok(()),
            other => Err(self.unexpected("Set", other)),
        }
    }

    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.wait_call(keys, timeout, true)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.wait_call(keys, timeout, false).map(drop)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        check_args([key], None)?;
        let req = Msg::Add {
            key: key.to_owned(),
            delta,
        };
        match self.call(&req, Duration::ZERO)? {
            Msg::Int(v) => Ok(v),
            other => Err(self.unexpected("Add", other)),
        }
    }

    fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> Result<CasOutcome> {
        check_args([key], Some(desired))?;
        check_args([], expected)?;
        let req = Msg::CompareSet {
            key: key.to_owned(),
            expected: expected.map(<[u8]>::to_vec),
            desired: desired.to_vec(),
        };
        match self.call(&req, Duration::ZERO)? {
            Msg::Cas { swapped, current } => Ok(CasOutcome { swapped, current }),
            other => Err(self.unexpected("CompareSet", other)),
        }
    }

    fn delete(&self, key: &str) -> Result<bool> {
        check_args([key], None)?;
        match self.call(
            &Msg::Delete {
                key: key.to_owned(),
            },
            Duration::ZERO,
        )? {
            Msg::Bool(b) => Ok(b),
            other => Err(self.unexpected("Delete", other)),
        }
    }

    fn location(&self) -> String {
        self.addr.clone()
    }

    fn local_addr(&self) -> Option<SocketAddr> {
        self.lock().stream.get_ref().local_addr().ok()
    }
}

fn connect_retrying(
    addr: &str,
    deadline: Instant,
    timeout: Duration,
    abort: Option<&crate::AbortHandle>,
) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(10);
    let mut last = String::from("no attempt");
    loop {
        if let Some(reason) = abort.and_then(crate::AbortHandle::reason) {
            return Err(Error::Aborted {
                rank: usize::MAX,
                reason,
                waiting: format!("to reach the store at {addr} (last attempt: {last})"),
            });
        }
        match addr.to_socket_addrs() {
            Ok(addrs) => {
                let addrs: Vec<SocketAddr> = addrs.collect();
                if addrs.is_empty() {
                    last = "the name resolves to no address".into();
                }
                for a in addrs {
                    let left = deadline.saturating_duration_since(Instant::now());
                    // Watched by an abort handle: short attempts, so that it is looked at often.
                    let most = if abort.is_some() {
                        crate::ABORT_POLL * 5
                    } else {
                        Duration::from_secs(5)
                    };
                    let attempt = left.clamp(Duration::from_millis(10), most);
                    match TcpStream::connect_timeout(&a, attempt) {
                        Ok(s) => return Ok(s),
                        Err(e) if retryable(&e) => last = format!("{a}: {e}"),
                        Err(e) => {
                            return Err(Error::Connect {
                                addr: addr.to_owned(),
                                timeout,
                                reason: format!("{a}: {e}"),
                            });
                        }
                    }
                }
            }
            // The name may not resolve yet (a node still coming up): retry.
            Err(e) => last = format!("cannot resolve: {e}"),
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Connect {
                addr: addr.to_owned(),
                timeout,
                reason: last,
            });
        }
        let cap = if abort.is_some() {
            crate::ABORT_POLL
        } else {
            Duration::from_millis(250)
        };
        std::thread::sleep(backoff.min(deadline - now).min(cap));
        backoff = (backoff * 2).min(Duration::from_millis(250));
    }
}

/// The handshake (see [`crate::StoreServer`]); returns the keys of the records that follow.
fn handshake(
    stream: &mut TcpStream,
    addr: &str,
    secret: &Secret,
    label: &str,
    timeout: Duration,
) -> Result<Session> {
    let protocol = |reason: String| Error::Protocol {
        addr: addr.to_owned(),
        reason,
    };
    let io_err = |what: &str, e: &dyn std::fmt::Display| Error::StoreGone {
        addr: addr.to_owned(),
        reason: format!("{what}: {e}"),
    };
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(|e| io_err("cannot set socket timeouts", &e))?;
    let hello = match read_msg(stream, 4096) {
        Ok(m) => m,
        Err(ReadError::Decode(e)) => {
            return Err(protocol(format!("not an oxccl store (greeting: {e})")));
        }
        Err(e) => return Err(io_err("no greeting", &e)),
    };
    let Msg::Hello {
        version,
        nonce: server_nonce,
    } = hello.clone()
    else {
        return Err(protocol(format!(
            "not an oxccl store (a {} message instead of a greeting)",
            hello.kind()
        )));
    };
    if version != PROTOCOL_VERSION {
        return Err(protocol(format!(
            "the store speaks protocol version {version}; this client speaks {PROTOCOL_VERSION}"
        )));
    }
    let client_nonce = random_bytes()?;
    let auth = Msg::Auth {
        mac: STORE.client_proof(secret, &server_nonce, &client_nonce, label.as_bytes()),
        nonce: client_nonce,
        label: label.to_owned(),
    };
    write_msg(stream, &auth).map_err(|e| io_err("cannot authenticate", &e))?;
    match read_msg(stream, 4096) {
        Ok(Msg::AuthOk { mac }) => {
            if STORE.server_proven(secret, &server_nonce, &client_nonce, &mac) {
                let ok = Msg::AuthOk { mac };
                let transcript = crate::server::transcript(&hello, &auth, &ok)
                    .map_err(|e| protocol(format!("the handshake's messages: {e}")))?;
                Ok(crate::server::session(
                    secret,
                    Role::Initiator,
                    &client_nonce,
                    &server_nonce,
                    &transcript,
                ))
            } else {
                let _ = stream.shutdown(Shutdown::Both);
                Err(Error::StoreNotAuthentic {
                    addr: addr.to_owned(),
                })
            }
        }
        Ok(Msg::AuthFail { reason }) => Err(Error::AuthRefused {
            addr: addr.to_owned(),
            reason,
            hint: secret.mismatch_hint(),
        }),
        Ok(other) => Err(protocol(format!(
            "a {} message instead of an authentication reply",
            other.kind()
        ))),
        Err(ReadError::Decode(e)) => Err(protocol(format!("unreadable authentication reply: {e}"))),
        Err(e) => Err(io_err("no authentication reply", &e)),
    }
}
