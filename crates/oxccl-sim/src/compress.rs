//! The compressed all-reduce (issue 17) predicted: the runtime's phases
//! (`oxccl::Communicator::all_reduce_compressed`) simulated as the collectives they are, plus
//! the codec's cost per byte, pipelined over chunks as the runtime pipelines them.
//!
//! Per chunk of `c` values (the runtime's chunking: [`chunk_values`]) on `n` ranks with blocks
//! of `B` and `M`-bit mantissas, with `s = ⌈⌈c/B⌉/n⌉` blocks per rank's share:
//! 1. a max all-reduce of `⌈c/B⌉` exponent bytes;
//! 2. an all-to-all of `s·B·M/8` mantissa bytes per peer;
//! 3. an all-gather of `s + s·B·M/8` bytes per rank (re-encoded sums: exponents, mantissas).
//!
//! Each phase runs through [`simulate`] with the tuner's choice of algorithm on the fabric,
//! so its wire time `w` includes the fabric's latencies, contention and protocol. The codec
//! costs `e = c·size/encode` (exponents and quantisation) before the wire and
//! `d = c·size/decode` (integer sums, re-encoding, decoding) after it, on each rank's own
//! core ([`Codec`]). The runtime keeps the phases of three chunks in flight at once (the
//! exponents of chunk `i`, the all-to-all of `i − 1`, the all-gather of `i − 2`) while the
//! caller codes, so the codec overlaps the wire, and the latencies of chunks in flight overlap
//! each other. The model, over `k` chunks of wire time `w` (the three phases of one chunk,
//! simulated one after another) and codec time `e + d` each, with `W` the three phases
//! simulated once for the whole buffer (the bandwidth the fabric gives them, its latencies
//! paid once):
//!
//! ```text
//! T = e + max(W, k·w / 3, k·(e + d)) + d      (one chunk: e + w + d, the phases in sequence)
//! ```
//!
//! one chunk's encoding to fill the pipeline, then the slowest of the wire's bandwidth, the
//! wire's per-chunk latency shared by three chunks in flight, and the codec, then one chunk's
//! decoding to drain it. Contention between the phases of different chunks is not modelled
//! beyond `W`.

use oxccl_core::compress::{Format, Width, block_count, max_ranks};
use oxccl_core::schedule::{Algorithm, Collective};

use crate::{Fabric, Report, Spec, simulate};

/// The codec's rate on one core, in bytes of uncompressed input per second.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Codec {
    /// Exponents and quantisation (and bfp4 packing), bytes of input per second.
    pub encode_bytes_per_s: f64,
    /// Sums, re-encoding and decoding (and unpacking), bytes of output per second.
    pub decode_bytes_per_s: f64,
}

impl Default for Codec {
    /// [`DEFAULT_ENCODE_BYTES_PER_S`] and [`DEFAULT_DECODE_BYTES_PER_S`].
    fn default() -> Codec {
        Codec {
            encode_bytes_per_s: DEFAULT_ENCODE_BYTES_PER_S,
            decode_bytes_per_s: DEFAULT_DECODE_BYTES_PER_S,
        }
    }
}

/// The all-reduce's encoding rate measured on this project's machine (one core of a 2-vCPU
/// x86-64 VM, AVX2/AVX-512, 64 MiB of `f32`, `bench/bfp-codec.sh`): exponents at about
/// 23 GB/s and quantisation at about 14.5 GB/s, one after the other: about 9 GB/s.
pub const DEFAULT_ENCODE_BYTES_PER_S: f64 = 9e9;

/// The all-reduce's decoding rate measured there: the integer sums (about as fast as a copy,
/// taken as 20 GB/s), re-encoding a `1/n` share (about 3 GB/s, so 12 GB/s at 4 ranks) and
/// decoding `i8` mantissas (about 19 GB/s), one after the other: about 5 GB/s.
pub const DEFAULT_DECODE_BYTES_PER_S: f64 = 5e9;

/// Chunks whose phases the runtime has in flight at once.
pub const IN_FLIGHT: usize = 3;

/// The runtime's default pipeline chunk (bytes of input; `OXCCL_COMPRESS_CHUNK`).
pub const DEFAULT_CHUNK_BYTES: usize = 4 << 20;

/// Values per pipeline chunk, as the runtime cuts them: `chunk_bytes` of `elem_size`-byte
/// values, rounded down to whole shares of blocks (`n·B` values), at least one share each.
pub fn chunk_values(chunk_bytes: usize, elem_size: usize, n: usize, fmt: Format) -> usize {
    let whole = n.max(1) * fmt.block.values();
    ((chunk_bytes / elem_size.max(1)) / whole * whole).max(whole)
}

