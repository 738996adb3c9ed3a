//! `oxccl topo`: prints a topology file (JSON or TOML) as a table or JSON, refuses an invalid
//! one with a message naming the file and the fault, and detects the hosts of a job: its own
//! ranks on this host are one host; ranks in two network namespaces of a test bed are two.

use std::path::PathBuf;
use std::process::{Command, Output};

use oxccl_testbed::{HostSpec, Testbed};

mod common;
use common::{BIN, assert_exact, clean_cmd, run_in_bed, serial};

fn topo_cmd(cmd: &mut Command, args: &[&str]) {
    cmd.arg("topo").args(args);
    clean_cmd(cmd);
}

fn topo(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    topo_cmd(&mut cmd, args);
    cmd.envs(env.iter().copied());
    cmd.output().expect("running oxccl topo")
}

fn stdout_ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "oxccl topo failed ({}): {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A directory removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("oxccl-topo-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("temp dir");
        TempDir(d)
    }

    fn file(&self, name: &str, text: &str) -> String {
        let p = self.0.join(name);
        std::fs::write(&p, text).expect("writing a topology file");
        p.to_string_lossy().into_owned()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const TOML: &str = "\
# two hosts of two ranks, the second one on a slower link
[[hosts]]
name = \"h0\"
ranks = [0, 1]
link_gbps = 1.0

[[hosts]]
name = \"h1\"
ranks = [2, 3]
link_gbps = 0.25
";

const JSON: &str = r#"{"hosts": [{"name": "h0", "ranks": [0, 1], "link_gbps": 1.0},
  {"name": "h1", "ranks": [2, 3], "link_gbps": 0.25}]}"#;

const TABLE: &str = "\
host  name  ranks  link
   0  h0    0-1    1 Gbit/s
   1  h1    2-3    0.25 Gbit/s
4 ranks on 2 hosts, 2 per host, uneven link rates
";

const JSON_OUT: &str = "{\"hosts\": [
  {\"name\":\"h0\",\"ranks\":[0,1],\"link_gbps\":1.0},
  {\"name\":\"h1\",\"ranks\":[2,3],\"link_gbps\":0.25}
]}
";

#[test]
fn a_file_in_either_format_prints_as_a_table_and_as_json() {
    let _serial = serial();
    let dir = TempDir::new("formats");
    for (name, text) in [("t.toml", TOML), ("t.json", JSON)] {
        let path = dir.file(name, text);
        let out = stdout_ok(&topo(&["--file", &path], &[]));
        assert_eq!(out, format!("# oxccl topo: from file {path}\n{TABLE}"));
        let out = stdout_ok(&topo(&["--file", &path, "--json"], &[]));
        assert_eq!(out, JSON_OUT);
        // The JSON printed reads back as the same topology.
        let again = dir.file("again.json", &out);
        assert_eq!(
            stdout_ok(&topo(&["--file", &again, "--json"], &[])),
            JSON_OUT
        );
        // OXCCL_TOPO_FILE does what --file does when not under a launcher.
        let out = stdout_ok(&topo(&[], &[("OXCCL_TOPO_FILE", &path)]));
        assert!(out.ends_with(TABLE), "{out}");
    }
}

