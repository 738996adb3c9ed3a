//! The verbs tests: resources, the initiator's loops and the target's roles.
//!
//! Each side owns one queue pair, a send and a receive completion queue and two provider-memory
//! regions (`alloc_mr`, the zero-copy path): `target`, which the peer WRITEs, READs and runs
//! atomics on (and where receives land), and `source`, the local buffer WRITEs and SENDs gather
//! from and READs and atomics scatter into.
//!
//! A ping-pong side that waits by watching memory (write_lat) drives its provider's progress in
//! the loop when that progress is software (tcp, ofi: [`CompletionQueue::progress`]).
//!
//! Waiting for completions spins on the completion queue (perftest's default), or with `events`
//! (`-e`, perftest's `--events`) sleeps in [`CompletionQueue::wait`], which leaves the CPU to
//! whoever needs it: the tcp provider's progress threads, on a machine with few cores.

use std::cell::Cell;
use std::time::{Duration, Instant};

use oxccl_verbs::{
    AccessFlags, CompletionQueue, Context, Device, MemoryRegion, QpConfig, QpEndpoint, QueuePair,
    RecvWr, RemoteBuffer, SendWr, Sge, WcOpcode, WcStatus, WorkCompletion, WrOp,
};

use super::Test;
use super::channel::Spin;
use super::error::{Error, Result};
use super::report::Marks;

/// Ping-pong loops signal one request in this many (and always the last), as perftest does with
/// its completion moderation; the others complete silently.
const LAT_SIGNAL_EVERY: u64 = 64;

/// How long one sleep on a completion queue lasts before the peer and the timeout are checked.
const EVENT_SLICE: Duration = Duration::from_millis(50);

/// One side of a verbs test.
pub struct VerbsSide {
    // Field order is drop order: the queue pair before its queues and regions.
    qp: QueuePair,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    target: MemoryRegion,
    source: MemoryRegion,
    remote: Option<RemoteBuffer>,
    _ctx: Context,
    max_size: usize,
    rx_posted: Cell<u64>,
    fetch_add_seen: Cell<u64>,
    events: bool,
    /// The provider's progress is software (not shm): a side that waits by watching memory
    /// polls its completion queue too, so that the peer's WRITE is read in this thread.
    drive: bool,
}

impl VerbsSide {
    /// Opens the device and allocates everything for messages up to `max_size` bytes. With
    /// `events`, completion waits sleep instead of spinning.
    pub fn open(
        provider: oxccl_verbs::Provider,
        max_size: usize,
        tx_depth: u32,
        rx_depth: u32,
        events: bool,
    ) -> Result<Self> {
        super::channel::yield_often(provider == oxccl_verbs::Provider::Tcp);
        let ctx = Device::by_name(provider.name())?
            .open()
            .map_err(|e| Error::from(e).context(format!("opening the {provider} device")))?;
        let pd = ctx.alloc_pd()?;
        let send_cq = ctx.create_cq(tx_depth as usize * 2)?;
        let recv_cq = ctx.create_cq(rx_depth as usize * 2)?;
        let cfg = QpConfig {
            max_send_wr: (tx_depth * 2).max(QpConfig::default().max_send_wr),
            max_recv_wr: rx_depth,
            ..QpConfig::default()
        };
        let qp = pd.create_qp(&send_cq, &recv_cq, &cfg)?;
        // Room for the 8-byte word that holds the last byte of any message (see `Watch`).
        let len = max_size.div_ceil(64).max(1) * 64;
        let target = pd
            .alloc_mr(len, AccessFlags::ALL)
            .map_err(|e| Error::from(e).context(format!("allocating a {len}-byte region")))?;
        let source = pd
            .alloc_mr(len, AccessFlags::LOCAL_WRITE)
            .map_err(|e| Error::from(e).context(format!("allocating a {len}-byte region")))?;
        source.fill(0xa5);
        Ok(VerbsSide {
            qp,
            send_cq,
            recv_cq,
            target,
            source,
            remote: None,
            _ctx: ctx,
            max_size,
            rx_posted: Cell::new(0),
            fetch_add_seen: Cell::new(0),
            events,
            drive: provider != oxccl_verbs::Provider::Shm,
        })
    }

