//! A compressed sum all-reduce whose result is the same bits on every rank (issue 17): block
//! floating point ([`oxccl_core::compress`]) with exponents the ranks agree on, mantissas
//! summed as integers, and the sums sent back compressed.
//!
//! The steps, each an ordinary collective of this communicator:
//! 1. every rank computes its blocks' exponents and the ranks take their max (an all-reduce of
//!    `u8`, one byte per block: 1/128 of an `f32` buffer at blocks of 32);
//! 2. every rank quantises its values to those exponents (one rounding, to nearest even), so
//!    that mantissas of one block mean the same unit on every rank;
//! 3. an all-to-all sends each rank the `i8` mantissas of the blocks it owns (a share of the
//!    blocks per rank; `bfp4` packs two mantissas a byte);
//! 4. each rank adds the mantissas of its blocks as integers (`i16`: no overflow up to
//!    [`compress::max_ranks`] ranks), exactly and in any order, and re-encodes the sums in the
//!    same format ([`compress::requantize`]: a new exponent per block from the largest sum,
//!    one rounding to nearest even, on integers);
//! 5. an all-gather gives every rank every share's re-encoded blocks (exponent bytes and
//!    mantissas), and each decodes them once.
//!
//! Integer addition is exact and associative, the one re-encoding is done once, by the share's
//! owner, in integer arithmetic, and moving bytes does not change them, so the result is the
//! same bits on every rank, whatever algorithm moves them.
//!
//! **Error bound.** Per value, with `u = u(E)` the unit of the block's agreed exponent and
//! `u' = u(E')` that of the re-encoded sum: `|result − Σ_r x_r| ≤ n · u/2 + u'/2`, one
//! quantisation of each input at the common exponent plus one rounding of the sum. `u' = u`
//! when the block's sums fit the mantissa as they are; otherwise `u'/2 ≤ 2A/(2^M − 1)`, `A` the
//! largest magnitude of the block's (quantised) sum: the result is accurate to one BFP
//! quantisation of the sum on top of the inputs' own. A block holding a NaN or an infinity on
//! any rank is NaN on every rank; a sum beyond the float's range is ±infinity.
//!
//! **On the wire**, per rank and value of the caller's buffer, against `2(n−1)/n` values of
//! the element type for a plain ring: `(n−1)/n` mantissas out in the all-to-all and `(n−1)/n`
//! mantissas plus an exponent byte per block in the all-gather, plus the exponents' all-reduce:
//! `2(n−1)/n · (M/8 + 1.5/B)` bytes, 0.262× an `f32` ring for `bfp8` and 0.137× for `bfp4` at
//! `B` = 32 (the format's own 8.25/32 and 4.25/32, plus the exponents' max).
//!
//! **Pipelining.** A call is cut into chunks of [`Options::compress_chunk`] bytes of input
//! (`OXCCL_COMPRESS_CHUNK`, default [`DEFAULT_CHUNK`]; whole shares of blocks, so the result
//! does not depend on it). Each chunk's three collectives are started without blocking
//! ([`Communicator::start`]) and the calling thread codes the next chunks while the worker
//! moves the earlier ones: at step `k` it computes chunk `k`'s exponents, quantises chunk
//! `k − 1`, sums and re-encodes chunk `k − 2` and decodes chunk `k − 3`. Every rank starts
//! the same calls in the same order, and they never feed the link-rate learner (a metered call
//! runs alone and takes its sequence number late, which calls started behind it would
//! overtake). The work buffers come from a pool kept by the calling
//! thread, so a training loop's calls reuse them instead of faulting in fresh pages.
//!
//! **Error feedback** ([`Communicator::all_reduce_compressed_feedback`]): the caller keeps a
//! residual `e` per value and the call sums `x = g + e` and leaves `e = x − Q(x)`, this rank's
//! quantisation error, for the next call, so that what quantisation drops is sent later
//! instead of lost. The owner of each share also adds its share's result rounding
//! `S − Q'(S)` to its residual: no rank holds the exact sum but the owner, and fed back there
//! it telescopes over calls too, so that the sum of the results over `k` calls differs from
//! the sum of the inputs only by the residuals left after the last one. Both are fused into
//! the steps above (the add into step 1, the residual into step 2, the result rounding into
//! step 3), a cache-sized piece at a time: one call, no pass over memory of its own.
//!
//! [`Options::compress_chunk`]: super::Options::compress_chunk

mod reduce_scatter;

use std::cell::RefCell;
use std::ops::Range;
use std::time::{Duration, Instant};

