//! `oxccl status --store HOST:PORT [--json]`: asks every process of a running job, through
//! its store, what it is doing right now, and names the rank that holds everyone up.
//!
//! Each process of an oxccl job runs a service thread that waits on the store for requests
//! (`oxccl::status`); it answers with its flight recorder's live state: per communicator, the
//! running collective, its sequence number and steps done, the peer it waits on and since
//! when, and the last call completed. The answers are analysed as `oxccl doctor` analyses
//! dumps (the same code): ranks that did not answer (stopped, or dead without closing), ranks
//! behind the others, and who waits on whom.
//!
//! It answers within `--timeout` (1 s) even when the job hangs: processes that have not
//! answered by then are reported silent. Exit status: 0 when every process answered and no
//! call has waited longer than `--stuck-after`; 1 when a process is silent or a call is stuck;
//! 2 on a usage error or when the store cannot be asked (unreachable, wrong secret).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use oxccl::flight::CallState;
use oxccl::status::{Answers, Registration};
use oxccl_bootstrap::{ClientOptions, Secret, TcpStore};
use serde::Serialize;

use crate::doctor::{
    self, CommReport, Loaded, RankSummary, Words, call_text, duration_text, ranks_text,
};

/// Options of `oxccl status`.
#[derive(Clone, Debug, clap::Args)]
pub struct Args {
    /// The job's store, HOST:PORT [default: OXCCL_STORE_ADDR, else MASTER_ADDR:MASTER_PORT].
    #[arg(long)]
    store: Option<String>,
    /// File holding the job's secret [default: OXCCL_SECRET or OXCCL_SECRET_FILE, else the
    /// per-user secret file].
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// How long to take in all, answers included (e.g. `1s`, `500ms`).
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    timeout: Duration,
    /// A call that has waited this long counts as stuck.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    stuck_after: Duration,
    /// Print the answers and their analysis as one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// `1.5s`, `500ms`, `2` (seconds).
fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let (num, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else {
        (t, 1.0)
    };
    match num.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v * scale < 3600.0 => {
            Ok(Duration::from_secs_f64(v * scale))
        }
        _ => Err(format!(
            "{s:?} is not a duration between 0 and 1 h (e.g. 1s, 500ms)"
        )),
    }
}

/// The words of the verdicts, for live answers.
const LIVE_WORDS: Words = Words {
    none_from: "no answer from",
    why_one: "stopped, hung with its signals blocked, or dead",
    why_many: "stopped, hung with their signals blocked, or dead",
    all_in: "all ranks that answered are in",
};

/// The whole status, as `--json` prints it.
#[derive(Debug, Serialize)]
struct Status {
    store: String,
    /// The request's number in the store.
    request: u64,
    /// From connecting to the store to the last answer collected.
    elapsed_ms: u64,
    /// Processes asked, that answered, and that did not.
    asked: usize,
    answered: usize,
    silent: Vec<Registration>,
    /// Processes whose service has ended (their communicators are gone).
    gone: usize,
    /// Whether every process answered and no call is stuck.
    healthy: bool,
    /// Per communicator: the analysis and its headline.
    communicators: Vec<CommStatus>,
    warnings: Vec<String>,
}

/// One communicator's status.
#[derive(Debug, Serialize)]
struct CommStatus {
    /// The rank that holds everyone up, if any.
    holder: Option<u32>,
    /// The ranks whose running call has waited longer than `--stuck-after`.
    stuck: Vec<u32>,
    /// One sentence: healthy, or who holds everyone up and why.
    headline: String,
    #[serde(flatten)]
    report: CommReport,
}

/// The running call of `r`, if its last started one is not finished.
fn running(r: &RankSummary) -> Option<&oxccl::flight::Entry> {
    r.last_started_call
        .as_ref()
        .map(|c| &c.entry)
        .filter(|e| e.state == CallState::Running)
}

/// How long `r`'s running call has waited at answer time (else has run), in ns.
fn waited_ns(r: &RankSummary) -> Option<u64> {
    let e = running(r)?;
    let since = e.waiting_since_unix_ns.unwrap_or(e.start_unix_ns);
    (since > 0).then(|| r.time_unix_ns.saturating_sub(since))
}

