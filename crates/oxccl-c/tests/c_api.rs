//! C programs against `include/oxccl.h` and the `liboxccl.so` this test build made:
//! `tests/c/collectives.c` (every collective, data type and operator, checked against closed
//! forms; unique ids, split, registration, groups; error codes and messages) under
//! `oxccl run -n 4` and Open MPI's `mpirun -np 2`, `tests/c/failure.c` (a peer that leaves),
//! and the README's example (`examples/c/example.c`) built with `pkg-config` after
//! `scripts/install-c.sh`.
//!
//! Needs a C compiler (`cc`, or `$CC`), `pkg-config`, and Debian's `openmpi-bin`; without one
//! a test prints `SKIPPED <name>: <reason>` and passes, except under `CI=true`, where it fails.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;

/// One job at a time: 4 ranks already share this machine's 2 cores.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Seconds a launcher may run before it is stopped.
const LIMIT_S: &str = "180";

fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn repo_root() -> PathBuf {
    crate_dir().join("../..")
}

/// The profile's output directory (`target/debug`), where cargo put `liboxccl.so`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's path");
    // target/<profile>/deps/c_api-<hash>
    exe.parent()
        .and_then(Path::parent)
        .expect("a profile directory")
        .to_owned()
}

fn lib_dir() -> PathBuf {
    build_artifacts();
    let dir = profile_dir();
    assert!(
        dir.join("liboxccl.so").exists(),
        "{} has no liboxccl.so after cargo build -p oxccl-c",
        dir.display()
    );
    dir
}

/// Features that `cargo test --workspace` (scripts/test.sh, CI) turns on in the crates
/// liboxccl.so and `oxccl` are made of, beyond what oxccl-c's and oxccl-cli's dependencies and
/// dev-dependencies ask for: getrandom's `std` and `sys_rng`, through proptest's rand (a
/// dev-dependency of the runtime's crates). See [`build_artifacts`].
const WORKSPACE_TEST_FEATURES: &[&str] = &["getrandom/std", "getrandom/sys_rng"];

/// Variables cargo sets for a test's process, besides `CARGO_PKG_*` and `CARGO_BIN_*`.
const CARGO_SET_FOR_TESTS: &[&str] = &[
    "CARGO_MANIFEST_DIR",
    "CARGO_MANIFEST_PATH",
    "CARGO_MANIFEST_LINKS",
    "CARGO_CRATE_NAME",
    "CARGO_PRIMARY_PACKAGE",
    "CARGO_TARGET_TMPDIR",
    "CARGO_RUSTC_CURRENT_DIR",
    "OUT_DIR",
];

/// Builds (or finds up to date) `liboxccl.so` and the `oxccl` launcher in this test's profile
/// and target directory. `cargo test` builds neither (nothing links a cdylib; `oxccl` is
/// another package's binary), so this runs cargo once more, resolved as the test build was,
/// so that it reuses what that build compiled rather than compiling the runtime and the CLI a
/// second time and overwriting `target/debug/oxccl`:
/// - it selects this test target too (`--test c_api`, already built: nothing to do), so that
///   cargo resolves with dev-dependencies as `cargo test` did: oxccl-testbed's
///   `oxccl-seal/mitm`, and cbindgen's syn, which makes proc-macro2 and quote units shared by
///   the proc-macros (serde's, thiserror's) rather than built apart for them;
/// - the ofi feature when this test was built with it, and [`WORKSPACE_TEST_FEATURES`].
///
/// After `cargo test --workspace --features oxccl-verbs/ofi --no-run` it compiles only
/// oxccl-c's cdylib (0.9 s here, where the two `cargo build -p` this replaced compiled 21
/// crates in 63 s). After `cargo test -p oxccl-c` it compiles the runtime once under these
/// features (later runs find it). With `OXCCL_C_API_EXPECT_FRESH=1` (scripts/test.sh, after the
/// workspace's test build) it fails if it compiled anything of another package: a dependency
/// changed and the features above fell behind (compare `cargo tree --workspace -e
/// normal,build,dev -f '{p} {f}'` with the same for `-p oxccl-c -p oxccl-cli`).
fn build_artifacts() {
    static BUILT: Mutex<bool> = Mutex::new(false);
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if *built {
        return;
    }
    let (profile, target) = profile_and_target();
    let mut features: Vec<&str> = WORKSPACE_TEST_FEATURES.to_vec();
    if oxccl_verbs::OFI_BUILT_IN {
        features.push("oxccl-verbs/ofi");
    }
    let mut cmd = Command::new(env!("CARGO"));
    // What cargo set for this test's process (CARGO_MANIFEST_DIR, CARGO_PKG_NAME, OUT_DIR, ...)
    // is not the environment the test build ran in, and build scripts read some of it (ring's
    // reruns when CARGO_MANIFEST_DIR or CARGO_PKG_NAME differ): passed on, it would make cargo
    // rerun ring's build script and compile everything above ring again, here and in the next
    // `cargo test`.
    for (var, _) in std::env::vars_os() {
        let name = var.to_string_lossy();
        if CARGO_SET_FOR_TESTS.contains(&&*name)
            || name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_BIN_")
        {
            cmd.env_remove(&var);
        }
    }
    let out = cmd
        .args([
            "build",
            "--quiet",
            "--message-format=json-render-diagnostics",
        ])
        .args([
            "-p",
            "oxccl-c",
            "-p",
            "oxccl-cli",
            "--lib",
            "--bin",
            "oxccl",
        ])
        .args(["--test", "c_api", "--features", &features.join(",")])
        .arg("--profile")
        .arg(&profile)
        .arg("--target-dir")
        .arg(&target)
        .current_dir(repo_root())
        .output()
        .expect("running cargo build");
    assert!(
        out.status.success(),
        "cargo build -p oxccl-c -p oxccl-cli failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    if std::env::var_os("OXCCL_C_API_EXPECT_FRESH").is_some_and(|v| v == "1") {
        let own = crate_dir().join("Cargo.toml");
        let compiled = compiled_units(&String::from_utf8_lossy(&out.stdout), &own);
        assert!(
            compiled.is_empty(),
            "the C API test's cargo build compiled {} again after the workspace's test build: \
             its features differ from that build's (see build_artifacts in {})",
            compiled.join(", "),
            file!()
        );
    }
    *built = true;
}

