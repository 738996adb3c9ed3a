//! `oxccl sim`: predicts a collective's time on a modelled fabric (`oxccl-sim`), in the table
//! of `oxccl perf` (the same columns and busbw factors; `#wrong` reads N/A).
//!
//! ```text
//! oxccl sim --topo examples/topologies/testbed-b.toml all_reduce -b 1M -e 64M -f 2
//! oxccl sim --topo nvl72.toml all_reduce -b 64M -e 64M -d half --algo agg --trace agg.json
//! ```
//!
//! Every size runs the schedules the runtime's tuner would pick on the fabric's topology
//! (or `--algo`), out of place and in place (`--oop-only`: out of place only). After the table:
//! the algorithm of every size, and the busiest links of the largest size (bytes, the share
//! of the collective's time they were busy, the rate they achieved while busy against their
//! capacity). `--trace FILE` writes the largest size's timeline as a Chrome/Perfetto trace:
//! process 1 holds one track per rank, process 2 one per link (a track that carries
//! overlapping spans is split into lanes, `rank 3`, `rank 3 #2`, ...). The traced run
//! simulates every rank up to [`TRACE_ALL`] ranks; above, only the representatives of the
//! fabric's symmetry have tracks.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;
use oxccl::schedule::Algorithm;
use oxccl::{CollectiveKind, DataType, ReduceOp};
use oxccl_sim::{Fabric, Report, Spec, Track, simulate};
use serde_json::{Value, json};

use crate::perf::{Row, Table, parse_collective, sized, write_table};

/// Options of `oxccl sim`.
#[derive(Debug, Parser)]
pub struct Args {
    /// The collective: all_reduce, reduce_scatter, all_gather, broadcast, reduce, all_to_all,
    /// gather, scatter.
    pub(crate) collective: String,
    /// Topology file (the format of OXCCL_TOPO_FILE, extended: see examples/topologies).
    #[arg(long)]
    pub(crate) topo: PathBuf,
    /// Smallest size in bytes (K/M/G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = crate::verbs_perf::parse_size)]
    pub(crate) min_bytes: usize,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "256M", value_parser = crate::verbs_perf::parse_size)]
    pub(crate) max_bytes: usize,
    /// Size multiplication factor between steps.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    pub(crate) factor: usize,
    /// Data type (nccl-tests names: float, half, bfloat16, double, int8, ..., f8e4m3 (or e4m3),
    /// f8e5m2 (or e5m2)).
    #[arg(
        short = 'd',
        long = "datatype",
        alias = "dtype",
        default_value = "float"
    )]
    pub(crate) dtype: DataType,
    /// Reduction operator (shown in the table; every operator costs the same).
    #[arg(short = 'o', long = "op", default_value = "sum")]
    pub(crate) op: ReduceOp,
    /// Root rank of rooted collectives.
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    root: usize,
    /// Force an algorithm (OXCCL_ALGO names: ring, rd, tree, chain, direct, prop, hier, agg)
    /// instead of the tuner's choice.
    #[arg(long)]
    algo: Option<String>,
    /// Bytes per pipelined slice [default: the tuner's].
    #[arg(long, value_parser = crate::verbs_perf::parse_size)]
    chunk: Option<usize>,
    /// Channels [default: the tuner's].
    #[arg(long)]
    pub(crate) channels: Option<usize>,
    /// Receive slots per peer and channel, as OXCCL_SLOTS [default: the runtime's, 4 across
    /// hosts, 8 on one].
    #[arg(long)]
    pub(crate) slots: Option<usize>,
    /// Print one JSON document instead of the table.
    #[arg(long)]
    pub(crate) json: bool,
    /// Write the largest size's timeline as a Chrome/Perfetto trace (JSON) to this file.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Simulate every rank even where the fabric's symmetry would allow fewer.
    #[arg(long)]
    pub(crate) no_symmetry: bool,
    /// Only out of place (the in-place columns read N/A): half the work.
    #[arg(long)]
    oop_only: bool,
    /// Busiest links to list.
    #[arg(long, default_value_t = 10)]
    links: usize,
    /// Predict the compressed all-reduce instead (`bfp8`, `bfp4`, `bfp8/16`, ...; `off`):
    /// its three phases on the fabric plus the codec, pipelined, beside the plain one.
    #[arg(long, default_value = "off")]
    pub(crate) compress: String,
    /// The codec's rate per core for --compress, GB/s of uncompressed input, encode and
    /// decode alike [default: the rates measured here, 9 encoding and 5 decoding].
    #[arg(long)]
    pub(crate) codec_gbps: Option<f64>,
    /// Bytes of input per pipeline chunk for --compress (as OXCCL_COMPRESS_CHUNK).
    #[arg(long, value_parser = crate::verbs_perf::parse_size, default_value = "4M")]
    pub(crate) compress_chunk: usize,
}