/// The headline and holder of one communicator.
fn judge(report: CommReport, stuck_after: Duration) -> CommStatus {
    let stuck: Vec<u32> = report
        .ranks
        .iter()
        .filter(|r| waited_ns(r).is_some_and(|ns| ns >= stuck_after.as_nanos() as u64))
        .map(|r| r.rank)
        .collect();
    let trouble = !report.missing_ranks.is_empty() || !stuck.is_empty();
    let holder = report.suspects.first().copied().filter(|_| trouble);
    let headline = match holder {
        Some(h) => {
            let waiters: Vec<u32> = report
                .ranks
                .iter()
                .filter(|r| r.waiting_on == Some(h))
                .map(|r| r.rank)
                .collect();
            let why = if report.missing_ranks.contains(&h) {
                "it does not answer (stopped, hung with its signals blocked, or dead)".to_string()
            } else if report.behind.contains(&h) {
                let at = report
                    .ranks
                    .iter()
                    .find(|r| r.rank == h)
                    .map_or(String::new(), |r| format!(" at #{}", r.last_started));
                format!("it is behind the others{at}")
            } else {
                "the others wait on it".to_string()
            };
            let waited = match waiters.len() {
                0 => String::new(),
                1 => format!("; {} waits on it", ranks_text(&waiters)),
                _ => format!("; {} wait on it", ranks_text(&waiters)),
            };
            format!("rank {h} holds everyone up: {why}{waited}")
        }
        None if trouble => format!(
            "stuck: {} waited longer than {}",
            ranks_text(&stuck),
            duration_text(stuck_after.as_nanos() as u64)
        ),
        None => format!(
            "healthy: all {} ranks answered, none has waited {} or more",
            report.world_size,
            duration_text(stuck_after.as_nanos() as u64)
        ),
    };
    CommStatus {
        holder,
        stuck,
        headline,
        report,
    }
}