/// The packages of `cargo build --message-format=json` output (`stdout`) whose artifacts were
/// compiled rather than found up to date, other than the one of `own` (a manifest path).
fn compiled_units(stdout: &str, own: &Path) -> Vec<String> {
    let field = |line: &str, name: &str| -> Option<String> {
        let key = format!("\"{name}\":\"");
        let at = line.find(&key)? + key.len();
        Some(line[at..].split('"').next()?.to_owned())
    };
    let own = own.canonicalize().unwrap_or_else(|_| own.to_owned());
    let mut compiled: Vec<String> = stdout
        .lines()
        .filter(|l| l.contains("\"reason\":\"compiler-artifact\"") && l.contains("\"fresh\":false"))
        .filter(|l| {
            let manifest =
                field(l, "manifest_path").and_then(|m| Path::new(&m).canonicalize().ok());
            manifest.as_deref() != Some(own.as_path())
        })
        .map(|l| field(l, "package_id").unwrap_or_else(|| l.chars().take(200).collect()))
        .collect();
    compiled.dedup();
    compiled
}

/// The cargo profile of this test build and its target directory.
fn profile_and_target() -> (String, PathBuf) {
    let dir = profile_dir();
    let profile = match dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => "dev".to_owned(),
        Some(p) => p.to_owned(),
        None => panic!("cannot tell the profile from {}", dir.display()),
    };
    (
        profile,
        dir.parent().expect("a target directory").to_owned(),
    )
}

/// The `oxccl` launcher, built (or found up to date) in this test's target directory.
fn oxccl() -> PathBuf {
    build_artifacts();
    let exe = profile_dir().join("oxccl");
    assert!(exe.exists(), "{} was not built", exe.display());
    exe
}

/// Whether `program` is on the PATH.
fn have(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn compiler() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".into())
}

/// Skips (or fails, under `CI=true`) unless every program is installed.
fn require(test: &str, programs: &[&str]) -> bool {
    let absent: Vec<&str> = programs.iter().copied().filter(|p| !have(p)).collect();
    let why = format!(
        "{} not found (apt-get install gcc pkg-config openmpi-bin)",
        absent.join(", ")
    );
    oxccl_testbed::require(test, if absent.is_empty() { Ok(()) } else { Err(why) })
}

/// A scratch directory for one test's files.
fn scratch(test: &str) -> PathBuf {
    let (_, target) = profile_and_target();
    let dir = target.join("oxccl-c-tests").join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("creating a scratch directory");
    dir
}

/// Compiles one C file against the header and `liboxccl.so`, warnings as errors.
fn compile(src: &Path, out: &Path) {
    let lib = lib_dir();
    let result = Command::new(compiler())
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1"])
        .arg("-I")
        .arg(crate_dir().join("include"))
        .arg(src)
        .arg("-L")
        .arg(&lib)
        .args(["-loxccl", "-lm"])
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-o")
        .arg(out)
        .output()
        .expect("running the C compiler");
    assert!(
        result.status.success(),
        "compiling {} failed:\n{}",
        src.display(),
        String::from_utf8_lossy(&result.stderr)
    );
}