    /// What the peer needs: our queue pair endpoint and target region.
    pub fn local(&self) -> (QpEndpoint, RemoteBuffer) {
        (self.qp.endpoint(), self.target.remote())
    }

    /// Connects to the peer's queue pair and records its target region. For the send tests,
    /// `rx_depth` receives are posted before returning.
    pub fn connect(
        &mut self,
        peer: &QpEndpoint,
        buf: RemoteBuffer,
        test: Test,
        rx_depth: u32,
    ) -> Result<()> {
        if buf.len < self.max_size as u64 {
            return Err(Error::new(format!(
                "the peer's region has {} bytes, the test needs {}",
                buf.len, self.max_size
            )));
        }
        self.qp
            .connect(peer)
            .map_err(|e| Error::from(e).context("connecting the queue pair"))?;
        self.remote = Some(buf);
        if matches!(test, Test::SendLat | Test::SendBw) {
            self.post_recvs(rx_depth as u64)?;
        }
        Ok(())
    }

    fn remote(&self) -> Result<RemoteBuffer> {
        self.remote
            .ok_or_else(|| Error::new("internal error: queue pair not connected"))
    }

    fn post_recvs(&self, n: u64) -> Result<()> {
        let sge = [Sge::new(&self.target, 0, self.max_size)];
        let mut wrs = Vec::with_capacity(n.min(64) as usize);
        let mut left = n;
        while left > 0 {
            wrs.clear();
            for _ in 0..left.min(64) {
                let id = self.rx_posted.get() + 1;
                self.rx_posted.set(id);
                wrs.push(RecvWr::new(id, &sge));
            }
            left -= wrs.len() as u64;
            self.qp
                .post_recv(&wrs)
                .map_err(|e| Error::from(e).context("posting receives"))?;
        }
        Ok(())
    }

    /// The initiator's part of a latency test; returns per-operation times in nanoseconds.
    pub fn lat_client(
        &self,
        test: Test,
        spin: &mut Spin<'_>,
        run: &super::channel::RunSpec,
    ) -> Result<Vec<u64>> {
        let mut samples = Vec::with_capacity(run.iters as usize);
        let total = run.warmup + run.iters;
        let mut last = Instant::now();
        let mut stamp = |i: u64, samples: &mut Vec<u64>| {
            let now = Instant::now();
            if i >= run.warmup {
                samples.push((now - last).as_nanos() as u64);
            }
            last = now;
        };
        match test {
            Test::WriteLat => {
                let remote = self.remote()?.at(0);
                let watch = Watch::new(&self.target, run.size)?;
                let sge = [Sge::new(&self.source, 0, run.size)];
                for i in 0..total {
                    let seq = run.seq + i + 1;
                    self.write_seq(&sge, remote, &watch, seq, i + 1 == total, i, spin)?;
                    watch.wait(seq, spin, self.drive.then_some(&self.recv_cq))?;
                    stamp(i, &mut samples);
                }
            }
            Test::SendLat => {
                let sge = [Sge::new(&self.source, 0, run.size)];
                for i in 0..total {
                    self.send_one(&sge, i + 1 == total, i, spin)?;
                    self.recv_one(run.size, spin)?;
                    stamp(i, &mut samples);
                }
            }
            Test::ReadLat => {
                let remote = self.remote()?.at(0);
                let sge = [Sge::new(&self.source, 0, run.size)];
                for i in 0..total {
                    let wr = SendWr::new(i, WrOp::Read { remote }, &sge);
                    self.post(&[wr])?;
                    self.wait_send(spin, WcOpcode::Read)?;
                    stamp(i, &mut samples);
                }
            }
            Test::AtomicLat => {
                let remote = self.remote()?.at(0);
                let sge = [Sge::new(&self.source, 0, 8)];
                let old = self.source.atomic_u64(0)?;
                for i in 0..total {
                    let wr = SendWr::new(i, WrOp::FetchAdd { remote, add: 1 }, &sge);
                    self.post(&[wr])?;
                    self.wait_send(spin, WcOpcode::FetchAdd)?;
                    stamp(i, &mut samples);
                    let got = old.load(std::sync::atomic::Ordering::Relaxed);
                    let want = self.fetch_add_seen.get();
                    if got != want {
                        return Err(Error::new(format!(
                            "fetch-and-add #{want} returned {got}, expected {want}: the remote \
                             word was not updated atomically"
                        )));
                    }
                    self.fetch_add_seen.set(want + 1);
                }
            }
            _ => return Err(Error::new(format!("{test} is not a latency test"))),
        }
        Ok(samples)
    }

