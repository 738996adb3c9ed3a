//! The compact forms' unit tests: shared shapes, bad schedules, big steps.

use super::*;
use oxccl_core::schedule::{Op, Step};

fn send(peer: usize, len: usize, deps: &[u32]) -> Step {
    Step {
        op: Op::Send {
            peer,
            channel: 0,
            src: Region::new(Buf::Input, 0, len),
        },
        deps: deps.to_vec(),
    }
}

fn recv(peer: usize, len: usize, deps: &[u32]) -> Step {
    Step {
        op: Op::Recv {
            peer,
            channel: 0,
            dst: Region::new(Buf::Output, 0, len),
            reduce_with: Some(Region::new(Buf::Input, 0, len)),
        },
        deps: deps.to_vec(),
    }
}

fn sched(rank: usize, steps: Vec<Step>) -> Schedule {
    Schedule {
        rank,
        steps,
        scratch: 0,
    }
}

fn part(rank: usize, steps: Vec<Step>, shapes: &Shapes) -> Part {
    let spec = Spec::new(Collective::AllReduce { count: 1 }, 4);
    Part::new(rank, sched(rank, steps), &spec, 4, false, false, shapes).unwrap()
}

/// Ranks whose schedules differ only in their peers share one shape; their queues keep
/// their own peers, and their dependency counts are their own.
#[test]
fn schedules_that_differ_in_peers_share_a_shape() {
    let shapes = Shapes::default();
    let ring = |r: usize| {
        let (next, prev) = ((r + 1) % 4, (r + 3) % 4);
        vec![
            send(next, 10, &[]),
            recv(prev, 10, &[]),
            send(next, 10, &[1]),
            recv(prev, 10, &[0, 1]),
        ]
    };
    let mut a = part(0, ring(0), &shapes);
    let b = part(1, ring(1), &shapes);
    assert!(std::sync::Arc::ptr_eq(&a.shape, &b.shape));
    assert_eq!((a.sendq[0].peer, b.sendq[0].peer), (1, 2));
    assert_eq!((a.recvq[0].peer, b.recvq[0].peer), (3, 0));
    let sh = &a.shape;
    assert_eq!(sh.send_first, vec![(0, 2)]);
    assert_eq!(sh.recv_first, vec![(1, 2)]);
    assert_eq!(sh.queue_steps(0).collect::<Vec<_>>(), vec![0, 2]);
    assert_eq!(sh.queue_steps(1).collect::<Vec<_>>(), vec![1, 3]);
    // Step 1's dependents are steps 2 and 3, step 0's step 3.
    let dependents = |s: usize| &sh.dep_list[sh.dep_at[s] as usize..sh.dep_at[s + 1] as usize];
    assert_eq!((dependents(0), dependents(1)), (&[3][..], &[2, 3][..]));
    assert_eq!(a.ndeps, vec![0, 0, 1, 2]);
    assert!(!dep_done(&mut a.ndeps, &mut a.many, 3));
    assert!(dep_done(&mut a.ndeps, &mut a.many, 3));
    assert_eq!((a.ndeps[3], b.ndeps[3]), (0, 2));
    // Another size, another dependency, another order of the queues: other shapes.
    let mut other = ring(2);
    other[2] = send(3, 11, &[1]);
    let c = part(2, other, &shapes);
    let mut other = ring(2);
    other[3].deps = vec![1];
    let d = part(2, other, &shapes);
    let mut other = ring(3);
    other.swap(0, 1);
    let e = part(3, other, &shapes);
    for x in [&c, &d, &e] {
        assert!(!std::sync::Arc::ptr_eq(&a.shape, &x.shape));
    }
    assert_eq!(shapes.0.lock().unwrap().len(), 4);
}

