//! `oxccl perf`: collective benchmarks in the format of nccl-tests (`all_reduce_perf`, ...).
//!
//! Started without a launcher, it launches its own `-n` ranks on this host (`oxccl run`);
//! under a launcher (torchrun, Slurm, `oxccl run`) each process is one rank. Rank 0 prints.

mod compress;
pub(crate) use compress::parse as parse_compress;

use std::io::Write;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use oxccl::schedule::{Collective, CollectiveKind};
use oxccl::{Buffers, Communicator, DataType, Element, ReduceOp, as_bytes, as_bytes_mut};

/// Options of `oxccl perf`.
#[derive(Debug, Parser)]
pub struct Args {
    /// The collective: all_reduce, reduce_scatter, all_gather, broadcast, reduce, all_to_all,
    /// gather, scatter.
    collective: String,
    /// Ranks to launch on this host when not started by a launcher.
    #[arg(short = 'n', long = "nranks", default_value_t = 2)]
    nranks: usize,
    /// Smallest size in bytes (K/M/G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = crate::verbs_perf::parse_size)]
    min_bytes: usize,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "256M", value_parser = crate::verbs_perf::parse_size)]
    max_bytes: usize,
    /// Size multiplication factor between steps.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    factor: usize,
    /// Data type (nccl-tests names: float, half, bfloat16, double, int8, uint8, int32, ...,
    /// f8e4m3 (or e4m3), f8e5m2 (or e5m2)).
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    dtype: DataType,
    /// Reduction operator: sum, prod, min, max, avg.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    op: ReduceOp,
    /// Root rank of rooted collectives.
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    root: usize,
    /// Check every result (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    check: u8,
    /// Warm-up iterations per size.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    warmup: usize,
    /// Timed iterations per size.
    #[arg(short = 'i', long = "iters", default_value_t = 20)]
    iters: usize,
    /// Buffer registration, as nccl-tests' `-R`: 0 plain vectors; 1 vectors registered with
    /// the communicator (`Communicator::register`); 2 memory the communicator allocates
    /// (`Communicator::alloc`: written in place by the senders over shm too).
    #[arg(short = 'R', long = "local_register", default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=2))]
    register: u8,
    /// Print one JSON document instead of the table.
    #[arg(long)]
    json: bool,
    /// Compress a sum all-reduce of float, half or bfloat16 with block floating point:
    /// `bfp8`, `bfp4` (blocks of 32; `bfp8/16`, `bfp4/64`, ...) or `off`
    /// (`Communicator::all_reduce_compressed`: exact integer sums, the same bits on every rank).
    #[arg(long, default_value = "off")]
    compress: String,
    /// With --compress: error feedback, as a DDP hook runs it (a residual kept from call to
    /// call, added in and updated in the same call: `Communicator::all_reduce_compressed_feedback`,
    /// averaging); the check runs from a zero residual.
    #[arg(long, requires = "compress")]
    feedback: bool,
}

/// A benchmark buffer: a vector, registered or not, or memory the communicator allocated.
enum Mem<T: Element> {
    Plain(Vec<T>),
    Registered(oxccl::Registered<T>),
}

impl<T: Element> Mem<T> {
    /// `len` zeroed elements, as `-R` says.
    fn new(comm: &Communicator, register: u8, len: usize) -> Result<Mem<T>, String> {
        let zeros = || vec![T::from_f64(0.0); len];
        Ok(match register {
            1 if len > 0 => Mem::Registered(comm.register(zeros()).map_err(|e| e.to_string())?),
            2 if len > 0 => Mem::Registered(comm.alloc(len).map_err(|e| e.to_string())?),
            _ => Mem::Plain(zeros()),
        })
    }
}

impl<T: Element> std::ops::Deref for Mem<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Mem::Plain(v) => v,
            Mem::Registered(r) => r,
        }
    }
}

impl<T: Element> std::ops::DerefMut for Mem<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            Mem::Plain(v) => v,
            Mem::Registered(r) => r,
        }
    }
}

