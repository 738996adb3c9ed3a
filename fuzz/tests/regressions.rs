//! Replays the `schedule` target's committed inputs without libFuzzer: its seed corpus
//! (`corpus-seed/schedule/`) and the crashes it found (`regressions/schedule/`, minimized).
//! `cargo test --manifest-path fuzz/Cargo.toml`.

use std::path::Path;

fn replay(dir: &str) -> usize {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let Ok(rd) = std::fs::read_dir(&dir) else {
        return 0;
    };
    let mut n = 0;
    for e in rd.filter_map(Result::ok) {
        let data = std::fs::read(e.path()).unwrap();
        let name = e.path().display().to_string();
        let r = std::panic::catch_unwind(|| oxccl_fuzz::schedule::check(&data));
        assert!(r.is_ok(), "{name} fails (bytes {data:02x?})");
        n += 1;
    }
    n
}

#[test]
fn schedule_seed_corpus() {
    assert!(replay("corpus-seed/schedule") > 100);
}

#[test]
fn schedule_regressions() {
    replay("regressions/schedule");
}
