//! `oxccl doctor [--json] PATH...`: reads the flight-recorder dumps of a job's ranks and says
//! which rank is behind, and on what.
//!
//! Each rank of an oxccl job keeps a flight recorder of its last calls and dumps it as one JSON
//! object (format version 1) on a timeout, an abort or SIGUSR1: to a file when
//! `OXCCL_DEBUG_DUMP` is set, otherwise as one line on stderr. A PATH is a dump file, a
//! directory (every `*.json` in it), or a log holding dump lines, with or without the
//! `[rank] ` prefix of `oxccl run`: a dump line is read from the first `{"oxccl_flight_recorder"`
//! to the end of the line. What cannot be parsed is skipped with a warning naming the file and
//! line.
//!
//! The dumps are grouped by communicator; within one, the newest dump of each rank counts. Per
//! communicator the report gives:
//! - the ranks without a dump (suspects themselves: dead, stopped, or never timed out);
//! - per rank: its last started and last completed collective, how long the last one had been
//!   running at dump time, its progress, what it was waiting on, its error, and its last few
//!   calls;
//! - the calls on which ranks disagree (same sequence number, different collective, count, type,
//!   operator or root);
//! - the verdict: the ranks furthest behind (lowest last-started collective) and the missing
//!   ones, with how many others wait on each; when every rank is at the same collective, the
//!   ranks most waited on. Send/recv have per-peer sequence numbers: they are shown but not
//!   counted.
//!
//! Exit status: 0 when the analysis ran, whatever it found; 2 on a usage error or when no dump
//! was found.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use oxccl::flight::{CallState, DUMP_VERSION, Dump, Entry, MARKER};
use oxccl::schedule::CollectiveKind;
use serde::Serialize;

/// Calls per rank in the text report's table.
const RECENT: usize = 3;

/// Options of `oxccl doctor`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print the analysis as one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Dump files, directories of `*.json` dumps, or logs holding dump lines (e.g. the stderr of
    /// `oxccl run`).
    #[arg(required = true, value_name = "PATH")]
    paths: Vec<PathBuf>,
}

/// A dump and where it was found (`FILE` or `FILE:LINE`).
#[derive(Debug)]
pub(crate) struct Loaded {
    pub(crate) dump: Dump,
    pub(crate) source: String,
}

// ---------------------------------------------------------------------------------------------
// Reading.

/// Reads every dump under `paths`; what cannot be read or parsed becomes a warning.
fn load(paths: &[PathBuf], warnings: &mut Vec<String>) -> Vec<Loaded> {
    let mut dumps = Vec::new();
    for path in paths {
        if path.is_dir() {
            let mut files: Vec<PathBuf> = match std::fs::read_dir(path) {
                Ok(dir) => dir
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "json"))
                    .collect(),
                Err(e) => {
                    warnings.push(format!("{}: {e}", path.display()));
                    continue;
                }
            };
            files.sort();
            if files.is_empty() {
                warnings.push(format!(
                    "{}: no *.json file in this directory",
                    path.display()
                ));
            }
            for file in files {
                load_file(&file, &mut dumps, warnings);
            }
        } else {
            load_file(path, &mut dumps, warnings);
        }
    }
    dumps
}

/// Reads the dumps of one file into `dumps`.
fn load_file(path: &Path, dumps: &mut Vec<Loaded>, warnings: &mut Vec<String>) {
    match std::fs::read(path) {
        Ok(bytes) => dumps.extend(parse_text(
            &String::from_utf8_lossy(&bytes),
            &path.display().to_string(),
            warnings,
        )),
        Err(e) => warnings.push(format!("{}: {e}", path.display())),
    }
}

/// The dumps in the text of the file `name`: the whole text as one dump object (a dump file,
/// compact or pretty-printed), or else every line holding [`MARKER`] (a log).
fn parse_text(text: &str, name: &str, warnings: &mut Vec<String>) -> Vec<Loaded> {
    let mut whole_error = None;
    if text.trim_start().starts_with('{') {
        match serde_json::from_str::<Dump>(text) {
            Ok(dump) => return vec![checked(dump, name.to_string(), warnings)],
            Err(e) => whole_error = Some(e),
        }
    }
    let mut dumps = Vec::new();
    let mut markers = 0;
    for (i, line) in text.lines().enumerate() {
        let Some(at) = line.find(MARKER) else {
            continue;
        };
        markers += 1;
        let source = format!("{name}:{}", i + 1);
        match serde_json::from_str::<Dump>(line[at..].trim_end()) {
            Ok(dump) => dumps.push(checked(dump, source, warnings)),
            Err(e) => warnings.push(format!("{source}: skipped an unparsable dump: {e}")),
        }
    }
    if markers == 0 {
        warnings.push(match whole_error {
            Some(e) => format!("{name}: not a flight-recorder dump: {e}"),
            None => format!("{name}: no flight-recorder dump in this file"),
        });
    }
    dumps
}

/// `dump` as loaded from `source`, with a warning if its format version is not the known one.
fn checked(dump: Dump, source: String, warnings: &mut Vec<String>) -> Loaded {
    if dump.oxccl_flight_recorder != DUMP_VERSION {
        warnings.push(format!(
            "{source}: dump format version {}, this oxccl reads version {DUMP_VERSION}; \
             reading it anyway",
            dump.oxccl_flight_recorder
        ));
    }
    Loaded { dump, source }
}

// ---------------------------------------------------------------------------------------------
// Analysis.

/// The whole analysis, as printed by `--json`.
#[derive(Debug, Serialize)]
pub(crate) struct Report {
    pub(crate) communicators: Vec<CommReport>,
    pub(crate) warnings: Vec<String>,
}

