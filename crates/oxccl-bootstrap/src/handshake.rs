//! The mutual challenge-response by which two ends of a side channel prove the job's secret to
//! each other, written once for the store, the aggregation service and oxccl-kv.
//!
//! The server says hello with a fresh challenge (a nonce). The client proves first: an HMAC
//! ([`Secret::mac_of`]) under the conversation's client label over the server's challenge, its
//! own, and its claims (its name, what it asks for), sent with its own challenge. The server
//! checks it and answers with its proof: an HMAC under the server label over both challenges
//! the other way round. A client sends nothing more to a server that fails to answer; a server
//! tells a client that failed to prove why, and serves it nothing. The two labels differ, so
//! that a proof for one direction is never valid for the other, and each conversation has its
//! own ([`Labels`]), so that a proof for one is never valid for another.
//!
//! [`Labels`] is the proof itself (what each MAC covers, and its check). [`accept`] and
//! [`connect`] run the whole conversation over the JSON frames of [`crate::frame`] (oxccl-kv's
//! segment handshake): the hello, the client's proof and the server's answer, each frame
//! capped at [`MAX_AUTH_FRAME`] bytes before the peer has proven the secret (a longer one is
//! refused before its body is read), each wait bounded by a timeout whose error names what it
//! waited for. The store keeps its binary frames ([`crate::wire`]) and the aggregation service
//! its join (the proof travels in it, with the job's endpoints, and the service answers once
//! every member has joined): both prove and check with [`Labels`].
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::net::{TcpListener, TcpStream};
//! use std::time::Duration;
//! use oxccl_bootstrap::Secret;
//! use oxccl_bootstrap::handshake::{self, Labels};
//!
//! const LABELS: Labels = Labels::new("example v1 client", "example v1 server");
//! let secret = Secret::new("the job's shared secret")?;
//! let listener = TcpListener::bind("127.0.0.1:0")?;
//! let addr = listener.local_addr()?;
//! let s2 = secret.clone();
//! let server = std::thread::spawn(move || {
//!     let (mut s, _) = listener.accept().unwrap();
//!     handshake::accept(&mut s, &LABELS, &[s2], "server", Duration::from_secs(5))
//! });
//! let mut s = TcpStream::connect(addr)?;
//! let server_name = handshake::connect(&mut s, &LABELS, &secret, "client", Duration::from_secs(5))?;
//! assert_eq!(server_name, "server");
//! let proven = server.join().unwrap()?;
//! assert_eq!((proven.name.as_str(), proven.secret), ("client", 0));
//! # Ok(()) }
//! ```

use std::fmt;
use std::io::ErrorKind;
use std::net::TcpStream;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::Secret;
use crate::frame;

/// Length of the challenges and proofs.
pub const NONCE_LEN: usize = 32;

/// Largest frame accepted before the peer has proven the secret.
pub const MAX_AUTH_FRAME: usize = 4096;

/// What a server that was not proven the secret tells the client, and logs.
pub const NOT_PROVEN: &str = "the job secret was not proven (a stranger, or OXCCL_SECRET differs)";

/// The labels of one conversation's two proofs (distinct, and distinct from every other
/// conversation's), and the proofs computed and checked under them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Labels {
    /// Under which the client proves: over the server's challenge, the client's, its claims.
    pub client: &'static str,
    /// Under which the server answers: over the client's challenge, then the server's.
    pub server: &'static str,
}

/// The store's labels ([`crate::StoreServer`], [`crate::TcpStore`]).
pub const STORE: Labels = Labels::new("oxccl-store v1 client proof", "oxccl-store v1 server proof");

impl Labels {
    /// A conversation's labels.
    pub const fn new(client: &'static str, server: &'static str) -> Labels {
        Labels { client, server }
    }

