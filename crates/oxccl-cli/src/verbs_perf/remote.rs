//! `--server` and `--connect HOST:PORT`: verbs-perf between two processes that did not start
//! each other, in two network namespaces or on two machines.
//!
//! # Design
//!
//! The server is rank 0 of a two-rank job of `oxccl-bootstrap`: it serves the rendezvous store
//! (a [`StoreServer`] on `--bind`, default `0.0.0.0:18515`) and joins it in-process; the client
//! is rank 1 and joins over TCP. Every store connection is authenticated both ways with the
//! job's shared secret (`OXCCL_SECRET` or `OXCCL_SECRET_FILE`, required), so a stranger neither
//! joins nor learns anything.
//!
//! Through the store the two ranks all-gather one record each ([`Rendezvous`]): the server's
//! control port and a fresh random token from each side. The client then opens a plain TCP
//! control connection to the server's host on that port and the two prove they read the store:
//! the client sends the server's token, the server answers with the client's. Only then do they
//! speak the control protocol of the spawned-server mode over that connection (a
//! [`LineChannel`]): the same `setup`, `endpoint`, `run`, `ready`, `finish`, `done` messages,
//! so queue pair endpoints and rkeys go only to the authenticated peer and both modes share one
//! code path. Why not a channel over the store's keys: the store answers one request at a time
//! per connection, so a reader blocked in a `get` would delay every send; the rank that serves
//! the store holds it in-process and would have to poll the server's client list to notice that
//! its peer died. A TCP connection notices at once (EOF), and keepalive with `TCP_USER_TIMEOUT`
//! ([`keepalive`]) bounds the wait for a peer whose machine or link died silently.
//!
//! Every wait is bounded: `--wait` (default 60 s) for the server to see its client join and for
//! the client to reach the server, `--timeout` for each step of a run.
//!
//! # Addresses
//!
//! The tcp provider advertises the address of its listener, `OXCCL_TCP_ADDR` (default
//! 127.0.0.1), which the other host could not reach. So when `OXCCL_TCP_ADDR` is unset, each
//! side sets it to the local address of its control connection (the interface the peer reached
//! it on, or that it reached the peer from) before it opens its context ([`default_env`]).
//! The raw `tcp_lat` / `tcp_bw` baselines listen on the same address ([`data_ip`]).