/// The analysis of one communicator.
#[derive(Debug, Serialize)]
pub(crate) struct CommReport {
    pub(crate) comm_id: String,
    pub(crate) world_size: u32,
    pub(crate) ranks_with_dumps: Vec<u32>,
    pub(crate) missing_ranks: Vec<u32>,
    /// Sentences for a person: mismatches first, then who is behind or missing.
    pub(crate) verdicts: Vec<String>,
    /// The ranks to look at first, most likely first.
    pub(crate) suspects: Vec<u32>,
    /// The ranks with dumps whose last started collective is the lowest, when not all agree.
    pub(crate) behind: Vec<u32>,
    pub(crate) mismatches: Vec<Mismatch>,
    pub(crate) ranks: Vec<RankSummary>,
}

/// Ranks that called different collectives under one sequence number.
#[derive(Debug, Serialize)]
pub(crate) struct Mismatch {
    pub(crate) seq: u64,
    /// One side per distinct call, most ranks first.
    pub(crate) sides: Vec<MismatchSide>,
}

/// The ranks of a mismatch that made the same call.
#[derive(Debug, Serialize)]
pub(crate) struct MismatchSide {
    pub(crate) ranks: Vec<u32>,
    /// E.g. `all_reduce (count 1000, float, sum)`.
    pub(crate) call: String,
}

/// What one rank's newest dump says about one communicator.
#[derive(Debug, Serialize)]
pub(crate) struct RankSummary {
    pub(crate) rank: u32,
    /// Where the dump was read (`FILE` or `FILE:LINE`).
    pub(crate) source: String,
    pub(crate) pid: Option<u32>,
    pub(crate) host: Option<String>,
    pub(crate) reason: String,
    pub(crate) detail: String,
    pub(crate) time_unix_ns: u64,
    pub(crate) last_started: u64,
    pub(crate) last_completed: u64,
    pub(crate) last_started_call: Option<Call>,
    pub(crate) last_completed_call: Option<Call>,
    /// From the newest unfinished call that was waiting.
    pub(crate) waiting: Option<String>,
    pub(crate) waiting_on: Option<u32>,
    /// The newest error of this communicator's calls.
    pub(crate) error: Option<String>,
    /// The other ranks whose `waiting_on` is this rank.
    pub(crate) waited_on_by: Vec<u32>,
    /// The last few calls, oldest first.
    pub(crate) recent: Vec<Call>,
}

/// A recorded call and how long it had run at dump time (or took).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Call {
    #[serde(flatten)]
    pub(crate) entry: Entry,
    pub(crate) elapsed_ns: Option<u64>,
}

/// One rank's view of one communicator, from one dump.
struct RankView<'a> {
    loaded: &'a Loaded,
    rank: u32,
    world_size: u32,
    last_started: u64,
    last_completed: u64,
    /// This communicator's entries, oldest first.
    entries: Vec<&'a Entry>,
}

impl<'a> RankView<'a> {
    fn dump_ns(&self) -> u64 {
        self.loaded.dump.time_unix_ns
    }

    /// The newest collective (not send/recv) entry with sequence number `seq`.
    fn collective(&self, seq: u64) -> Option<&'a Entry> {
        self.entries
            .iter()
            .rev()
            .find(|e| !e.coll.is_point_to_point() && e.seq == seq)
            .copied()
    }

    /// The newest unfinished entry that says what it was waiting for.
    fn waiting(&self) -> Option<&'a Entry> {
        self.entries
            .iter()
            .rev()
            .find(|e| {
                e.state != CallState::Completed && (e.waiting.is_some() || e.waiting_on.is_some())
            })
            .copied()
    }

    /// The peer this rank waits on, if known and not itself.
    fn waiting_on(&self) -> Option<u32> {
        self.waiting()
            .and_then(|e| e.waiting_on)
            .filter(|&p| p != self.rank)
    }

    fn call(&self, entry: &Entry) -> Call {
        Call {
            entry: entry.clone(),
            elapsed_ns: entry.elapsed_ns(self.dump_ns()),
        }
    }
}

/// One view per communicator that `loaded` knows of: those in its `communicators` list, the one
/// that triggered it, and any its entries name.
fn views(loaded: &Loaded) -> Vec<(&str, RankView<'_>)> {
    let dump = &loaded.dump;
    let view = |rank, world_size, last_started, last_completed| RankView {
        loaded,
        rank,
        world_size,
        last_started,
        last_completed,
        entries: Vec::new(),
    };
    // Views without a `communicators` record get their sequence numbers from their entries.
    let mut views: BTreeMap<&str, (RankView, bool)> = BTreeMap::new();
    for c in &dump.communicators {
        let v = view(c.rank, c.world_size, c.last_started, c.last_completed);
        views.insert(&c.comm_id, (v, true));
    }
    views
        .entry(&dump.comm_id)
        .or_insert_with(|| (view(dump.rank, dump.world_size, 0, 0), false));
    for e in &dump.entries {
        views
            .entry(&e.comm_id)
            .or_insert_with(|| (view(e.rank, e.world_size, 0, 0), false))
            .0
            .entries
            .push(e);
    }
    views
        .into_iter()
        .map(|(id, (mut v, recorded))| {
            if !recorded {
                let collectives = || v.entries.iter().filter(|e| !e.coll.is_point_to_point());
                v.last_started = collectives().map(|e| e.seq).max().unwrap_or(0);
                v.last_completed = collectives()
                    .filter(|e| e.state == CallState::Completed)
                    .map(|e| e.seq)
                    .max()
                    .unwrap_or(0);
            }
            (id, v)
        })
        .collect()
}

