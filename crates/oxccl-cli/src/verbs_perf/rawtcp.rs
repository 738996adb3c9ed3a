//! Raw TCP baselines printed beside the tcp provider's tests: what one TCP connection gives
//! without the library.
//!
//! - `tcp_lat`: two processes ping-ponging `size` bytes over one connection (TCP_NODELAY). With
//!   busy polling (`--busy`, or `OXCCL_TCP_POLL=busy`) both sides spin on non-blocking `recv`;
//!   otherwise they block in `recv`. The floor of any TCP transport's latency in that mode.
//! - `tcp_bw`: one stream of `size`-byte writes (1 MiB by default); the receiver drains it into a
//!   private buffer. The floor of any one-connection TCP transport's bandwidth.
//!
//! The server listens on an ephemeral port of the data address (see
//! [`super::remote::data_ip`]) and tells the client over the control channel, with a random
//! token that the client sends first on the connection: a stranger who connects first is
//! dropped, not measured.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::channel::{Channel, RunSpec, Spin};
use super::error::{Error, Result};
use super::report::Marks;

/// Length of the token that opens a data connection (hex characters).
pub const TOKEN_LEN: usize = 32;

/// A random token of [`TOKEN_LEN`] hex characters.
pub fn random_token() -> Result<String> {
    let mut raw = [0u8; TOKEN_LEN / 2];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut raw))
        .map_err(|e| Error::new(format!("reading random bytes from /dev/urandom: {e}")))?;
    Ok(raw.iter().map(|b| format!("{b:02x}")).collect())
}

/// Compares two byte strings in time independent of where they differ.
pub fn same_token(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The server's listening socket of a raw test.
pub struct RawListener {
    listener: TcpListener,
    addr: SocketAddr,
    token: String,
}

impl RawListener {
    /// Listens on `ip`, on a port the kernel picks.
    pub fn bind(ip: IpAddr) -> Result<Self> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| Error::new(format!("listening for the data connection on {ip}: {e}")))?;
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        Ok(RawListener {
            listener,
            addr,
            token: random_token()?,
        })
    }

    /// The address to announce.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The token the client must send first.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// Accepts the client's connection: the first one that opens with the token within
    /// `timeout`. Others are reported on stderr and closed. Gives up early when the control
    /// channel says the client is gone.
    pub fn accept(
        self,
        chan: &mut dyn Channel,
        timeout: Duration,
        busy: bool,
        io_timeout: Duration,
    ) -> Result<RawConn> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.listener.accept() {
                Ok((stream, from)) => match self.check(&stream) {
                    Ok(()) => return RawConn::new(stream, busy, io_timeout),
                    Err(why) => {
                        eprintln!("oxccl verbs-perf: refused a data connection from {from}: {why}");
                    }
                },
                Err(e)
                    if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted =>
                {
                    chan.check_peer()
                        .map_err(|e| e.context("waiting for the data connection"))?;
                    if Instant::now() >= deadline {
                        return Err(Error::new(format!(
                            "the {} did not open the data connection to {} within {:.1} s",
                            chan.peer_name(),
                            self.addr,
                            timeout.as_secs_f64()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => {
                    return Err(Error::new(format!(
                        "accepting the data connection on {}: {e}",
                        self.addr
                    )));
                }
            }
        }
    }

    /// Reads and checks the token a new connection opens with.
    fn check(&self, stream: &TcpStream) -> std::result::Result<(), String> {
        let mut s = stream;
        s.set_nonblocking(false).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(2)))
            .map_err(|e| e.to_string())?;
        let mut got = [0u8; TOKEN_LEN];
        s.read_exact(&mut got)
            .map_err(|e| format!("no token within 2 s ({e})"))?;
        if !same_token(&got, self.token.as_bytes()) {
            return Err("wrong token".into());
        }
        Ok(())
    }
}

/// One end of the data connection of a raw test.
pub struct RawConn {
    stream: TcpStream,
    busy: bool,
    timeout: Duration,
    peer: String,
}