/// A schedule that fails a check fails it the same way whether or not a shape it
/// nearly has was kept before.
#[test]
fn a_bad_schedule_fails_alike_with_or_without_shapes() {
    let spec = Spec::new(Collective::AllReduce { count: 1 }, 4);
    let ok = vec![send(1, 10, &[]), recv(3, 10, &[]), send(1, 10, &[1])];
    let bad_peer = vec![send(1, 10, &[]), recv(3, 10, &[]), send(0, 10, &[1])];
    let bad_dep = vec![send(1, 10, &[]), recv(3, 10, &[2]), send(1, 10, &[1])];
    for bad in [bad_peer, bad_dep] {
        let kept = Shapes::default();
        part(0, ok.clone(), &kept);
        let with = Part::new(0, sched(0, bad.clone()), &spec, 4, false, false, &kept);
        let without = Part::new(0, sched(0, bad), &spec, 4, false, false, &Shapes::default());
        let (with, without) = (with.err().unwrap(), without.err().unwrap());
        assert_eq!(with, without);
    }
}

/// Steps of `u32::MAX` elements or more, and steps waiting for `u8::MAX` dependencies or
/// more, are counted aside, and counted down exactly.
#[test]
fn big_steps_and_many_dependencies_are_kept_aside() {
    let shapes = Shapes::default();
    let big = 5_000_000_000usize;
    let mut steps = vec![send(1, big, &[])];
    let n = 300u32;
    for _ in 0..n {
        steps.push(send(1, 7, &[]));
    }
    let all: Vec<u32> = (1..=n).collect();
    steps.push(Step {
        op: Op::Copy {
            src: Region::new(Buf::Input, 0, 5),
            dst: Region::new(Buf::Output, 0, 5),
        },
        deps: all,
    });
    let mut p = part(0, steps, &shapes);
    let last = n as usize + 1;
    assert_eq!(p.shape.elems(0), big as u64);
    assert_eq!(p.shape.bytes(0, 4), big * 4);
    assert_eq!(p.shape.elems(1), 7);
    assert_eq!(p.shape.elems(last), 5);
    assert_eq!(p.ndeps[last], u8::MAX);
    for k in 0..n {
        let all_done = dep_done(&mut p.ndeps, &mut p.many, last);
        assert_eq!(all_done, k + 1 == n, "after {}", k + 1);
    }
    assert!(p.many.is_empty());
    assert_eq!(p.shape.send_first, vec![(0, n + 1)]);
    assert_eq!(p.shape.queue_steps(0).count(), n as usize + 1);
}

/// Counts whose buffers would overflow while the core sizes them are refused first, with
/// the collective, the counts and the limit named (they panicked with an overflow in the
/// tuner or in `Config::fragment` before).
#[test]
fn counts_too_large_to_size_are_an_error() {
    let f = Fabric::parse("[[hosts]]\nname = \"a\"\nranks = 4\n").unwrap();
    let cases = [
        (Collective::AllReduce { count: usize::MAX }, 4, "all_reduce"),
        (Collective::AllGather { count: 1 << 62 }, 1, "all_gather"),
        (
            Collective::AllToAllV {
                send_counts: vec![usize::MAX; 4],
                recv_counts: vec![1; 4],
            },
            4,
            "all_to_allv",
        ),
        (
            Collective::Broadcast { count: 1, root: 0 },
            usize::MAX,
            "broadcast",
        ),
    ];
    for (coll, elem, name) in cases {
        let spec = Spec::new(coll, elem);
        let e = simulate(&f, &spec).unwrap_err();
        assert!(
            e.contains(name) && e.contains("4 ranks") && e.contains(&MAX_BUFFER_BYTES.to_string()),
            "{e}"
        );
    }
    // At the limit: sized, and simulated (a broadcast of 1 PiB in one fragment).
    let spec = Spec {
        chunk_bytes: Some(1 << 50),
        ..Spec::new(
            Collective::Broadcast {
                count: 1 << 48,
                root: 0,
            },
            4,
        )
    };
    assert!(simulate(&f, &spec).unwrap().time_s > 0.0);
}