/// What [`simulate_compressed`] predicts.
#[derive(Clone, Debug, PartialEq)]
pub struct CompressedReport {
    /// The whole call, seconds.
    pub time_s: f64,
    /// Chunks of the pipeline.
    pub chunks: usize,
    /// Wire time of all chunks' phases (exponents, all-to-all, all-gather), each chunk's
    /// three one after another, summed over the chunks (before overlapping), seconds.
    pub wire_s: f64,
    /// Codec time of all chunks on one rank's core, seconds.
    pub codec_s: f64,
    /// Bytes one rank sends per call (the three phases, as a ring or direct exchange moves
    /// them: `2(n−1)/n` of the exponents, `(n−1)/n` of the mantissas and of the sums).
    pub wire_bytes: f64,
    /// The first (largest) chunk's three phases.
    pub phases: [Report; 3],
}

/// One chunk's phases: wire seconds, and their reports.
fn chunk(fabric: &Fabric, spec: &Spec, values: usize, fmt: Format) -> Result<[Report; 3], String> {
    let n = fabric.world;
    let blocks = block_count(values, fmt.block);
    let share_blocks = blocks.div_ceil(n);
    let share = share_blocks * fmt.block.values();
    let mbytes = match fmt.width {
        Width::Bfp8 => share,
        Width::Bfp4 => share / 2,
    };
    let phase = |coll: Collective| {
        let algo = spec
            .algo
            .filter(|a| a.supports(&coll) && *a != Algorithm::Aggregation);
        simulate(
            fabric,
            &Spec {
                algo,
                channels: spec.channels,
                slots: spec.slots,
                symmetry: spec.symmetry,
                ..Spec::new(coll, 1)
            },
        )
    };
    Ok([
        phase(Collective::AllReduce { count: blocks })?,
        phase(Collective::AllToAll { count: mbytes })?,
        phase(Collective::AllGather {
            count: share_blocks + mbytes,
        })?,
    ])
}

/// Predicts the compressed sum all-reduce of `spec` (an [`Collective::AllReduce`] of `count`
/// values of `spec.elem_size` bytes: 4 for `f32`, 2 for `f16`/`bf16`) in `fmt`, cut into
/// chunks of `chunk_bytes` of input, with the codec running at `codec` (see the module docs).
/// `spec.algo` applies to the phases it supports; its chunk size and trace are not used.
/// Refused, as the runtime refuses it, beyond [`max_ranks`]`::<i16>` ranks (258 for `bfp8`,
/// 4681 for `bfp4`).
pub fn simulate_compressed(
    fabric: &Fabric,
    spec: &Spec,
    fmt: Format,
    codec: &Codec,
    chunk_bytes: usize,
) -> Result<CompressedReport, String> {
    let Collective::AllReduce { count } = spec.coll else {
        return Err(format!(
            "compression applies to all_reduce, not {}",
            spec.coll.name()
        ));
    };
    if !(codec.encode_bytes_per_s > 0.0 && codec.decode_bytes_per_s > 0.0) {
        return Err("the codec's rates must be positive".into());
    }
    let n = fabric.world;
    if n == 0 {
        // (Each rank's share of the blocks divides by it.)
        return Err("the fabric has no rank".into());
    }
    let most = max_ranks::<i16>(fmt.width);
    if n > most {
        return Err(format!(
            "{n} ranks: the runtime's compressed all-reduce sums {fmt} mantissas in 16 bits, \
             which hold the sums of up to {most} ranks, and refuses more"
        ));
    }
    let per = chunk_values(chunk_bytes, spec.elem_size, n, fmt);
    let full = count / per;
    let rest = count % per;
    let chunks = (full + usize::from(rest > 0)).max(1);
    let es = spec.elem_size as f64;
    let first = chunk(fabric, spec, per.min(count), fmt)?;
    let wire = |p: &[Report; 3]| p.iter().map(|r| r.time_s).sum::<f64>();
    let (w1, v1) = (wire(&first), per.min(count) as f64);
    // (The last chunk, when shorter.)
    let (wl, vl) = if full > 0 && rest > 0 {
        (wire(&chunk(fabric, spec, rest, fmt)?), rest as f64)
    } else {
        (w1, v1)
    };
    let enc = |v: f64| v * es / codec.encode_bytes_per_s;
    let dec = |v: f64| v * es / codec.decode_bytes_per_s;
    let k = (chunks - 1) as f64;
    let wire_s = w1 * k + wl;
    let codec_s = (enc(v1) + dec(v1)) * k + enc(vl) + dec(vl);
    let time_s = if chunks == 1 {
        enc(v1) + w1 + dec(v1)
    } else {
        let whole = wire(&chunk(fabric, spec, count, fmt)?);
        let in_flight = wire_s / IN_FLIGHT as f64;
        enc(v1) + whole.max(in_flight).max(codec_s - enc(v1) - dec(vl)) + dec(vl)
    };
    // Bytes per rank, as the phases move them.
    let blocks = block_count(count, fmt.block) as f64;
    let nf = n as f64;
    let m = f64::from(fmt.width.bits()) / 8.0;
    let f = (nf - 1.0) / nf;
    let wire_bytes = 2.0 * f * blocks + f * count as f64 * m + f * (count as f64 * m + blocks);
    Ok(CompressedReport {
        time_s,
        chunks,
        wire_s,
        codec_s,
        wire_bytes,
        phases: first,
    })
}