/// Whether `oxccl perf` and `oxccl sim` run `kind`: every collective of one count per rank
/// (not all-to-allv, whose counts are per peer) that moves data (not barrier) among all ranks
/// (not send, recv).
fn runs(kind: CollectiveKind) -> bool {
    !matches!(
        kind,
        CollectiveKind::AllToAllV
            | CollectiveKind::Barrier
            | CollectiveKind::Send
            | CollectiveKind::Recv
    )
}

/// The collective of a command line: one that [`runs`], as its name (`all_reduce`), with
/// dashes (`all-reduce`) or as nccl-tests names its binary (`all_reduce_perf`).
pub(crate) fn parse_collective(arg: &str) -> Result<CollectiveKind, String> {
    let name = arg.trim_end_matches("_perf").replace('-', "_");
    name.parse().ok().filter(|&k| runs(k)).ok_or_else(|| {
        let names: Vec<&str> = CollectiveKind::ALL
            .into_iter()
            .filter(|&k| runs(k))
            .map(CollectiveKind::name)
            .collect();
        format!("unknown collective {arg:?}; one of {}", names.join(", "))
    })
}

/// Entry point.
pub fn main(args: Args) -> ExitCode {
    let kind = match parse_collective(&args.collective) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("oxccl perf: {e}");
            return ExitCode::from(2);
        }
    };
    if args.factor < 2 || args.min_bytes > args.max_bytes || args.iters == 0 || args.nranks == 0 {
        eprintln!(
            "oxccl perf: need -f ≥ 2, -b ≤ -e, -i ≥ 1 and -n ≥ 1 (got -f {} -b {} -e {} -i {} -n {})",
            args.factor, args.min_bytes, args.max_bytes, args.iters, args.nranks
        );
        return ExitCode::from(2);
    }
    let compressed = match compress::parse(&args.compress) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("oxccl perf: {e}");
            return ExitCode::from(2);
        }
    };
    if compressed.is_some()
        && (kind != CollectiveKind::AllReduce
            || args.op != ReduceOp::Sum
            || !matches!(args.dtype, DataType::F32 | DataType::F16 | DataType::Bf16))
    {
        eprintln!(
            "oxccl perf: --compress runs a sum all_reduce of float, half or bfloat16 (got {kind} \
             {} {})",
            args.dtype,
            args.op.name()
        );
        return ExitCode::from(2);
    }
    if oxccl_bootstrap::Launcher::in_env().is_none() {
        // Not under a launcher: start our own ranks.
        let (exe, mut own) = match crate::reexec_command() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("oxccl perf: cannot find this executable to launch ranks: {e}");
                return ExitCode::FAILURE;
            }
        };
        own.extend(crate::own_args());
        let opts = crate::run::LaunchOptions {
            prefix_output: false,
            ..crate::run::LaunchOptions::new(args.nranks)
        };
        return match crate::run::launch(&opts, exe.as_os_str(), &own) {
            Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
            Err(e) => {
                eprintln!("oxccl perf: {e}");
                ExitCode::FAILURE
            }
        };
    }
    match rank_main(&args, kind) {
        Ok(0) => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(1),
        Err(e) => {
            eprintln!("oxccl perf: {e}");
            ExitCode::FAILURE
        }
    }
}

fn rank_main(args: &Args, kind: CollectiveKind) -> Result<u64, String> {
    let comm = Communicator::from_env().map_err(|e| e.to_string())?;
    if let Some(fmt) = compress::parse(&args.compress)? {
        let wrong = match args.dtype {
            DataType::F16 => compress::bench::<half::f16>(&comm, args, fmt),
            DataType::Bf16 => compress::bench::<half::bf16>(&comm, args, fmt),
            _ => compress::bench::<f32>(&comm, args, fmt),
        }?;
        comm.destroy().map_err(|e| e.to_string())?;
        return Ok(wrong);
    }
    macro_rules! dispatch {
        ($($d:ident => $t:ty),*) => {
            match args.dtype {
                $(DataType::$d => bench::<$t>(&comm, args, kind),)*
            }
        };
    }
    let wrong = dispatch!(I8 => i8, U8 => u8, I32 => i32, U32 => u32, I64 => i64, U64 => u64,
        F16 => half::f16, Bf16 => half::bf16, F32 => f32, F64 => f64,
        F8E4M3 => oxccl::F8E4M3, F8E5M2 => oxccl::F8E5M2)?;
    comm.destroy().map_err(|e| e.to_string())?;
    Ok(wrong)
}

