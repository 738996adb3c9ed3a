//! The compressed reduce-scatter (issue 27: FSDP2's gradients): the first half of the
//! compressed all-reduce, on the shares the caller chose (rank `r` gets values `r·m..(r+1)·m`
//! of the sum, `m` the output's length) instead of shares of blocks.
//!
//! Per pipeline chunk (the same `m`-range `a..b` of every rank's share):
//! 1. every rank computes the block exponents of each share's piece (blocks start at each
//!    piece's first value; the last block of a piece may be short) and the ranks take their max
//!    (an all-reduce of one byte per block: 1/128 of the `f32` input at blocks of 32);
//! 2. every rank quantises its pieces to those exponents and an all-to-all sends each piece's
//!    mantissas to the piece's owner (with error feedback, `e = x − Q(x)` is kept first);
//! 3. the owner adds the mantissas of its piece from every rank as integers, exactly, and
//!    decodes the sums once into its output (divided by the world size for an average).
//!
//! The sums are decoded, not re-encoded: nothing is rounded after the inputs' quantisation in
//! `f32` (a sum of mantissas times the block's unit is exact there), so the result is
//! `Σ_r Q(x_r)` exactly, and with error feedback the residuals carry every bit compression
//! dropped. On the wire, per rank and value of the input: `(n−1)/n` mantissas plus the
//! exponents' all-reduce, 0.27× a plain `f32` reduce-scatter's `(n−1)/n · 4` bytes for `bfp8`
//! (0.14× for `bfp4`).

use std::ops::Range;
use std::time::Duration;

use half::{bf16, f16};
use oxccl_core::compress::{self, Format, Width};

use super::{add_into, fits_i16, give, take, typed, wait};
use crate::comm::{Communicator, Work};
use crate::schedule::Collective;
use crate::{DataType, Error, ReduceOp, Result};

/// One chunk: the same range of every rank's share, its state between the steps.
struct Piece {
    range: Range<usize>,
    /// Blocks per rank's piece.
    blocks: usize,
    exps: Vec<u8>,
    max: Option<Work<Vec<u8>>>,
    a2a: Option<Work<(Vec<u8>, Vec<u8>)>>,
}

/// Call-wide settings and scratch.
struct Call<'a, T> {
    comm: &'a Communicator,
    fmt: Format,
    n: usize,
    /// Values per rank's share (the output's length).
    m: usize,
    me: usize,
    wait: Duration,
    /// `x = g + e` of one piece, when there is a residual.
    x: Vec<T>,
    /// Mantissas of every rank's piece, each padded to whole blocks.
    q: Vec<i8>,
    /// The sums of this rank's piece.
    sums: Vec<i16>,
    bad: &'a dyn Fn(String) -> Error,
}

