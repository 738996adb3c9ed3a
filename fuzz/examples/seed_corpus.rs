//! Writes the seed corpus of the fuzz targets under `fuzz/corpus-seed/<target>/`, from the
//! decoders' own encoders and the `schedule` target's input format:
//!
//! ```sh
//! cargo run --manifest-path fuzz/Cargo.toml --example seed_corpus
//! ```
//!
//! `tcp_frame`: a hello, a header of every opcode (with its payload where it has one), a hello
//! followed by a stream of frames, and malformed headers (one per rejection reason).
//! `bootstrap_wire`: a frame of every message kind, two frames back to back, and malformed frames.
//! `seal_stream`: a sealed stream, unchanged and changed each way a man in the middle could.
//! `schedule`: every collective with every algorithm that supports it, over worlds of 1, 2, 3, 5,
//! 8 and 16 ranks, in and out of place, with a small count and a large one, pipelined in small
//! chunks or not; all-to-allv with uneven counts and send/recv pairs; then an unsupported
//! algorithm per collective and one request per way of breaking it. Every seed is checked as the
//! target checks it before it is written.
//! Every file is small (the whole corpus is a few KB); `--check` compares instead of writing, and
//! fails if the committed corpus is stale.

use std::collections::BTreeMap;
use std::path::Path;

use oxccl_core::fuzzing::CollectiveKind;
use oxccl_fuzz::schedule::{self as sched, ALGORITHMS, Input, KINDS, Outcome, label};

use oxccl_bootstrap::wire::{self, MAX_FRAME_LEN, Msg, NONCE_LEN, PROTOCOL_VERSION};
use oxccl_verbs::fuzzing::{Header, Hello, MAX_PAYLOAD, Opcode, encode_hello};

fn tcp_frame() -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let hello = encode_hello(&Hello {
        target: 0x1122_3344_5566_7788,
        initiator: 0x99aa_bbcc_ddee_ff00,
        rnr_us: 5_000_000,
        index: 0,
        count: 1,
        nonce: None,
    });
    out.insert("hello".into(), hello.to_vec());
    // A sealed connection's hello: the flag and a nonce (its records are oxccl-seal's, fuzzed by
    // `seal_stream`).
    let sealed = encode_hello(&Hello {
        target: 7,
        initiator: 9,
        rnr_us: 0,
        index: 1,
        count: 4,
        nonce: Some([0x5a; 32]),
    });
    out.insert("hello_sealed".into(), sealed.to_vec());
    let mut stream = hello.to_vec();
    for (name, op, len) in [
        ("write", Opcode::Write, 16),
        ("write_imm", Opcode::WriteImm, 0),
        ("send", Opcode::Send, 5),
        ("send_imm", Opcode::SendImm, 3),
        ("read_req", Opcode::ReadReq, 1 << 20),
        ("cas", Opcode::Cas, 8),
        ("faa", Opcode::Faa, 8),
        ("ack", Opcode::Ack, 0),
        ("nak", Opcode::Nak, 0),
        ("read_resp", Opcode::ReadResp, 4),
        ("atomic_resp", Opcode::AtomicResp, 0),
    ] {
        let mut h = Header::new(op, 42, len);
        h.imm = 0xdead_beef;
        h.addr = 0x7f00_0000_1000;
        h.rkey = 0x0001_0003;
        h.a = if op == Opcode::Nak { 3 } else { 5 };
        h.b = 9;
        let mut frame = h.encode().to_vec();
        frame.extend((0..h.payload_len()).map(|i| i as u8));
        stream.extend_from_slice(&frame);
        out.insert(name.to_string(), frame);
    }
    out.insert("stream".into(), stream);

    let good = Header::new(Opcode::Write, 1, 0).encode();
    let mut bad_magic = good;
    bad_magic[0] = b'X';
    out.insert("bad_magic".into(), bad_magic.to_vec());
    let mut bad_opcode = good;
    bad_opcode[4] = 8;
    out.insert("bad_opcode".into(), bad_opcode.to_vec());
    let mut reserved = good;
    reserved[63] = 1;
    out.insert("bad_reserved".into(), reserved.to_vec());
    out.insert(
        "bad_length_faa".into(),
        Header::new(Opcode::Faa, 1, 16).encode().to_vec(),
    );
    out.insert(
        "bad_length_write".into(),
        Header::new(Opcode::Write, 1, MAX_PAYLOAD + 1)
            .encode()
            .to_vec(),
    );
    out.insert(
        "bad_nak_status".into(),
        Header::new(Opcode::Nak, 1, 0).encode().to_vec(),
    );
    let mut short = good.to_vec();
    short.truncate(40);
    out.insert("short".into(), short);
    out
}