/// `kind` (one that [`runs`]) of `count` elements (per rank, where the collective counts
/// them so).
pub(crate) fn collective(kind: CollectiveKind, count: usize, root: usize) -> Collective {
    match kind {
        CollectiveKind::AllReduce => Collective::AllReduce { count },
        CollectiveKind::ReduceScatter => Collective::ReduceScatter { count },
        CollectiveKind::AllGather => Collective::AllGather { count },
        CollectiveKind::Broadcast => Collective::Broadcast { count, root },
        CollectiveKind::Reduce => Collective::Reduce { count, root },
        CollectiveKind::AllToAll => Collective::AllToAll { count },
        CollectiveKind::Gather => Collective::Gather { count, root },
        _ => Collective::Scatter { count, root },
    }
}

/// The collective `oxccl perf` runs for a size of `size` bytes of `es`-byte elements on `n`
/// ranks, and the size its table shows: collectives whose size counts all ranks' blocks
/// (reduce-scatter, all-gather, all-to-all, gather, scatter) get `size / es / n` elements per
/// rank.
pub(crate) fn sized(
    kind: CollectiveKind,
    size: usize,
    es: usize,
    n: usize,
    root: usize,
) -> (Collective, usize) {
    let per_rank = matches!(
        kind,
        CollectiveKind::ReduceScatter
            | CollectiveKind::AllGather
            | CollectiveKind::AllToAll
            | CollectiveKind::Gather
            | CollectiveKind::Scatter
    );
    let total = size / es;
    let count = if per_rank { total / n } else { total };
    let shown = if per_rank { count * n * es } else { count * es };
    (collective(kind, count, root), shown)
}

/// nccl-tests' bus bandwidth factor.
pub(crate) fn bus_factor(kind: CollectiveKind, n: usize) -> f64 {
    let n = n as f64;
    match kind {
        CollectiveKind::AllReduce => 2.0 * (n - 1.0) / n,
        CollectiveKind::Broadcast | CollectiveKind::Reduce => 1.0,
        _ => (n - 1.0) / n,
    }
}

/// Input element `i` of rank `r`: small values whose reduction is exact in every type.
fn input_value(op: ReduceOp, r: usize, i: usize) -> f64 {
    match op {
        ReduceOp::Prod => {
            if (r + i).is_multiple_of(5) {
                2.0
            } else {
                1.0
            }
        }
        ReduceOp::Min | ReduceOp::Max => ((r * 7 + i) % 13) as f64,
        _ => ((r + i) % 4) as f64,
    }
}

fn reduce_ref(op: ReduceOp, n: usize, i: usize, integer: bool) -> f64 {
    let vals = (0..n).map(|r| input_value(op, r, i));
    match op {
        ReduceOp::Sum => vals.sum(),
        ReduceOp::Prod => vals.product(),
        ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Avg => {
            let s: f64 = vals.sum();
            if integer {
                (s / n as f64).trunc()
            } else {
                s / n as f64
            }
        }
    }
}

/// What output element `i` of rank `me` must hold.
fn expected(coll: &Collective, op: ReduceOp, n: usize, me: usize, i: usize, integer: bool) -> f64 {
    match *coll {
        Collective::AllReduce { .. } | Collective::Reduce { .. } => reduce_ref(op, n, i, integer),
        Collective::ReduceScatter { count } => reduce_ref(op, n, me * count + i, integer),
        Collective::AllGather { count } | Collective::Gather { count, .. } => {
            input_value(op, i / count, i % count)
        }
        Collective::Broadcast { root, .. } => input_value(op, root, i),
        Collective::AllToAll { count } => input_value(op, i / count, me * count + i % count),
        Collective::Scatter { count, root } => input_value(op, root, me * count + i),
        _ => 0.0,
    }
}