/// How the verdicts name what a rank sent: dumps after the fact, or live answers.
pub(crate) struct Words {
    /// `no dump from`.
    pub(crate) none_from: &'static str,
    /// Why a rank may have sent nothing, for one rank and for several.
    pub(crate) why_one: &'static str,
    pub(crate) why_many: &'static str,
    /// `all ranks with dumps are in`.
    pub(crate) all_in: &'static str,
}

/// The words of `oxccl doctor`.
const DUMP_WORDS: Words = Words {
    none_from: "no dump from",
    why_one: "it may be dead, stopped, or never reached a timeout",
    why_many: "they may be dead, stopped, or never reached a timeout",
    all_in: "all ranks with dumps are in",
};

/// Analyses `dumps`: per communicator, with the newest dump of each rank.
pub(crate) fn analyze(dumps: &[Loaded], mut warnings: Vec<String>, words: &Words) -> Report {
    let mut comms: BTreeMap<&str, BTreeMap<u32, RankView>> = BTreeMap::new();
    for loaded in dumps {
        for (id, view) in views(loaded) {
            let ranks = comms.entry(id).or_default();
            match ranks.get(&view.rank) {
                Some(old) if old.dump_ns() >= view.dump_ns() => {}
                _ => {
                    ranks.insert(view.rank, view);
                }
            }
        }
    }
    // The communicators that triggered a dump first.
    let triggered: BTreeSet<&str> = dumps.iter().map(|d| d.dump.comm_id.as_str()).collect();
    let mut order: Vec<&str> = comms.keys().copied().collect();
    order.sort_by_key(|id| !triggered.contains(id));
    let communicators = order
        .into_iter()
        .map(|id| analyze_comm(id, &comms[id], &mut warnings, words))
        .collect();
    Report {
        communicators,
        warnings,
    }
}

/// Analyses one communicator from the newest view of each rank that has one.
fn analyze_comm(
    id: &str,
    ranks: &BTreeMap<u32, RankView>,
    warnings: &mut Vec<String>,
    words: &Words,
) -> CommReport {
    let world_size = ranks.values().map(|v| v.world_size).max().unwrap_or(0);
    if ranks.values().any(|v| v.world_size != world_size) {
        warnings.push(format!(
            "communicator {id}: the dumps disagree on the world size; using {world_size}"
        ));
    }
    let present: Vec<u32> = ranks.keys().copied().collect();
    let missing: Vec<u32> = (0..world_size).filter(|r| !ranks.contains_key(r)).collect();
    // peer -> the ranks waiting on it
    let mut waiting: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for v in ranks.values() {
        if let Some(peer) = v.waiting_on() {
            waiting.entry(peer).or_default().push(v.rank);
        }
    }
    let waiters = |peer: u32| waiting.get(&peer).cloned().unwrap_or_default();

    // Behind: the lowest last-started collective, when not everybody is there.
    let lowest = ranks.values().map(|v| v.last_started).min().unwrap_or(0);
    let highest = ranks.values().map(|v| v.last_started).max().unwrap_or(0);
    let behind: Vec<u32> = if lowest < highest {
        ranks
            .values()
            .filter(|v| v.last_started == lowest)
            .map(|v| v.rank)
            .collect()
    } else {
        Vec::new()
    };

    let mismatches = mismatches(ranks);
    let mut verdicts: Vec<String> = mismatches.iter().map(mismatch_text).collect();

    match missing.as_slice() {
        [] => {}
        &[m] => verdicts.push(format!(
            "{} rank {m} ({}); {}",
            words.none_from,
            words.why_one,
            others_text(ranks, &[], &waiters(m), m)
        )),
        _ => {
            let mut text = format!(
                "{} {} ({}); {}",
                words.none_from,
                ranks_text(&missing),
                words.why_many,
                positions_text(ranks, &present, "the others are in")
            );
            for &m in &missing {
                match waiters(m).len() {
                    0 => {}
                    1 => text += &format!("; 1 of them waits on rank {m}"),
                    n => text += &format!("; {n} of them wait on rank {m}"),
                }
            }
            verdicts.push(text);
        }
    }
    for &b in &behind {
        let view = &ranks[&b];
        verdicts.push(format!(
            "rank {b} is behind: {}; rank {b}'s last call is {}",
            others_text(ranks, &behind, &waiters(b), b),
            last_call_text(view)
        ));
    }

    // Suspects: missing and behind ranks, most waited on first; then the odd ones out of a
    // mismatch; failing all that, the ranks most waited on.
    let mut suspects: Vec<u32> = missing.iter().chain(&behind).copied().collect();
    suspects.sort_by_key(|&r| (std::cmp::Reverse(waiters(r).len()), r));
    for m in &mismatches {
        let majority = m.sides[0].ranks.len();
        if m.sides[1..].iter().all(|s| s.ranks.len() < majority) {
            suspects.extend(m.sides[1..].iter().flat_map(|s| s.ranks.iter().copied()));
        }
    }
    if suspects.is_empty() {
        // Who holds up whom, through chains of waits (0 waits on 3, which waits on 1): the
        // rank at the end of most chains. A cycle of waits leaves the direct counts.
        let chains = chain_ends(ranks);
        let waiting = if chains.is_empty() { &waiting } else { &chains };
        let most = waiting.values().map(Vec::len).max().unwrap_or(0);
        for (&r, who) in waiting.iter().filter(|(_, who)| who.len() == most) {
            let last = ranks.get(&r).map_or("unknown".to_string(), last_call_text);
            verdicts.push(format!(
                "rank {r} is waited on by {} ({} of the {} others); its last call is {last}",
                ranks_text(who),
                who.len(),
                world_size.saturating_sub(1),
            ));
            suspects.push(r);
        }
    }
    let mut seen = BTreeSet::new();
    suspects.retain(|r| seen.insert(*r));
    if verdicts.is_empty() {
        verdicts.push(format!(
            "no rank is behind: {}",
            positions_text(ranks, &present, words.all_in)
        ));
    }

    let summaries = ranks
        .values()
        .map(|v| summary(v, waiters(v.rank)))
        .collect();
    CommReport {
        comm_id: id.to_string(),
        world_size,
        ranks_with_dumps: present,
        missing_ranks: missing,
        verdicts,
        suspects,
        behind,
        mismatches,
        ranks: summaries,
    }
}

