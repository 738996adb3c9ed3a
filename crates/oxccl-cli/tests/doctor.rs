//! `oxccl doctor`: synthetic flight-recorder dumps of a hung 4-rank job (as files, a directory,
//! and `oxccl run` stderr logs) must name the rank that is behind and the collective it is on;
//! a missing rank and a mismatch must be reported; `--json` must parse; no dump is exit 2.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{Value, json};

const COMM: &str = "1f2e3d4c5b6a7988";
const SEC: u64 = 1_000_000_000;
/// When the job started, in ns since the epoch.
const T0: u64 = 1_764_455_000 * SEC;

/// An empty directory for one test.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("oxccl-doctor-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `oxccl doctor ARGS...`.
fn doctor(args: &[&Path]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .arg("doctor")
        .args(args)
        .output()
        .unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8(out.stderr.clone()).unwrap()
}

/// An all_reduce of 1000 floats (sum) by `rank`, started at T0 + `seq` s; completed 1 ms later,
/// or still `running`/`failed` with 3 of 12 steps done.
fn all_reduce(rank: u32, seq: u64, state: &str) -> Value {
    let start = T0 + seq * SEC;
    let done = state == "completed";
    json!({
        "comm_id": COMM, "rank": rank, "world_size": 4, "seq": seq, "coll": "all_reduce",
        "count": 1000, "dtype": "float", "op": "sum", "root": null, "peer": null,
        "algorithm": "ring", "protocol": "slots", "state": state,
        "start_unix_ns": start,
        "end_unix_ns": if done { json!(start + 1_000_000) } else { Value::Null },
        "steps": 12, "steps_done": if done { 12 } else { 3 }, "bytes_in": 3000,
        "waiting": null, "waiting_on": null, "error": null
    })
}

/// `entry` failed by a timeout while waiting for data from `peer`.
fn timed_out(mut entry: Value, peer: u32) -> Value {
    let waiting = format!("waiting for data from rank {peer} (channel 0)");
    entry["error"] = json!(format!(
        "oxccl: timeout after 30 s in all_reduce #42: {waiting}"
    ));
    entry["waiting"] = json!(waiting);
    entry["waiting_on"] = json!(peer);
    entry["end_unix_ns"] = json!(T0 + 72 * SEC);
    entry
}

/// The dump of `rank` (communicator COMM, 4 ranks) taken at T0 + `at` s.
fn dump(
    rank: u32,
    at: u64,
    reason: &str,
    started: u64,
    completed: u64,
    entries: Vec<Value>,
) -> Value {
    json!({
        "oxccl_flight_recorder": 1, "reason": reason,
        "detail": if reason == "signal" { "SIGUSR1" } else { "oxccl: timeout" },
        "time_unix_ns": T0 + at * SEC, "pid": 4000 + rank, "host": "node0",
        "rank": rank, "world_size": 4, "comm_id": COMM,
        "communicators": [{"comm_id": COMM, "rank": rank, "world_size": 4,
                           "last_started": started, "last_completed": completed}],
        "entries": entries
    })
}

