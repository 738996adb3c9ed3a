//! `oxccl sim all_reduce --compress bfp8|bfp4`: the compressed all-reduce predicted
//! ([`oxccl_sim::compress`]: its three phases on the fabric, the codec at `--codec-gbps` per
//! core, pipelined in chunks of `--compress-chunk`), beside the plain all-reduce on the same
//! fabric.
//!
//! ```text
//! oxccl sim --topo examples/topologies/two-dc-1000km.toml all_reduce -b 64M -e 1G -f 4 --compress bfp8
//! ```

use std::io::Write;

use oxccl::compress::Format;
use oxccl::schedule::{Algorithm, Collective, CollectiveKind};
use oxccl::{DataType, ReduceOp};
use oxccl_sim::{Codec, Fabric, Spec, simulate, simulate_compressed};
use serde_json::json;

use crate::sim::Args;

/// Runs the sizes of `args` compressed in `fmt`, and plain, on `fabric`; prints a table (or
/// JSON).
pub(crate) fn run(
    args: &Args,
    kind: CollectiveKind,
    fabric: &Fabric,
    fmt: Format,
    algo: Option<Algorithm>,
) -> Result<(), (u8, String)> {
    let usage = |e: String| (2u8, e);
    if kind != CollectiveKind::AllReduce
        || !matches!(args.op, ReduceOp::Sum | ReduceOp::Avg)
        || !matches!(args.dtype, DataType::F32 | DataType::F16 | DataType::Bf16)
    {
        return Err(usage(format!(
            "--compress predicts a sum all_reduce of float, half or bfloat16 (got {kind} of {} \
             with {:?})",
            args.dtype, args.op
        )));
    }
    let codec = match args.codec_gbps {
        None => Codec::default(),
        Some(g) if g > 0.0 && g.is_finite() => Codec {
            encode_bytes_per_s: g * 1e9,
            decode_bytes_per_s: g * 1e9,
        },
        Some(g) => {
            return Err(usage(format!(
                "--codec-gbps must be a positive rate (got {g})"
            )));
        }
    };
    if args.compress_chunk == 0 {
        return Err(usage("--compress-chunk must be at least 1".into()));
    }
    let (n, es) = (fabric.world, args.dtype.size());
    let mut out = std::io::stdout().lock();
    let io = |e: std::io::Error| (1u8, e.to_string());
    if !args.json {
        writeln!(
            out,
            "# oxccl sim all_reduce --compress {fmt}: nranks {n} topology: {} hosts: {} codec: \
             {} / {} GB/s per core (encode / decode), chunks of {} bytes",
            args.topo.display(),
            fabric.hosts.len(),
            codec.encode_bytes_per_s / 1e9,
            codec.decode_bytes_per_s / 1e9,
            args.compress_chunk
        )
        .map_err(io)?;
        writeln!(
            out,
            "# time: predicted compressed call; plain: the plain all-reduce on the same fabric; \
             wire: the phases' time; codec: one core's coding time; bytes: one rank's, against a \
             ring's 2(n-1)/n of the buffer"
        )
        .map_err(io)?;
        writeln!(
            out,
            "#{:>11} {:>12} {:>8} {:>12} {:>12} {:>8} {:>12} {:>12} {:>7} {:>10}",
            "size",
            "count",
            "type",
            "time(us)",
            "plain(us)",
            "ratio",
            "wire(us)",
            "codec(us)",
            "chunks",
            "bytes/ring"
        )
        .map_err(io)?;
    }
    let mut rows = Vec::new();
    let mut size = args.min_bytes;
    loop {
        let count = size / es;
        let spec = Spec {
            algo,
            channels: args.channels,
            slots: args.slots,
            symmetry: !args.no_symmetry,
            ..Spec::new(Collective::AllReduce { count }, es)
        };
        let what = |e: String| (1u8, format!("all_reduce of {} bytes: {e}", count * es));
        let plain = simulate(fabric, &spec).map_err(what)?;
        let c =
            simulate_compressed(fabric, &spec, fmt, &codec, args.compress_chunk).map_err(what)?;
        let ring = 2.0 * (n as f64 - 1.0) / n as f64 * (count * es) as f64;
        let vs_ring = if ring > 0.0 { c.wire_bytes / ring } else { 0.0 };
        let ratio = c.time_s / plain.time_s;
        if args.json {
            rows.push(json!({
                "size": count * es, "count": count, "type": args.dtype.name(),
                "compress": fmt.to_string(), "time_us": c.time_s * 1e6,
                "plain_us": plain.time_s * 1e6, "ratio": ratio, "wire_us": c.wire_s * 1e6,
                "codec_us": c.codec_s * 1e6, "chunks": c.chunks, "wire_bytes": c.wire_bytes,
                "wire_vs_ring": vs_ring, "plain_algo": plain.algo.name(),
            }));
        } else {
            writeln!(
                out,
                "{:>12} {:>12} {:>8} {:>12.1} {:>12.1} {:>8.3} {:>12.1} {:>12.1} {:>7} {:>10.3}",
                count * es,
                count,
                args.dtype.name(),
                c.time_s * 1e6,
                plain.time_s * 1e6,
                ratio,
                c.wire_s * 1e6,
                c.codec_s * 1e6,
                c.chunks,
                vs_ring
            )
            .map_err(io)?;
        }
        match size.checked_mul(args.factor) {
            Some(s) if s <= args.max_bytes => size = s,
            _ => break,
        }
    }
    if args.json {
        writeln!(
            out,
            "{}",
            json!({ "rows": rows, "topology": args.topo.display().to_string(),
                    "nranks": n, "codec_encode_gbps": codec.encode_bytes_per_s / 1e9,
                    "codec_decode_gbps": codec.decode_bytes_per_s / 1e9,
                    "chunk_bytes": args.compress_chunk })
        )
        .map_err(io)?;
    }
    Ok(())
}