/// The table of one communicator's ranks, the silent ones included.
fn table(c: &CommStatus, silent: &BTreeMap<(String, u32), &Registration>) -> String {
    let header = [
        "rank",
        "process",
        "state",
        "call",
        "step",
        "waiting on",
        "for",
        "last completed",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    let dash = || "-".to_string();
    for rank in 0..c.report.world_size {
        let Some(r) = c.report.ranks.iter().find(|r| r.rank == rank) else {
            let process = silent
                .get(&(c.report.comm_id.clone(), rank))
                .map_or_else(dash, |s| format!("{}:{}", s.host, s.pid));
            rows.push(vec![
                rank.to_string(),
                process,
                "NO ANSWER".into(),
                dash(),
                dash(),
                dash(),
                dash(),
                dash(),
            ]);
            continue;
        };
        let process = format!(
            "{}:{}",
            r.host.as_deref().unwrap_or("?"),
            r.pid.map_or_else(|| "?".into(), |p| p.to_string())
        );
        let last = r
            .last_completed_call
            .as_ref()
            .map_or(format!("#{}", r.last_completed), |c| {
                format!("{} #{}", c.entry.coll, c.entry.seq)
            });
        let row = match running(r) {
            Some(e) => vec![
                rank.to_string(),
                process,
                if r.waiting.is_some() {
                    "waiting".into()
                } else {
                    "running".into()
                },
                call_text(e),
                format!("{}/{}", e.steps_done, e.steps),
                r.waiting_on.map_or_else(
                    || r.waiting.as_deref().map_or_else(dash, short_wait),
                    |p| {
                        format!(
                            "rank {p} ({})",
                            r.waiting.as_deref().map_or_else(|| "?".into(), short_wait)
                        )
                    },
                ),
                waited_ns(r).map_or_else(dash, since_text),
                last,
            ],
            None => vec![
                rank.to_string(),
                process,
                "idle".into(),
                dash(),
                dash(),
                dash(),
                dash(),
                last,
            ],
        };
        rows.push(row);
    }
    crate::doctor::columns(&rows, "  ")
}

/// How long, at the recorder's clock's resolution (the coarse clock: a few ms).
fn since_text(ns: u64) -> String {
    if ns < 1_000_000 {
        "<1 ms".into()
    } else {
        duration_text(ns)
    }
}

/// `data`, `slot`, `mailbox`, `send`, `earlier steps`: what a waiting text waits for.
fn short_wait(text: &str) -> String {
    let kinds = [
        ("waiting for data", "data"),
        ("to free a slot", "a free slot"),
        ("mailbox", "mailbox message"),
        ("transport", "send completion"),
        ("waiting to send", "earlier steps"),
        ("earlier steps", "earlier steps"),
    ];
    kinds
        .iter()
        .find(|(k, _)| text.contains(k))
        .map_or_else(|| text.to_string(), |(_, s)| s.to_string())
}

fn render(s: &Status) -> String {
    let mut out = format!(
        "oxccl status: {} processes asked through {}, {} answered in {} ms",
        s.asked, s.store, s.answered, s.elapsed_ms
    );
    if !s.silent.is_empty() {
        out += &format!(", {} did not", s.silent.len());
    }
    out += "\n";
    let silent: BTreeMap<(String, u32), &Registration> = s
        .silent
        .iter()
        .map(|r| ((r.comm_id.clone(), r.rank), r))
        .collect();
    for c in &s.communicators {
        out += &format!(
            "\ncommunicator {} ({} ranks): {}\n",
            c.report.comm_id, c.report.world_size, c.headline
        );
        out += &table(c, &silent);
        // (In a healthy job that runs, the answers come from slightly different moments: who
        // is a call behind then means nothing.)
        if c.holder.is_some() || !c.stuck.is_empty() {
            for v in &c.report.verdicts {
                out += &format!("  verdict: {v}\n");
            }
        }
    }
    // Silent processes of communicators nobody answered for.
    let known: Vec<&str> = s
        .communicators
        .iter()
        .map(|c| c.report.comm_id.as_str())
        .collect();
    let orphans: Vec<&Registration> = s
        .silent
        .iter()
        .filter(|r| !known.contains(&r.comm_id.as_str()))
        .collect();
    if !orphans.is_empty() {
        out += "\nsilent processes of communicators no rank answered for (the whole job stopped, \
                or processes that ended without saying so):\n";
        for r in orphans {
            out += &format!(
                "  rank {} of {} in communicator {}: pid {} on {}\n",
                r.rank, r.world_size, r.comm_id, r.pid, r.host
            );
        }
    }
    if s.asked == 0 && s.gone > 0 {
        out += &format!(
            "no process to ask: the {} that registered with this store have ended\n",
            s.gone
        );
    } else if s.asked == 0 {
        out += "no oxccl process has registered with this store (a job started before \
                `oxccl status` existed, with OXCCL_STATUS=0, or over another store)\n";
    }
    out
}

/// Asks the store at `addr`; the status, or why not.
fn ask(args: &Args, addr: &str, start: Instant) -> Result<(Status, TcpStore, Answers), String> {
    let secret = match &args.secret_file {
        Some(path) => Secret::from_file(path),
        None => Secret::from_env_or_user_file(),
    }
    .map_err(|e| e.to_string())?;
    let opts = ClientOptions {
        // (Within the time `main` waits for this thread.)
        // (A reply that does not come is cut short by `main`'s wait.)
        connect_timeout: args.timeout * 4 / 5,
        label: format!("oxccl status pid {}", std::process::id()),
        ..ClientOptions::default()
    };
    // (A refusal names the secret and says where it comes from.)
    let store = TcpStore::connect_with(addr, &secret, &opts).map_err(|e| e.to_string())?;
    // Answers are collected until shortly before the timeout, leaving time to report.
    let margin = (args.timeout / 3).min(Duration::from_millis(300));
    let answers: Answers = oxccl::status::query(&store, start + args.timeout - margin)
        .map_err(|e| format!("asking the store at {addr}: {e}"))?;
    let elapsed_ms = start.elapsed().as_millis() as u64;
    let loaded: Vec<Loaded> = answers
        .answered
        .iter()
        .map(|(r, d)| Loaded {
            dump: d.clone(),
            source: format!("{}:{}", r.host, r.pid),
        })
        .collect();
    let mut warnings = answers.unreadable.clone();
    let report = doctor::analyze(&loaded, Vec::new(), &LIVE_WORDS);
    warnings.extend(report.warnings);
    let communicators: Vec<CommStatus> = report
        .communicators
        .into_iter()
        .map(|c| judge(c, args.stuck_after))
        .collect();
    let healthy = answers.silent.is_empty()
        && communicators
            .iter()
            .all(|c| c.holder.is_none() && c.stuck.is_empty());
    let status = Status {
        store: addr.to_string(),
        request: answers.request,
        elapsed_ms,
        asked: answers.answered.len() + answers.silent.len(),
        answered: answers.answered.len(),
        silent: answers.silent.clone(),
        gone: answers.gone,
        healthy,
        communicators,
        warnings,
    };
    Ok((status, store, answers))
}

/// `oxccl status`: 0 healthy, 1 a silent or stuck rank, 2 cannot ask.
pub fn main(args: Args) -> ExitCode {
    let start = Instant::now();
    let Some(addr) = args
        .store
        .clone()
        .or_else(|| std::env::var("OXCCL_STORE_ADDR").ok())
        .or_else(|| {
            let (host, port) = (std::env::var("MASTER_ADDR"), std::env::var("MASTER_PORT"));
            Some(format!("{}:{}", host.ok()?, port.ok()?))
        })
        .filter(|a| !a.trim().is_empty())
    else {
        eprintln!(
            "oxccl status: error: no store: give --store HOST:PORT, or set OXCCL_STORE_ADDR, or \
             MASTER_ADDR and MASTER_PORT"
        );
        return ExitCode::from(2);
    };
    // Asked from a thread: a store that accepts connections but never answers (its process is
    // stopped) must not hold this command past its timeout.
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let (args, addr) = (args.clone(), addr.clone());
        std::thread::spawn(move || {
            let _ = tx.send(ask(&args, &addr, start));
        });
    }
    let (status, store, answers) = match rx.recv_timeout(args.timeout) {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            eprintln!("oxccl status: error: {e}");
            return ExitCode::from(2);
        }
        Err(_) => {
            eprintln!(
                "oxccl status: error: the store at {addr} did not answer within {}: the process \
                 that serves it (rank 0, unless a standalone store runs) may be stopped or hung, \
                 and the whole job with it",
                duration_text(args.timeout.as_nanos() as u64)
            );
            return ExitCode::from(2);
        }
    };
    for w in &status.warnings {
        eprintln!("oxccl status: warning: {w}");
    }
    let text = if args.json {
        match serde_json::to_string_pretty(&status) {
            Ok(j) => j + "\n",
            Err(e) => {
                eprintln!("oxccl status: error: {e}");
                return ExitCode::from(2);
            }
        }
    } else {
        render(&status)
    };
    use std::io::Write;
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
    // Reported: the answers need not stay in the store.
    answers.forget(&store);
    if status.healthy {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