/// For each rank at the end of a chain of waits (waited on, waiting on nobody), the ranks
/// whose chains end there, directly or through others; chains that loop are left out.
fn chain_ends(ranks: &BTreeMap<u32, RankView>) -> BTreeMap<u32, Vec<u32>> {
    let next = |r: u32| ranks.get(&r).and_then(|v| v.waiting_on());
    let mut ends: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for &start in ranks.keys() {
        let mut at = start;
        let mut hops = 0;
        while let Some(n) = next(at) {
            at = n;
            hops += 1;
            if hops > ranks.len() {
                break;
            }
        }
        if hops > 0 && hops <= ranks.len() {
            ends.entry(at).or_default().push(start);
        }
    }
    ends
}

/// The per-rank summary of `view`.
fn summary(view: &RankView, waited_on_by: Vec<u32>) -> RankSummary {
    let dump = &view.loaded.dump;
    let waiting = view.waiting();
    let recent_from = view.entries.len().saturating_sub(RECENT);
    RankSummary {
        rank: view.rank,
        source: view.loaded.source.clone(),
        pid: dump.pid,
        host: dump.host.clone(),
        reason: dump.reason.clone(),
        detail: dump.detail.clone(),
        time_unix_ns: dump.time_unix_ns,
        last_started: view.last_started,
        last_completed: view.last_completed,
        last_started_call: view.collective(view.last_started).map(|e| view.call(e)),
        last_completed_call: view
            .collective(view.last_completed)
            .filter(|e| e.state == CallState::Completed)
            .map(|e| view.call(e)),
        waiting: waiting.and_then(|e| e.waiting.clone()),
        waiting_on: view.waiting_on(),
        error: view.entries.iter().rev().find_map(|e| e.error.clone()),
        waited_on_by,
        recent: view.entries[recent_from..]
            .iter()
            .map(|e| view.call(e))
            .collect(),
    }
}