use std::io::{ErrorKind, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use oxccl_bootstrap::{Bootstrap, Config, Secret, StoreServer};
use serde::{Deserialize, Serialize};

use super::channel::LineChannel;
use super::error::{Error, Result};
use super::rawtcp::{TOKEN_LEN, random_token, same_token};

/// The store's port when `--bind` or `--connect` gives none (perftest's port).
pub const DEFAULT_PORT: u16 = 18515;
/// The store's address when `--bind` is not given.
pub const DEFAULT_BIND: &str = "0.0.0.0:18515";
/// Namespace of the job's keys in the store.
const JOB_ID: &str = "verbs-perf";

/// What each rank publishes through the store.
#[derive(Debug, Serialize, Deserialize)]
struct Rendezvous {
    /// The server's control port (0 from the client).
    port: u16,
    /// A fresh random token, which the peer must echo on the control connection.
    token: String,
}

/// The job's shared secret: `OXCCL_SECRET` or `OXCCL_SECRET_FILE`, else the per-user secret
/// file (the same on both sides when they share a home directory).
pub fn secret() -> Result<Secret> {
    Secret::from_env_or_user_file().map_err(|e| Error::new(e.to_string()))
}

/// A `--bind` or `--connect` address (`HOST`, `HOST:PORT`, `IP`, `IP:PORT`, `[IPv6]:PORT`)
/// with the default port added when it has none.
pub fn with_default_port(addr: &str) -> Result<String> {
    let a = addr.trim();
    let bad = |why: &str| Error::new(format!("invalid address {addr:?}: {why}"));
    if a.is_empty() {
        return Err(bad("empty (expected HOST or HOST:PORT)"));
    }
    if a.parse::<SocketAddr>().is_ok() {
        return Ok(a.to_string());
    }
    if a.parse::<Ipv4Addr>().is_ok() {
        return Ok(format!("{a}:{DEFAULT_PORT}"));
    }
    if a.parse::<std::net::Ipv6Addr>().is_ok() {
        return Ok(format!("[{a}]:{DEFAULT_PORT}"));
    }
    match a.rsplit_once(':') {
        None => Ok(format!("{a}:{DEFAULT_PORT}")),
        Some((h, p)) if !h.is_empty() && !h.contains(':') => match p.parse::<u16>() {
            Ok(_) => Ok(a.to_string()),
            Err(_) => Err(bad(&format!("{p:?} is not a port number (0 to 65535)"))),
        },
        Some(_) => Err(bad("expected HOST, HOST:PORT or [IPv6]:PORT")),
    }
}

/// Sets the environment variable `key` to `value` unless it holds a non-empty value; returns
/// whether it set it.
pub fn default_env(key: &str, value: &str) -> bool {
    if std::env::var_os(key).is_some_and(|v| !v.is_empty()) {
        return false;
    }
    // SAFETY: the other threads of this process at this point (the store's acceptor and
    // connection threads, the control channel's reader, a tracing writer) do socket and pipe
    // I/O only and never read the environment, so nothing reads it concurrently.
    unsafe { std::env::set_var(key, value) };
    true
}

/// The IP address the raw baselines' data listener binds: `OXCCL_TCP_ADDR`'s (`IP` or
/// `IP:port`), as the tcp provider's listener does, else 127.0.0.1.
pub fn data_ip() -> IpAddr {
    std::env::var("OXCCL_TCP_ADDR")
        .ok()
        .and_then(|a| {
            let a = a.trim();
            a.parse::<SocketAddr>()
                .map(|s| s.ip())
                .or_else(|_| a.parse::<IpAddr>())
                .ok()
        })
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

/// Keepalive on the control connection, so that a peer whose machine or link died silently is
/// noticed within about `timeout` rather than never: probes after `timeout / 3` of silence,
/// and `TCP_USER_TIMEOUT` fails a connection whose data stays unacknowledged for `timeout`.
pub fn keepalive(stream: &TcpStream, timeout: Duration) {
    use rustix::net::sockopt;
    let third = (timeout / 3).max(Duration::from_secs(1));
    let _ = sockopt::set_socket_keepalive(stream, true);
    let _ = sockopt::set_tcp_keepidle(stream, third);
    let _ = sockopt::set_tcp_keepintvl(stream, (third / 2).max(Duration::from_secs(1)));
    let _ = sockopt::set_tcp_keepcnt(stream, 2);
    let _ = sockopt::set_tcp_user_timeout(stream, timeout.as_millis().min(u32::MAX as u128) as u32);
    let _ = stream.set_nodelay(true);
}

/// A connected `--server` or `--connect` side: the bootstrap (kept until the end, so that the
/// store outlives the client's use of it) and what the header says about the peer.
pub struct Session {
    boot: Bootstrap,
    server: Option<StoreServer>,
    /// "client 10.77.0.2:41234 (joined the store at 0.0.0.0:18515)" or the like.
    pub describe: String,
    /// The peer's IP address (replaces an unspecified address the peer announces).
    pub peer_ip: IpAddr,
    /// The local address of the control connection.
    pub local_ip: IpAddr,
}

impl Session {
    /// Ends the session: the server waits (briefly) for the client to leave the store.
    pub fn close(self) {
        let Session { boot, server, .. } = self;
        drop(boot);
        if let Some(server) = server {
            server.wait_for_clients_to_leave(Duration::from_secs(5));
        }
    }
}

/// `--server`: serves the store on `bind`, calls `listening` with its address, waits up to
/// `wait` for the client to join and connect, and returns the authenticated control channel.
pub fn serve(
    bind: &str,
    wait: Duration,
    io_timeout: Duration,
    listening: impl FnOnce(SocketAddr) -> Result<()>,
) -> Result<(Session, LineChannel)> {
    let secret = secret()?;
    let bind = with_default_port(bind)?;
    let server = StoreServer::bind(&bind, secret).map_err(|e| Error::new(e.to_string()))?;
    let addr = server.addr();
    let ctl = TcpListener::bind(SocketAddr::new(addr.ip(), 0))
        .map_err(|e| Error::new(format!("listening for the control connection: {e}")))?;
    ctl.set_nonblocking(true)?;
    let port = ctl.local_addr()?.port();
    listening(addr)?;
    let start = Instant::now();
    let store = server.store().with_location(&addr.to_string());
    let boot = Bootstrap::with_store(0, 2, Box::new(store), JOB_ID, wait).map_err(|e| {
        if e.is_timeout() {
            Error::new(format!(
                "no client joined the store at {addr} within {:.1} s (run `oxccl verbs-perf \
                 TEST --connect THIS_HOST:{}` with the same secret)",
                wait.as_secs_f64(),
                addr.port()
            ))
        } else {
            Error::new(format!(
                "joining the client through the store at {addr}: {e}"
            ))
        }
    })?;
    let mine = Rendezvous {
        port,
        token: random_token()?,
    };
    let all: Vec<Rendezvous> = boot
        .all_gather_serde("control", &mine)
        .map_err(|e| Error::new(format!("exchanging the control port: {e}")))?;
    let theirs = all
        .into_iter()
        .nth(1)
        .ok_or_else(|| Error::new("the store returned no record of the client"))?;
    let left = wait.saturating_sub(start.elapsed()).max(io_timeout);
    let stream = accept_control(&ctl, &mine.token, &theirs.token, left)?;
    drop(ctl);
    let peer = stream.peer_addr()?;
    let local_ip = stream.local_addr()?.ip();
    keepalive(&stream, io_timeout);
    let chan = LineChannel::new(stream.try_clone()?, stream, "client")?;
    Ok((
        Session {
            boot,
            server: Some(server),
            describe: format!("client {peer} (joined the store at {addr})"),
            peer_ip: peer.ip(),
            local_ip,
        },
        chan,
    ))
}

/// The server's side of the control handshake: the first connection that sends `mine` gets
/// `theirs` back.
fn accept_control(
    ctl: &TcpListener,
    mine: &str,
    theirs: &str,
    timeout: Duration,
) -> Result<TcpStream> {
    let deadline = Instant::now() + timeout;
    loop {
        match ctl.accept() {
            Ok((stream, from)) => match handshake_server(&stream, mine, theirs) {
                Ok(()) => return Ok(stream),
                Err(why) => {
                    eprintln!("oxccl verbs-perf: refused a control connection from {from}: {why}")
                }
            },
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                if Instant::now() >= deadline {
                    return Err(Error::new(format!(
                        "the client joined the store but did not open the control connection \
                         to port {} within {:.1} s (a firewall?)",
                        ctl.local_addr().map(|a| a.port()).unwrap_or(0),
                        timeout.as_secs_f64()
                    )));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(Error::new(format!("accepting the control connection: {e}"))),
        }
    }
}

fn handshake_server(
    stream: &TcpStream,
    mine: &str,
    theirs: &str,
) -> std::result::Result<(), String> {
    stream.set_nonblocking(false).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    let line = read_token_line(stream).map_err(|e| format!("no token within 5 s ({e})"))?;
    if !same_token(line.as_bytes(), mine.as_bytes()) {
        return Err("wrong token (not the client that joined the store)".into());
    }
    let mut s = stream;
    s.write_all(format!("{theirs}\n").as_bytes())
        .map_err(|e| e.to_string())?;
    stream.set_read_timeout(None).map_err(|e| e.to_string())?;
    Ok(())
}

/// Reads one token line without reading past it (the control channel's reader takes over).
fn read_token_line(stream: &TcpStream) -> std::io::Result<String> {
    let mut line = Vec::with_capacity(TOKEN_LEN + 1);
    let mut byte = [0u8; 1];
    let mut s = stream;
    while line.len() <= TOKEN_LEN {
        match std::io::Read::read(&mut s, &mut byte)? {
            0 => return Err(std::io::Error::new(ErrorKind::UnexpectedEof, "closed")),
            _ if byte[0] == b'\n' => return Ok(String::from_utf8_lossy(&line).into_owned()),
            _ => line.push(byte[0]),
        }
    }
    Err(std::io::Error::new(ErrorKind::InvalidData, "line too long"))
}

/// `--connect HOST:PORT`: joins the server's store (retrying for up to `wait` while nothing
/// listens), opens the control connection and returns it.
pub fn connect(to: &str, wait: Duration, io_timeout: Duration) -> Result<(Session, LineChannel)> {
    let secret = secret()?;
    let given = with_default_port(to)?;
    let addr = given
        .to_socket_addrs()
        .map_err(|e| Error::new(format!("cannot resolve {given}: {e}")))?
        .next()
        .ok_or_else(|| Error::new(format!("{given} resolves to no address")))?;
    let mut config = Config::new(1, 2, addr.to_string(), secret);
    config.serve_store = false;
    config.timeout = wait;
    config.job_id = JOB_ID.into();
    let start = Instant::now();
    let boot = Bootstrap::new(config).map_err(|e| Error::new(e.to_string()))?;
    let mine = Rendezvous {
        port: 0,
        token: random_token()?,
    };
    let all: Vec<Rendezvous> = boot
        .all_gather_serde("control", &mine)
        .map_err(|e| Error::new(format!("exchanging the control port: {e}")))?;
    let theirs = all
        .into_iter()
        .next()
        .ok_or_else(|| Error::new("the store returned no record of the server"))?;
    let ctl = SocketAddr::new(addr.ip(), theirs.port);
    let left = wait.saturating_sub(start.elapsed()).max(io_timeout);
    let stream = TcpStream::connect_timeout(&ctl, left)
        .map_err(|e| Error::new(format!("opening the control connection to {ctl}: {e}")))?;
    stream.set_read_timeout(Some(io_timeout.max(Duration::from_secs(5))))?;
    (&stream)
        .write_all(format!("{}\n", theirs.token).as_bytes())
        .map_err(|e| Error::new(format!("control handshake with {ctl}: {e}")))?;
    let line = read_token_line(&stream)
        .map_err(|e| Error::new(format!("control handshake with {ctl}: no answer ({e})")))?;
    if !same_token(line.as_bytes(), mine.token.as_bytes()) {
        return Err(Error::new(format!(
            "control handshake with {ctl}: the server answered with the wrong token (it is not \
             the server that joined the store)"
        )));
    }
    stream.set_read_timeout(None)?;
    let local_ip = stream.local_addr()?.ip();
    keepalive(&stream, io_timeout);
    let chan = LineChannel::new(stream.try_clone()?, stream, "server")?;
    Ok((
        Session {
            boot,
            server: None,
            describe: format!("{given} (store), control connection {ctl}"),
            peer_ip: addr.ip(),
            local_ip,
        },
        chan,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_port_is_added_only_when_missing() {
        let ok = |a: &str| with_default_port(a).unwrap();
        assert_eq!(ok("10.0.0.1"), "10.0.0.1:18515");
        assert_eq!(ok("10.0.0.1:99"), "10.0.0.1:99");
        assert_eq!(ok(" host "), "host:18515");
        assert_eq!(ok("host:7"), "host:7");
        assert_eq!(ok("::1"), "[::1]:18515");
        assert_eq!(ok("[::1]:5"), "[::1]:5");
        for bad in [
            "",
            "  ",
            "1.2.3.4:99999",
            "host:",
            "host:x",
            ":5",
            "[::1]:x",
            "a:b:c",
        ] {
            assert!(with_default_port(bad).is_err(), "{bad:?} accepted");
        }
    }
}
