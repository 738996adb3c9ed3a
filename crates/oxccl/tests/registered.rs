//! Registered buffers (`Communicator::register`, `Communicator::alloc`), by real processes on
//! shm and tcp: results against a reference every rank computes, what moved where
//! (`Communicator::stats`: receives into registered memory are written in place by the
//! sender where the link allows, and nothing is copied out of the slots for them), send and
//! receive, several calls on the same buffers, mixed registered and plain buffers across
//! ranks, and the registration's own errors.

mod common;

use oxccl::{Communicator, ReduceOp, Stats};
use serde_json::{Value, json};

use common::{error_kind, expect_results, run_ranks};

/// The tests of this file run one at a time: whether a receive is written in place depends on
/// its announcement reaching the sender before the data leaves, which a machine loaded with
/// the other tests' ranks can delay past the whole transfer.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The peer processes' entry point (a no-op unless `OXCCL_TEST_CHILD` is set).
#[test]
fn child_entry() {
    common::child_entry(dispatch);
}

fn dispatch(scenario: &str, args: &Value) -> Value {
    let comm = Communicator::from_env().unwrap_or_else(|e| panic!("init: {e}"));
    let r = match scenario {
        "all_reduce" => all_reduce(&comm, args),
        "send_recv" => send_recv(&comm, args),
        "errors" => errors(&comm),
        "late_write" => late_write(&comm, args),
        other => panic!("unknown scenario {other:?}"),
    };
    let v = match r {
        Ok(v) => v,
        Err(e) => json!({ "ok": false, "kind": error_kind(&e), "msg": e.to_string() }),
    };
    common::mark_done();
    common::linger();
    drop(comm);
    v
}

fn stats_json(s: Stats) -> Value {
    json!({
        "sent": s.sent, "placed": s.placed, "copied": s.copied, "reduced": s.reduced,
        "local": s.local, "received_in_place": s.received_in_place, "moved": s.moved(),
    })
}

fn delta(a: Stats, b: Stats) -> Stats {
    Stats {
        sent: b.sent - a.sent,
        placed: b.placed - a.placed,
        copied: b.copied - a.copied,
        reduced: b.reduced - a.reduced,
        local: b.local - a.local,
        received_in_place: b.received_in_place - a.received_in_place,
    }
}

/// Rank `r`'s element `i`: small integers, so that sums are exact in f32.
fn input(r: usize, i: usize) -> f32 {
    ((r * 7 + i * 13) % 101) as f32
}