/// Relative difference allowed on `n` ranks. The 8-bit floats round an input (9 is not an
/// e5m2 value) and then once per step of a reduction: at most `n − 1` steps and a division,
/// `n` roundings in all, each within the unit roundoff `u`; the inputs are nonnegative, so the
/// sum of magnitudes in the error bound (see `oxccl_core::dtype`) is the result itself.
fn tolerance(d: DataType, n: usize) -> f64 {
    match d {
        DataType::F16 => 1e-2,
        DataType::Bf16 => 2e-2,
        DataType::F32 => 1e-5,
        DataType::F64 => 1e-12,
        DataType::F8E4M3 | DataType::F8E5M2 => {
            let u = d.unit_roundoff().unwrap_or(0.0);
            (1.0 + u).powi(n.max(1) as i32) - 1.0
        }
        _ => 0.0,
    }
}

/// One size's results: out of place (`[0]`) and in place (`[1]`).
pub(crate) struct Row {
    pub(crate) size: usize,
    pub(crate) count: usize,
    pub(crate) time_us: [f64; 2],
    pub(crate) wrong: [u64; 2],
    /// Bytes that went through rank 0's memory per call, as its executor counts them
    /// (`Communicator::stats`: sent, placed, copied and reduced out of slots, local steps);
    /// `None` where nobody counted (a simulation).
    pub(crate) moved: [Option<u64>; 2],
}