use half::{bf16, f16};
use oxccl_core::compress::{self, Format, Width};

use super::{Communicator, Work};
use crate::schedule::Collective;
use crate::{DataType, Element, Error, ReduceOp, Result, log_enabled};

/// Bytes of input per pipeline chunk unless `OXCCL_COMPRESS_CHUNK` says otherwise.
pub const DEFAULT_CHUNK: usize = 4 << 20;

/// With [`Compression::Auto`], the smallest all-reduce (bytes) that goes compressed across
/// hosts.
pub const AUTO_MIN_BYTES: usize = 1 << 20;

/// When a plain [`Communicator::all_reduce`] compresses (`OXCCL_COMPRESS`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Compression {
    /// Never (`off`, the default): every all-reduce is exact.
    #[default]
    Off,
    /// The tuner decides (`auto`): `bfp8` for `f32`/`f16`/`bf16` sums and averages of at
    /// least [`AUTO_MIN_BYTES`](crate::COMPRESS_AUTO_MIN_BYTES) when the ranks are on more than one host (a wire-bound job);
    /// never when every rank is on one host (shared memory is memory-bound: compressing
    /// costs more than the bytes it saves).
    Auto,
    /// Always, in this format, for `f32`/`f16`/`bf16` sums and averages (`bfp8`, `bfp4`,
    /// `bfp8/16`, ...).
    Always(Format),
}

impl std::str::FromStr for Compression {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Compression, String> {
        match s.trim() {
            "" | "off" | "0" => Ok(Compression::Off),
            "auto" => Ok(Compression::Auto),
            f => f.parse::<Format>().map(Compression::Always).map_err(|_| {
                "off, auto, bfp8 or bfp4, optionally with a block size (bfp8/16, bfp4/64)"
                    .to_string()
            }),
        }
    }
}

thread_local! {
    /// Work buffers of finished chunks, for the next ones (at most [`POOL`] kept).
    static BUFFERS: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
}

/// Buffers the pool of a thread keeps at most.
const POOL: usize = 24;

/// A buffer of `len` bytes from the pool (its contents are stale: callers write all of it).
fn take(len: usize) -> Vec<u8> {
    let mut v = BUFFERS
        .with(|p| {
            let mut p = p.borrow_mut();
            let i = p.iter().position(|b| b.capacity() >= len)?;
            Some(p.swap_remove(i))
        })
        .unwrap_or_default();
    v.resize(len, 0);
    v
}

/// Gives a buffer back to the pool.
fn give(v: Vec<u8>) {
    BUFFERS.with(|p| {
        let mut p = p.borrow_mut();
        if p.len() < POOL {
            p.push(v);
        }
    });
}

/// The sizes of one chunk's exchange.
#[derive(Clone, Copy)]
struct Shape {
    /// Values of the chunk.
    len: usize,
    /// Blocks of the chunk.
    blocks: usize,
    /// Blocks per rank's share (the last shares may be padding).
    share_blocks: usize,
    /// Values per share.
    share: usize,
    /// Bytes of a share's mantissas on the wire.
    mbytes: usize,
}

impl Shape {
    fn new(len: usize, n: usize, fmt: Format) -> Shape {
        let blocks = compress::block_count(len, fmt.block);
        let share_blocks = blocks.div_ceil(n);
        let share = share_blocks * fmt.block.values();
        let mbytes = match fmt.width {
            Width::Bfp8 => share,
            Width::Bfp4 => share / 2, // blocks hold an even number of values
        };
        Shape {
            len,
            blocks,
            share_blocks,
            share,
            mbytes,
        }
    }

    /// Bytes of a share in the all-gather: exponents, then mantissas.
    fn gbytes(&self) -> usize {
        self.share_blocks + self.mbytes
    }

    /// The values of share `r` that exist (the last shares may be short or empty).
    fn values(&self, r: usize) -> Range<usize> {
        (r * self.share).min(self.len)..((r + 1) * self.share).min(self.len)
    }
}

/// One pipeline chunk's state between its steps.
struct Chunk {
    range: Range<usize>,
    shape: Shape,
    exps: Vec<u8>,
    max: Option<Work<Vec<u8>>>,
    a2a: Option<Work<(Vec<u8>, Vec<u8>)>>,
    gather: Option<Work<(Vec<u8>, Vec<u8>)>>,
}

