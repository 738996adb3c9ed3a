//! A compressed sum all-reduce whose result is exact and the same bits on every rank (issue 17):
//! block floating point ([`oxccl_core::compress`]) with exponents the ranks agree on and
//! mantissas summed as integers.
//!
//! The steps, each an ordinary collective of this communicator:
//! 1. every rank computes its blocks' exponents and the ranks take their max (an all-reduce of
//!    `u8`, one byte per block: 1/128 of an `f32` buffer at blocks of 32);
//! 2. every rank quantises its values to those exponents (one rounding, to nearest even), so
//!    that mantissas of one block mean the same unit on every rank;
//! 3. an all-to-all sends each rank the `i8` mantissas of the blocks it owns (a share of the
//!    blocks per rank; `bfp4` packs two mantissas a byte);
//! 4. each rank adds the mantissas of its blocks as integers (`i16`: no overflow up to
//!    [`compress::max_ranks`] ranks), exactly and in any order;
//! 5. an all-gather gives every rank every block's sums, and each decodes them once.
//!
//! Integer addition is exact and associative, and moving bytes does not change them, so the
//! result is the same bits on every rank, whatever algorithm moves them, and its error is that
//! of the one quantisation per input: at most `n · u/2` per value, `u` the unit of the block's
//! agreed exponent (see [`oxccl_core::compress`] for the bound). A block holding a NaN or an
//! infinity on any rank is NaN on every rank.
//!
//! On the wire, per rank and value of the caller's buffer, against `2(n−1)/n` values of the
//! element type for a plain ring: `(n−1)/n` mantissas (1 byte, or half a byte for `bfp4`) out in
//! the all-to-all and `(n−1)/n` sums (2 bytes) in the all-gather, plus the exponents: about
//! 0.38× of an `f32` ring for `bfp8` and 0.31× for `bfp4`. (Sending the sums narrower, at
//! `M + ⌈log2 n⌉` bits, is the next step toward the 0.26× bound.)

use half::{bf16, f16};
use oxccl_core::compress::{self, Format, Width};

use super::Communicator;
use crate::{DataType, Error, ReduceOp, Result};

impl Communicator {
    /// Sums `buf` over every rank in place, compressed with block floating point `fmt`: the
    /// result is exact for the values quantised to the ranks' common block exponents, and the
    /// same bits on every rank (see the [module docs](self)).
    ///
    /// Every rank passes the same length and format. Fails with
    /// [`Error::InvalidArgument`] beyond [`compress::max_ranks`] ranks (258 for `bfp8`), and
    /// with the error of any of the collectives it runs.
    ///
    /// ```
    /// # use std::time::Duration;
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
    /// // Twice sin(i), within one quantisation per rank: 2 · 2/255 of a block's largest value.
    /// assert!(sums[0].iter().enumerate().all(|(i, s)| (s - 2.0 * (i as f32).sin()).abs() <= 4.0 / 255.0));
    /// // The same bits on both ranks.
    /// assert!(sums[0].iter().zip(&sums[1]).all(|(a, b)| a.to_bits() == b.to_bits()));
    /// # Ok(()) }
    /// ```
    pub fn all_reduce_compressed<T: compress::Float>(
        &self,
        buf: &mut [T],
        fmt: Format,
    ) -> Result<()> {
        let (n, me, len) = (self.world_size(), self.rank(), buf.len());
        let bad = |msg: String| Error::InvalidArgument {
            rank: me,
            msg: format!("compressed all_reduce ({fmt}, {len} values): {msg}"),
        };
        if n > compress::max_ranks::<i16>(fmt.width) {
            return Err(bad(format!(
                "{n} ranks: {:?} mantissa sums fit 16 bits up to {} ranks",
                fmt.width,
                compress::max_ranks::<i16>(fmt.width)
            )));
        }
        let codec = |e: compress::CodecError| bad(e.to_string());
        let b = fmt.block.values();
        let nb = compress::block_count(len, fmt.block);
        // 1. The common exponents.
        let mut exps = vec![0u8; nb];
        compress::block_exponents(buf, fmt, &mut exps).map_err(codec)?;
        self.all_reduce_in_place(&mut exps, ReduceOp::Max)?;
        // 2. Mantissas at those exponents, padded to n equal shares of whole blocks (an even
        // count, so that bfp4 shares pack into whole bytes).
        let share = (nb.div_ceil(n) * b).next_multiple_of(2);
        let mut mant = vec![0i8; share * n];
        compress::quantize(buf, &exps, fmt, &mut mant[..len]).map_err(codec)?;
        // 3. Each rank gets every rank's mantissas of its share.
        let mut mine = vec![0i8; share * n];
        match fmt.width {
            Width::Bfp8 => self.all_to_all(&mant, &mut mine)?,
            Width::Bfp4 => {
                let mut packed = vec![0u8; share * n / 2];
                compress::pack4(&mant, &mut packed).map_err(codec)?;
                let mut got = vec![0u8; share * n / 2];
                self.all_to_all(&packed, &mut got)?;
                compress::unpack4(&got, &mut mine).map_err(codec)?;
            }
        }
        // 4. Exact integer sums of the share.
        let mut sums = vec![0i16; share];
        // (An empty buffer still runs every collective, so that a rank whose length differs
        // is reported as a mismatch, not left waiting.)
        for from in mine.chunks_exact(share.max(1)) {
            for (s, &m) in sums.iter_mut().zip(from) {
                *s += i16::from(m);
            }
        }
        // 5. Every share's sums to every rank, decoded once.
        let mut all = vec![0i16; share * n];
        self.all_gather::<u8>(
            bytemuck::cast_slice(&sums),
            bytemuck::cast_slice_mut(&mut all),
        )?;
        compress::dequantize(&all[..len], &exps, fmt, buf).map_err(codec)?;
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
        let (len, at, me) = (buf.len(), buf.as_ptr() as usize, self.rank());
        let bad = move |msg: String| Error::InvalidArgument {
            rank: me,
            msg: format!("compressed all_reduce ({fmt}, {len} bytes of {dtype}): {msg}"),
        };
        let cast = |e: bytemuck::PodCastError| {
            bad(format!(
                "not whole, aligned {dtype} values ({e:?}; the buffer starts at {at:#x})"
            ))
        };
        match dtype {
            DataType::F32 => {
                let v = bytemuck::try_cast_slice_mut::<u8, f32>(buf).map_err(cast)?;
                self.all_reduce_compressed(v, fmt)
            }
            DataType::F16 => {
                let v = bytemuck::try_cast_slice_mut::<u8, f16>(buf).map_err(cast)?;
                self.all_reduce_compressed(v, fmt)
            }
            DataType::Bf16 => {
                let v = bytemuck::try_cast_slice_mut::<u8, bf16>(buf).map_err(cast)?;
                self.all_reduce_compressed(v, fmt)
            }
            _ => Err(bad(
                "compression sums float32, float16 or bfloat16 values".into()
            )),
        }
    }
}