fn bench<T: Element>(
    comm: &Communicator,
    args: &Args,
    kind: CollectiveKind,
) -> Result<u64, String> {
    let (n, me) = (comm.world_size(), comm.rank());
    let es = T::DTYPE.size();
    let root = args.root;
    if root >= n {
        return Err(format!("root {root} is outside a world of {n} ranks"));
    }
    let integer = !T::DTYPE.is_float();
    // Start every rank's engine and caches before the first timed size, as nccl-tests warms up.
    let mut w = [0u64];
    for _ in 0..args.warmup.max(1) * 4 {
        comm.all_reduce_in_place(&mut w, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
    }
    let mut rows = Vec::new();
    let mut size = args.min_bytes;
    loop {
        let (coll, shown) = sized(kind, size, es, n, root);
        let mut row = Row {
            size: shown,
            count: shown / es,
            time_us: [0.0; 2],
            wrong: [0; 2],
            moved: [None; 2],
        };
        for (k, in_place) in [false, true].into_iter().enumerate() {
            let in_len = coll.input_len(n, me);
            let out_len = coll.output_len(n, me);
            let (io, oo) = coll.in_place_offsets(n, me).unwrap_or((0, 0));
            let mem = |len: usize| Mem::<T>::new(comm, args.register, len);
            let mut input = mem(if in_place { 0 } else { in_len })?;
            let mut output = mem(if in_place { 0 } else { out_len })?;
            let mut buf = mem(if in_place {
                (io + in_len).max(oo + out_len)
            } else {
                0
            })?;
            let fill = |input: &mut Mem<T>, buf: &mut Mem<T>| {
                let dst = if in_place {
                    &mut buf[io..io + in_len]
                } else {
                    &mut input[..]
                };
                for (i, x) in dst.iter_mut().enumerate() {
                    *x = T::from_f64(input_value(args.op, me, i));
                }
            };
            fill(&mut input, &mut buf);
            let once = |input: &Mem<T>, output: &mut Mem<T>, buf: &mut Mem<T>| {
                let bufs = if in_place {
                    Buffers::InPlace(as_bytes_mut(buf))
                } else {
                    Buffers::OutOfPlace {
                        input: as_bytes(input),
                        output: as_bytes_mut(output),
                    }
                };
                comm.run(&coll, T::DTYPE, args.op, bufs)
                    .map_err(|e| e.to_string())
            };
            for _ in 0..args.warmup {
                once(&input, &mut output, &mut buf)?;
                if in_place {
                    fill(&mut input, &mut buf);
                }
            }
            comm.barrier().map_err(|e| e.to_string())?;
            let before = comm.stats().moved();
            let t0 = Instant::now();
            for _ in 0..args.iters {
                once(&input, &mut output, &mut buf)?;
            }
            let mut t = [t0.elapsed().as_secs_f64() * 1e6 / args.iters as f64];
            row.moved[k] = Some((comm.stats().moved() - before) / args.iters as u64);
            comm.all_reduce_in_place(&mut t, ReduceOp::Max)
                .map_err(|e| e.to_string())?;
            row.time_us[k] = t[0];
            if args.check != 0 {
                fill(&mut input, &mut buf);
                once(&input, &mut output, &mut buf)?;
                let result: &[T] = if in_place {
                    &buf[oo..oo + out_len]
                } else {
                    &output
                };
                let tol = tolerance(T::DTYPE, n);
                let bad = result
                    .iter()
                    .enumerate()
                    .filter(|&(i, x)| {
                        let want = expected(&coll, args.op, n, me, i, integer);
                        let got = x.to_f64();
                        (got - want).abs() > tol * want.abs().max(1.0)
                    })
                    .count() as u64;
                let mut w = [bad];
                comm.all_reduce_in_place(&mut w, ReduceOp::Sum)
                    .map_err(|e| e.to_string())?;
                row.wrong[k] = w[0];
            }
        }
        rows.push(row);
        match size.checked_mul(args.factor) {
            Some(s) if s <= args.max_bytes => size = s,
            _ => break,
        }
    }
    let wrong: u64 = rows.iter().map(|r| r.wrong[0] + r.wrong[1]).sum();
    if me == 0 {
        print_rows(comm, args, kind, &rows).map_err(|e| e.to_string())?;
    }
    Ok(wrong)
}

fn print_rows(
    comm: &Communicator,
    args: &Args,
    kind: CollectiveKind,
    rows: &[Row],
) -> std::io::Result<()> {
    let n = comm.world_size();
    let provider = comm
        .providers()
        .iter()
        .flatten()
        .map(|p| p.name())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect::<Vec<_>>()
        .join("+");
    let table = Table {
        kind,
        nranks: n,
        dtype: args.dtype,
        op: args.op,
        root: args.root,
        check: args.check != 0,
        in_place: true,
        title: format!(
            "oxccl perf {kind}: nranks {n} minBytes {} maxBytes {} step: {}(factor) warmup iters: {} iters: {} validation: {} local_register: {} provider: {}",
            args.min_bytes,
            args.max_bytes,
            args.factor,
            args.warmup,
            args.iters,
            args.check,
            args.register,
            if provider.is_empty() {
                "none"
            } else {
                &provider
            }
        ),
        json: serde_json::Map::from_iter([("provider".to_string(), provider.clone().into())]),
    };
    write_table(&mut std::io::stdout().lock(), &table, rows, args.json)
}

/// What a results table says besides its rows (shared by `oxccl perf` and `oxccl sim`).
pub(crate) struct Table {
    pub(crate) kind: CollectiveKind,
    pub(crate) nranks: usize,
    pub(crate) dtype: DataType,
    pub(crate) op: ReduceOp,
    pub(crate) root: usize,
    /// Results were checked (else `#wrong` reads N/A).
    pub(crate) check: bool,
    /// The rows have in-place results (else those columns read N/A).
    pub(crate) in_place: bool,
    /// The first header line, after `# `.
    pub(crate) title: String,
    /// More top-level fields of the JSON document.
    pub(crate) json: serde_json::Map<String, serde_json::Value>,
}

/// Writes rows in the nccl-tests format (or one JSON document).
pub(crate) fn write_table(
    out: &mut dyn Write,
    t: &Table,
    rows: &[Row],
    json: bool,
) -> std::io::Result<()> {
    let (kind, n) = (t.kind, t.nranks);
    let bw = |r: &Row, k: usize| {
        let algbw = if r.time_us[k] > 0.0 {
            r.size as f64 / (r.time_us[k] * 1e3)
        } else {
            0.0
        };
        (algbw, algbw * bus_factor(kind, n))
    };
    let root: i64 = if kind.is_rooted() { t.root as i64 } else { -1 };
    let redop = if kind.reduces() { t.op.name() } else { "none" };
    let avg_busbw = rows.iter().map(|r| bw(r, 0).1).sum::<f64>() / rows.len().max(1) as f64;
    if json {
        let rows: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                let side = |k: usize| {
                    let (a, b) = bw(r, k);
                    let mut s = serde_json::json!({"time_us": r.time_us[k], "algbw": a, "busbw": b, "wrong": r.wrong[k]});
                    if let Some(m) = r.moved[k] {
                        s["moved_bytes"] = m.into();
                    }
                    s
                };
                let mut row = serde_json::json!({"size": r.size, "count": r.count, "type": t.dtype.name(),
                    "redop": redop, "root": root, "oop": side(0)});
                if t.in_place {
                    row["ip"] = side(1);
                }
                row
            })
            .collect();
        let mut doc = serde_json::json!({"collective": kind, "nranks": n, "dtype": t.dtype.name(),
            "op": t.op.name(), "root": root, "rows": rows, "avg_busbw": avg_busbw});
        for (k, v) in &t.json {
            doc[k] = v.clone();
        }
        writeln!(out, "{doc}")?;
        return Ok(());
    }
    writeln!(out, "# {}", t.title)?;
    writeln!(out, "#")?;
    writeln!(
        out,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>27}  {:>27}",
        "", "", "", "", "", "out-of-place", "in-place"
    )?;
    writeln!(
        out,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}",
        "size",
        "count",
        "type",
        "redop",
        "root",
        "time",
        "algbw",
        "busbw",
        "#wrong",
        "time",
        "algbw",
        "busbw",
        "#wrong"
    )?;
    writeln!(
        out,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}",
        "(B)",
        "(elements)",
        "",
        "",
        "",
        "(us)",
        "(GB/s)",
        "(GB/s)",
        "",
        "(us)",
        "(GB/s)",
        "(GB/s)",
        ""
    )?;
    for r in rows {
        let (a0, b0) = bw(r, 0);
        let (a1, b1) = bw(r, 1);
        let wrong = |k: usize| {
            if t.check {
                r.wrong[k].to_string()
            } else {
                "N/A".into()
            }
        };
        let ip: [String; 4] = if t.in_place {
            [
                format!("{:.2}", r.time_us[1]),
                format!("{a1:.2}"),
                format!("{b1:.2}"),
                wrong(1),
            ]
        } else {
            ["N/A", "N/A", "N/A", "N/A"].map(String::from)
        };
        writeln!(
            out,
            "  {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7.2}  {:>6.2}  {:>6.2}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}",
            r.size,
            r.count,
            t.dtype.name(),
            redop,
            root,
            r.time_us[0],
            a0,
            b0,
            wrong(0),
            ip[0],
            ip[1],
            ip[2],
            ip[3]
        )?;
    }
    if rows.iter().any(|r| r.moved[0].is_some()) {
        writeln!(
            out,
            "# Bytes through rank 0's memory per call (sent, placed, copied and reduced out of \
             slots, local steps):"
        )?;
        for r in rows {
            let m = |k: usize| r.moved[k].map_or("N/A".into(), |m| m.to_string());
            writeln!(out, "#  {:>10}  oop {:>12}  ip {:>12}", r.size, m(0), m(1))?;
        }
    }
    let total_wrong: u64 = rows.iter().map(|r| r.wrong[0] + r.wrong[1]).sum();
    writeln!(
        out,
        "# Out of bounds values : {total_wrong} {}",
        if total_wrong == 0 { "OK" } else { "FAILED" }
    )?;
    writeln!(out, "# Avg bus bandwidth    : {avg_busbw:.4} ")?;
    writeln!(out, "#")?;
    Ok(())
}
