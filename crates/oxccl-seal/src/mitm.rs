//! A man in the middle, for tests: a TCP proxy that forwards a wire's bytes both ways, changes
//! one record of one direction on the way (flips a bit, replays it, drops it, or swaps it with
//! the next) and keeps a copy of everything it forwarded, for tests to check that a tamper is
//! caught and that the bytes say nothing to a stranger.
//!
//! A wire starts with a cleartext handshake before its records; the test says how long it is
//! with [`Plan::handshake`], from the bytes seen so far in one direction (read a byte at a
//! time there, so nothing past the handshake is forwarded before the proxy knows it).
//!
//! ```
//! use std::io::{Read, Write};
//! use std::net::{TcpListener, TcpStream};
//! use oxccl_seal::mitm::{Plan, Proxy, Tamper, Toward};
//!
//! let server = TcpListener::bind("127.0.0.1:0")?;
//! let proxy = Proxy::start(server.local_addr()?, Plan::new(Tamper::None, Toward::Target))?;
//! let mut c = TcpStream::connect(proxy.addr())?;
//! let (mut s, _) = server.accept()?;
//! c.write_all(b"abc")?;
//! let mut got = [0u8; 3];
//! s.read_exact(&mut got)?;
//! assert_eq!(&got, b"abc");
//! # Ok::<(), std::io::Error>(())
//! ```

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::HEADER_LEN;

/// Whether `needle` occurs in `hay`: what a test asks of the bytes a proxy captured (an
/// address, a key's name, a payload must not be there).
pub fn holds(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

/// What the proxy does to the planned direction's records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tamper {
    /// Forwards everything unchanged.
    None,
    /// Flips one bit in the middle of record `record`'s body.
    FlipBit {
        /// Which record (0: the first after the handshake).
        record: u64,
    },
    /// Forwards record `record` twice.
    Replay {
        /// Which record.
        record: u64,
    },
    /// Forwards every record but `record`.
    Drop {
        /// Which record.
        record: u64,
    },
    /// Forwards record `record + 1` before record `record`.
    Swap {
        /// The first of the two.
        record: u64,
    },
    /// Flips one bit of the byte at `offset` of the direction, counted from its first byte,
    /// handshake or not: for a wire whose handshake the test does not parse (a flip past the
    /// handshake lands in some record).
    FlipAt {
        /// The byte's offset.
        offset: u64,
    },
}

/// A direction of the proxied connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Toward {
    /// From the client (who connected to the proxy) to the target.
    Target,
    /// From the target back to the client.
    Client,
}

/// What to tamper with, where.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    /// What to do.
    pub tamper: Tamper,
    /// In which direction.
    pub toward: Toward,
    /// On which accepted connection (0: the first).
    pub connection: usize,
    /// How many cleartext bytes precede the records in a direction, once the bytes seen so far
    /// in it tell (`None`: not yet). The default says 0: records from the first byte.
    pub handshake: fn(Toward, &[u8]) -> Option<usize>,
}

impl Plan {
    /// `tamper` toward `toward`, on the first connection, with no cleartext handshake.
    pub fn new(tamper: Tamper, toward: Toward) -> Plan {
        Plan {
            tamper,
            toward,
            connection: 0,
            handshake: |_, _| Some(0),
        }
    }
}

struct Shared {
    plan: Plan,
    tampered: AtomicBool,
    captured: Mutex<Vec<u8>>,
    stop: AtomicBool,
}

/// The proxy; it stops accepting when dropped (connections under way run until they close).
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

/// The most bytes [`Proxy::captured`] keeps.
const CAPTURE_MAX: usize = 256 << 20;

impl Proxy {
    /// A proxy on 127.0.0.1 in front of `target`.
    pub fn start(target: SocketAddr, plan: Plan) -> io::Result<Proxy> {
        Proxy::start_on(SocketAddr::from(([127, 0, 0, 1], 0)), target, plan)
    }

    /// A proxy listening on `bind` (a namespace host's address) in front of `target`.
    pub fn start_on(bind: SocketAddr, target: SocketAddr, plan: Plan) -> io::Result<Proxy> {
        let listener = TcpListener::bind(bind)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            plan,
            tampered: AtomicBool::new(false),
            captured: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        std::thread::Builder::new()
            .name("mitm-accept".into())
            .spawn(move || accept_loop(listener, target, s))?;
        Ok(Proxy { addr, shared })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether the planned tamper was done (assert it: a test whose tamper never happened
    /// proves nothing).
    pub fn tampered(&self) -> bool {
        self.shared.tampered.load(Ordering::SeqCst)
    }

    /// [`Proxy::tampered`], waiting up to `within` for it: a swap is marked once the later
    /// record has gone, which the reader may have refused (and the test gone on) already.
    pub fn tampered_within(&self, within: Duration) -> bool {
        let end = Instant::now() + within;
        while !self.tampered() && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.tampered()
    }

    /// Every byte forwarded so far, both directions, every connection, in arrival order of
    /// their chunks (up to 256 MiB).
    pub fn captured(&self) -> Vec<u8> {
        self.shared
            .captured
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop.
        let _ = TcpStream::connect(self.addr);
    }
}

fn accept_loop(listener: TcpListener, target: SocketAddr, shared: Arc<Shared>) {
    let count = AtomicUsize::new(0);
    for client in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(client) = client else { continue };
        // The target may not listen yet (a client would retry): retry for a while.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let server = loop {
            match TcpStream::connect(target) {
                Ok(s) => break Some(s),
                Err(_) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                Err(_) => break None,
            }
        };
        let Some(server) = server else { continue };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let index = count.fetch_add(1, Ordering::SeqCst);
        for toward in [Toward::Target, Toward::Client] {
            let (from, to) = match toward {
                Toward::Target => (client.try_clone(), server.try_clone()),
                Toward::Client => (server.try_clone(), client.try_clone()),
            };
            let (Ok(from), Ok(to)) = (from, to) else {
                continue;
            };
            let planned = index == shared.plan.connection
                && toward == shared.plan.toward
                && shared.plan.tamper != Tamper::None;
            let s = shared.clone();
            let _ = std::thread::Builder::new()
                .name("mitm-pipe".into())
                .spawn(move || {
                    let _ = if let (true, Tamper::FlipAt { offset }) = (planned, s.plan.tamper) {
                        pipe_flip_at(&from, &to, offset, &s)
                    } else if planned {
                        pipe_records(&from, &to, toward, &s)
                    } else {
                        pipe_raw(&from, &to, &s)
                    };
                    let _ = to.shutdown(Shutdown::Write);
                    let _ = from.shutdown(Shutdown::Read);
                });
        }
    }
}