    /// The client's proof: that it holds `secret`, for this conversation (the two challenges)
    /// and what it claims in it (`claims`: its name, what it asks for).
    pub fn client_proof(
        &self,
        secret: &Secret,
        server_nonce: &[u8; NONCE_LEN],
        client_nonce: &[u8; NONCE_LEN],
        claims: &[u8],
    ) -> [u8; NONCE_LEN] {
        secret.mac_of(self.client, &[server_nonce, client_nonce, claims])
    }

    /// Whether `proof` is the client's proof of `secret` ([`Labels::client_proof`]); checked in
    /// constant time.
    pub fn client_proven(
        &self,
        secret: &Secret,
        server_nonce: &[u8; NONCE_LEN],
        client_nonce: &[u8; NONCE_LEN],
        claims: &[u8],
        proof: &[u8],
    ) -> bool {
        secret.verify_mac(self.client, &[server_nonce, client_nonce, claims], proof)
    }

    /// Which of `secrets` (a server serving several jobs) the client proved, if any.
    pub fn client_secret(
        &self,
        secrets: &[Secret],
        server_nonce: &[u8; NONCE_LEN],
        client_nonce: &[u8; NONCE_LEN],
        claims: &[u8],
        proof: &[u8],
    ) -> Option<usize> {
        secrets
            .iter()
            .position(|s| self.client_proven(s, server_nonce, client_nonce, claims, proof))
    }

    /// The server's answer to the client's challenge.
    pub fn server_proof(
        &self,
        secret: &Secret,
        server_nonce: &[u8; NONCE_LEN],
        client_nonce: &[u8; NONCE_LEN],
    ) -> [u8; NONCE_LEN] {
        secret.mac_of(self.server, &[client_nonce, server_nonce])
    }

    /// Whether `proof` is the server's answer ([`Labels::server_proof`]); checked in constant
    /// time.
    pub fn server_proven(
        &self,
        secret: &Secret,
        server_nonce: &[u8; NONCE_LEN],
        client_nonce: &[u8; NONCE_LEN],
        proof: &[u8],
    ) -> bool {
        secret.verify_mac(self.server, &[client_nonce, server_nonce], proof)
    }
}

/// The conversation's messages, as JSON frames (`{"msg": "hello", ...}`).
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
enum Msg {
    /// Server → client, first: its name and challenge.
    Hello {
        name: String,
        nonce: [u8; NONCE_LEN],
    },
    /// Client → server: its name, its proof and its own challenge.
    Auth {
        name: String,
        nonce: [u8; NONCE_LEN],
        proof: Vec<u8>,
    },
    /// Server → client: accepted, with the server's proof.
    Welcome { proof: Vec<u8> },
    /// Server → client: refused, and why.
    Refused { reason: String },
}

/// Why a handshake failed: who failed to prove what, who refused, or what did not come.
#[derive(Debug)]
pub enum Error {
    /// The client did not prove the secret (the server's side; the client was told).
    ClientNotProven,
    /// The server's answer did not prove the secret (the client's side): an impostor.
    ServerNotProven,
    /// The server refused this client, saying why.
    Refused(String),
    /// `what` did not come within `timeout`.
    TimedOut {
        /// What was waited for (`"the server's hello"`).
        what: &'static str,
        /// How long.
        timeout: Duration,
    },
    /// The peer sent another message than `what`.
    Unexpected {
        /// What was expected.
        what: &'static str,
        /// What came instead.
        got: String,
    },
    /// The connection failed while waiting for or sending `what` (closed, a frame over the
    /// cap, a malformed one).
    Io {
        /// What was being waited for or sent (`"the server's hello"`).
        what: &'static str,
        /// Whether it was being sent (else waited for).
        sending: bool,
        /// The failure.
        error: std::io::Error,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::ClientNotProven => f.write_str(NOT_PROVEN),
            Error::ServerNotProven => {
                f.write_str("the peer did not prove the job secret (an impostor?)")
            }
            Error::Refused(reason) => write!(f, "refused: {reason}"),
            Error::TimedOut { what, timeout } => {
                write!(f, "timed out after {timeout:?} waiting for {what}")
            }
            Error::Unexpected { what, got } => write!(f, "expected {what}, got {got}"),
            Error::Io {
                what,
                sending: true,
                error,
            } => write!(f, "sending {what}: {error}"),
            Error::Io { what, error, .. } => write!(f, "waiting for {what}: {error}"),
        }
    }
}