/// Entry point.
pub fn main(args: Args) -> ExitCode {
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err((code, e)) => {
            eprintln!("oxccl sim: error: {e}");
            ExitCode::from(code)
        }
    }
}

/// One simulated size.
struct Sized {
    row: Row,
    algo: Algorithm,
    report: Report,
    wall_s: f64,
}

fn run(args: &Args) -> Result<(), (u8, String)> {
    let usage = |e: String| (2u8, e);
    let kind = parse_collective(&args.collective).map_err(usage)?;
    if args.factor < 2 || args.min_bytes > args.max_bytes {
        return Err(usage(format!(
            "need -f ≥ 2 and -b ≤ -e (got -f {} -b {} -e {})",
            args.factor, args.min_bytes, args.max_bytes
        )));
    }
    let algo = match &args.algo {
        None => None,
        Some(a) => Some(Algorithm::from_name(a).ok_or_else(|| {
            usage(format!(
                "unknown algorithm {a:?}; one of ring, rd, tree, chain, direct, dissemination, \
                 prop, hier, agg"
            ))
        })?),
    };
    if args.channels == Some(0) || args.chunk == Some(0) {
        return Err(usage("--channels and --chunk must be at least 1".into()));
    }
    let compress = crate::perf::parse_compress(&args.compress).map_err(usage)?;
    let fabric = Fabric::from_file(&args.topo).map_err(|e| (1, e))?;
    if let Some(fmt) = compress {
        return crate::sim_compress::run(args, kind, &fabric, fmt, algo);
    }
    let n = fabric.world;
    if args.root >= n {
        return Err(usage(format!(
            "root {} is outside the fabric's {n} ranks",
            args.root
        )));
    }
    let results = simulate_sizes(args, kind, &fabric, algo)?;
    report(args, kind, &fabric, &results)
}

/// Simulates every size of the sweep (out of place, then in place unless `--oop-only`),
/// keeping the out-of-place report of each.
fn simulate_sizes(
    args: &Args,
    kind: CollectiveKind,
    fabric: &Fabric,
    algo: Option<Algorithm>,
) -> Result<Vec<Sized>, (u8, String)> {
    let usage = |e: String| (2u8, e);
    let n = fabric.world;
    let es = args.dtype.size();
    let mut results: Vec<Sized> = Vec::new();
    let mut size = args.min_bytes;
    loop {
        let (coll, shown) = sized(kind, size, es, n, args.root);
        if let Some(a) = algo
            && !a.supports(&coll)
        {
            let can: Vec<&str> = Algorithm::ALL
                .into_iter()
                .filter(|x| x.supports(&coll))
                .map(Algorithm::name)
                .collect();
            return Err(usage(format!(
                "algorithm {} can't run {kind}; it runs with {}",
                a.name(),
                can.join(", ")
            )));
        }
        let last = size
            .checked_mul(args.factor)
            .is_none_or(|s| s > args.max_bytes);
        let mut row = Row {
            size: shown,
            count: shown / es,
            time_us: [0.0; 2],
            wrong: [0; 2],
            moved: [None; 2],
        };
        let mut kept = None;
        for (k, in_place) in [false, true].into_iter().enumerate() {
            if in_place && args.oop_only {
                break;
            }
            let traced = last && !in_place && args.trace.is_some();
            let spec = Spec {
                coll: coll.clone(),
                elem_size: es,
                in_place,
                algo,
                chunk_bytes: args.chunk,
                channels: args.channels,
                slots: args.slots,
                trace: traced,
                // A trace has a track for every rank: the traced run simulates them all,
                // where that is affordable.
                symmetry: !(args.no_symmetry || traced && fabric.world <= TRACE_ALL),
            };
            let t0 = std::time::Instant::now();
            let report = simulate(fabric, &spec)
                .map_err(|e| (1, format!("{kind} of {shown} bytes: {e}")))?;
            let wall_s = t0.elapsed().as_secs_f64();
            row.time_us[k] = report.time_s * 1e6;
            if k == 0 {
                kept = Some((report, wall_s));
            }
        }
        let (report, wall_s) = kept.expect("out of place ran");
        results.push(Sized {
            row,
            algo: report.algo,
            report,
            wall_s,
        });
        if last {
            break;
        }
        size *= args.factor;
    }
    Ok(results)
}