/// The same all-reduce three ways: plain vectors, vectors the caller registered, memory
/// the communicator allocated (`args["mode"]`: which ranks register; "mixed" registers on
/// even ranks only). Each is run twice on the same buffers; returns the wrong elements and
/// what moved in the second run of each way.
fn all_reduce(comm: &Communicator, args: &Value) -> oxccl::Result<Value> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let count = args["count"].as_u64().unwrap() as usize;
    let mixed = args["mode"] == "mixed";
    let want: Vec<f32> = (0..count)
        .map(|i| (0..n).map(|r| input(r, i)).sum())
        .collect();
    let mine: Vec<f32> = (0..count).map(|i| input(rank, i)).collect();
    let mut out = serde_json::Map::new();
    let mut wrong = Vec::new();
    let check = |what: &str, got: &[f32], wrong: &mut Vec<String>| {
        if let Some(i) = (0..count).find(|&i| got[i] != want[i]) {
            wrong.push(format!("{what}: element {i} is {} not {}", got[i], want[i]));
        }
    };
    // Plain.
    let mut plain = vec![0f32; count];
    let mut moved = Stats::default();
    for _ in 0..2 {
        plain.iter_mut().for_each(|x| *x = -1.0);
        let before = comm.stats();
        comm.all_reduce(&mine, &mut plain, ReduceOp::Sum)?;
        moved = delta(before, comm.stats());
        check("plain", &plain, &mut wrong);
    }
    out.insert("plain".into(), stats_json(moved));
    // Registered vectors (on every rank, or on even ranks only).
    let register = !mixed || rank % 2 == 0;
    let src = if register {
        Some(comm.register(mine.clone())?)
    } else {
        None
    };
    let mut dst = if register {
        Some(comm.register(vec![0f32; count])?)
    } else {
        None
    };
    let mut plain_dst = vec![0f32; count];
    for _ in 0..2 {
        let before = comm.stats();
        let input: &[f32] = src.as_deref().unwrap_or(&mine);
        let output: &mut [f32] = dst.as_deref_mut().unwrap_or(&mut plain_dst);
        output.iter_mut().for_each(|x| *x = -1.0);
        comm.all_reduce(input, output, ReduceOp::Sum)?;
        moved = delta(before, comm.stats());
        check("registered", output, &mut wrong);
    }
    out.insert("registered".into(), stats_json(moved));
    let back = dst.map(|d| d.into_vec()).transpose()?;
    if back.is_some_and(|v| v.len() != count) {
        wrong.push("into_vec lost elements".into());
    }
    // Allocated memory, in place.
    let mut buf = if register {
        Some(comm.alloc::<f32>(count)?)
    } else {
        None
    };
    let mut plain_buf = vec![0f32; count];
    for _ in 0..2 {
        let b: &mut [f32] = buf.as_deref_mut().unwrap_or(&mut plain_buf);
        b.copy_from_slice(&mine);
        let before = comm.stats();
        comm.all_reduce_in_place(b, ReduceOp::Sum)?;
        moved = delta(before, comm.stats());
        check("allocated", b, &mut wrong);
    }
    out.insert("allocated".into(), stats_json(moved));
    drop((src, buf));
    // Deregistered: the same calls work on plain memory again.
    let mut again = vec![0f32; count];
    comm.all_reduce(&mine, &mut again, ReduceOp::Sum)?;
    check("after deregistration", &again, &mut wrong);
    out.insert("wrong".into(), json!(wrong));
    out.insert("ok".into(), json!(true));
    Ok(Value::Object(out))
}

/// Rank 0 sends rank 1 a registered (allocated) buffer three times; rank 1 receives into one
/// of its own.
fn send_recv(comm: &Communicator, args: &Value) -> oxccl::Result<Value> {
    let count = args["count"].as_u64().unwrap() as usize;
    let rank = comm.rank();
    let mut wrong = Vec::new();
    let before = comm.stats();
    if rank == 0 {
        let mut buf = comm.alloc::<u32>(count)?;
        for round in 0..3u32 {
            buf.iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = i as u32 ^ round);
            comm.send(&buf, 1)?;
        }
    } else if rank == 1 {
        let mut buf = comm.alloc::<u32>(count)?;
        for round in 0..3u32 {
            buf.fill(u32::MAX);
            comm.recv(&mut buf, 0)?;
            if let Some(i) = (0..count).find(|&i| buf[i] != i as u32 ^ round) {
                wrong.push(format!("round {round}: element {i}"));
            }
        }
    }
    let moved = delta(before, comm.stats());
    Ok(json!({ "ok": true, "wrong": wrong, "moved": stats_json(moved) }))
}

