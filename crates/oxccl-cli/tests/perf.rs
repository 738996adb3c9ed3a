//! `oxccl perf`: launches its own ranks, checks every result, prints nccl-tests' columns.

use std::process::Command;

fn perf(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_oxccl"));
    cmd.arg("perf").args(args);
    for k in [
        "RANK",
        "WORLD_SIZE",
        "OXCCL_RANK",
        "SLURM_PROCID",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
    ] {
        cmd.env_remove(k);
    }
    cmd.env("OXCCL_TIMEOUT", "60");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("running oxccl perf")
}

fn json(args: &[&str], env: &[(&str, &str)]) -> serde_json::Value {
    let mut all = args.to_vec();
    all.push("--json");
    let out = perf(&all, env);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "oxccl perf {args:?} failed: {}\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// Every row checked (-c 1) and right, busbw = algbw × nccl-tests' factor, algbw = size / time.
fn check_rows(doc: &serde_json::Value, factor: f64, sizes: usize) {
    let rows = doc["rows"].as_array().unwrap();
    assert_eq!(rows.len(), sizes, "{doc}");
    for row in rows {
        for side in ["oop", "ip"] {
            let s = &row[side];
            assert_eq!(s["wrong"], 0, "{row}");
            let (t, algbw, busbw) = (
                s["time_us"].as_f64().unwrap(),
                s["algbw"].as_f64().unwrap(),
                s["busbw"].as_f64().unwrap(),
            );
            assert!(t > 0.0, "{row}");
            let size = row["size"].as_f64().unwrap();
            assert!(
                (algbw - size / (t * 1e3)).abs() <= 1e-9 + 1e-6 * algbw,
                "{row}"
            );
            assert!(
                (busbw - algbw * factor).abs() <= 1e-9 + 1e-6 * busbw,
                "{row}"
            );
        }
    }
}

#[test]
fn all_reduce_over_shm_checks_every_result() {
    let doc = json(
        &[
            "all_reduce",
            "-n",
            "3",
            "-b",
            "8",
            "-e",
            "1M",
            "-f",
            "16",
            "-w",
            "1",
            "-i",
            "2",
        ],
        &[],
    );
    assert_eq!(doc["nranks"], 3);
    assert_eq!(doc["provider"], "shm");
    // 8, 128, 2K, 32K, 512K
    check_rows(&doc, 2.0 * 2.0 / 3.0, 5);
}

#[test]
fn every_collective_type_and_operator() {
    for (coll, factor) in [
        ("reduce_scatter", 0.5),
        ("all_gather", 0.5),
        ("broadcast", 1.0),
        ("reduce", 1.0),
        ("all_to_all", 0.5),
        ("gather", 0.5),
        ("scatter", 0.5),
    ] {
        let doc = json(
            &[
                coll, "-n", "2", "-b", "64", "-e", "256K", "-f", "64", "-w", "1", "-i", "1", "-r",
                "1",
            ],
            &[],
        );
        check_rows(&doc, factor, 3);
    }
    for (d, o) in [
        ("half", "max"),
        ("bfloat16", "sum"),
        ("int8", "prod"),
        ("uint64", "min"),
        ("double", "avg"),
        ("int32", "avg"),
        ("f8e4m3", "sum"),
        ("e5m2", "avg"),
        ("f8e5m2", "max"),
        ("e4m3", "prod"),
    ] {
        let doc = json(
            &[
                "all_reduce",
                "-n",
                "2",
                "-b",
                "1K",
                "-e",
                "128K",
                "-f",
                "128",
                "-d",
                d,
                "-o",
                o,
                "-w",
                "1",
                "-i",
                "1",
            ],
            &[],
        );
        // Printed by its nccl-tests name, whichever spelling was given.
        let name = match d {
            "e4m3" => "f8e4m3",
            "e5m2" => "f8e5m2",
            d => d,
        };
        assert_eq!(doc["dtype"], name);
        check_rows(&doc, 1.0, 2);
    }
}

#[test]
fn forced_tcp() {
    let doc = json(
        &[
            "all_reduce",
            "-n",
            "2",
            "-b",
            "4",
            "-e",
            "2M",
            "-f",
            "32",
            "-w",
            "1",
            "-i",
            "1",
        ],
        &[("OXCCL_PROVIDER", "tcp")],
    );
    assert_eq!(doc["provider"], "tcp");
    check_rows(&doc, 1.0, 4);
}

#[test]
fn table_has_the_nccl_tests_columns() {
    let out = perf(
        &[
            "all_reduce",
            "-n",
            "2",
            "-b",
            "8",
            "-e",
            "64",
            "-f",
            "8",
            "-w",
            "1",
            "-i",
            "1",
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for col in [
        "size",
        "count",
        "type",
        "redop",
        "root",
        "time",
        "algbw",
        "busbw",
        "#wrong",
        "out-of-place",
        "in-place",
    ] {
        assert!(text.contains(col), "no column {col}: {text}");
    }
    assert!(text.contains("# Avg bus bandwidth"), "{text}");
    assert!(text.contains("# Out of bounds values : 0 OK"), "{text}");
    let rows: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(rows.len(), 2, "{text}");
    let cols: Vec<&str> = rows[1].split_whitespace().collect();
    assert_eq!(&cols[..5], ["64", "16", "float", "sum", "-1"], "{text}");
}

#[test]
fn bad_arguments_are_refused() {
    let out = perf(&["all_scream", "-n", "2"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown collective"));
    let out = perf(&["all_reduce", "-n", "2", "-d", "int16"], &[]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("int16"));
    // A root outside the world fails on every rank, and the launcher reports it.
    let out = perf(
        &["broadcast", "-n", "2", "-r", "5", "-b", "8", "-e", "8"],
        &[],
    );
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("root 5"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `--compress`: the compressed sum all-reduce, checked exactly (small integer inputs), with
/// fewer bytes on the wire than a ring of the uncompressed type would send; other collectives,
/// operators and types are refused.
#[test]
fn compressed_all_reduce() {
    for (c, dtype, most) in [("bfp8", "float", 0.45), ("bfp4/64", "half", 0.75)] {
        // Per value, 1 (bfp8) or 0.5 (bfp4) byte of mantissa out and a 2-byte sum back, against
        // a ring's 2 values of 4 (float) or 2 (half) bytes: 0.375 and 0.625, plus the exponents
        // and the padding of shares to whole blocks at small sizes.
        let doc = json(
            &[
                "all_reduce",
                "-n",
                "3",
                "-b",
                "1K",
                "-e",
                "256K",
                "-f",
                "16",
                "-d",
                dtype,
                "--compress",
                c,
                "-c",
                "1",
                "-w",
                "1",
                "-i",
                "3",
            ],
            &[],
        );
        let rows = doc["rows"].as_array().expect("rows");
        assert_eq!(rows.len(), 3, "{doc}");
        for r in rows {
            assert_eq!(r["wrong"], 0, "{c}: {r}");
            let ratio = r["wire_vs_ring"].as_f64().expect("wire_vs_ring");
            assert!(
                ratio > 0.0 && ratio < most,
                "{c} {dtype}: wire/ring {ratio}: {r}"
            );
        }
    }
    for bad in [
        &["all_gather", "--compress", "bfp8"][..],
        &["all_reduce", "-o", "max", "--compress", "bfp8"],
        &["all_reduce", "-d", "double", "--compress", "bfp8"],
        &["all_reduce", "--compress", "bfp7"],
    ] {
        let o = perf(bad, &[]);
        assert_eq!(o.status.code(), Some(2), "{bad:?}");
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("--compress"),
            "{bad:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}