/// Prints the sweep as nccl-tests does (or its JSON), then the algorithms by size, the
/// simulation's cost, the busiest links at the largest size and where the trace went.
fn report(
    args: &Args,
    kind: CollectiveKind,
    fabric: &Fabric,
    results: &[Sized],
) -> Result<(), (u8, String)> {
    let n = fabric.world;
    let largest = results.last().expect("one size at least");
    if let Some(path) = &args.trace {
        write_trace(path, fabric, &largest.report).map_err(|e| {
            (
                1,
                format!("cannot write the trace to {}: {e}", path.display()),
            )
        })?;
    }
    let links = busiest(fabric, &largest.report, args.links);
    let rows: Vec<Row> = results
        .iter()
        .map(|s| Row {
            size: s.row.size,
            count: s.row.count,
            time_us: s.row.time_us,
            wrong: s.row.wrong,
            moved: s.row.moved,
        })
        .collect();
    let rep = &largest.report;
    let sym = if rep.symmetric && rep.approximate {
        format!(
            "symmetry: APPROXIMATE, {} of {n} ranks simulated as if every rank ran its \
             representative's schedule (--no-symmetry runs them all)",
            rep.simulated_ranks
        )
    } else if rep.symmetric {
        format!("symmetry: {} of {n} ranks simulated", rep.simulated_ranks)
    } else {
        "symmetry: none".to_string()
    };
    let mut extra = serde_json::Map::new();
    extra.insert("topology".into(), args.topo.display().to_string().into());
    extra.insert(
        "algos".into(),
        results.iter().map(|s| Value::from(s.algo.name())).collect(),
    );
    extra.insert(
        "sim".into(),
        json!({
            "simulated_ranks": rep.simulated_ranks, "symmetric": rep.symmetric,
            "approximate": rep.approximate,
            "steps": rep.steps, "flows": rep.flows,
            "wall_s": results.iter().map(|s| s.wall_s).collect::<Vec<_>>(),
        }),
    );
    extra.insert(
        "links".into(),
        links
            .iter()
            .map(|l| {
                json!({"link": l.name, "bytes": l.bytes, "busy_s": l.busy_s, "busy_pct": l.busy_pct,
                   "achieved_gbps": l.achieved_gbps, "capacity_gbps": l.capacity_gbps})
            })
            .collect(),
    );
    let table = Table {
        kind,
        nranks: n,
        dtype: args.dtype,
        op: args.op,
        root: args.root,
        check: false,
        in_place: !args.oop_only,
        title: format!(
            "oxccl sim {kind}: nranks {n} minBytes {} maxBytes {} step: {}(factor) topology: {} hosts: {} {sym}",
            args.min_bytes,
            args.max_bytes,
            args.factor,
            args.topo.display(),
            fabric.hosts.len(),
        ),
        json: extra,
    };
    let mut out = std::io::stdout().lock();
    let io = |e: std::io::Error| (1u8, e.to_string());
    write_table(&mut out, &table, &rows, args.json).map_err(io)?;
    if args.json {
        return Ok(());
    }
    writeln!(out, "# algorithm: {}", algo_ranges(results)).map_err(io)?;
    writeln!(
        out,
        "# simulated in {:.3} s wall ({} steps, {} flows at the largest size)",
        results.iter().map(|s| s.wall_s).sum::<f64>(),
        rep.steps,
        rep.flows
    )
    .map_err(io)?;
    if !links.is_empty() {
        writeln!(
            out,
            "# busiest links at {} bytes (of {} links; by bytes over capacity; busy: share of the {:.2} us; rate: while busy)",
            largest.row.size,
            fabric.links.len(),
            rep.time_s * 1e6
        )
        .map_err(io)?;
        let w = links.iter().map(|l| l.name.len()).max().unwrap_or(4).max(4);
        writeln!(
            out,
            "# {:<w$}  {:>14}  {:>6}  {:>12}  {:>12}",
            "link", "bytes", "busy%", "rate(Gb/s)", "cap(Gb/s)"
        )
        .map_err(io)?;
        for l in &links {
            writeln!(
                out,
                "# {:<w$}  {:>14.0}  {:>6.1}  {:>12.2}  {:>12.2}",
                l.name, l.bytes, l.busy_pct, l.achieved_gbps, l.capacity_gbps
            )
            .map_err(io)?;
        }
    }
    if let Some(path) = &args.trace {
        writeln!(
            out,
            "# trace of {} bytes: {} (open in ui.perfetto.dev or chrome://tracing)",
            largest.row.size,
            path.display()
        )
        .map_err(io)?;
    }
    Ok(())
}