/// Call-wide settings and scratch.
struct Call<'a> {
    comm: &'a Communicator,
    fmt: Format,
    n: usize,
    me: usize,
    wait: Duration,
    /// Unpacked mantissas (`n` shares).
    q: Vec<i8>,
    /// One share's sums.
    sums: Vec<i16>,
    /// One share's agreed exponents.
    sexps: Vec<u8>,
    bad: &'a dyn Fn(String) -> Error,
    /// Seconds the caller waited for each phase (exponents, all-to-all, all-gather).
    waited: [f64; 3],
}

impl Call<'_> {
    /// The result of a started call of phase `phase`, which must be there.
    fn wait<R>(&mut self, w: &mut Option<Work<R>>, phase: usize) -> Result<R> {
        let t = Instant::now();
        let r = wait(w, self.wait, self.bad);
        self.waited[phase] += t.elapsed().as_secs_f64();
        r
    }

    /// Step 1: with a residual, `x = g + e` into the chunk; the chunk's exponents, and the
    /// start of their max all-reduce.
    fn exponents<T: compress::Float>(
        &self,
        c: &mut Chunk,
        buf: &mut [T],
        res: Option<&[T]>,
    ) -> Result<()> {
        let bad = self.bad;
        let codec = |e: compress::CodecError| bad(e.to_string());
        let mut exps = take(c.shape.blocks);
        let x = &mut buf[c.range.clone()];
        match res {
            None => compress::block_exponents(x, self.fmt, &mut exps).map_err(codec)?,
            Some(res) => {
                // A cache-sized piece at a time: the add, then the piece's exponents.
                let b = self.fmt.block.values();
                let pieces = x.chunks_mut(PIECE).zip(res[c.range.clone()].chunks(PIECE));
                for ((x, e), ex) in pieces.zip(exps.chunks_mut(PIECE / b)) {
                    add_into(x, e);
                    compress::block_exponents(&*x, self.fmt, ex).map_err(codec)?;
                }
            }
        }
        let coll = Collective::AllReduce { count: exps.len() };
        c.max = Some(self.comm.start_unmetered(coll, ReduceOp::Max, exps));
        Ok(())
    }

    /// Step 2: quantised to the agreed exponents, with a residual `e = x − Q(x)`; the start of
    /// the all-to-all.
    fn quantise<T: compress::Float>(
        &mut self,
        c: &mut Chunk,
        buf: &[T],
        res: Option<&mut [T]>,
    ) -> Result<()> {
        let bad = self.bad;
        let codec = |e: compress::CodecError| bad(e.to_string());
        let s = c.shape;
        c.exps = self.wait(&mut c.max, 0)?;
        let mut send = take(s.mbytes * self.n);
        // bfp8 mantissas are quantised straight into the send buffer; bfp4's are packed there.
        let q: &mut [i8] = match self.fmt.width {
            Width::Bfp8 => bytemuck::cast_slice_mut(&mut send[..]),
            Width::Bfp4 => &mut self.q[..s.share * self.n],
        };
        let x = &buf[c.range.clone()];
        match res {
            None => compress::quantize(x, &c.exps, self.fmt, &mut q[..s.len]),
            Some(res) => {
                let e = &mut res[c.range.clone()];
                compress::quantize_with_error(x, &c.exps, self.fmt, &mut q[..s.len], e)
            }
        }
        .map_err(codec)?;
        q[s.len..].fill(0);
        if self.fmt.width == Width::Bfp4 {
            compress::pack4(&self.q[..s.share * self.n], &mut send).map_err(codec)?;
        }
        let recv = take(s.mbytes * self.n);
        let coll = Collective::AllToAll { count: s.mbytes };
        c.a2a = Some(self.comm.start_unmetered(coll, ReduceOp::Sum, (send, recv)));
        Ok(())
    }

    /// Step 3: this rank's share summed exactly and re-encoded (with a residual, the
    /// re-encoding's rounding added to it); the start of the all-gather.
    fn sum<T: compress::Float>(&mut self, c: &mut Chunk, res: Option<&mut [T]>) -> Result<()> {
        let bad = self.bad;
        let codec = |e: compress::CodecError| bad(e.to_string());
        let s = c.shape;
        let (send, recv) = self.wait(&mut c.a2a, 1)?;
        give(send);
        let sums = &mut self.sums[..s.share];
        sums.fill(0);
        {
            // bfp8 mantissas are summed where they landed; bfp4's are unpacked first.
            let q: &[i8] = match self.fmt.width {
                Width::Bfp8 => bytemuck::cast_slice(&recv[..]),
                Width::Bfp4 => {
                    let q = &mut self.q[..s.share * self.n];
                    compress::unpack4(&recv, q).map_err(codec)?;
                    q
                }
            };
            if s.share > 0 {
                for from in q.chunks_exact(s.share) {
                    for (t, &m) in sums.iter_mut().zip(from) {
                        *t += i16::from(m);
                    }
                }
            }
        }
        give(recv);
        // The share's agreed exponents (0 for padding blocks past the end, whose sums are 0).
        let first = (self.me * s.share_blocks).min(s.blocks);
        let last = ((self.me + 1) * s.share_blocks).min(s.blocks);
        let sexps = &mut self.sexps[..s.share_blocks];
        sexps[..last - first].copy_from_slice(&c.exps[first..last]);
        sexps[last - first..].fill(0);
        let mut gin = take(s.gbytes());
        let (new_exps, mant) = gin.split_at_mut(s.share_blocks);
        // bfp8's re-encoded mantissas go straight into the all-gather's buffer.
        let q: &mut [i8] = match self.fmt.width {
            Width::Bfp8 => bytemuck::cast_slice_mut(&mut mant[..]),
            Width::Bfp4 => &mut self.q[..s.share],
        };
        compress::requantize(sums, sexps, self.fmt, new_exps, q).map_err(codec)?;
        let mine = s.values(self.me);
        if let (Some(res), false) = (res, mine.is_empty()) {
            let at = c.range.start + mine.start;
            let nb = compress::block_count(mine.len(), self.fmt.block);
            let owned = &mut res[at..at + mine.len()];
            let (m, ne) = (&q[..mine.len()], &new_exps[..nb]);
            rounding_error(&sums[..mine.len()], &sexps[..nb], m, ne, self.fmt, owned)
                .map_err(codec)?;
        }
        if self.fmt.width == Width::Bfp4 {
            compress::pack4(&self.q[..s.share], mant).map_err(codec)?;
        }
        let gout = take(s.gbytes() * self.n);
        let coll = Collective::AllGather { count: s.gbytes() };
        c.gather = Some(self.comm.start_unmetered(coll, ReduceOp::Sum, (gin, gout)));
        Ok(())
    }

    /// Step 4: every share's re-encoded sums decoded into the chunk (divided by the world
    /// size for an average).
    fn decode<T: compress::Float>(
        &mut self,
        c: &mut Chunk,
        buf: &mut [T],
        average: bool,
    ) -> Result<()> {
        let bad = self.bad;
        let codec = |e: compress::CodecError| bad(e.to_string());
        let s = c.shape;
        let (gin, gout) = self.wait(&mut c.gather, 2)?;
        give(gin);
        let out = &mut buf[c.range.clone()];
        for r in 0..self.n {
            let v = s.values(r);
            if v.is_empty() {
                break;
            }
            let at = r * s.gbytes();
            let exps = &gout[at..at + compress::block_count(v.len(), self.fmt.block)];
            let mant = &gout[at + s.share_blocks..at + s.gbytes()];
            let q: &[i8] = match self.fmt.width {
                Width::Bfp8 => bytemuck::cast_slice(&mant[..v.len()]),
                Width::Bfp4 => {
                    let q = &mut self.q[..v.len()];
                    compress::unpack4(&mant[..v.len().div_ceil(2)], q).map_err(codec)?;
                    q
                }
            };
            let out = &mut out[v];
            compress::dequantize(q, exps, self.fmt, out).map_err(codec)?;
            if average && self.n > 1 {
                crate::reduce::divide(T::DTYPE, crate::dtype::as_bytes_mut(out), self.n);
            }
        }
        give(gout);
        give(std::mem::take(&mut c.exps));
        Ok(())
    }
}