    /// The target's part of a ping-pong latency test (write_lat, send_lat): answer every message.
    pub fn lat_server(
        &self,
        test: Test,
        spin: &mut Spin<'_>,
        run: &super::channel::RunSpec,
    ) -> Result<()> {
        let total = run.warmup + run.iters;
        match test {
            Test::WriteLat => {
                let remote = self.remote()?.at(0);
                let watch = Watch::new(&self.target, run.size)?;
                let sge = [Sge::new(&self.source, 0, run.size)];
                for i in 0..total {
                    let seq = run.seq + i + 1;
                    watch.wait(seq, spin, self.drive.then_some(&self.recv_cq))?;
                    self.write_seq(&sge, remote, &watch, seq, i + 1 == total, i, spin)?;
                }
            }
            Test::SendLat => {
                let sge = [Sge::new(&self.source, 0, run.size)];
                for i in 0..total {
                    self.recv_one(run.size, spin)?;
                    self.send_one(&sge, i + 1 == total, i, spin)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Stamps `seq` into the watched word of the source and WRITEs the message.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn write_seq(
        &self,
        sge: &[Sge<'_>],
        remote: oxccl_verbs::RemoteAddr,
        watch: &Watch<'_>,
        seq: u64,
        last: bool,
        i: u64,
        spin: &mut Spin<'_>,
    ) -> Result<()> {
        self.source
            .write(watch.off, &seq.to_le_bytes()[..watch.n])?;
        self.post_lat(seq, WrOp::Write { remote }, sge, last, i, spin)
    }

    #[inline]
    fn send_one(&self, sge: &[Sge<'_>], last: bool, i: u64, spin: &mut Spin<'_>) -> Result<()> {
        self.post_lat(i, WrOp::Send, sge, last, i, spin)
    }

    /// Posts one request of a latency loop, signaled every `LAT_SIGNAL_EVERY` and on the last
    /// iteration, and waits for the signaled ones to complete.
    #[inline]
    fn post_lat(
        &self,
        wr_id: u64,
        op: WrOp,
        sge: &[Sge<'_>],
        last: bool,
        i: u64,
        spin: &mut Spin<'_>,
    ) -> Result<()> {
        let signaled = last || (i + 1).is_multiple_of(LAT_SIGNAL_EVERY);
        let opcode = op.wc_opcode();
        let mut wr = SendWr::new(wr_id, op, sge);
        if !signaled {
            wr = wr.unsignaled();
        }
        self.post(&[wr])?;
        if signaled {
            self.wait_send(spin, opcode)?;
        }
        Ok(())
    }

    /// Waits for one receive completion of `size` bytes and re-posts a receive.
    #[inline]
    fn recv_one(&self, size: usize, spin: &mut Spin<'_>) -> Result<()> {
        let mut wc = [WorkCompletion::EMPTY; 1];
        self.await_cq(&self.recv_cq, &mut wc, spin, &|| {
            "a receive completion".into()
        })?;
        check_wc(&wc[0], WcOpcode::Recv, &self.qp)?;
        if wc[0].byte_len as usize != size {
            return Err(Error::new(format!(
                "received {} bytes, expected {size}",
                wc[0].byte_len
            )));
        }
        self.post_recvs(1)
    }

    #[inline]
    fn post(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        self.qp
            .post_send(wrs)
            .map_err(|e| Error::from(e).context("posting a send request"))
    }

    /// Waits until one send completion arrives and checks it.
    #[inline]
    fn wait_send(&self, spin: &mut Spin<'_>, op: WcOpcode) -> Result<()> {
        let mut wc = [WorkCompletion::EMPTY; 1];
        self.await_cq(&self.send_cq, &mut wc, spin, &|| {
            format!("a {op:?} completion")
        })?;
        check_wc(&wc[0], op, &self.qp)
    }

    /// Waits for completions on `cq` (at least one; at most `wc.len()`): spins, or with
    /// `events` sleeps in slices, checking the peer and the timeout between them.
    #[inline]
    fn await_cq(
        &self,
        cq: &CompletionQueue,
        wc: &mut [WorkCompletion],
        spin: &mut Spin<'_>,
        what: &dyn Fn() -> String,
    ) -> Result<usize> {
        loop {
            let n = if self.events {
                match cq.wait(wc, EVENT_SLICE) {
                    Ok(n) => n,
                    Err(oxccl_verbs::Error::Timeout { .. }) => 0,
                    Err(e) => return Err(Error::from(e).context(format!("waiting for {}", what()))),
                }
            } else {
                cq.poll(wc)
            };
            if n > 0 {
                spin.progress();
                return Ok(n);
            }
            if self.events {
                spin.idle(what)?;
            } else {
                spin.turn(what)?;
            }
        }
    }

    /// The initiator's part of a bandwidth test: `warmup` then `iters` requests with up to
    /// `tx_depth` outstanding, a signaled one every `cq_mod`.
    pub fn bw_client(
        &self,
        test: Test,
        spin: &mut Spin<'_>,
        run: &super::channel::RunSpec,
        tx_depth: u32,
    ) -> Result<Marks> {
        let remote = self.remote()?.at(0);
        let op = match test {
            Test::WriteBw => WrOp::Write { remote },
            Test::ReadBw => WrOp::Read { remote },
            Test::SendBw => WrOp::Send,
            _ => return Err(Error::new(format!("{test} is not a bandwidth test"))),
        };
        let tx_depth = tx_depth as u64;
        let cq_mod = (tx_depth / 2).clamp(1, 64);
        let sge = [Sge::new(&self.source, 0, run.size)];
        let mut marks = Marks::new(run.iters, cq_mod);
        if run.warmup > 0 {
            self.stream(op, &sge, run.warmup, tx_depth, cq_mod, spin, &mut marks)?;
        }
        marks.start();
        self.stream(op, &sge, run.iters, tx_depth, cq_mod, spin, &mut marks)?;
        Ok(marks)
    }

    #[allow(clippy::too_many_arguments)]
    fn stream(
        &self,
        op: WrOp,
        sge: &[Sge<'_>],
        count: u64,
        tx_depth: u64,
        cq_mod: u64,
        spin: &mut Spin<'_>,
        marks: &mut Marks,
    ) -> Result<()> {
        let opcode = op.wc_opcode();
        let mut wrs: Vec<SendWr<'_>> = Vec::with_capacity(cq_mod as usize);
        let mut wc = [WorkCompletion::EMPTY; 16];
        let (mut posted, mut completed) = (0u64, 0u64);
        while completed < count {
            let room = tx_depth - (posted - completed);
            if room > 0 && posted < count {
                let k = room.min(count - posted).min(cq_mod);
                wrs.clear();
                for j in 1..=k {
                    let id = posted + j;
                    let wr = SendWr::new(id, op, sge);
                    wrs.push(if id % cq_mod == 0 || id == count {
                        wr
                    } else {
                        wr.unsignaled()
                    });
                }
                self.post(&wrs)?;
                posted += k;
            }
            let mut n = self.send_cq.poll(&mut wc);
            if n == 0 {
                if posted - completed < tx_depth && posted < count {
                    continue;
                }
                // The send queue is full, or all is posted: wait.
                n = self.await_cq(&self.send_cq, &mut wc, spin, &|| {
                    format!("{opcode:?} completions")
                })?;
            }
            for c in &wc[..n] {
                check_wc(c, opcode, &self.qp)?;
                completed = completed.max(c.wr_id);
            }
            spin.progress();
            marks.mark(completed);
        }
        Ok(())
    }

    /// The target's part of send_bw: keep receives posted and count `warmup + iters` messages.
    pub fn bw_server_recv(&self, spin: &mut Spin<'_>, run: &super::channel::RunSpec) -> Result<()> {
        let total = run.warmup + run.iters;
        let mut wc = [WorkCompletion::EMPTY; 64];
        let mut got = 0u64;
        while got < total {
            let n = self.await_cq(&self.recv_cq, &mut wc, spin, &|| {
                format!("receive #{} of {total}", got + 1)
            })?;
            for c in &wc[..n] {
                check_wc(c, WcOpcode::Recv, &self.qp)?;
                if c.byte_len as usize != run.size {
                    return Err(Error::new(format!(
                        "received {} bytes, expected {}",
                        c.byte_len, run.size
                    )));
                }
            }
            got += n as u64;
            self.post_recvs(n as u64)?;
        }
        Ok(())
    }
}

/// Checks a completion: success and the expected opcode; errors name the status.
fn check_wc(wc: &WorkCompletion, op: WcOpcode, qp: &QueuePair) -> Result<()> {
    if wc.status != WcStatus::Success {
        let detail = qp
            .error_detail()
            .map(|d| format!(" ({d})"))
            .unwrap_or_default();
        let hint = match wc.status {
            WcStatus::RetryExceeded => ": the peer is gone",
            WcStatus::RnrRetryExceeded => ": the peer posted no receive in time",
            WcStatus::RemoteAccessError => ": the peer refused the access (rkey, range, flags)",
            WcStatus::WorkRequestFlushed => {
                ": the queue pair is in the error state (an earlier request failed or the peer \
                 went away)"
            }
            _ => "",
        };
        return Err(Error::new(format!(
            "{op:?} request {} completed with {}{hint}{detail}",
            wc.wr_id, wc.status
        )));
    }
    if wc.opcode != op && !(op == WcOpcode::Recv && wc.opcode == WcOpcode::RecvRdmaWithImm) {
        return Err(Error::new(format!(
            "expected a {op:?} completion, got {:?} (wr_id {})",
            wc.opcode, wc.wr_id
        )));
    }
    Ok(())
}

/// The word a ping-pong side spins on: the naturally aligned 8-byte word holding the message's
/// last byte. The sender stamps the low `n` bytes of a sequence number into bytes `off..size`
/// of its message; the receiver compares the same bytes of its target region. Consecutive
/// numbers differ in their low byte, so a stale value never matches.
pub struct Watch<'a> {
    word: &'a std::sync::atomic::AtomicU64,
    off: usize,
    n: usize,
}

impl<'a> Watch<'a> {
    /// The watch for messages of `size` bytes landing at offset 0 of `mr`.
    pub fn new(mr: &'a MemoryRegion, size: usize) -> Result<Self> {
        let off = (size.max(1) - 1) & !7;
        Ok(Watch {
            word: mr.atomic_u64(off)?,
            off,
            n: size - off,
        })
    }

    #[inline]
    fn mask(&self) -> u64 {
        if self.n >= 8 {
            u64::MAX
        } else {
            (1u64 << (8 * self.n)) - 1
        }
    }

    /// Spins until the watched bytes hold `seq`, driving `cq`'s progress each turn (a
    /// provider whose progress is software; `ucp_worker_progress` in UCX's perftest).
    #[inline]
    pub fn wait(&self, seq: u64, spin: &mut Spin<'_>, cq: Option<&CompletionQueue>) -> Result<()> {
        let mask = self.mask();
        let want = seq & mask;
        // Little-endian: byte `off` of the region is the low byte of the word.
        let arrived = || self.word.load(std::sync::atomic::Ordering::Acquire) & mask == want;
        while !arrived() {
            if let Some(cq) = cq {
                cq.progress();
                // What the progress landed is seen before the turn's pause, as a raw `recv`
                // loop sees its bytes.
                if arrived() {
                    break;
                }
            }
            spin.turn(&|| format!("the peer's message #{seq}"))?;
        }
        spin.progress();
        Ok(())
    }
}
