//! Fuzzes the schedule builder (`crates/oxccl-core/src/schedule/`) against the symbolic
//! reference executor (`crates/oxccl-core/src/verify.rs`): see `fuzz/src/schedule.rs` for the
//! input format and what is checked.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    oxccl_fuzz::schedule::check(data);
});