fn bootstrap_wire() -> BTreeMap<String, Vec<u8>> {
    let samples = [
        Msg::Hello {
            version: PROTOCOL_VERSION,
            nonce: [7; NONCE_LEN],
        },
        Msg::Auth {
            mac: [1; NONCE_LEN],
            nonce: [2; NONCE_LEN],
            label: "rank 3 pid 42".into(),
        },
        Msg::AuthOk {
            mac: [9; NONCE_LEN],
        },
        Msg::Name {
            label: "rank 3 pid 42".into(),
        },
        Msg::AuthFail {
            reason: "wrong secret".into(),
        },
        Msg::Set {
            key: "rank/0/endpoint".into(),
            value: b"10.0.0.1:4791".to_vec(),
        },
        Msg::Get {
            keys: vec!["a".into(), "bé".into()],
            timeout_ms: 1234,
        },
        Msg::Wait {
            keys: vec!["barrier/1".into()],
            timeout_ms: u64::MAX,
        },
        Msg::Add {
            key: "counter".into(),
            delta: -5,
        },
        Msg::CompareSet {
            key: "leader".into(),
            expected: None,
            desired: b"3".to_vec(),
        },
        Msg::Delete { key: "d".into() },
        Msg::Done,
        Msg::Values(vec![vec![], b"abc".to_vec()]),
        Msg::Int(i64::MIN),
        Msg::Bool(true),
        Msg::Cas {
            swapped: false,
            current: Some(b"old".to_vec()),
        },
        Msg::TimedOut {
            missing: vec!["r/2".into(), "r/3".into()],
        },
        Msg::Failed {
            message: "no".into(),
        },
    ];
    let mut out = BTreeMap::new();
    for msg in &samples {
        let frame = wire::encode(msg).expect("sample encodes");
        out.insert(msg.kind().to_lowercase(), frame);
    }
    let mut two = out["set"].clone();
    two.extend_from_slice(&out["done"]);
    out.insert("two_frames".into(), two);

    // Malformed: unknown tag, empty body, a boolean that is not 0/1, a key running past the end,
    // a key that is not UTF-8, trailing bytes, an oversized announcement, a truncated frame.
    out.insert("bad_tag".into(), vec![1, 0, 0, 0, 200]);
    out.insert("bad_empty".into(), vec![0, 0, 0, 0]);
    out.insert("bad_bool".into(), vec![2, 0, 0, 0, 33, 2]);
    let mut past_end = wire::encode(&Msg::Delete { key: "abc".into() }).expect("encodes");
    past_end[5] = 0xff;
    out.insert("bad_key_len".into(), past_end);
    out.insert("bad_utf8".into(), vec![6, 0, 0, 0, 15, 1, 0, 0, 0, 0xff]);
    let mut trailing = wire::encode(&Msg::Done).expect("encodes");
    trailing.push(0);
    trailing[0] += 1;
    out.insert("bad_trailing".into(), trailing);
    out.insert(
        "too_large".into(),
        ((MAX_FRAME_LEN + 1) as u32).to_le_bytes().to_vec(),
    );
    let mut truncated = out["get"].clone();
    truncated.pop();
    out.insert("truncated".into(), truncated);
    out
}

/// Whether algorithm `a` supports collective `k` (indices into `ALGORITHMS` and `KINDS`).
fn supports(k: usize, a: usize) -> bool {
    let case = sched::Case::from_input(&Input {
        kind: k as u8,
        world: Input::world_byte(2),
        count: 1,
        ..Input::default()
    });
    ALGORITHMS[a].supports(&case.reqs[0].coll)
}