/// A fresh secret for one job.
fn secret() -> String {
    use std::io::Read;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .expect("reading /dev/urandom");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A command with only `PATH`, `HOME` and a fresh `OXCCL_SECRET` in its environment.
fn clean(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(program);
    cmd.env_clear();
    for var in ["PATH", "HOME"] {
        if let Some(v) = std::env::var_os(var) {
            cmd.env(var, v);
        }
    }
    cmd.env("OXCCL_SECRET", secret());
    cmd
}

fn oxccl_run(n: usize, program: &Path, args: &[&str]) -> Command {
    let mut cmd = clean(oxccl());
    cmd.args(["run", "--timeout", LIMIT_S, "-n", &n.to_string()])
        .arg(program)
        .args(args);
    cmd
}

fn mpirun(n: usize, program: &Path) -> Command {
    let mut cmd = clean("timeout");
    cmd.args([
        LIMIT_S,
        "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
    ])
    .arg(n.to_string())
    .args(["-x", "OXCCL_SECRET"])
    .arg(program);
    cmd
}

fn run(mut cmd: Command, what: &str) -> (Output, String) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let text = format!(
        "{what}: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out, text)
}

/// Every one of `n` ranks ran the same number of checks (many) and failed none.
fn assert_all_ranks_passed(out: &Output, text: &str, n: usize) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(!stdout.contains("FAIL"), "{text}");
    let mut ranks: Vec<(usize, usize)> = stdout
        .lines()
        .filter_map(|l| l.split_once("rank ").map(|(_, rest)| rest))
        .filter_map(|l| {
            let (r, rest) = l.split_once(": checks ")?;
            let (checks, failed) = rest.split_once(" failed ")?;
            assert_eq!(failed.trim(), "0", "{text}");
            Some((r.parse().ok()?, checks.parse().ok()?))
        })
        .collect();
    ranks.sort_unstable();
    assert_eq!(ranks.len(), n, "every rank reports: {text}");
    assert!(
        ranks.iter().enumerate().all(|(i, &(r, _))| r == i),
        "{text}"
    );
    assert!(
        ranks.iter().all(|&(_, c)| c == ranks[0].1 && c > 400),
        "{text}"
    );
}

fn collectives_program(test: &str) -> PathBuf {
    let exe = scratch(test).join("collectives");
    compile(&crate_dir().join("tests/c/collectives.c"), &exe);
    exe
}

#[test]
fn c_collectives_under_oxccl_run_with_4_ranks() {
    let test = "c_collectives_under_oxccl_run_with_4_ranks";
    if !require(test, &[&compiler()]) {
        return;
    }
    let exe = collectives_program(test);
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (out, text) = run(oxccl_run(4, &exe, &[]), "oxccl run -n 4 collectives");
    assert_all_ranks_passed(&out, &text, 4);
}

#[test]
fn c_collectives_under_mpirun_with_2_ranks() {
    let test = "c_collectives_under_mpirun_with_2_ranks";
    if !require(test, &[&compiler(), "mpirun"]) {
        return;
    }
    let exe = collectives_program(test);
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (out, text) = run(mpirun(2, &exe), "mpirun -np 2 collectives");
    assert_all_ranks_passed(&out, &text, 2);
}

#[test]
fn c_peer_that_leaves_is_a_remote_error_naming_it() {
    let test = "c_peer_that_leaves_is_a_remote_error_naming_it";
    if !require(test, &[&compiler()]) {
        return;
    }
    let exe = scratch(test).join("failure");
    compile(&crate_dir().join("tests/c/failure.c"), &exe);
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut cmd = oxccl_run(2, &exe, &[]);
    cmd.env("OXCCL_TIMEOUT", "10");
    let (out, text) = run(cmd, "oxccl run -n 2 failure");
    assert!(out.status.success(), "{text}");
    assert!(text.contains("ok   the peer's exit was reported"), "{text}");
}

#[test]
fn c_example_builds_with_pkg_config_and_runs() {
    let test = "c_example_builds_with_pkg_config_and_runs";
    if !require(test, &[&compiler(), "pkg-config"]) {
        return;
    }
    let dir = scratch(test);
    let prefix = dir.join("prefix");
    lib_dir(); // built (or found up to date) before install-c.sh --no-build copies it
    let (profile, target) = profile_and_target();
    let (out, text) = run(
        {
            let mut c = Command::new(repo_root().join("scripts/install-c.sh"));
            c.arg(&prefix)
                .args(["--profile", &profile, "--no-build", "--target-dir"])
                .arg(&target);
            c
        },
        "scripts/install-c.sh",
    );
    assert!(out.status.success(), "{text}");
    // The README's command.
    let exe = dir.join("example");
    let build = format!(
        "{} {} $(pkg-config --cflags --libs oxccl) \
         -Wl,-rpath,$(pkg-config --variable=libdir oxccl) -o {}",
        compiler(),
        repo_root().join("examples/c/example.c").display(),
        exe.display()
    );
    let mut cmd = Command::new("sh");
    cmd.args(["-c", &build])
        .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig"));
    let (out, text) = run(cmd, &build);
    assert!(out.status.success(), "{text}");
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (out, text) = run(oxccl_run(4, &exe, &[]), "oxccl run -n 4 example");
    assert!(out.status.success(), "{text}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    for r in 0..4 {
        let line = format!("rank {r} of 4: grad[0] = 10 (want 10)");
        assert!(stdout.contains(&line), "{text}");
    }
}