#[test]
fn an_invalid_file_fails_with_a_message_naming_the_file_and_the_fault() {
    let _serial = serial();
    let dir = TempDir::new("invalid");
    let cases = [
        (
            "gap.json",
            r#"{"hosts":[{"name":"a","ranks":[0,2]}]}"#,
            "rank 1 ",
        ),
        (
            "twice.toml",
            "[[hosts]]\nname=\"a\"\nranks=[0,1]\n[[hosts]]\nname=\"b\"\nranks=[1]\n",
            "rank 1 appears on two hosts",
        ),
        (
            "rate.toml",
            "[[hosts]]\nname=\"a\"\nranks=[0]\nlink_gbps=-1.0\n",
            "link_gbps",
        ),
        (
            "empty.json",
            r#"{"hosts":[{"name":"a","ranks":[0]},{"name":"b","ranks":[]}]}"#,
            "host 1 (\"b\") has no ranks",
        ),
        (
            "names.json",
            r#"{"hosts":[{"name":"a","ranks":[0]},{"name":"a","ranks":[1]}]}"#,
            "same name",
        ),
        (
            "typo.toml",
            "[[hosts]]\nname=\"a\"\nranks=[0]\nlink_gbs=1.0\n",
            "link_gbs",
        ),
        ("syntax.json", "{\"hosts\": [", "invalid topology JSON"),
    ];
    for (name, text, want) in cases {
        let path = dir.file(name, text);
        let out = topo(&["--file", &path], &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {err}");
        assert!(out.stdout.is_empty(), "{name}");
        assert!(
            err.starts_with("oxccl topo: error: ") && err.contains(&path) && err.contains(want),
            "{name}: {err:?} should name the file and say {want:?}"
        );
    }
    let missing = dir.0.join("missing.toml").to_string_lossy().into_owned();
    let out = topo(&["--file", &missing], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot read") && err.contains(&missing),
        "{err}"
    );
}

#[test]
fn self_launched_ranks_on_this_host_are_one_host() {
    let _serial = serial();
    let out = stdout_ok(&topo(&["-n", "3"], &[]));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "{out}");
    assert_eq!(lines[0], "# oxccl topo: from host identities of 3 ranks");
    assert!(lines[1].starts_with("host  name"), "{out}");
    assert!(
        lines[2].starts_with("   0  ")
            && lines[2].contains("  0-2  ")
            && lines[2].ends_with("unknown"),
        "{out}"
    );
    assert_eq!(lines[3], "3 ranks on 1 host, 3 per host");

    let out = stdout_ok(&topo(&["-n", "3", "--json"], &[]));
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let hosts = v["hosts"].as_array().expect("hosts");
    assert_eq!(hosts.len(), 1, "{out}");
    assert_eq!(hosts[0]["ranks"], serde_json::json!([0, 1, 2]));
    // The full host identity is kept: boot id / network namespace.
    assert!(
        hosts[0]["name"].as_str().unwrap().contains("/net:["),
        "{out}"
    );
    assert!(hosts[0].get("link_gbps").is_none(), "{out}");
}