impl RawConn {
    /// Configures an accepted or connected stream: TCP_NODELAY; non-blocking when busy-polling,
    /// else blocking with `timeout` on every read and write.
    fn new(stream: TcpStream, busy: bool, timeout: Duration) -> Result<Self> {
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "the peer".into());
        stream.set_nodelay(true)?;
        if busy {
            stream.set_nonblocking(true)?;
        } else {
            stream.set_nonblocking(false)?;
            stream.set_read_timeout(Some(timeout))?;
            stream.set_write_timeout(Some(timeout))?;
        }
        Ok(RawConn {
            stream,
            busy,
            timeout,
            peer,
        })
    }

    /// Connects to the server's data listener at `addr` and sends `token`.
    pub fn connect(addr: SocketAddr, token: &str, busy: bool, timeout: Duration) -> Result<Self> {
        let mut stream = TcpStream::connect_timeout(&addr, timeout)
            .map_err(|e| Error::new(format!("opening the data connection to {addr}: {e}")))?;
        stream.set_write_timeout(Some(timeout))?;
        stream
            .write_all(token.as_bytes())
            .map_err(|e| Error::new(format!("sending the token to {addr}: {e}")))?;
        RawConn::new(stream, busy, timeout)
    }

    /// Maps an I/O error of the data connection to a message.
    fn io_error(&self, e: std::io::Error, what: &str) -> Error {
        match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => Error::new(format!(
                "no progress for {:.1} s while {what} (is the peer at {} stuck?)",
                self.timeout.as_secs_f64(),
                self.peer
            )),
            _ => Error::new(format!(
                "the data connection to {} failed while {what}: {e}",
                self.peer
            )),
        }
    }

    /// Sends all of `buf`.
    fn send_all(&mut self, mut buf: &[u8], spin: &mut Spin<'_>) -> Result<()> {
        while !buf.is_empty() {
            match self.stream.write(buf) {
                Ok(0) => return Err(Error::new(format!("the peer at {} is gone", self.peer))),
                Ok(n) => {
                    buf = &buf[n..];
                    spin.progress();
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if self.busy && e.kind() == ErrorKind::WouldBlock => {
                    spin.turn(&|| "room in the socket's send buffer".into())?;
                }
                Err(e) => return Err(self.io_error(e, "sending")),
            }
        }
        Ok(())
    }

    /// Receives exactly `buf.len()` bytes.
    fn recv_exact(&mut self, mut buf: &mut [u8], spin: &mut Spin<'_>) -> Result<()> {
        while !buf.is_empty() {
            match self.stream.read(buf) {
                Ok(0) => {
                    return Err(Error::new(format!(
                        "the peer at {} closed the data connection",
                        self.peer
                    )));
                }
                Ok(n) => {
                    buf = &mut buf[n..];
                    spin.progress();
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if self.busy && e.kind() == ErrorKind::WouldBlock => {
                    spin.turn(&|| "data from the peer".into())?;
                }
                Err(e) => return Err(self.io_error(e, "receiving")),
            }
        }
        Ok(())
    }

    /// Drains `n` bytes through `buf`.
    fn drain(&mut self, mut n: u64, buf: &mut [u8], spin: &mut Spin<'_>) -> Result<()> {
        while n > 0 {
            let k = buf.len().min(usize::try_from(n).unwrap_or(usize::MAX));
            match self.stream.read(&mut buf[..k]) {
                Ok(0) => {
                    return Err(Error::new(format!(
                        "the peer at {} closed the data connection with {n} bytes to come",
                        self.peer
                    )));
                }
                Ok(got) => {
                    n -= got as u64;
                    spin.progress();
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if self.busy && e.kind() == ErrorKind::WouldBlock => {
                    spin.turn(&|| "data from the peer".into())?;
                }
                Err(e) => return Err(self.io_error(e, "receiving")),
            }
        }
        Ok(())
    }

    /// The client's side of `tcp_lat`: `warmup + iters` round trips; per-round-trip nanoseconds.
    pub fn lat_client(&mut self, spin: &mut Spin<'_>, run: &RunSpec) -> Result<Vec<u64>> {
        let out = vec![0xa5u8; run.size];
        let mut inb = vec![0u8; run.size];
        let mut samples = Vec::with_capacity(run.iters as usize);
        let mut last = Instant::now();
        for i in 0..run.warmup + run.iters {
            self.send_all(&out, spin)?;
            self.recv_exact(&mut inb, spin)?;
            let now = Instant::now();
            if i >= run.warmup {
                samples.push((now - last).as_nanos() as u64);
            }
            last = now;
        }
        Ok(samples)
    }

    /// The server's side of `tcp_lat`: answers every message with one of the same size.
    pub fn lat_server(&mut self, spin: &mut Spin<'_>, run: &RunSpec) -> Result<()> {
        let mut buf = vec![0u8; run.size];
        for _ in 0..run.warmup + run.iters {
            self.recv_exact(&mut buf, spin)?;
            self.send_all(&buf, spin)?;
        }
        Ok(())
    }

    /// The client's side of `tcp_bw`: `warmup` writes, the server's acknowledgement, then
    /// `iters` measured writes and the acknowledgement that the server has read them all.
    pub fn bw_client(&mut self, spin: &mut Spin<'_>, run: &RunSpec) -> Result<Marks> {
        let buf = vec![0xa5u8; run.size];
        let mut ack = [0u8; 1];
        let every = (run.iters / 1000).max(1);
        let mut marks = Marks::new(run.iters, every);
        if run.warmup > 0 {
            for _ in 0..run.warmup {
                self.send_all(&buf, spin)?;
            }
            self.recv_exact(&mut ack, spin)?;
        }
        marks.start();
        for i in 1..=run.iters {
            self.send_all(&buf, spin)?;
            if i % every == 0 {
                marks.mark(i);
            }
        }
        self.recv_exact(&mut ack, spin)?;
        // The end of the run: when the server has received the last byte.
        marks.mark(run.iters);
        Ok(marks)
    }

    /// The server's side of `tcp_bw`: drains the warm-up and acknowledges it, then drains the
    /// measured writes and acknowledges them.
    pub fn bw_server(&mut self, spin: &mut Spin<'_>, run: &RunSpec) -> Result<()> {
        let mut buf = vec![0u8; run.size.clamp(64 << 10, 4 << 20)];
        let size = run.size as u64;
        if run.warmup > 0 {
            self.drain(run.warmup * size, &mut buf, spin)?;
            self.send_all(&[1], spin)?;
        }
        self.drain(run.iters * size, &mut buf, spin)?;
        self.send_all(&[1], spin)
    }
}