impl Communicator {
    /// Sums `buf` over every rank in place, compressed with block floating point `fmt`: the
    /// ranks quantise to common block exponents, sum the mantissas exactly, and the owner of
    /// each share of blocks rounds its sums once into `fmt` again, so the result is the same
    /// bits on every rank, within one quantisation of each input plus one of the sum (the
    /// derivation and the bound: [`compress`](crate::compress), "The result phase"). Large
    /// calls are pipelined in chunks of [`Options::compress_chunk`](crate::Options::compress_chunk)
    /// bytes, whose collectives run while the caller codes the next chunks.
    ///
    /// Every rank passes the same length and format. Fails with
    /// [`Error::InvalidArgument`] beyond [`compress::max_ranks`] ranks (258 for `bfp8`), and
    /// with the error of any of the collectives it runs.
    ///
    /// ```
    /// # use std::time::{Duration, Instant};
    /// # use oxccl::{Communicator, Options};
    /// # use oxccl_bootstrap::{Bootstrap, Config, Secret, StoreServer};
    /// use oxccl::compress::Format;
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let secret = Secret::new("the job's shared secret")?;
    /// # let server = StoreServer::bind("127.0.0.1:0", secret.clone())?;
    /// # let addr = server.addr().to_string();
    /// let ranks: Vec<_> = (0..2)
    ///     .map(|rank| {
    /// #       let mut config = Config::new(rank, 2, addr.clone(), secret.clone());
    /// #       config.serve_store = false;
    /// #       config.timeout = Duration::from_secs(20);
    ///         std::thread::spawn(move || -> oxccl::Result<Vec<f32>> {
    ///             let comm = Communicator::init(Bootstrap::new(config)?, Options::default())?;
    ///             let mut grad: Vec<f32> = (0..1000).map(|i| (i as f32).sin()).collect();
    ///             comm.all_reduce_compressed(&mut grad, Format::BFP8)?;
    ///             Ok(grad)
    ///         })
    ///     })
    ///     .collect();
    /// let sums: Vec<Vec<f32>> = ranks.into_iter().map(|r| r.join().unwrap()).collect::<Result<_, _>>()?;
    /// // Twice sin(i), within one quantisation per rank and one of the sum: 2 · 2/255 of a
    /// // block's largest value (at most 1), plus 2/255 of the sum's (at most 2).
    /// assert!(sums[0].iter().enumerate().all(|(i, s)| (s - 2.0 * (i as f32).sin()).abs() <= 8.0 / 255.0));
    /// // The same bits on both ranks.
    /// assert!(sums[0].iter().zip(&sums[1]).all(|(a, b)| a.to_bits() == b.to_bits()));
    /// # Ok(()) }
    /// ```
    pub fn all_reduce_compressed<T: compress::Float>(
        &self,
        buf: &mut [T],
        fmt: Format,
    ) -> Result<()> {
        self.compressed_all_reduce(buf, None, fmt, false)
    }