impl<T: compress::Float> Call<'_, T> {
    /// The values of rank `r`'s piece of `p`, in the input.
    fn span(&self, p: &Piece, r: usize) -> Range<usize> {
        r * self.m + p.range.start..r * self.m + p.range.end
    }

    /// Step 1: every piece's exponents (of `x = g + e` with a residual), and the start of
    /// their max all-reduce.
    fn exponents(&mut self, p: &mut Piece, input: &[T], res: Option<&[T]>) -> Result<()> {
        let bad = self.bad;
        let codec = |e: compress::CodecError| bad(e.to_string());
        let mut exps = take(p.blocks * self.n);
        for r in 0..self.n {
            let span = self.span(p, r);
            let e = &mut exps[r * p.blocks..(r + 1) * p.blocks];
            match res {
                None => compress::block_exponents(&input[span], self.fmt, e),
                Some(res) => {
                    let x = &mut self.x[..span.len()];
                    x.copy_from_slice(&input[span.clone()]);
                    add_into(x, &res[span]);
                    compress::block_exponents(&*x, self.fmt, e)
                }
            }
            .map_err(codec)?;
        }
        let coll = Collective::AllReduce { count: exps.len() };
        p.max = Some(self.comm.start_unmetered(coll, ReduceOp::Max, exps));
        Ok(())
    }

    /// Step 2: every piece quantised to the agreed exponents (with a residual, `x = g + e`
    /// quantised and `e = x − Q(x)` kept); the start of the all-to-all.
    fn quantise(&mut self, p: &mut Piece, input: &[T], mut res: Option<&mut [T]>) -> Result<()> {
        let bad = self.bad;
        let codec = |e: compress::CodecError| bad(e.to_string());
        p.exps = wait(&mut p.max, self.wait, bad)?;
        let (b, len) = (self.fmt.block.values(), p.range.len());
        let padded = p.blocks * b;
        for r in 0..self.n {
            let span = self.span(p, r);
            let exps = &p.exps[r * p.blocks..(r + 1) * p.blocks];
            let qr = &mut self.q[r * padded..(r + 1) * padded];
            match res.as_deref_mut() {
                None => compress::quantize(&input[span], exps, self.fmt, &mut qr[..len]),
                Some(res) => {
                    let x = &mut self.x[..len];
                    x.copy_from_slice(&input[span.clone()]);
                    add_into(x, &res[span.clone()]);
                    let (q, e) = (&mut qr[..len], &mut res[span]);
                    compress::quantize_with_error(&*x, exps, self.fmt, q, e)
                }
            }
            .map_err(codec)?;
            qr[len..].fill(0);
        }
        let mbytes = mantissa_bytes(self.fmt, padded);
        let mut send = take(mbytes * self.n);
        let all = &self.q[..padded * self.n];
        match self.fmt.width {
            Width::Bfp8 => send.copy_from_slice(bytemuck::cast_slice(all)),
            Width::Bfp4 => compress::pack4(all, &mut send).map_err(codec)?,
        }
        let recv = take(mbytes * self.n);
        let coll = Collective::AllToAll { count: mbytes };
        p.a2a = Some(self.comm.start_unmetered(coll, ReduceOp::Sum, (send, recv)));
        Ok(())
    }

    /// Step 3: this rank's piece from every rank summed exactly and decoded into `output`.
    fn sum(&mut self, p: &mut Piece, output: &mut [T], average: bool) -> Result<()> {
        let (send, recv) = wait(&mut p.a2a, self.wait, self.bad)?;
        give(send);
        let (b, len) = (self.fmt.block.values(), p.range.len());
        let padded = p.blocks * b;
        let q = &mut self.q[..padded * self.n];
        match self.fmt.width {
            Width::Bfp8 => q.copy_from_slice(bytemuck::cast_slice(&recv)),
            Width::Bfp4 => compress::unpack4(&recv, q).map_err(|e| (self.bad)(e.to_string()))?,
        }
        give(recv);
        let sums = &mut self.sums[..padded];
        sums.fill(0);
        if padded > 0 {
            for from in q.chunks_exact(padded) {
                for (t, &v) in sums.iter_mut().zip(from) {
                    *t += i16::from(v);
                }
            }
        }
        let exps = &p.exps[self.me * p.blocks..(self.me + 1) * p.blocks];
        let out = &mut output[p.range.clone()];
        compress::dequantize(&sums[..len], exps, self.fmt, &mut *out)
            .map_err(|e| (self.bad)(e.to_string()))?;
        if average && self.n > 1 {
            crate::reduce::divide(T::DTYPE, crate::dtype::as_bytes_mut(out), self.n);
        }
        give(std::mem::take(&mut p.exps));
        Ok(())
    }
}

/// Bytes of `values` mantissas on the wire (whole blocks: an even count).
fn mantissa_bytes(fmt: Format, values: usize) -> usize {
    match fmt.width {
        Width::Bfp8 => values,
        Width::Bfp4 => values / 2,
    }
}