/// `ring (1048576-67108864)`, or several when the tuner switches by size.
fn algo_ranges(results: &[Sized]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < results.len() {
        let mut j = i;
        while j + 1 < results.len() && results[j + 1].algo == results[i].algo {
            j += 1;
        }
        let (a, z) = (results[i].row.size, results[j].row.size);
        parts.push(if i == j {
            format!("{} ({a} B)", results[i].algo.name())
        } else {
            format!("{} ({a}-{z} B)", results[i].algo.name())
        });
        i = j + 1;
    }
    parts.join(", ")
}

/// A link's use during one collective.
struct LinkUse {
    name: String,
    bytes: f64,
    busy_s: f64,
    busy_pct: f64,
    achieved_gbps: f64,
    capacity_gbps: f64,
}

/// The `k` most loaded links (ties: the lower index first).
fn busiest(fabric: &Fabric, report: &Report, k: usize) -> Vec<LinkUse> {
    let mut idx: Vec<usize> = (0..fabric.links.len().min(report.link_bytes.len()))
        .filter(|&l| report.link_bytes[l] > 0.0)
        .collect();
    // By the share of its capacity the link used over the whole collective (the
    // bottlenecks first), then by bytes.
    let load = |l: usize| report.link_bytes[l] / fabric.links[l].bytes_per_s;
    idx.sort_by(|&a, &b| {
        load(b)
            .total_cmp(&load(a))
            .then(report.link_bytes[b].total_cmp(&report.link_bytes[a]))
            .then(a.cmp(&b))
    });
    idx.truncate(k);
    idx.into_iter()
        .map(|l| {
            let bytes = report.link_bytes[l];
            let busy_s = report.link_busy_s.get(l).copied().unwrap_or(0.0);
            LinkUse {
                name: fabric.links[l].name.clone(),
                bytes,
                busy_s,
                busy_pct: if report.time_s > 0.0 {
                    100.0 * busy_s / report.time_s
                } else {
                    0.0
                },
                achieved_gbps: if busy_s > 0.0 {
                    bytes * 8.0 / busy_s / 1e9
                } else {
                    0.0
                },
                capacity_gbps: fabric.links[l].bytes_per_s * 8.0 / 1e9,
            }
        })
        .collect()
}