    /// [`Communicator::all_reduce_compressed`] with error feedback, as a DDP communication hook
    /// wants it, in one call: the sum (or, with [`ReduceOp::Avg`], the average) of
    /// `x = buf + residual` over the ranks into `buf`, and into `residual` what this call's
    /// compression dropped of this rank's `x` (its quantisation at the agreed exponents, plus,
    /// for the share of blocks this rank re-encodes, the sum's rounding), for the next call to
    /// send. Over `k` calls the results add up to the inputs' sum minus the residuals left after
    /// the last (the module docs, "Error feedback"). A block that holds a NaN or an infinity
    /// on some rank leaves a zero residual (its sum is NaN: a residual should not carry that
    /// into later calls).
    ///
    /// `residual` is as long as `buf` and starts at zeros; `op` is [`ReduceOp::Sum`] or
    /// [`ReduceOp::Avg`] ([`Error::InvalidArgument`] otherwise, as for a length that differs).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use oxccl::{Communicator, Options, ReduceOp};
    /// # use oxccl_bootstrap::{Bootstrap, Config, Secret, StoreServer};
    /// use oxccl::compress::Format;
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let secret = Secret::new("the job's shared secret")?;
    /// # let server = StoreServer::bind("127.0.0.1:0", secret.clone())?;
    /// # let addr = server.addr().to_string();
    /// let ranks: Vec<_> = (0..2)
    ///     .map(|rank| {
    /// #       let mut config = Config::new(rank, 2, addr.clone(), secret.clone());
    /// #       config.serve_store = false;
    /// #       config.timeout = Duration::from_secs(20);
    ///         std::thread::spawn(move || -> oxccl::Result<f64> {
    ///             let comm = Communicator::init(Bootstrap::new(config)?, Options::default())?;
    ///             let mut residual = vec![0f32; 1000];
    ///             let mut total = 0f64;
    ///             // Ten steps of the same gradient, averaged with bfp4 (7 levels a sign).
    ///             for _ in 0..10 {
    ///                 let mut grad: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
    ///                 comm.all_reduce_compressed_feedback(&mut grad, &mut residual, Format::BFP4, ReduceOp::Avg)?;
    ///                 total += grad[7] as f64;
    ///             }
    ///             Ok(total)
    ///         })
    ///     })
    ///     .collect();
    /// let totals: Vec<f64> = ranks.into_iter().map(|r| r.join().unwrap()).collect::<Result<_, _>>()?;
    /// // What ten steps applied: ten times sin(7 · 0.37), short of it by the residuals left
    /// // (at most a unit of a bfp4 block, 1/7 of its largest magnitude, per rank).
    /// let exact = 10.0 * (7.0f64 * 0.37).sin();
    /// assert!((totals[0] - exact).abs() <= 0.2, "{} against {exact}", totals[0]);
    /// # Ok(()) }
    /// ```
    pub fn all_reduce_compressed_feedback<T: compress::Float>(
        &self,
        buf: &mut [T],
        residual: &mut [T],
        fmt: Format,
        op: ReduceOp,
    ) -> Result<()> {
        let average = self.sum_or_average("compressed all_reduce", op)?;
        self.check_residual("compressed all_reduce", buf.len(), residual.len())?;
        self.compressed_all_reduce(buf, Some(residual), fmt, average)
    }