/// The hang: rank 2 is stuck in all_reduce #41 (dumped on SIGUSR1); ranks 0, 1, 3 time out in
/// all_reduce #42, rank 3 waiting on rank 2, rank 0 on rank 3, rank 1 on rank 0 (a ring).
fn hang() -> Vec<Value> {
    let waiting_ranks = [(0, 3), (1, 0), (3, 2)];
    let mut dumps: Vec<Value> = waiting_ranks
        .iter()
        .map(|&(rank, peer)| {
            let entries = vec![
                all_reduce(rank, 40, "completed"),
                all_reduce(rank, 41, "completed"),
                timed_out(all_reduce(rank, 42, "failed"), peer),
            ];
            dump(rank, 72, "timeout", 42, 41, entries)
        })
        .collect();
    let stuck = vec![all_reduce(2, 40, "completed"), all_reduce(2, 41, "running")];
    dumps.insert(2, dump(2, 75, "signal", 41, 40, stuck));
    dumps
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

/// Writes `dumps` to DIR/dump-RANK.json, one compact object each; returns the paths.
fn write_files(dir: &Path, dumps: &[Value]) -> Vec<PathBuf> {
    dumps
        .iter()
        .map(|d| {
            let path = dir.join(format!("dump-{}.json", d["rank"]));
            std::fs::write(&path, compact(d)).unwrap();
            path
        })
        .collect()
}

/// The expected verdict on [`hang`].
const HANG_VERDICT: &str = "verdict: rank 2 is behind: the others are in all_reduce #42 \
    (count 1000, float, sum) and 1 of them waits on rank 2; rank 2's last call is all_reduce #41 \
    (count 1000, float, sum; running for 34.0 s, 3/12 steps)";

#[test]
fn hang_files_name_the_rank_behind() {
    let dir = temp_dir("files");
    let files = write_files(&dir, &hang());
    let args: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    let out = doctor(&args);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(text.contains(HANG_VERDICT), "{text}");
    assert!(text.contains("suspects: rank 2\n"), "{text}");
    assert!(
        text.contains("communicator 1f2e3d4c5b6a7988 (world size 4): dumps from ranks 0-3"),
        "{text}"
    );
    // Rank 3's details: what it waits on, and its error.
    assert!(
        text.contains("waiting:        waiting for data from rank 2 (channel 0) [on rank 2]"),
        "{text}"
    );
    assert!(text.contains("error:          oxccl: timeout after 30 s in all_reduce #42"));
    assert!(stderr(&out).is_empty(), "{}", stderr(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn hang_directory_as_json() {
    let dir = temp_dir("json");
    write_files(&dir, &hang());
    std::fs::write(dir.join("notes.txt"), "not read: not *.json").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .args(["doctor", "--json"])
        .arg(&dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let comm = &report["communicators"][0];
    assert_eq!(comm["comm_id"], COMM);
    assert_eq!(comm["world_size"], 4);
    assert_eq!(comm["suspects"], json!([2]));
    assert_eq!(comm["behind"], json!([2]));
    assert_eq!(comm["missing_ranks"], json!([]));
    assert_eq!(comm["mismatches"], json!([]));
    let verdict = comm["verdicts"][0].as_str().unwrap();
    assert!(verdict.starts_with("rank 2 is behind"), "{verdict}");
    let ranks = comm["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 4);
    assert_eq!(ranks[2]["last_started"], 41);
    assert_eq!(ranks[2]["last_started_call"]["state"], "running");
    assert_eq!(ranks[2]["last_started_call"]["elapsed_ns"], 34 * SEC);
    assert_eq!(ranks[2]["waited_on_by"], json!([3]));
    assert_eq!(ranks[3]["waiting_on"], 2);
    assert_eq!(ranks[0]["last_completed_call"]["seq"], 41);
    assert_eq!(ranks[0]["recent"].as_array().unwrap().len(), 3);
    assert_eq!(report["warnings"], json!([]));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn missing_rank_is_the_suspect() {
    let dir = temp_dir("missing");
    let mut dumps = hang();
    dumps.remove(2);
    write_files(&dir, &dumps);
    let out = doctor(&[&dir]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        text.contains(
            "verdict: no dump from rank 2 (it may be dead, stopped, or never reached a timeout); \
             the others are in all_reduce #42 (count 1000, float, sum) and 1 of them waits on \
             rank 2"
        ),
        "{text}"
    );
    assert!(text.contains("suspects: rank 2\n"), "{text}");
    assert!(
        text.contains("dumps from ranks 0, 1, 3, none from rank 2"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn mismatch_is_reported() {
    let dir = temp_dir("mismatch");
    let mut dumps = hang();
    // Rank 2 has reached #42 too, but called broadcast from root 0 there.
    let mut bcast = all_reduce(2, 42, "running");
    bcast["coll"] = json!("broadcast");
    bcast["op"] = Value::Null;
    bcast["root"] = json!(0);
    dumps[2] = dump(
        2,
        75,
        "signal",
        42,
        41,
        vec![all_reduce(2, 41, "completed"), bcast],
    );
    write_files(&dir, &dumps);
    let out = doctor(&[&dir]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        text.contains(
            "verdict: mismatch at #42: ranks 0, 1, 3 called all_reduce (count 1000, float, sum), \
             rank 2 called broadcast (count 1000, float, root 0)"
        ),
        "{text}"
    );
    assert!(!text.contains("is behind"), "{text}");
    assert!(text.contains("suspects: rank 2\n"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn stderr_logs_with_rank_prefixes() {
    let dir = temp_dir("log");
    let dumps = hang();
    // As `oxccl run` prints them: ranks 0, 1 in one log, ranks 2, 3 in another, among other
    // output, plus a dump line cut short.
    let log_a = format!(
        "[0] step 41 done\n[0] {}\n[1] {}\n[1] {{\"oxccl_flight_recorder\":1,\"reason\":\"ti\n",
        compact(&dumps[0]),
        compact(&dumps[1])
    );
    let log_b = format!(
        "[3] {}\nrank 2 got SIGUSR1\n[2] {}\n",
        compact(&dumps[3]),
        compact(&dumps[2])
    );
    std::fs::write(dir.join("a.log"), log_a).unwrap();
    std::fs::write(dir.join("b.log"), log_b).unwrap();
    let out = doctor(&[&dir.join("a.log"), &dir.join("b.log")]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(text.contains(HANG_VERDICT), "{text}");
    assert!(text.contains("from ") && text.contains("b.log:3"), "{text}");
    let warnings = stderr(&out);
    assert!(
        warnings.contains("warning: ") && warnings.contains("a.log:4: skipped an unparsable dump"),
        "{warnings}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn newest_dump_per_rank_and_unknown_version() {
    let dir = temp_dir("newest");
    let mut dumps = hang();
    // An older dump of rank 3 (from #30) must not hide the newer one; a version-2 dump is read
    // with a warning.
    let old = dump(3, 31, "timeout", 30, 29, vec![all_reduce(3, 30, "failed")]);
    std::fs::write(dir.join("old-3.json"), compact(&old)).unwrap();
    dumps[1]["oxccl_flight_recorder"] = json!(2);
    write_files(&dir, &dumps);
    let out = doctor(&[&dir]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(text.contains(HANG_VERDICT), "{text}");
    assert!(
        stderr(&out).contains("dump-1.json: dump format version 2"),
        "{}",
        stderr(&out)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn no_dump_is_exit_2() {
    let dir = temp_dir("none");
    std::fs::write(dir.join("x.json"), "{\"hello\": 1}").unwrap();
    let out = doctor(&[&dir]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("x.json: not a flight-recorder dump"),
        "{}",
        stderr(&out)
    );
    assert!(stderr(&out).contains("no flight-recorder dump found"));
    let out = doctor(&[&dir.join("absent.log")]);
    assert_eq!(out.status.code(), Some(2));
    // No PATH at all: a usage error.
    let out = doctor(&[]);
    assert_eq!(out.status.code(), Some(2));
    let _ = std::fs::remove_dir_all(&dir);
}

/// End to end: a real job (`oxccl perf`, 3 ranks) where rank 1 stops itself (`OXCCL_FAULT`)
/// in its 5th all-reduce; ranks 0 and 2 time out and dump their flight recorders; the doctor,
/// reading those real dumps, must single out rank 1.
#[test]
fn real_dumps_of_a_stalled_job_name_the_stopped_rank() {
    let dir = temp_dir("real");
    let prefix = format!("{}/dump-", dir.display());
    let out = Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .args(["perf", "all_reduce", "-n", "3", "-b", "1M", "-e", "1M"])
        .args(["-w", "2", "-i", "20"])
        .env("OXCCL_FAULT", "stop:rank=1,seq=5")
        .env("OXCCL_TIMEOUT", "2")
        .env("OXCCL_DEBUG_DUMP", &prefix)
        .output()
        .unwrap();
    assert!(!out.status.success(), "the stalled job succeeded");
    let err = stderr(&out);
    // The first rank to time out asks the others to dump too; the launcher stops the job as
    // soon as one rank fails, so both dumps are normal, and one is guaranteed.
    let dumped: Vec<usize> = [0, 2]
        .into_iter()
        .filter(|r| dir.join(format!("dump-{r}.json")).exists())
        .collect();
    assert!(!dumped.is_empty(), "no survivor dumped; stderr:\n{err}");
    assert!(
        !dir.join("dump-1.json").exists(),
        "the stopped rank cannot dump"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .args(["doctor", "--json"])
        .arg(&dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let comm = &report["communicators"][0];
    assert_eq!(comm["world_size"], 3, "{report}");
    assert_eq!(comm["suspects"][0], 1, "{report}");
    let missing = comm["missing_ranks"].as_array().unwrap();
    assert!(missing.contains(&json!(1)), "{report}");
    assert_eq!(missing.len(), 3 - dumped.len(), "{report}");
    // The survivors were in call #5 when they gave up.
    for r in dumped {
        let rank = comm["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["rank"] == r)
            .unwrap_or_else(|| panic!("rank {r} missing in {report}"));
        assert_eq!(rank["last_started"], 5, "{rank}");
    }
    let text = Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .arg("doctor")
        .arg(&dir)
        .output()
        .unwrap();
    let text = stdout(&text);
    assert!(
        text.lines().any(|l| {
            let l = l.trim_start();
            l.starts_with("suspects: rank 1") || l.starts_with("suspects: ranks 1,")
        }),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