impl std::error::Error for Error {}

impl Error {
    /// What did not come (timed out, or the connection failed waiting for it), if that is the
    /// failure.
    pub fn awaited(&self) -> Option<&'static str> {
        match self {
            Error::TimedOut { what, .. }
            | Error::Io {
                what,
                sending: false,
                ..
            } => Some(what),
            _ => None,
        }
    }

    /// Whether the failure is the secret's: a peer that did not prove it, or a refusal.
    pub fn is_auth(&self) -> bool {
        matches!(
            self,
            Error::ClientNotProven | Error::ServerNotProven | Error::Refused(_)
        )
    }
}

/// An error of waiting for `what` (a timeout says so, naming it).
fn io_error(what: &'static str, timeout: Duration) -> impl Fn(std::io::Error) -> Error {
    move |error| match error.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => Error::TimedOut { what, timeout },
        _ => Error::Io {
            what,
            sending: false,
            error,
        },
    }
}

fn send(s: &mut TcpStream, m: &Msg, what: &'static str) -> Result<(), Error> {
    frame::send_json(s, m).map_err(|error| Error::Io {
        what,
        sending: true,
        error,
    })
}

fn recv(s: &mut TcpStream, what: &'static str, timeout: Duration) -> Result<Msg, Error> {
    frame::recv_json(s, MAX_AUTH_FRAME, "handshake message").map_err(io_error(what, timeout))
}

fn fresh_nonce() -> Result<[u8; NONCE_LEN], Error> {
    frame::nonce().map_err(|error| Error::Io {
        what: "a challenge from the OS random source",
        sending: false,
        error,
    })
}

fn timeouts(s: &TcpStream, timeout: Duration) -> Result<(), Error> {
    s.set_read_timeout(Some(timeout))
        .and_then(|()| s.set_write_timeout(Some(timeout)))
        .map_err(|error| Error::Io {
            what: "the socket's timeouts to be set",
            sending: false,
            error,
        })
}

/// A client that proved the secret to [`accept`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Proven {
    /// The name it gave (covered by its proof).
    pub name: String,
    /// Which of the server's secrets it proved (an index).
    pub secret: usize,
    /// What keys the connection from here on ([`Keying::session`]).
    pub keying: Keying,
}

/// What both ends of a finished handshake share to key the connection that follows: both
/// challenges and both names. With the secret, it makes the connection's
/// [`oxccl_seal::Session`], which a stranger (no secret) cannot, and which a man in the middle
/// who changed a challenge or a name leaves different on the two ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keying {
    /// The server's challenge.
    pub server_nonce: [u8; NONCE_LEN],
    /// The client's challenge.
    pub client_nonce: [u8; NONCE_LEN],
    /// The server's name, then the client's (length-prefixed), as each said it.
    pub transcript: Vec<u8>,
}

impl Keying {
    fn new(ns: [u8; NONCE_LEN], nc: [u8; NONCE_LEN], server: &str, client: &str) -> Keying {
        let mut transcript = Vec::with_capacity(8 + server.len() + client.len());
        for n in [server, client] {
            transcript.extend_from_slice(&(n.len() as u32).to_le_bytes());
            transcript.extend_from_slice(n.as_bytes());
        }
        Keying {
            server_nonce: ns,
            client_nonce: nc,
            transcript,
        }
    }