    /// `Ok(true)` for [`ReduceOp::Avg`], `Ok(false)` for [`ReduceOp::Sum`], the error naming
    /// `what` for any other operation.
    fn sum_or_average(&self, what: &str, op: ReduceOp) -> Result<bool> {
        match op {
            ReduceOp::Sum => Ok(false),
            ReduceOp::Avg => Ok(true),
            op => Err(Error::InvalidArgument {
                rank: self.rank(),
                msg: format!("{what}: compression sums or averages; op={op:?} is not supported"),
            }),
        }
    }

    /// An error naming `what` unless the residual holds `len` values.
    fn check_residual(&self, what: &str, len: usize, residual: usize) -> Result<()> {
        if residual == len {
            return Ok(());
        }
        Err(Error::InvalidArgument {
            rank: self.rank(),
            msg: format!("{what}: a residual of {residual} values for {len} values of input"),
        })
    }

    /// The compressed all-reduce, with or without a residual, summing or averaging.
    fn compressed_all_reduce<T: compress::Float>(
        &self,
        buf: &mut [T],
        mut residual: Option<&mut [T]>,
        fmt: Format,
        average: bool,
    ) -> Result<()> {
        let (n, me, len) = (self.world_size(), self.rank(), buf.len());
        let bad = |msg: String| Error::InvalidArgument {
            rank: me,
            msg: format!("compressed all_reduce ({fmt}, {len} values): {msg}"),
        };
        fits_i16(n, fmt, &bad)?;
        // Chunks of whole shares of blocks (so that block boundaries, hence the result, do
        // not depend on the chunk size); an empty buffer is one empty chunk, so that a rank
        // whose length differs is reported as a mismatch, not left waiting.
        let whole = n * fmt.block.values();
        let per = (self.options().compress_chunk / T::DTYPE.size()) / whole * whole;
        let per = per.max(whole);
        let ranges: Vec<Range<usize>> = (0..len.max(1))
            .step_by(per)
            .map(|a| a..(a + per).min(len))
            .collect();
        let first = Shape::new(ranges[0].len(), n, fmt);
        let mut call = Call {
            comm: self,
            fmt,
            n,
            me,
            wait: self.timeout() + Duration::from_secs(5),
            q: vec![0; first.share * n],
            sums: vec![0; first.share],
            sexps: vec![0; first.share_blocks],
            bad: &bad,
            waited: [0.0; 3],
        };
        let t0 = Instant::now();
        let mut chunks: Vec<Chunk> = ranges
            .into_iter()
            .map(|range| Chunk {
                shape: Shape::new(range.len(), n, fmt),
                range,
                exps: Vec::new(),
                max: None,
                a2a: None,
                gather: None,
            })
            .collect();
        // Step k: exponents of chunk k, quantisation of k − 1, sums of k − 2, decoding of k − 3.
        let count = chunks.len();
        for k in 0..count + 3 {
            if let Some(c) = chunks.get_mut(k) {
                call.exponents(c, buf, residual.as_deref())?;
            }
            if let Some(c) = k.checked_sub(1).and_then(|i| chunks.get_mut(i)) {
                call.quantise(c, buf, residual.as_deref_mut())?;
            }
            if let Some(c) = k.checked_sub(2).and_then(|i| chunks.get_mut(i)) {
                call.sum(c, residual.as_deref_mut())?;
            }
            if let Some(c) = k.checked_sub(3).and_then(|i| chunks.get_mut(i)) {
                call.decode(c, buf, average)?;
            }
        }
        if log_enabled() {
            let total = t0.elapsed().as_secs_f64();
            let [e, a, g] = call.waited.map(|w| w * 1e3);
            crate::log_line(format!(
                "rank {me}: compressed all_reduce ({fmt}, {len} values, {count} chunks{}): \
                 {:.1} ms: coding {:.1} ms; waiting for the exponents {e:.1} ms, the \
                 all-to-all {a:.1} ms, the all-gather {g:.1} ms",
                if residual.is_some() {
                    ", error feedback"
                } else {
                    ""
                },
                total * 1e3,
                (total - call.waited.iter().sum::<f64>()) * 1e3,
            ));
        }
        Ok(())
    }