fn schedule() -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut add = |name: String, inp: Input, want: Outcome| {
        let bytes = inp.encode();
        let got = sched::check(&bytes);
        // A valid case too large for the verifier is not worth a seed.
        if got == Outcome::BuiltOnly && want == Outcome::Verified {
            return;
        }
        assert_eq!(got, want, "seed {name}");
        out.insert(name, bytes);
    };
    for (k, &kind) in KINDS.iter().enumerate() {
        for (a, algo) in ALGORITHMS.iter().enumerate() {
            if !supports(k, a) {
                continue;
            }
            for n in [1usize, 2, 3, 5, 8, 16] {
                if kind == CollectiveKind::Send && n == 1 {
                    continue;
                }
                for (size, count, chunk) in [("small", 7, 3), ("large", 1000, 4096)] {
                    for in_place in [false, true] {
                        let wide = kind != CollectiveKind::AllReduce || algo.name() == "direct";
                        let count: usize = if size == "large" && wide && n > 3 {
                            60
                        } else {
                            count
                        };
                        let inp = Input {
                            kind: k as u8,
                            world: Input::world_byte(n),
                            count: Input::count_field(count),
                            root: (n / 2) as u8,
                            algo: a as u8,
                            flags: u8::from(in_place),
                            chunk,
                            channels: if size == "large" { 1 } else { 2 },
                            slots: if size == "large" { 1 } else { 3 },
                            seed: (n * 131 + k) as u64,
                            tail: (0..n * n).map(|i| ((i * 7 + 3) % 11) as u16).collect(),
                        };
                        let case = sched::Case::from_input(&inp);
                        if in_place && !case.reqs[0].in_place {
                            continue;
                        }
                        let place = if in_place { "-in_place" } else { "" };
                        let (kind, algo) = (label(kind), algo.name());
                        let name = format!("{kind}-{algo}-n{n}-{size}{place}");
                        add(name, inp, Outcome::Verified);
                    }
                }
            }
        }
    }
    // An algorithm that cannot run the collective, per collective.
    for (k, &kind) in KINDS.iter().enumerate() {
        let a = (0..ALGORITHMS.len()).find(|&a| !supports(k, a)).unwrap();
        let inp = Input {
            kind: k as u8,
            world: 2,
            count: 5,
            algo: a as u8,
            ..Input::default()
        };
        add(format!("bad-algo-{}", label(kind)), inp, Outcome::Refused);
    }
    // One per breakage, on a collective it applies to.
    for (b, kind) in [
        (10, CollectiveKind::AllReduce),
        (11, CollectiveKind::AllGather),
        (12, CollectiveKind::Broadcast),
        (12, CollectiveKind::Send),
        (13, CollectiveKind::AllToAllV),
        (14, CollectiveKind::ReduceScatter),
        (15, CollectiveKind::Barrier),
    ] {
        let k = KINDS.iter().position(|x| *x == kind).unwrap();
        let a = (0..ALGORITHMS.len()).find(|&a| supports(k, a)).unwrap();
        let inp = Input {
            kind: k as u8,
            world: 2,
            count: 9,
            algo: a as u8,
            flags: (b << 4) as u8,
            chunk: 4,
            ..Input::default()
        };
        let why = sched::BREAKAGES[b - 10].replace(' ', "_");
        add(format!("bad-{}-{why}", label(kind)), inp, Outcome::Refused);
    }
    out
}

/// `seal_stream`: every change (none, flip, drop, replay, swap, cut, overwrite) of a stream of
/// small, empty and record-spanning messages.
fn seal_stream() -> BTreeMap<String, Vec<u8>> {
    let names = ["none", "flip", "drop", "replay", "swap", "cut", "overwrite"];
    let mut out = BTreeMap::new();
    for (change, name) in names.iter().enumerate() {
        for (shape, lens) in [
            ("small", &[5u16, 0, 40][..]),
            ("spanning", &[40_000u16, 3][..]),
        ] {
            let mut input = vec![change as u8];
            input.extend_from_slice(&(7u32 + change as u32 * 13).to_le_bytes());
            for l in lens {
                input.extend_from_slice(&l.to_le_bytes());
            }
            out.insert(format!("{name}_{shape}"), input);
        }
    }
    out
}

fn main() {
    let check = std::env::args().any(|a| a == "--check");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus-seed");
    let mut stale = false;
    for (target, files) in [
        ("tcp_frame", tcp_frame()),
        ("bootstrap_wire", bootstrap_wire()),
        ("schedule", schedule()),
        ("seal_stream", seal_stream()),
    ] {
        let dir = root.join(target);
        if check {
            let on_disk: BTreeMap<String, Vec<u8>> = std::fs::read_dir(&dir)
                .map(|rd| {
                    rd.filter_map(Result::ok)
                        .map(|e| {
                            let name = e.file_name().to_string_lossy().into_owned();
                            (name, std::fs::read(e.path()).unwrap_or_default())
                        })
                        .collect()
                })
                .unwrap_or_default();
            if on_disk != files {
                eprintln!("{} is stale: rerun without --check", dir.display());
                stale = true;
            }
            continue;
        }
        if dir.exists() {
            std::fs::remove_dir_all(&dir).expect("remove the old seed corpus");
        }
        std::fs::create_dir_all(&dir).expect("create the seed corpus directory");
        let bytes: usize = files.values().map(Vec::len).sum();
        for (name, data) in &files {
            std::fs::write(dir.join(name), data).expect("write a seed");
        }
        println!("{}: {} files, {bytes} bytes", dir.display(), files.len());
    }
    if stale {
        std::process::exit(1);
    }
}
