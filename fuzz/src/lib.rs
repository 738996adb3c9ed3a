//! Shared code of the fuzz targets: what the `schedule` target checks lives here, so that the
//! seed-corpus generator (`examples/seed_corpus.rs`) can encode inputs in its format and the
//! regression test (`tests/regressions.rs`) can replay inputs without libFuzzer.

pub mod schedule;