/// Rank 0 receives into a registered buffer (`args["memory"]`: a vector it registered, or
/// memory the communicator allocated) from rank 1, which an injected fault holds back 500 ms
/// before its first send; 150 ms in, rank 0 aborts. Its call returns the error, and then
/// nothing may change in its buffer (rank 1 wakes up and writes after the abort): the buffer
/// is compared with what it held when the error came, 1.5 s later.
fn late_write(comm: &Communicator, args: &Value) -> oxccl::Result<Value> {
    let count = args["count"].as_u64().unwrap() as usize;
    let rank = comm.rank();
    if rank == 1 {
        let mut buf = comm.alloc::<u32>(count)?;
        buf.iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = i as u32 | 1);
        let r = comm.send(&buf, 0);
        return Ok(json!({ "ok": true, "send": format!("{r:?}") }));
    }
    let mut reg;
    let mut alloc;
    let buf: &mut [u32] = if args["memory"] == "alloc" {
        alloc = comm.alloc::<u32>(count)?;
        &mut alloc
    } else {
        reg = comm.register(vec![0u32; count])?;
        &mut reg
    };
    buf.fill(0);
    let (err, at_error, changed) = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(150));
            comm.abort();
        });
        let err = comm.recv(buf, 1).err().map(|e| e.to_string());
        let at_error = buf.to_vec();
        std::thread::sleep(std::time::Duration::from_millis(1500));
        let changed = (0..count).filter(|&i| buf[i] != at_error[i]).count();
        (err, at_error, changed)
    });
    Ok(json!({
        "ok": true, "error": err, "changed": changed,
        "landed_before": at_error.iter().filter(|&&x| x != 0).count(),
    }))
}

/// The registration's errors: a buffer overlapping one registered already.
fn errors(comm: &Communicator) -> oxccl::Result<Value> {
    let mut v = vec![0u8; 1 << 20];
    let p = v.as_mut_ptr();
    // SAFETY: `v` outlives both registrations (dropped at the end of this function).
    let first = unsafe { comm.register_raw(p, 1 << 20) }?;
    // SAFETY: as above.
    let overlap = unsafe { comm.register_raw(p.wrapping_add(4096), 4096) };
    let msg = overlap
        .map(|_| String::new())
        .unwrap_or_else(|e| e.to_string());
    drop(first);
    // Free again once the first is gone.
    // SAFETY: as above.
    let again = unsafe { comm.register_raw(p.wrapping_add(4096), 4096) }.is_ok();
    comm.barrier()?;
    Ok(json!({ "ok": true, "overlap": msg, "again": again }))
}

fn get(v: &Value, way: &str, what: &str) -> u64 {
    v[way][what]
        .as_u64()
        .unwrap_or_else(|| panic!("{way}.{what} in {v}"))
}

fn run_all_reduce(provider: &str, mode: &str) {
    let _g = serial();
    // 16 MiB: the ring's all-gather receives are 8 MiB each (registered receives of at least
    // PLACE_MIN are announced).
    let count = 4 << 20;
    let out = run_ranks(
        2,
        &[("OXCCL_PROVIDER", provider)],
        "all_reduce",
        &json!({ "count": count, "mode": mode }),
    );
    let results = expect_results("registered buffers", &out);
    for (rank, v) in results.iter().enumerate() {
        assert_eq!(v["ok"], true, "rank {rank}: {v}");
        assert_eq!(v["wrong"], json!([]), "rank {rank} ({provider} {mode})");
        // Without registration nothing is placed.
        assert_eq!(get(v, "plain", "placed"), 0, "rank {rank}: {v}");
        let half = (count * 4 / 2) as u64;
        for way in ["registered", "allocated"] {
            let me = mode != "mixed" || rank % 2 == 0;
            // What a rank receives in place is what its peer placed: whether the receiver
            // registered its destination, and its link writes in place (shm: allocated
            // memory only, tcp: any).
            let writable = me && (provider == "tcp" || way == "allocated");
            let got = get(v, way, "received_in_place");
            // The all-gather half arrives once: in place, or (a fragment that left before
            // the receiver's announcement reached its sender) through a slot.
            assert_eq!(
                get(v, way, "copied") + got,
                get(v, "plain", "copied"),
                "rank {rank} {way}: {v}"
            );
            assert_eq!(get(v, "plain", "copied"), half, "rank {rank}: {v}");
            if writable {
                assert!(got > 0, "rank {rank} {way}: nothing in place: {v}");
                assert_eq!(
                    get(v, way, "moved") + got,
                    get(v, "plain", "moved"),
                    "rank {rank} {way}: what is written in place is not copied again: {v}"
                );
            } else {
                assert_eq!(got, 0, "rank {rank} {way}: {v}");
            }
        }
    }
    // Every byte one rank placed, the other received in place.
    for way in ["registered", "allocated"] {
        assert_eq!(
            get(&results[0], way, "placed"),
            get(&results[1], way, "received_in_place"),
            "{way}"
        );
    }
}