    /// [`Communicator::all_reduce_compressed`] on the bytes of `dtype` values, for bindings
    /// that hold untyped memory: `float32`, `float16` or `bfloat16`, native-endian and aligned
    /// to the value's size.
    pub fn all_reduce_compressed_bytes(
        &self,
        buf: &mut [u8],
        dtype: DataType,
        fmt: Format,
    ) -> Result<()> {
        self.all_reduce_compressed_bytes_with(buf, None, dtype, fmt, ReduceOp::Sum)
    }

    /// [`Communicator::all_reduce_compressed_bytes`] with `op` ([`ReduceOp::Sum`] or
    /// [`ReduceOp::Avg`]) and, when given, a residual of the same type and length for error
    /// feedback ([`Communicator::all_reduce_compressed_feedback`]).
    pub fn all_reduce_compressed_bytes_with(
        &self,
        buf: &mut [u8],
        residual: Option<&mut [u8]>,
        dtype: DataType,
        fmt: Format,
        op: ReduceOp,
    ) -> Result<()> {
        let (len, me) = (buf.len(), self.rank());
        let what = format!("compressed all_reduce ({fmt}, {len} bytes of {dtype})");
        let average = self.sum_or_average(&what, op)?;
        if let Some(r) = &residual {
            self.check_residual(&what, len, r.len())?;
        }
        let bad = |msg: String| Error::InvalidArgument {
            rank: me,
            msg: format!("{what}: {msg}"),
        };
        macro_rules! run {
            ($t:ty) => {{
                let v = typed::<$t>(buf, &bad)?;
                let r = residual.map(|r| typed::<$t>(r, &bad)).transpose()?;
                self.compressed_all_reduce(v, r, fmt, average)
            }};
        }
        match dtype {
            DataType::F32 => run!(f32),
            DataType::F16 => run!(f16),
            DataType::Bf16 => run!(bf16),
            _ => Err(bad(
                "compression sums float32, float16 or bfloat16 values".into()
            )),
        }
    }

    /// The format a plain all-reduce of `count` values of `T` with `op` goes compressed in,
    /// if [`Options::compress`](super::Options::compress) asks for it and the call qualifies;
    /// says once (at `OXCCL_DEBUG=INFO`) why a call that could not be compressed stays exact.
    pub(super) fn compressed_format<T: Element>(
        &self,
        count: usize,
        op: ReduceOp,
    ) -> Option<Format> {
        let fmt = match self.options().compress {
            Compression::Off => return None,
            Compression::Always(f) => f,
            Compression::Auto => {
                let hosts = self.hosts();
                let one_host = hosts.iter().all(|h| *h == hosts[0]);
                if one_host || count * T::DTYPE.size() < AUTO_MIN_BYTES {
                    return None;
                }
                Format::BFP8
            }
        };
        let float = matches!(T::DTYPE, DataType::F32 | DataType::F16 | DataType::Bf16);
        let sum = matches!(op, ReduceOp::Sum | ReduceOp::Avg);
        let fits = self.world_size() <= compress::max_ranks::<i16>(fmt.width);
        if float && sum && fits {
            return Some(fmt);
        }
        if log_enabled() {
            let why = if !fits {
                format!(
                    "{} ranks are more than {fmt} sums in 16 bits",
                    self.world_size()
                )
            } else {
                format!(
                    "{} {:?} is not a float32/float16/bfloat16 sum or average",
                    T::DTYPE,
                    op
                )
            };
            say_once(format!(
                "rank {}: OXCCL_COMPRESS={fmt}: all_reduce stays exact: {why}",
                self.rank()
            ));
        }
        None
    }

    /// A plain all-reduce, compressed in `fmt` (see [`Communicator::compressed_format`]): the
    /// input copied to the output, summed compressed there, divided by the world size for an
    /// average.
    pub(super) fn all_reduce_compressed_as<T: Element>(
        &self,
        input: Option<&[T]>,
        output: &mut [T],
        op: ReduceOp,
        fmt: Format,
    ) -> Result<()> {
        if let Some(input) = input {
            if input.len() != output.len() {
                return Err(Error::InvalidArgument {
                    rank: self.rank(),
                    msg: format!(
                        "all_reduce: input of {} values, output of {}",
                        input.len(),
                        output.len()
                    ),
                });
            }
            output.copy_from_slice(input);
        }
        let bytes = crate::dtype::as_bytes_mut(output);
        self.all_reduce_compressed_bytes_with(bytes, None, T::DTYPE, fmt, op)
    }
}