/// Up to this many ranks, a traced run simulates every rank (without the symmetry).
pub const TRACE_ALL: usize = 1024;

/// Chrome trace-event JSON: process 1 "ranks" (a thread per rank), process 2 "links" (a
/// thread per link that carried anything); complete events (`ph: X`) in microseconds.
/// Spans that overlap on one track go to extra lanes (threads named `... #2`), since the
/// format wants the spans of a thread nested.
pub(crate) fn trace_json(fabric: &Fabric, report: &Report) -> Value {
    let mut events: Vec<Value> = vec![
        json!({"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "ranks"}}),
        json!({"ph": "M", "name": "process_sort_index", "pid": 1, "args": {"sort_index": 1}}),
        json!({"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "links"}}),
        json!({"ph": "M", "name": "process_sort_index", "pid": 2, "args": {"sort_index": 2}}),
    ];
    let Some(trace) = &report.trace else {
        return json!({"traceEvents": events, "displayTimeUnit": "ns"});
    };
    // Per track, spans by start; lanes greedily.
    let mut by_track: std::collections::BTreeMap<(u8, usize), Vec<usize>> = Default::default();
    for (i, e) in trace.iter().enumerate() {
        let key = match e.track {
            Track::Rank(r) => (1, r),
            Track::Link(l) => (2, l),
        };
        by_track.entry(key).or_default().push(i);
    }
    let mut next_tid = [0u64; 3];
    for ((pid, id), mut spans) in by_track {
        spans.sort_by(|&a, &b| {
            trace[a]
                .start_s
                .total_cmp(&trace[b].start_s)
                .then(trace[b].end_s.total_cmp(&trace[a].end_s))
        });
        let base = match pid {
            1 => fabric
                .nodes
                .get(id)
                .map_or(format!("rank {id}"), |n| format!("rank {id} ({})", n.name)),
            _ => fabric
                .links
                .get(id)
                .map_or(format!("link {id}"), |l| l.name.clone()),
        };
        // lane -> (tid, stack of open ends); times in whole nanoseconds, as Perfetto keeps
        // them, so that a span ending where the next starts doesn't overlap it by rounding.
        let mut lanes: Vec<(u64, Vec<i64>)> = Vec::new();
        for i in spans {
            let e = &trace[i];
            let start = (e.start_s * 1e9).round() as i64;
            let end = ((e.end_s * 1e9).round() as i64).max(start);
            let lane = lanes.iter_mut().position(|(_, stack)| {
                while stack.last().is_some_and(|&top| top <= start) {
                    stack.pop();
                }
                stack.last().is_none_or(|&top| end <= top)
            });
            let lane = match lane {
                Some(l) => l,
                None => {
                    next_tid[pid as usize] += 1;
                    let tid = next_tid[pid as usize];
                    let name = if lanes.is_empty() {
                        base.clone()
                    } else {
                        format!("{base} #{}", lanes.len() + 1)
                    };
                    events.push(
                        json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                        "args": {"name": name}}),
                    );
                    events.push(json!({"ph": "M", "name": "thread_sort_index", "pid": pid,
                        "tid": tid, "args": {"sort_index": tid}}));
                    lanes.push((tid, Vec::new()));
                    lanes.len() - 1
                }
            };
            lanes[lane].1.push(end);
            events.push(
                json!({"ph": "X", "name": e.name, "pid": pid, "tid": lanes[lane].0,
                "ts": start as f64 / 1e3, "dur": (end - start) as f64 / 1e3,
                "args": {"bytes": e.bytes}}),
            );
        }
    }
    json!({"traceEvents": events, "displayTimeUnit": "ns",
        "otherData": {"algorithm": report.algo.name(), "time_us": report.time_s * 1e6}})
}

fn write_trace(path: &Path, fabric: &Fabric, report: &Report) -> std::io::Result<()> {
    let doc = trace_json(fabric, report);
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    serde_json::to_writer(&mut f, &doc)?;
    f.flush()
}