fn forward(to: &TcpStream, bytes: &[u8], shared: &Shared) -> io::Result<()> {
    {
        let mut c = shared.captured.lock().unwrap_or_else(|e| e.into_inner());
        if c.len() + bytes.len() <= CAPTURE_MAX {
            c.extend_from_slice(bytes);
        }
    }
    (&mut &*to).write_all(bytes)
}

fn pipe_raw(from: &TcpStream, to: &TcpStream, shared: &Shared) -> io::Result<()> {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = (&mut &*from).read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        forward(to, &buf[..n], shared)?;
    }
}

/// [`pipe_raw`], flipping a bit of the byte at `offset`.
fn pipe_flip_at(from: &TcpStream, to: &TcpStream, offset: u64, shared: &Shared) -> io::Result<()> {
    let mut buf = vec![0u8; 64 << 10];
    let mut at = 0u64;
    loop {
        let n = (&mut &*from).read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        if (at..at + n as u64).contains(&offset) {
            buf[(offset - at) as usize] ^= 0x10;
            shared.tampered.store(true, Ordering::SeqCst);
        }
        at += n as u64;
        forward(to, &buf[..n], shared)?;
    }
}

/// Reads exactly `buf.len()` bytes; `Ok(false)` if the stream ended before the first.
fn read_all(from: &TcpStream, buf: &mut [u8]) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match (&mut &*from).read(&mut buf[got..])? {
            0 if got == 0 => return Ok(false),
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n => got += n,
        }
    }
    Ok(true)
}

fn pipe_records(
    from: &TcpStream,
    to: &TcpStream,
    toward: Toward,
    shared: &Shared,
) -> io::Result<()> {
    // The cleartext handshake, a byte at a time until its length is known.
    let mut seen = Vec::new();
    loop {
        match (shared.plan.handshake)(toward, &seen) {
            Some(n) if n <= seen.len() => break,
            Some(n) => {
                let mut rest = vec![0u8; n - seen.len()];
                if !read_all(from, &mut rest)? {
                    return Ok(());
                }
                forward(to, &rest, shared)?;
                seen.extend_from_slice(&rest);
            }
            None => {
                let mut b = [0u8; 1];
                if !read_all(from, &mut b)? {
                    return Ok(());
                }
                forward(to, &b, shared)?;
                seen.push(b[0]);
            }
        }
    }
    let mut held: Option<Vec<u8>> = None;
    for k in 0u64.. {
        let mut record = vec![0u8; HEADER_LEN];
        if !read_all(from, &mut record)? {
            if let Some(h) = held.take() {
                forward(to, &h, shared)?;
            }
            return Ok(());
        }
        let body = u32::from_le_bytes([record[0], record[1], record[2], record[3]]) as usize;
        record.resize(HEADER_LEN + body.min(crate::MAX_RECORD + crate::TAG_LEN), 0);
        read_all(from, &mut record[HEADER_LEN..])?;
        match shared.plan.tamper {
            Tamper::FlipBit { record: r } if r == k => {
                let mid = HEADER_LEN + (record.len() - HEADER_LEN) / 2;
                record[mid] ^= 0x10;
                shared.tampered.store(true, Ordering::SeqCst);
                forward(to, &record, shared)?;
            }
            Tamper::Replay { record: r } if r == k => {
                forward(to, &record, shared)?;
                shared.tampered.store(true, Ordering::SeqCst);
                forward(to, &record, shared)?;
            }
            Tamper::Drop { record: r } if r == k => {
                shared.tampered.store(true, Ordering::SeqCst);
            }
            Tamper::Swap { record: r } if r == k => held = Some(record),
            Tamper::Swap { record: r } if r + 1 == k => {
                // Marked before the receiver can see the swap (it may fail at once).
                shared.tampered.store(true, Ordering::SeqCst);
                forward(to, &record, shared)?;
                if let Some(h) = held.take() {
                    forward(to, &h, shared)?;
                }
            }
            _ => forward(to, &record, shared)?,
        }
    }
    Ok(())
}