    /// The connection's keys on one end (`Role::Initiator`: the client), for the conversation
    /// of `labels` under `secret`: carry the stream in records with
    /// [`oxccl_seal::SealedStream`] from here on.
    pub fn session(
        &self,
        labels: &Labels,
        secret: &Secret,
        role: oxccl_seal::Role,
    ) -> oxccl_seal::Session {
        oxccl_seal::JobKey::derive(secret.as_bytes(), labels.client).session(
            role,
            &self.client_nonce,
            &self.server_nonce,
            &self.transcript,
        )
    }
}

/// A server that proved the secret to [`connect_keyed`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Connected {
    /// The server's name.
    pub server: String,
    /// What keys the connection from here on ([`Keying::session`]).
    pub keying: Keying,
}

/// The server's side: says hello as `name`, checks the client's proof against `secrets`, and
/// answers with its own (a client that failed is told [`NOT_PROVEN`]). Every wait and write
/// is bounded by `timeout`, and the stream keeps it as its read and write timeouts.
pub fn accept(
    s: &mut TcpStream,
    labels: &Labels,
    secrets: &[Secret],
    name: &str,
    timeout: Duration,
) -> Result<Proven, Error> {
    timeouts(s, timeout)?;
    let ns = fresh_nonce()?;
    let hello = Msg::Hello {
        name: name.to_string(),
        nonce: ns,
    };
    send(s, &hello, "the hello")?;
    let proven = match recv(s, "the client's proof", timeout) {
        Ok(Msg::Auth { name, nonce, proof }) => labels
            .client_secret(secrets, &ns, &nonce, name.as_bytes(), &proof)
            .map(|secret| (name, nonce, secret))
            .ok_or(Error::ClientNotProven),
        Ok(m) => Err(Error::Unexpected {
            what: "the client's proof",
            got: format!("{m:?}"),
        }),
        Err(e) => Err(e),
    };
    // A client that did not prove the secret, whichever way, is told so.
    let (peer, nc, secret) = proven.inspect_err(|_| {
        let refused = Msg::Refused {
            reason: NOT_PROVEN.into(),
        };
        let _ = send(s, &refused, "the refusal");
    })?;
    let proof = labels.server_proof(&secrets[secret], &ns, &nc).to_vec();
    send(s, &Msg::Welcome { proof }, "the server's proof")?;
    let keying = Keying::new(ns, nc, name, &peer);
    Ok(Proven {
        name: peer,
        secret,
        keying,
    })
}

/// The client's side: reads the server's hello, proves `secret` as `name`, and checks the
/// server's answer. Returns the server's name. Every wait and write is bounded by `timeout`,
/// and the stream keeps it as its read and write timeouts.
pub fn connect(
    s: &mut TcpStream,
    labels: &Labels,
    secret: &Secret,
    name: &str,
    timeout: Duration,
) -> Result<String, Error> {
    connect_keyed(s, labels, secret, name, timeout).map(|c| c.server)
}

