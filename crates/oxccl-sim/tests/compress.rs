//! The compressed all-reduce's prediction (`simulate_compressed`): cheaper than the plain
//! all-reduce on a wire-bound fabric (the 1 Gbit/s bed: 4 hosts on a star) with the measured
//! codec, dearer with an unrealistically slow codec, its bytes those of the phases, and its
//! time the sequential phases when there is one chunk.

use oxccl_core::compress::Format;
use oxccl_core::schedule::Collective;
use oxccl_sim::compress::{DEFAULT_CHUNK_BYTES, chunk_values};
use oxccl_sim::{Codec, Fabric, Link, Node, NodeKind, Spec, simulate, simulate_compressed};

/// `p` hosts of one rank on a star of links of `gbit` Gbit/s each way, 20 µs each.
fn star(p: usize, gbit: f64) -> Fabric {
    let mut nodes: Vec<Node> = (0..p)
        .map(|r| Node {
            name: format!("r{r}"),
            kind: NodeKind::Rank { host: r },
        })
        .collect();
    nodes.push(Node {
        name: "switch".into(),
        kind: NodeKind::Switch {
            reduce_bytes_per_s: None,
        },
    });
    let mut links = Vec::new();
    for r in 0..p {
        for (from, to) in [(r, p), (p, r)] {
            links.push(Link {
                name: format!("{from}->{to}"),
                from,
                to,
                bytes_per_s: gbit * 1e9 / 8.0,
                latency_s: 20e-6,
            });
        }
    }
    Fabric {
        nodes,
        links,
        world: p,
        hosts: (0..p).map(|r| (format!("h{r}"), vec![r])).collect(),
        reduce_bytes_per_s: 10e9,
        per_message_s: 5e-6,
        scaleup_per_message_s: 5e-6,
        symmetry: None,
        layout: Default::default(),
    }
}

fn spec(count: usize) -> Spec {
    Spec::new(Collective::AllReduce { count }, 4)
}

#[test]
fn compressed_beats_plain_on_a_wire_bound_bed_and_loses_with_a_slow_codec() {
    let fabric = star(4, 1.0);
    let count = 16 << 20; // 64 MiB of f32
    let plain = simulate(&fabric, &spec(count)).unwrap().time_s;
    for (fmt, bound) in [(Format::BFP8, 8.25 / 32.0), (Format::BFP4, 4.25 / 32.0)] {
        let c = simulate_compressed(
            &fabric,
            &spec(count),
            fmt,
            &Codec::default(),
            DEFAULT_CHUNK_BYTES,
        )
        .unwrap();
        let ratio = c.time_s / plain;
        // Wire-bound: near the format's bound (plus the exponents' max), far below plain.
        assert!(ratio > bound && ratio < bound + 0.06, "{fmt}: {ratio}");
        assert_eq!(c.chunks, 16);
        // Bytes: 2(n-1)/n (M/8 + 1.5/B) per value, against 2(n-1)/n · 4 for a ring.
        let ring = 1.5 * count as f64 * 4.0;
        let want = 1.5 * count as f64 * (fmt.width.bits() as f64 / 8.0 + 1.5 / 32.0);
        assert!((c.wire_bytes - want).abs() < 1e-9 * want, "{fmt}");
        assert!(c.wire_bytes / ring < bound + 0.02);
        // A codec of 50 MB/s: the codec is the bottleneck, and compression loses.
        let slow = Codec {
            encode_bytes_per_s: 50e6,
            decode_bytes_per_s: 50e6,
        };
        let s =
            simulate_compressed(&fabric, &spec(count), fmt, &slow, DEFAULT_CHUNK_BYTES).unwrap();
        assert!(s.time_s > plain, "{fmt}: {} against {plain}", s.time_s);
        // Codec-bound: about the codec's time, encode and decode of 64 MiB at 50 MB/s.
        let codec = 2.0 * count as f64 * 4.0 / 50e6;
        assert!((s.codec_s - codec).abs() < 1e-9 * codec);
        assert!(s.time_s >= codec && s.time_s < codec * 1.1);
    }
}

#[test]
fn one_chunk_is_its_phases_one_after_another() {
    let fabric = star(4, 10.0);
    let count = 100_000;
    let codec = Codec {
        encode_bytes_per_s: 2e9,
        decode_bytes_per_s: 4e9,
    };
    let c = simulate_compressed(&fabric, &spec(count), Format::BFP8, &codec, 1 << 30).unwrap();
    assert_eq!(c.chunks, 1);
    let wire: f64 = c.phases.iter().map(|r| r.time_s).sum();
    let want = wire + count as f64 * 4.0 / 2e9 + count as f64 * 4.0 / 4e9;
    assert!((c.time_s - want).abs() < 1e-12 + 1e-9 * want);
    // Chunks as the runtime cuts them: whole shares of blocks.
    assert_eq!(chunk_values(1 << 20, 4, 4, Format::BFP8), 262_144);
    assert_eq!(chunk_values(10, 4, 4, Format::BFP8), 128);
    // Not an all-reduce, or a codec of no speed: refused, with the reason.
    let e = simulate_compressed(
        &fabric,
        &Spec::new(Collective::AllGather { count: 10 }, 4),
        Format::BFP8,
        &codec,
        1 << 20,
    )
    .unwrap_err();
    assert!(e.contains("all_reduce"), "{e}");
    let zero = Codec {
        encode_bytes_per_s: 0.0,
        ..codec
    };
    let e = simulate_compressed(&fabric, &spec(10), Format::BFP8, &zero, 1 << 20).unwrap_err();
    assert!(e.contains("positive"), "{e}");
    // More ranks than 16-bit sums hold: refused, as the runtime refuses them.
    let e =
        simulate_compressed(&star(259, 1.0), &spec(10), Format::BFP8, &codec, 1 << 20).unwrap_err();
    assert!(e.contains("259 ranks") && e.contains("up to 258"), "{e}");
}