#[test]
fn all_reduce_on_registered_buffers_shm() {
    run_all_reduce("shm", "all");
}

#[test]
fn all_reduce_on_registered_buffers_tcp() {
    run_all_reduce("tcp", "all");
}

/// One rank registers, the other does not: the protocol agrees anyway (a sender places only
/// what its receiver announced).
#[test]
fn all_reduce_with_one_rank_registered_tcp() {
    run_all_reduce("tcp", "mixed");
}

fn run_send_recv(provider: &str) {
    let _g = serial();
    let count = 4 << 20;
    let out = run_ranks(
        2,
        &[("OXCCL_PROVIDER", provider)],
        "send_recv",
        &json!({ "count": count }),
    );
    let results = expect_results("registered buffers", &out);
    assert_eq!(results[1]["wrong"], json!([]), "{}", results[1]);
    let bytes = 3 * 4 * count as u64;
    let (r0, r1) = (&results[0]["moved"], &results[1]["moved"]);
    let in_place = r1["received_in_place"].as_u64().unwrap();
    // Every byte arrived once, in place or through a slot. A send is eager: the fragments that
    // fit the receiver's free slots can leave before its announcement reaches the sender, so
    // each receive may take up to a window of them through slots (8 slots of 128 KiB on shm,
    // 4 of 1 MiB on tcp), and the rest in place.
    assert_eq!(in_place + r1["copied"].as_u64().unwrap(), bytes, "{r1}");
    assert!(in_place >= bytes - 3 * (4 << 20), "{r1}");
    assert_eq!(r0["placed"].as_u64().unwrap(), in_place, "{r0}");
    assert_eq!(
        r0["placed"].as_u64().unwrap() + r0["sent"].as_u64().unwrap(),
        bytes,
        "{r0}"
    );
}

#[test]
fn send_recv_in_place_shm() {
    run_send_recv("shm");
}

#[test]
fn send_recv_in_place_tcp() {
    run_send_recv("tcp");
}

fn run_late_write(provider: &str, memory: &str) {
    let _g = serial();
    let outs = run_ranks(
        2,
        &[
            ("OXCCL_PROVIDER", provider),
            ("OXCCL_FAULT", "delay:rank=1,peer=0,ms=500"),
        ],
        "late_write",
        &json!({ "count": 4 << 20, "memory": memory }),
    );
    let res = &expect_results("late_write", &outs)[0];
    let err = res["error"].as_str().unwrap_or("");
    assert!(err.contains("aborted"), "{provider}/{memory}: {res}");
    assert_eq!(
        res["changed"], 0,
        "{provider}/{memory}: the peer wrote into the buffer after the call's error: {res}"
    );
    eprintln!("{provider}/{memory}: {res}; rank 1: {}", outs[1].result());
}

/// No write lands in a registered receive buffer after its call returned an error (the peer,
/// held back, writes afterwards: refused, since the failed communicator revoked its
/// registrations).
#[test]
fn no_write_lands_after_the_error_shm() {
    run_late_write("shm", "register");
    run_late_write("shm", "alloc");
}

#[test]
fn no_write_lands_after_the_error_tcp() {
    run_late_write("tcp", "register");
    run_late_write("tcp", "alloc");
}

#[test]
fn overlapping_registrations_are_refused() {
    let _g = serial();
    let out = run_ranks(2, &[], "errors", &json!({}));
    for v in expect_results("overlapping registrations", &out) {
        let msg = v["overlap"].as_str().unwrap();
        assert!(
            msg.contains("overlap") && msg.contains("register") && msg.contains("rank"),
            "{msg}"
        );
        assert_eq!(v["again"], true);
    }
}