#[test]
fn under_a_launcher_the_file_wins_over_detection_with_a_warning() {
    let _serial = serial();
    let dir = TempDir::new("launcher");
    let path = dir.file("t.toml", TOML);
    // `oxccl run -n 4 oxccl topo`: four ranks on one host, the file says two hosts.
    let mut cmd = Command::new(BIN);
    cmd.args(["run", "-n", "4", BIN]);
    topo_cmd(&mut cmd, &[]);
    cmd.env("OXCCL_TOPO_FILE", &path);
    let out = cmd.output().expect("running oxccl run");
    let stdout = stdout_ok(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let want: String = format!("# oxccl topo: from OXCCL_TOPO_FILE={path}\n{TABLE}")
        .lines()
        .map(|l| format!("[0] {l}\n"))
        .collect();
    assert_eq!(stdout, want);
    assert!(
        stderr.contains("groups the ranks as [0-1] [2-3]")
            && stderr.contains("[0-3]; using the file"),
        "{stderr}"
    );
    // A file that does not fit the job fails every rank, naming the file.
    let mut cmd = Command::new(BIN);
    cmd.args(["run", "-n", "3", BIN]);
    topo_cmd(&mut cmd, &[]);
    cmd.env("OXCCL_TOPO_FILE", &path);
    let out = cmd.output().expect("running oxccl run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&path) && stderr.contains("rank 3, but the job has 3 ranks"),
        "{stderr}"
    );
}

#[test]
fn ranks_in_two_network_namespaces_are_two_hosts() {
    let _serial = serial();
    if !oxccl_testbed::require(
        "ranks_in_two_network_namespaces_are_two_hosts",
        Testbed::available(),
    ) {
        return;
    }
    let tb =
        Testbed::new(&[HostSpec::unshaped(), HostSpec::unshaped()]).expect("creating the test bed");
    // Ranks 0 and 2 in host 0, rank 1 in host 1: host 1 comes second, as its lowest rank.
    let placement = [0usize, 1, 0];
    let outputs = run_in_bed(&tb, &placement, &["topo", "--json"], &[], 29517);
    for (rank, out) in outputs.iter().enumerate() {
        assert!(
            out.status.success(),
            "rank {rank} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        if rank > 0 {
            assert!(out.stdout.is_empty(), "only rank 0 prints");
        }
    }
    let json = String::from_utf8_lossy(&outputs[0].stdout);
    let v: serde_json::Value = serde_json::from_str(&json).expect("rank 0 prints JSON");
    let hosts = v["hosts"].as_array().expect("hosts");
    assert_eq!(hosts.len(), 2, "{json}");
    assert_eq!(hosts[0]["ranks"], serde_json::json!([0, 2]), "{json}");
    assert_eq!(hosts[1]["ranks"], serde_json::json!([1]), "{json}");
    assert_ne!(hosts[0]["name"], hosts[1]["name"]);
    println!("ranks in two namespaces:\n{json}");
}

/// Uneven shaped links (400, 400, 400 and 100 Mbit/s, one rank per host, the rates in
/// `OXCCL_TOPO_FILE`): large all-reduces run with the proportional shares, over tcp between
/// the namespaces, and every result is exact (`oxccl perf -c 1`), for two types and operators.
/// (How much faster than the ring is for `bench/topology.sh`, not a test.)
#[test]
fn proportional_all_reduce_across_shaped_namespaces_is_exact() {
    let _serial = serial();
    let name = "proportional_all_reduce_across_shaped_namespaces_is_exact";
    if !oxccl_testbed::require(name, Testbed::available()) {
        return;
    }
    let rates = [400u64, 400, 400, 100];
    let tb = Testbed::new(&rates.map(HostSpec::mbit)).expect("creating the test bed");
    let dir = TempDir::new("shaped");
    let file = dir.0.join("bed.json");
    let hosts: Vec<serde_json::Value> = rates
        .iter()
        .enumerate()
        .map(|(h, r)| {
            serde_json::json!({"name": format!("h{h}"), "ranks": [h], "link_gbps": *r as f64 / 1000.0})
        })
        .collect();
    std::fs::write(&file, serde_json::json!({ "hosts": hosts }).to_string()).unwrap();
    let file = file.to_str().unwrap();
    for (i, (dtype, op)) in [("float", "sum"), ("int32", "max")].into_iter().enumerate() {
        let args = [
            "perf",
            "all_reduce",
            "-b",
            "256K",
            "-e",
            "2M",
            "-f",
            "8",
            "-w",
            "1",
            "-i",
            "2",
            "-c",
            "1",
            "-d",
            dtype,
            "-o",
            op,
        ];
        let env = [("OXCCL_TOPO_FILE", file), ("OXCCL_DEBUG", "INFO")];
        let outs = run_in_bed(&tb, &[0, 1, 2, 3], &args, &env, 29531 + i as u16);
        assert_exact(&format!("{dtype} {op}"), &outs, 2);
        let log = String::from_utf8_lossy(&outs[0].stderr);
        assert!(
            log.lines()
                .any(|l| l.contains("all_reduce of 262144 bytes: algorithm prop")),
            "{dtype} {op}: the large all-reduces did not run the proportional algorithm:\n{log}"
        );
        // (The debug log names each kind of call once: the 2 MiB ones ran the same plan kind.)
    }
}

/// 2 hosts × 2 ranks in namespaces (shm inside a host, tcp between them), the two-tier
/// algorithm forced for every size from 8 B: exact results. (Small calls once mixed the
/// mailbox and slot protocols on one link: a rank whose blocks were empty talked only to its
/// host-mate and chose mailboxes, its host-mate slots.)
#[test]
fn hierarchical_collectives_across_namespaces_are_exact_at_every_size() {
    let _serial = serial();
    let name = "hierarchical_collectives_across_namespaces_are_exact_at_every_size";
    if !oxccl_testbed::require(name, Testbed::available()) {
        return;
    }
    let tb = Testbed::new(&[HostSpec::unshaped(), HostSpec::unshaped()]).expect("a test bed");
    let dir = TempDir::new("hier");
    let file = dir.0.join("bed.json");
    std::fs::write(
        &file,
        r#"{"hosts": [{"name": "h0", "ranks": [0, 1]}, {"name": "h1", "ranks": [2, 3]}]}"#,
    )
    .unwrap();
    let env = [
        ("OXCCL_TOPO_FILE", file.to_str().unwrap()),
        ("OXCCL_ALGO", "hier"),
    ];
    let colls = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"];
    for (i, coll) in colls.into_iter().enumerate() {
        let args = [
            "perf", coll, "-b", "8", "-e", "1M", "-f", "32", "-w", "1", "-i", "2", "-c", "1",
        ];
        let outs = run_in_bed(&tb, &[0, 0, 1, 1], &args, &env, 29541 + i as u16);
        assert_exact(coll, &outs, 4);
    }
}

/// `OXCCL_TOPO_PROBE=1` on shaped links of 400, 200, 200 and 100 Mbit/s (one rank per host,
/// no rates given): every rank measures the same rates, each within 20% of its link's (the
/// fastest host needs the incast pass: its pairwise best is only 200), and the tuner then runs
/// large all-reduces with proportional shares.
#[test]
fn the_link_probe_measures_shaped_links() {
    let _serial = serial();
    let name = "the_link_probe_measures_shaped_links";
    if !oxccl_testbed::require(name, Testbed::available()) {
        return;
    }
    let rates = [400u64, 200, 200, 100];
    let tb = Testbed::new(&rates.map(HostSpec::mbit)).expect("creating the test bed");
    let env = [("OXCCL_TOPO_PROBE", "1M"), ("OXCCL_DEBUG", "INFO")];
    let outs = run_in_bed(&tb, &[0, 1, 2, 3], &["topo", "--json"], &env, 29551);
    for (rank, out) in outs.iter().enumerate() {
        assert!(
            out.status.success(),
            "rank {rank} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let json = String::from_utf8_lossy(&outs[0].stdout);
    let v: serde_json::Value = serde_json::from_str(&json).expect("rank 0 prints JSON");
    let hosts = v["hosts"].as_array().expect("hosts");
    assert_eq!(hosts.len(), 4, "{json}");
    for (h, want) in rates.iter().enumerate() {
        let got = hosts[h]["link_gbps"].as_f64().expect("a probed rate") * 1000.0;
        let want = *want as f64;
        assert!(
            (got - want).abs() <= 0.2 * want,
            "host {h}: probed {got:.0} Mbit/s, shaped {want} Mbit/s\n{json}"
        );
    }
    println!("{name}: {json}");
    let args = [
        "perf",
        "all_reduce",
        "-b",
        "1M",
        "-e",
        "1M",
        "-w",
        "1",
        "-i",
        "1",
        "-c",
        "1",
    ];
    let outs = run_in_bed(&tb, &[0, 1, 2, 3], &args, &env, 29552);
    assert_exact("all_reduce after the probe", &outs, 1);
    let log = String::from_utf8_lossy(&outs[0].stderr);
    assert!(
        log.lines()
            .any(|l| l.contains("all_reduce of 1048576 bytes: algorithm prop")),
        "the probed rates did not pick the proportional all-reduce:\n{log}"
    );
}