/// [`connect`], returning also what keys the connection from here on.
pub fn connect_keyed(
    s: &mut TcpStream,
    labels: &Labels,
    secret: &Secret,
    name: &str,
    timeout: Duration,
) -> Result<Connected, Error> {
    timeouts(s, timeout)?;
    let (server, ns) = match recv(s, "the server's hello", timeout)? {
        Msg::Hello { name, nonce } => (name, nonce),
        m => {
            return Err(Error::Unexpected {
                what: "a hello",
                got: format!("{m:?}"),
            });
        }
    };
    let nc = fresh_nonce()?;
    let auth = Msg::Auth {
        name: name.to_string(),
        nonce: nc,
        proof: labels
            .client_proof(secret, &ns, &nc, name.as_bytes())
            .to_vec(),
    };
    send(s, &auth, "the client's proof")?;
    match recv(s, "the server's proof", timeout)? {
        Msg::Welcome { proof } if labels.server_proven(secret, &ns, &nc, &proof) => {
            let keying = Keying::new(ns, nc, &server, name);
            Ok(Connected { server, keying })
        }
        Msg::Welcome { .. } => Err(Error::ServerNotProven),
        Msg::Refused { reason } => Err(Error::Refused(reason)),
        m => Err(Error::Unexpected {
            what: "a welcome",
            got: format!("{m:?}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::net::TcpListener;
    use std::time::Instant;

    use super::*;

    const LABELS: Labels = Labels::new("test v1 client", "test v1 server");
    const T: Duration = Duration::from_secs(5);

    fn secret(s: &str) -> Secret {
        Secret::new(s).unwrap()
    }

    /// A server running `serve` on one connection, and a client's stream to it.
    fn pair<R: Send + 'static>(
        serve: impl FnOnce(TcpStream) -> R + Send + 'static,
    ) -> (TcpStream, std::thread::JoinHandle<R>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || serve(l.accept().unwrap().0));
        (TcpStream::connect(addr).unwrap(), t)
    }

    #[test]
    fn both_prove_the_same_secret() {
        use std::io::Write;
        let (mut c, t) = pair(|mut s| {
            let p = accept(&mut s, &LABELS, &[secret("a"), secret("b")], "srv", T)?;
            // The connection goes on sealed under the keys the handshake made.
            let session = p
                .keying
                .session(&LABELS, &secret("b"), oxccl_seal::Role::Acceptor);
            let mut sealed = oxccl_seal::SealedStream::new(s, session, "cli");
            let mut got = [0u8; 5];
            sealed.read_exact(&mut got).unwrap();
            sealed.write_all(&got).unwrap();
            sealed.flush().unwrap();
            Ok::<_, Error>((p, got))
        });
        let connected = connect_keyed(&mut c, &LABELS, &secret("b"), "cli", T).unwrap();
        assert_eq!(connected.server, "srv");
        let session = connected
            .keying
            .session(&LABELS, &secret("b"), oxccl_seal::Role::Initiator);
        let mut sealed = oxccl_seal::SealedStream::new(c, session, "srv");
        sealed.write_all(b"hello").unwrap();
        sealed.flush().unwrap();
        let mut back = [0u8; 5];
        sealed.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"hello");
        let (p, got) = t.join().unwrap().unwrap();
        assert_eq!((p.name.as_str(), p.secret, &got), ("cli", 1, b"hello"));
        assert_eq!(p.keying, connected.keying);
    }

    #[test]
    fn a_server_refuses_a_stranger() {
        let (mut c, t) = pair(|mut s| accept(&mut s, &LABELS, &[secret("job")], "srv", T));
        let e = connect(&mut c, &LABELS, &secret("stranger"), "cli", T).unwrap_err();
        assert!(matches!(&e, Error::Refused(r) if r == NOT_PROVEN), "{e}");
        assert!(e.to_string().contains("OXCCL_SECRET differs"), "{e}");
        let e = t.join().unwrap().unwrap_err();
        assert!(matches!(e, Error::ClientNotProven), "{e}");
        assert!(e.is_auth());
    }

    #[test]
    fn a_client_refuses_an_impostor_server() {
        // The impostor says hello, ignores the proof and answers with one of its own making.
        let (mut c, t) = pair(|mut s| {
            let ns = [7; NONCE_LEN];
            let hello = Msg::Hello {
                name: "srv".into(),
                nonce: ns,
            };
            frame::send_json(&mut s, &hello).unwrap();
            let Msg::Auth { nonce, .. } = frame::recv_json(&mut s, MAX_AUTH_FRAME, "auth").unwrap()
            else {
                panic!("no auth")
            };
            let proof = LABELS
                .server_proof(&secret("impostor"), &ns, &nonce)
                .to_vec();
            frame::send_json(&mut s, &Msg::Welcome { proof }).unwrap();
        });
        let e = connect(&mut c, &LABELS, &secret("job"), "cli", T).unwrap_err();
        assert!(matches!(e, Error::ServerNotProven), "{e}");
        assert!(
            e.to_string().contains("did not prove the job secret"),
            "{e}"
        );
        t.join().unwrap();
    }

    #[test]
    fn proofs_are_bound_to_their_direction_and_labels() {
        let (s, ns, nc) = (secret("job"), [1; NONCE_LEN], [2; NONCE_LEN]);
        let p = LABELS.client_proof(&s, &ns, &nc, b"cli");
        assert!(LABELS.client_proven(&s, &ns, &nc, b"cli", &p));
        assert!(!LABELS.client_proven(&s, &ns, &nc, b"other", &p), "claims");
        assert!(
            !LABELS.client_proven(&s, &nc, &ns, b"cli", &p),
            "challenges"
        );
        assert!(
            !STORE.client_proven(&s, &ns, &nc, b"cli", &p),
            "another conversation"
        );
        let q = LABELS.server_proof(&s, &ns, &nc);
        assert!(LABELS.server_proven(&s, &ns, &nc, &q));
        assert!(!LABELS.server_proven(&s, &ns, &nc, &p), "a client's proof");
        assert!(!LABELS.server_proven(&secret("other"), &ns, &nc, &q));
        assert_eq!(
            LABELS.client_secret(&[secret("x"), s.clone()], &ns, &nc, b"cli", &p),
            Some(1)
        );
        assert_eq!(
            LABELS.client_secret(&[secret("x")], &ns, &nc, b"cli", &p),
            None
        );
    }

    #[test]
    fn a_frame_over_the_cap_before_authentication_is_refused_unread() {
        // The server's hello announces 4 GiB: the client refuses it having read the length
        // only (nothing of the body is read, so nothing is allocated for it).
        let (mut c, t) = pair(|mut s| {
            use std::io::Write;
            s.write_all(&u32::MAX.to_le_bytes()).unwrap();
            s.write_all(b"{\"msg\"").unwrap();
            s
        });
        let e = connect(&mut c, &LABELS, &secret("job"), "cli", T).unwrap_err();
        let m = e.to_string();
        assert!(matches!(e, Error::Io { .. }), "{m}");
        assert!(
            m.contains(&format!("of {} bytes (at most {MAX_AUTH_FRAME})", u32::MAX)),
            "{m}"
        );
        let _keep = t.join().unwrap();
        // The body's first bytes are still unread.
        let mut rest = [0; 6];
        c.read_exact(&mut rest).unwrap();
        assert_eq!(&rest, b"{\"msg\"");
        // A client's proof over the cap: the server refuses it the same way.
        let (mut c, t) = pair(|mut s| accept(&mut s, &LABELS, &[secret("job")], "srv", T));
        let _hello: Msg = frame::recv_json(&mut c, MAX_AUTH_FRAME, "hello").unwrap();
        use std::io::Write;
        c.write_all(&(MAX_AUTH_FRAME as u32 + 1).to_le_bytes())
            .unwrap();
        let e = t.join().unwrap().unwrap_err();
        assert!(e.to_string().contains("(at most 4096)"), "{e}");
    }

    #[test]
    fn a_silent_peer_times_out_naming_what_was_awaited() {
        let quick = Duration::from_millis(200);
        // A server that never says hello.
        let (mut c, t) = pair(|s| {
            std::thread::sleep(Duration::from_secs(2));
            s
        });
        let t0 = Instant::now();
        let e = connect(&mut c, &LABELS, &secret("job"), "cli", quick).unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(2));
        assert!(
            matches!(
                e,
                Error::TimedOut {
                    what: "the server's hello",
                    ..
                }
            ),
            "{e}"
        );
        assert!(
            e.to_string().contains("waiting for the server's hello"),
            "{e}"
        );
        drop(t);
        // A client that never proves.
        let (c, t) = pair(move |mut s| accept(&mut s, &LABELS, &[secret("job")], "srv", quick));
        let e = t.join().unwrap().unwrap_err();
        assert!(
            matches!(
                e,
                Error::TimedOut {
                    what: "the client's proof",
                    ..
                }
            ),
            "{e}"
        );
        drop(c);
    }
}