/// The result of a started pipeline step, which must be there.
fn wait<R>(w: &mut Option<Work<R>>, timeout: Duration, bad: &dyn Fn(String) -> Error) -> Result<R> {
    match w.take() {
        Some(mut w) => w.wait(timeout),
        None => Err(bad(
            "a pipeline step ran before the one it follows (a bug)".into()
        )),
    }
}

/// An error (made by `bad`) unless the `i16` sums of `n` ranks' mantissas of `fmt` cannot
/// overflow.
fn fits_i16(n: usize, fmt: Format, bad: &dyn Fn(String) -> Error) -> Result<()> {
    let max = compress::max_ranks::<i16>(fmt.width);
    if n > max {
        return Err(bad(format!(
            "{n} ranks: {:?} mantissa sums fit 16 bits up to {max} ranks",
            fmt.width
        )));
    }
    Ok(())
}

/// `bytes` as `T` values, or the error `bad` makes naming why not.
fn typed<'a, T: Element>(
    bytes: &'a mut [u8],
    bad: &dyn Fn(String) -> Error,
) -> Result<&'a mut [T]> {
    let at = bytes.as_ptr() as usize;
    bytemuck::try_cast_slice_mut(bytes).map_err(|e| {
        bad(format!(
            "not whole, aligned {} values ({e:?}; the buffer starts at {at:#x})",
            T::DTYPE
        ))
    })
}

/// Values per piece of the fused residual passes: they stay in the first-level caches.
const PIECE: usize = 1 << 12;

/// `x += e`, rounded once to `T`.
fn add_into<T: compress::Float>(x: &mut [T], e: &[T]) {
    if let (Some(x), Some(e)) = (T::as_f32_mut(x), T::as_f32(e)) {
        for (x, e) in x.iter_mut().zip(e) {
            *x += e;
        }
        return;
    }
    let (mut a, mut b) = ([0f32; PIECE], [0f32; PIECE]);
    for (x, e) in x.chunks_mut(PIECE).zip(e.chunks(PIECE)) {
        let (a, b) = (&mut a[..x.len()], &mut b[..x.len()]);
        T::widen(x, a);
        T::widen(e, b);
        for (a, b) in a.iter_mut().zip(&*b) {
            *a += b;
        }
        T::narrow(a, x);
    }
}

/// `res += S − Q'(S)`: the rounding of the re-encoded sums (`sums` at `exps`, re-encoded as
/// `q` at `new_exps`), nothing in a [`compress::NON_FINITE`] block. The difference is exact in
/// `f32` (both are multiples of the sum's unit, at most 2^15 of them).
fn rounding_error<T: compress::Float>(
    sums: &[i16],
    exps: &[u8],
    q: &[i8],
    new_exps: &[u8],
    fmt: Format,
    res: &mut [T],
) -> std::result::Result<(), compress::CodecError> {
    let b = fmt.block.values();
    let (mut sf, mut qf, mut rf) = ([0f32; PIECE], [0f32; PIECE], [0f32; PIECE]);
    let pieces = sums
        .chunks(PIECE)
        .zip(q.chunks(PIECE))
        .zip(res.chunks_mut(PIECE));
    let blocks = exps.chunks(PIECE / b).zip(new_exps.chunks(PIECE / b));
    for (((s, q), r), (e, ne)) in pieces.zip(blocks) {
        let m = s.len();
        let (sf, qf, rf) = (&mut sf[..m], &mut qf[..m], &mut rf[..m]);
        compress::dequantize(s, e, fmt, &mut *sf)?;
        compress::dequantize(q, ne, fmt, &mut *qf)?;
        T::widen(r, rf);
        for (((r, s), q), &e) in rf.chunks_mut(b).zip(sf.chunks(b)).zip(qf.chunks(b)).zip(e) {
            if e != compress::NON_FINITE {
                for ((r, s), q) in r.iter_mut().zip(s).zip(q) {
                    *r += s - q;
                }
            }
        }
        T::narrow(rf, r);
    }
    Ok(())
}

/// Writes an `OXCCL_DEBUG` line unless this process wrote the same one before.
fn say_once(line: String) {
    static SAID: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut said = SAID.lock().unwrap_or_else(|e| e.into_inner());
    if !said.contains(&line) {
        crate::log_line(line.clone());
        said.push(line);
    }
}