/// Collective sequence numbers under which ranks recorded different calls.
fn mismatches(ranks: &BTreeMap<u32, RankView>) -> Vec<Mismatch> {
    // seq -> call -> ranks
    let mut calls: BTreeMap<u64, BTreeMap<String, Vec<u32>>> = BTreeMap::new();
    for view in ranks.values() {
        let seqs: BTreeSet<u64> = view
            .entries
            .iter()
            .filter(|e| !e.coll.is_point_to_point())
            .map(|e| e.seq)
            .collect();
        for seq in seqs {
            let entry = view.collective(seq).expect("seq taken from the entries");
            // all_to_allv's count is each rank's own.
            let with_count = entry.coll != CollectiveKind::AllToAllV;
            let call = format!("{}{}", entry.coll, args_text(entry, with_count));
            calls
                .entry(seq)
                .or_default()
                .entry(call)
                .or_default()
                .push(view.rank);
        }
    }
    calls
        .into_iter()
        .filter(|(_, sides)| sides.len() > 1)
        .map(|(seq, sides)| {
            let mut sides: Vec<MismatchSide> = sides
                .into_iter()
                .map(|(call, ranks)| MismatchSide { ranks, call })
                .collect();
            sides.sort_by_key(|s| (std::cmp::Reverse(s.ranks.len()), s.ranks[0]));
            Mismatch { seq, sides }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Sentences.

/// `mismatch at #42: ranks 0, 1 called all_reduce (...), rank 2 called broadcast (...)`.
fn mismatch_text(m: &Mismatch) -> String {
    let sides: Vec<String> = m
        .sides
        .iter()
        .map(|s| format!("{} called {}", ranks_text(&s.ranks), s.call))
        .collect();
    format!("mismatch at #{}: {}", m.seq, sides.join(", "))
}

/// Where the ranks other than `subject` and `excluded` are, and how many of them wait on
/// `subject`: `the others are in all_reduce #42 (...) and 3 of them wait on rank 1`.
fn others_text(
    ranks: &BTreeMap<u32, RankView>,
    excluded: &[u32],
    waiters: &[u32],
    subject: u32,
) -> String {
    let others: Vec<u32> = ranks
        .keys()
        .copied()
        .filter(|r| *r != subject && !excluded.contains(r))
        .collect();
    let mut text = positions_text(ranks, &others, "the others are in");
    let waiting = waiters.iter().filter(|r| others.contains(r)).count();
    if waiting > 0 {
        let verb = if waiting == 1 { "waits" } else { "wait" };
        text += &format!(" and {waiting} of them {verb} on rank {subject}");
    }
    text
}

/// Where the ranks `of` are: `{lead} all_reduce #42 (...)` when they share their last started
/// collective, otherwise `the ranks are at: ranks 0, 1 in all_reduce #43 (...), rank 3 in ...`.
fn positions_text(ranks: &BTreeMap<u32, RankView>, of: &[u32], lead: &str) -> String {
    let mut groups: BTreeMap<std::cmp::Reverse<u64>, Vec<u32>> = BTreeMap::new();
    for &r in of {
        groups
            .entry(std::cmp::Reverse(ranks[&r].last_started))
            .or_default()
            .push(r);
    }
    let call = |seq: u64, group: &[u32]| {
        group
            .iter()
            .find_map(|r| ranks[r].collective(seq))
            .map_or(format!("#{seq}"), call_text)
    };
    match groups.len() {
        0 => "no other rank has a dump".to_string(),
        1 => {
            let (seq, group) = groups.iter().next().expect("one group");
            format!("{lead} {}", call(seq.0, group))
        }
        _ => {
            let parts: Vec<String> = groups
                .iter()
                .map(|(seq, group)| format!("{} in {}", ranks_text(group), call(seq.0, group)))
                .collect();
            format!("the ranks are at: {}", parts.join(", "))
        }
    }
}

/// A rank's last started collective with its state:
/// `all_reduce #41 (count 1000, float, sum; completed)`.
fn last_call_text(view: &RankView) -> String {
    match view.collective(view.last_started) {
        Some(e) => {
            let mut parts = args_parts(e, true).join(", ");
            if !parts.is_empty() {
                parts += "; ";
            }
            let state = state_text(e, view.dump_ns());
            format!("{} #{} ({parts}{state})", e.coll, e.seq)
        }
        None if view.last_started == view.last_completed => {
            format!("#{} (completed)", view.last_started)
        }
        None => format!("#{} (started)", view.last_started),
    }
}

/// `all_reduce #42 (count 1000, float, sum)`.
pub(crate) fn call_text(e: &Entry) -> String {
    format!("{} #{}{}", e.coll, e.seq, args_text(e, true))
}

/// ` (count 1000, float, sum)`, ` (count 8, u8, root 0)`, `` for a barrier.
pub(crate) fn args_text(e: &Entry, with_count: bool) -> String {
    let parts = args_parts(e, with_count);
    if parts.is_empty() {
        String::new()
    } else {
        format!(" ({})", parts.join(", "))
    }
}

/// `count 1000`, `float`, `sum`, `root 0`, `peer 1`: what was given.
fn args_parts(e: &Entry, with_count: bool) -> Vec<String> {
    let mut parts = Vec::new();
    if with_count && !(e.coll == CollectiveKind::Barrier && e.count == 0) {
        parts.push(format!("count {}", e.count));
    }
    parts.extend(e.dtype.map(|d| d.to_string()));
    parts.extend(e.op.map(|o| o.to_string()));
    parts.extend(e.root.map(|r| format!("root {r}")));
    parts.extend(e.peer.map(|p| format!("peer {p}")));
    parts
}

/// `completed`, `running for 35.0 s, 11/12 steps`, `failed after 30.0 s, 3/12 steps`.
pub(crate) fn state_text(e: &Entry, dump_ns: u64) -> String {
    let elapsed = e.elapsed_ns(dump_ns).map(duration_text);
    let steps = format!("{}/{} steps", e.steps_done, e.steps);
    match (e.state, elapsed) {
        (CallState::Completed, _) => "completed".to_string(),
        (CallState::Running, Some(t)) => format!("running for {t}, {steps}"),
        (CallState::Failed, Some(t)) => format!("failed after {t}, {steps}"),
        (state, None) => format!("{state}, {steps}"),
    }
}

/// `rank 2`, `ranks 0, 1, 3`, `ranks 0, 4-9` (for sorted `ranks`).
pub(crate) fn ranks_text(ranks: &[u32]) -> String {
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for &r in ranks {
        match runs.last_mut() {
            Some((_, last)) if *last + 1 == r => *last = r,
            _ => runs.push((r, r)),
        }
    }
    let list: Vec<String> = runs
        .iter()
        .flat_map(|&(first, last)| match last - first {
            0 => vec![first.to_string()],
            1 => vec![first.to_string(), last.to_string()],
            _ => vec![format!("{first}-{last}")],
        })
        .collect();
    match ranks.len() {
        1 => format!("rank {}", list[0]),
        _ => format!("ranks {}", list.join(", ")),
    }
}

/// `850 ns`, `12.3 µs`, `4.5 ms`, `35.0 s`.
pub(crate) fn duration_text(ns: u64) -> String {
    let ns_f = ns as f64;
    if ns < 1_000 {
        format!("{ns} ns")
    } else if ns < 1_000_000 {
        format!("{:.1} µs", ns_f / 1e3)
    } else if ns < 1_000_000_000 {
        format!("{:.1} ms", ns_f / 1e6)
    } else {
        format!("{:.1} s", ns_f / 1e9)
    }
}

/// `512 B`, `48.0 KiB`, `1.5 MiB`, `2.0 GiB`.
pub(crate) fn bytes_text(bytes: u64) -> String {
    let b = bytes as f64;
    if bytes < 1 << 10 {
        format!("{bytes} B")
    } else if bytes < 1 << 20 {
        format!("{:.1} KiB", b / 1024.0)
    } else if bytes < 1 << 30 {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    } else {
        format!("{:.1} GiB", b / (1u64 << 30) as f64)
    }
}

// ---------------------------------------------------------------------------------------------
// Text output.

/// The report as text for a person.
fn render_text(report: &Report) -> String {
    let mut out = String::new();
    for (i, comm) in report.communicators.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        render_comm(comm, &mut out);
    }
    out
}

fn render_comm(comm: &CommReport, out: &mut String) {
    let dumps = if comm.ranks_with_dumps.is_empty() {
        "no dumps".to_string()
    } else {
        format!("dumps from {}", ranks_text(&comm.ranks_with_dumps))
    };
    out.push_str(&format!(
        "communicator {} (world size {}): {dumps}",
        comm.comm_id, comm.world_size
    ));
    if !comm.missing_ranks.is_empty() {
        out.push_str(&format!(", none from {}", ranks_text(&comm.missing_ranks)));
    }
    out.push('\n');
    for v in &comm.verdicts {
        out.push_str(&format!("  verdict: {v}\n"));
    }
    let suspects = if comm.suspects.is_empty() {
        "none".to_string()
    } else {
        ranks_text(&comm.suspects)
    };
    out.push_str(&format!("  suspects: {suspects}\n"));

    let first_dump = comm.ranks.iter().map(|r| r.time_unix_ns).min().unwrap_or(0);
    for r in &comm.ranks {
        let host = r
            .host
            .as_deref()
            .map(|h| format!(" on {h}"))
            .unwrap_or_default();
        let pid = r.pid.map(|p| format!(" pid {p}")).unwrap_or_default();
        out.push_str(&format!(
            "\n  rank {}:{pid}{host}, dumped ({}) at +{:.1} s, from {}\n",
            r.rank,
            r.reason,
            (r.time_unix_ns - first_dump) as f64 / 1e9,
            r.source
        ));
        let dump_ns = r.time_unix_ns;
        let started = match &r.last_started_call {
            Some(c) => {
                let mut s = format!("{}, {}", call_text(&c.entry), state_text(&c.entry, dump_ns));
                if c.entry.state != CallState::Completed {
                    s += &format!(", {} in", bytes_text(c.entry.bytes_in));
                }
                s
            }
            None => format!("#{}", r.last_started),
        };
        out.push_str(&format!("    last started:   {started}\n"));
        let completed = match &r.last_completed_call {
            Some(c) => call_text(&c.entry),
            None => format!("#{}", r.last_completed),
        };
        out.push_str(&format!("    last completed: {completed}\n"));
        if r.waiting.is_some() || r.waiting_on.is_some() {
            let what = r.waiting.as_deref().unwrap_or("waiting");
            let on = r
                .waiting_on
                .map(|p| format!(" [on rank {p}]"))
                .unwrap_or_default();
            out.push_str(&format!("    waiting:        {what}{on}\n"));
        }
        if !r.waited_on_by.is_empty() {
            out.push_str(&format!(
                "    waited on by:   {}\n",
                ranks_text(&r.waited_on_by)
            ));
        }
        if let Some(e) = &r.error {
            out.push_str(&format!("    error:          {e}\n"));
        }
        if !r.detail.is_empty() && r.error.as_deref() != Some(r.detail.as_str()) {
            out.push_str(&format!("    dump detail:    {}\n", r.detail));
        }
        if !r.recent.is_empty() {
            out.push_str(&recent_table(&r.recent, dump_ns));
        }
    }
}

/// The last few calls of a rank as an aligned table, indented by four spaces.
fn recent_table(calls: &[Call], dump_ns: u64) -> String {
    let header = "seq call count dtype op root/peer state steps bytes_in time";
    let mut rows = vec![header.split(' ').map(String::from).collect::<Vec<_>>()];
    for c in calls {
        let e = &c.entry;
        let dash = || "-".to_string();
        rows.push(vec![
            format!("#{}", e.seq),
            e.coll.to_string(),
            e.count.to_string(),
            e.dtype.map_or_else(dash, |d| d.to_string()),
            e.op.map_or_else(dash, |o| o.to_string()),
            e.root.or(e.peer).map_or_else(dash, |r| r.to_string()),
            e.state.to_string(),
            format!("{}/{}", e.steps_done, e.steps),
            bytes_text(e.bytes_in),
            e.elapsed_ns(dump_ns).map_or_else(dash, duration_text),
        ]);
    }
    columns(&rows, "    ")
}

/// `rows` as a table: each cell padded to its column's widest, two spaces between columns,
/// every line after `indent`.
pub(crate) fn columns(rows: &[Vec<String>], indent: &str) -> String {
    let n = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..n)
        .map(|i| {
            rows.iter()
                .filter_map(|row| row.get(i))
                .map(|c| c.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:w$}"))
            .collect();
        out.push_str(&format!("{indent}{}\n", cells.join("  ").trim_end()));
    }
    out
}

// ---------------------------------------------------------------------------------------------

/// `oxccl doctor`: 0 when the analysis ran, 2 when no dump was found.
pub fn main(args: Args) -> ExitCode {
    let mut warnings = Vec::new();
    let dumps = load(&args.paths, &mut warnings);
    if dumps.is_empty() {
        for w in &warnings {
            eprintln!("oxccl doctor: warning: {w}");
        }
        eprintln!("oxccl doctor: error: no flight-recorder dump found");
        return ExitCode::from(2);
    }
    let report = analyze(&dumps, warnings, &DUMP_WORDS);
    for w in &report.warnings {
        eprintln!("oxccl doctor: warning: {w}");
    }
    let text = if args.json {
        let mut json = serde_json::to_string_pretty(&report).expect("the report serializes");
        json.push('\n');
        json
    } else {
        render_text(&report)
    };
    // A closed stdout (`| head`) is not an error of the analysis.
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    /// A collective entry of communicator "c" with the given state.
    fn entry(rank: u32, seq: u64, coll: &str, state: &str) -> Value {
        let end = (state == "completed").then_some(1_000_000_000u64 * seq + 1_000);
        json!({
            "comm_id": "c", "rank": rank, "world_size": 4, "seq": seq, "coll": coll,
            "count": 1000, "dtype": "float", "op": "sum", "root": null, "peer": null,
            "algorithm": "ring", "protocol": "slots", "state": state,
            "start_unix_ns": 1_000_000_000u64 * seq,
            "end_unix_ns": end,
            "steps": 12, "steps_done": if state == "completed" { 12 } else { 3 },
            "bytes_in": 4096, "waiting": null, "waiting_on": null, "error": null
        })
    }

    /// A dump of rank `rank` of communicator "c" (4 ranks) taken at `time` seconds.
    fn dump(rank: u32, time: u64, started: u64, completed: u64, entries: Vec<Value>) -> Value {
        json!({
            "oxccl_flight_recorder": 1, "reason": "timeout", "detail": "timed out",
            "time_unix_ns": time * 1_000_000_000, "pid": 100 + rank, "host": "h",
            "rank": rank, "world_size": 4, "comm_id": "c",
            "communicators": [{"comm_id": "c", "rank": rank, "world_size": 4,
                               "last_started": started, "last_completed": completed}],
            "entries": entries
        })
    }

    /// Waits on `peer` in the last entry of `d`.
    fn waits_on(mut d: Value, peer: u32) -> Value {
        let last = d["entries"].as_array_mut().unwrap().last_mut().unwrap();
        last["waiting_on"] = json!(peer);
        last["waiting"] = json!(format!("waiting for data from rank {peer} (channel 0)"));
        d
    }

    /// `d` as the recorder writes it: compact, the version key first (serde_json sorts keys).
    fn compact(d: &Value) -> String {
        let mut rest = d.clone();
        let version = rest
            .as_object_mut()
            .unwrap()
            .remove("oxccl_flight_recorder")
            .unwrap();
        format!(
            "{{\"oxccl_flight_recorder\":{version},{}",
            &rest.to_string()[1..]
        )
    }

    fn report_of(dumps: &[Value]) -> (Report, Vec<String>) {
        let mut warnings = Vec::new();
        let text: Vec<String> = dumps
            .iter()
            .map(|d| format!("[x] {}", compact(d)))
            .collect();
        let loaded = parse_text(&text.join("\n"), "log", &mut warnings);
        assert_eq!(loaded.len(), dumps.len(), "{warnings:?}");
        let report = analyze(&loaded, Vec::new(), &DUMP_WORDS);
        (report, warnings)
    }

    /// Ranks 0, 1, 3 in #42 (one waiting on rank 2), rank 2 still in #41.
    fn hang() -> Vec<Value> {
        let done = |r| entry(r, 41, "all_reduce", "completed");
        vec![
            waits_on(
                dump(
                    0,
                    100,
                    42,
                    41,
                    vec![done(0), entry(0, 42, "all_reduce", "failed")],
                ),
                3,
            ),
            waits_on(
                dump(
                    1,
                    100,
                    42,
                    41,
                    vec![done(1), entry(1, 42, "all_reduce", "failed")],
                ),
                0,
            ),
            dump(2, 101, 41, 40, vec![entry(2, 41, "all_reduce", "running")]),
            waits_on(
                dump(
                    3,
                    100,
                    42,
                    41,
                    vec![done(3), entry(3, 42, "all_reduce", "failed")],
                ),
                2,
            ),
        ]
    }

    #[test]
    fn the_rank_behind_is_named_with_its_waiters() {
        let (report, warnings) = report_of(&hang());
        assert!(warnings.is_empty(), "{warnings:?}");
        let comm = &report.communicators[0];
        assert_eq!(comm.behind, vec![2]);
        assert_eq!(comm.suspects, vec![2]);
        assert!(comm.missing_ranks.is_empty());
        assert_eq!(
            comm.verdicts,
            vec![
                "rank 2 is behind: the others are in all_reduce #42 (count 1000, float, sum) \
                 and 1 of them waits on rank 2; rank 2's last call is all_reduce #41 \
                 (count 1000, float, sum; running for 60.0 s, 3/12 steps)"
            ]
        );
        let r3 = &comm.ranks[3];
        assert_eq!(
            (r3.last_started, r3.last_completed, r3.waiting_on),
            (42, 41, Some(2))
        );
        assert_eq!(comm.ranks[2].waited_on_by, vec![3]);
        assert_eq!(comm.ranks[0].waited_on_by, vec![1]);
    }

    #[test]
    fn a_missing_rank_is_a_suspect() {
        let mut dumps = hang();
        dumps.remove(2);
        let (report, _) = report_of(&dumps);
        let comm = &report.communicators[0];
        assert_eq!(comm.missing_ranks, vec![2]);
        assert_eq!(comm.suspects, vec![2]);
        assert!(comm.behind.is_empty());
        assert!(comm.verdicts[0].starts_with("no dump from rank 2 (it may be dead"));
        assert!(comm.verdicts[0].ends_with("and 1 of them waits on rank 2"));
    }

    #[test]
    fn several_missing_ranks_share_one_verdict() {
        let mut dumps = hang();
        dumps.truncate(2);
        let (report, _) = report_of(&dumps);
        let comm = &report.communicators[0];
        assert_eq!(comm.missing_ranks, vec![2, 3]);
        // Rank 0 waits on rank 3: it comes first.
        assert_eq!(comm.suspects, vec![3, 2]);
        assert_eq!(
            comm.verdicts,
            vec![
                "no dump from ranks 2, 3 (they may be dead, stopped, or never reached a \
                 timeout); the others are in all_reduce #42 (count 1000, float, sum); 1 of them \
                 waits on rank 3"
            ]
        );
    }

    #[test]
    fn a_healthy_job_has_no_suspect() {
        let dumps: Vec<Value> = (0..4)
            .map(|r| dump(r, 100, 5, 5, vec![entry(r, 5, "all_reduce", "completed")]))
            .collect();
        let (report, _) = report_of(&dumps);
        let comm = &report.communicators[0];
        assert!(comm.suspects.is_empty());
        assert_eq!(
            comm.verdicts,
            vec![
                "no rank is behind: all ranks with dumps are in all_reduce #5 \
                 (count 1000, float, sum)"
            ]
        );
    }

    #[test]
    fn different_calls_under_one_seq_are_a_mismatch() {
        let mut odd = entry(2, 42, "broadcast", "failed");
        odd["op"] = Value::Null;
        odd["root"] = json!(0);
        let dumps: Vec<Value> = (0..4)
            .map(|r| {
                let call = if r == 2 {
                    odd.clone()
                } else {
                    entry(r, 42, "all_reduce", "failed")
                };
                dump(r, 100, 42, 41, vec![call])
            })
            .collect();
        let (report, _) = report_of(&dumps);
        let comm = &report.communicators[0];
        assert_eq!(comm.mismatches.len(), 1);
        assert_eq!(
            comm.verdicts[0],
            "mismatch at #42: ranks 0, 1, 3 called all_reduce (count 1000, float, sum), \
             rank 2 called broadcast (count 1000, float, root 0)"
        );
        assert_eq!(comm.suspects, vec![2]);
    }

    #[test]
    fn send_recv_do_not_count_as_progress() {
        let mut dumps = hang();
        // Rank 2's send #500 has a far higher (per-peer) number than anybody's collectives.
        let mut send = entry(2, 500, "send", "completed");
        send["peer"] = json!(1);
        dumps[2]["entries"].as_array_mut().unwrap().push(send);
        let (report, _) = report_of(&dumps);
        let comm = &report.communicators[0];
        assert_eq!(comm.behind, vec![2]);
        assert!(comm.mismatches.is_empty());
        assert_eq!(
            comm.ranks[2].recent.last().unwrap().entry.coll,
            CollectiveKind::Send
        );
    }

    #[test]
    fn the_newest_dump_of_a_rank_counts() {
        let mut dumps = hang();
        // A later dump of rank 2 that has caught up to #42.
        dumps.push(dump(
            2,
            200,
            42,
            41,
            vec![entry(2, 42, "all_reduce", "running")],
        ));
        let (report, _) = report_of(&dumps);
        let comm = &report.communicators[0];
        assert!(comm.behind.is_empty());
        assert_eq!(comm.ranks[2].last_started, 42);
        // Everybody is at #42: the verdict falls back to who is waited on, through chains of
        // waits (1 waits on 0, 0 on 3, 3 on 2, and 2 on nobody): rank 2 is at the end of them.
        assert_eq!(comm.suspects, vec![2]);
    }

    #[test]
    fn logs_are_read_after_prefixes_and_garbage_is_named() {
        let d = compact(&dump(1, 1, 0, 0, vec![]));
        let text = format!("[0] hello\n[1] {d}\n[2] {{\"oxccl_flight_recorder\": 1, \"rank\"\n");
        let mut warnings = Vec::new();
        let loaded = parse_text(&text, "job.log", &mut warnings);
        assert_eq!(loaded.len(), 1);
        assert_eq!(loaded[0].source, "job.log:2");
        assert_eq!(loaded[0].dump.rank, 1);
        assert_eq!(warnings.len(), 1);
        assert!(
            warnings[0].starts_with("job.log:3: skipped"),
            "{warnings:?}"
        );
    }

    #[test]
    fn a_pretty_printed_dump_file_is_one_dump() {
        let d = serde_json::to_string_pretty(&dump(3, 1, 0, 0, vec![])).unwrap();
        let mut warnings = Vec::new();
        let loaded = parse_text(&d, "d.json", &mut warnings);
        assert_eq!((loaded.len(), loaded[0].dump.rank), (1, 3));
        assert!(warnings.is_empty());
        // Not a dump: one warning naming the file.
        assert!(parse_text("{\"a\": 1}", "other.json", &mut warnings).is_empty());
        assert!(warnings[0].starts_with("other.json: not a flight-recorder dump"));
    }

    #[test]
    fn an_unknown_version_is_read_with_a_warning() {
        let mut d = dump(0, 1, 0, 0, vec![]);
        d["oxccl_flight_recorder"] = json!(2);
        let mut warnings = Vec::new();
        assert_eq!(parse_text(&d.to_string(), "d.json", &mut warnings).len(), 1);
        assert!(warnings[0].contains("version 2"), "{warnings:?}");
    }

    #[test]
    fn units() {
        assert_eq!(duration_text(850), "850 ns");
        assert_eq!(duration_text(12_300), "12.3 µs");
        assert_eq!(duration_text(35_000_000_000), "35.0 s");
        assert_eq!(bytes_text(512), "512 B");
        assert_eq!(bytes_text(3 << 19), "1.5 MiB");
        assert_eq!(ranks_text(&[2]), "rank 2");
        assert_eq!(ranks_text(&[0, 1, 3]), "ranks 0, 1, 3");
        assert_eq!(ranks_text(&[0, 4, 5, 6, 7, 9]), "ranks 0, 4-7, 9");
    }
}