impl Communicator {
    /// Rank `r` gets values `r·m..(r+1)·m` of the sum (or, with [`ReduceOp::Avg`], the
    /// average) of every rank's `input` (`n·m` values, `m = output.len()`), compressed with
    /// block floating point `fmt` on the wire: the ranks quantise to common block exponents
    /// and the owner of each share sums the mantissas exactly and decodes them once. With
    /// `residual` (as long as `input`, starting at zeros), error feedback: the call sums
    /// `x = input + residual` and leaves in `residual` what quantisation dropped of `x`, for
    /// the next call; `input` itself is left alone.
    ///
    /// The result is `Σ_r Q(x_r)` in `f32` exactly (rounded once to `f16`/`bf16`): within one
    /// quantisation of each input at the block's agreed exponent. For FSDP2's gradients
    /// (parameters' all-gathers stay exact). Fails with [`Error::InvalidArgument`] for lengths
    /// that do not fit, an operation other than sum or average, or more ranks than `i16`
    /// sums hold ([`compress::max_ranks`]), and with any collective's error.
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
    ///         std::thread::spawn(move || -> oxccl::Result<Vec<f32>> {
    ///             let comm = Communicator::init(Bootstrap::new(config)?, Options::default())?;
    ///             let grad: Vec<f32> = (0..1000).map(|i| (i as f32).cos()).collect();
    ///             let mut mine = vec![0f32; 500];
    ///             comm.reduce_scatter_compressed(&grad, &mut mine, None, Format::BFP8, ReduceOp::Sum)?;
    ///             Ok(mine)
    ///         })
    ///     })
    ///     .collect();
    /// let shares: Vec<Vec<f32>> = ranks.into_iter().map(|r| r.join().unwrap()).collect::<Result<_, _>>()?;
    /// // Rank 1 holds twice cos(i) for i in 500..1000, within one quantisation per rank.
    /// assert!(shares[1].iter().enumerate().all(|(i, s)| (s - 2.0 * ((500 + i) as f32).cos()).abs() <= 4.0 / 255.0));
    /// # Ok(()) }
    /// ```
    pub fn reduce_scatter_compressed<T: compress::Float>(
        &self,
        input: &[T],
        output: &mut [T],
        residual: Option<&mut [T]>,
        fmt: Format,
        op: ReduceOp,
    ) -> Result<()> {
        let (n, me, m) = (self.world_size(), self.rank(), output.len());
        let bad = |msg: String| Error::InvalidArgument {
            rank: me,
            msg: format!("compressed reduce_scatter ({fmt}, {m} values a rank): {msg}"),
        };
        let average = self.sum_or_average("compressed reduce_scatter", op)?;
        if input.len() != n * m {
            return Err(bad(format!(
                "an input of {} values for {n} ranks (n · m = {} expected)",
                input.len(),
                n * m
            )));
        }
        if let Some(r) = &residual {
            self.check_residual("compressed reduce_scatter", input.len(), r.len())?;
        }
        fits_i16(n, fmt, &bad)?;
        let b = fmt.block.values();
        // Pieces of whole blocks, so that the result does not depend on the chunk size; an
        // empty output is one empty piece, so that a rank whose length differs is reported as
        // a mismatch rather than left waiting.
        let per = (self.options().compress_chunk / T::DTYPE.size() / n / b * b).max(b);
        let mut pieces: Vec<Piece> = (0..m.max(1))
            .step_by(per)
            .map(|a| a..(a + per).min(m))
            .map(|range| Piece {
                blocks: compress::block_count(range.len(), fmt.block),
                range,
                exps: Vec::new(),
                max: None,
                a2a: None,
            })
            .collect();
        let largest = pieces[0].blocks * b;
        let mut call = Call {
            comm: self,
            fmt,
            n,
            m,
            me,
            wait: self.timeout() + Duration::from_secs(5),
            x: if residual.is_some() {
                vec![<T as bytemuck::Zeroable>::zeroed(); largest]
            } else {
                Vec::new()
            },
            q: vec![0; largest * n],
            sums: vec![0; largest],
            bad: &bad,
        };
        let mut residual = residual;
        // Step k: exponents of piece k, quantisation of k − 1, sums of k − 2.
        for k in 0..pieces.len() + 2 {
            if let Some(p) = pieces.get_mut(k) {
                call.exponents(p, input, residual.as_deref())?;
            }
            if let Some(p) = k.checked_sub(1).and_then(|i| pieces.get_mut(i)) {
                call.quantise(p, input, residual.as_deref_mut())?;
            }
            if let Some(p) = k.checked_sub(2).and_then(|i| pieces.get_mut(i)) {
                call.sum(p, output, average)?;
            }
        }
        Ok(())
    }

    /// [`Communicator::reduce_scatter_compressed`] on the bytes of `dtype` values (`float32`,
    /// `float16` or `bfloat16`, native-endian, aligned), for bindings that hold untyped memory.
    pub fn reduce_scatter_compressed_bytes(
        &self,
        input: &[u8],
        output: &mut [u8],
        residual: Option<&mut [u8]>,
        dtype: DataType,
        fmt: Format,
        op: ReduceOp,
    ) -> Result<()> {
        let me = self.rank();
        let what = format!(
            "compressed reduce_scatter ({fmt}, {} bytes of {dtype})",
            output.len()
        );
        let bad = |msg: String| Error::InvalidArgument {
            rank: me,
            msg: format!("{what}: {msg}"),
        };
        macro_rules! run {
            ($t:ty) => {{
                let i: &[$t] = bytemuck::try_cast_slice(input).map_err(|e| {
                    bad(format!(
                        "the input is not whole, aligned {dtype} values ({e:?})"
                    ))
                })?;
                let o = typed::<$t>(output, &bad)?;
                let r = residual.map(|r| typed::<$t>(r, &bad)).transpose()?;
                self.reduce_scatter_compressed(i, o, r, fmt, op)
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
}
