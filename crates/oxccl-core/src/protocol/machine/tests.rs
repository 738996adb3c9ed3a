//! The protocol machine's unit tests: pairs of machines run by hand in every event order
//! (and random ones); slots, credits, fragments, mailboxes, dependencies, a group's shared queue.

use super::*;
use crate::schedule::{Buf, Region, Step};

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
            reduce_with: None,
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

/// Link 0 leads to the other of two ranks.
fn links(rank: usize) -> Vec<usize> {
    if rank == 0 {
        vec![usize::MAX, 0]
    } else {
        vec![0, usize::MAX]
    }
}

fn cfg(slots: usize, frag: usize, inline_max: usize) -> Config {
    let mut c = Config::new(1, slots, frag, 1);
    c.inline_max = inline_max;
    c
}

/// One rank's side in a two-rank run: its machine's queue state and what is on the wire
/// towards the other.
struct Side {
    flows: Flows,
    /// Fragments posted and not yet arrived: (slot, off, len, total).
    wire: VecDeque<(u32, usize, usize, usize)>,
    /// Credits posted and not yet arrived.
    credits: VecDeque<u64>,
    /// Signaled fragments posted and not completed: their step.
    completing: VecDeque<usize>,
    /// What the peer's slots hold: slot -> (off, len, total), until consumed.
    landed: Vec<Option<(usize, usize, usize)>>,
}

impl Side {
    fn new(slots: usize) -> Side {
        Side {
            flows: Flows::new(1, 1),
            wire: VecDeque::new(),
            credits: VecDeque::new(),
            completing: VecDeque::new(),
            landed: vec![None; slots],
        }
    }
}

/// Runs two ranks' schedules to the end, choosing among every enabled action and every
/// delivery by `choose(n)`, and checks the protocol's invariants on the way: a fragment
/// never lands in a slot whose previous fragment is not consumed, the receiver consumes
/// exactly the fragment it expects, and both calls finish. Returns the actions taken.
fn run_pair(
    s0: &Schedule,
    s1: &Schedule,
    c: Config,
    mut choose: impl FnMut(usize) -> usize,
) -> Result<usize, String> {
    let l0 = links(0);
    let l1 = links(1);
    let q0 = Queues::new(s0, &l0, 1)?;
    let q1 = Queues::new(s1, &l1, 1)?;
    let mut m = [
        Machine::new(s0, &q0, c, 1, false, Reuse::default()),
        Machine::new(s1, &q1, c, 1, false, Reuse::default()),
    ];
    let mut side = [Side::new(c.slots), Side::new(c.slots)];
    let mut taken = 0;
    let mut acts = Vec::new();
    loop {
        // Every choice: (rank, Some(action)) or a delivery (rank, None, kind).
        let mut choices: Vec<(usize, Option<Action>, u8)> = Vec::new();
        for r in 0..2 {
            m[r].enabled(&side[r].flows, &mut acts);
            choices.extend(acts.iter().map(|a| (r, Some(*a), 0)));
            if !side[r].wire.is_empty() {
                choices.push((r, None, 1));
            }
            if !side[r].credits.is_empty() {
                choices.push((r, None, 2));
            }
            if !side[r].completing.is_empty() {
                choices.push((r, None, 3));
            }
        }
        if choices.is_empty() {
            break;
        }
        let (r, a, kind) = choices.swap_remove(choose(choices.len()));
        let o = 1 - r;
        taken += 1;
        match (a, kind) {
            (Some(a), _) => {
                m[r].commit(&mut side[r].flows, &a);
                match a {
                    Action::Post {
                        step,
                        slot,
                        off,
                        len,
                        total,
                        signaled,
                        ..
                    } => {
                        let dest = &mut side[r].landed[slot as usize];
                        if dest.is_some() {
                            return Err(format!("rank {r} overwrote slot {slot}"));
                        }
                        *dest = Some((off, len, total));
                        side[r].wire.push_back((slot, off, len, total));
                        if signaled {
                            side[r].completing.push_back(step);
                        }
                    }
                    Action::Recv {
                        slot,
                        off,
                        len,
                        total,
                        ..
                    } => {
                        let got = side[o].landed[slot as usize].take();
                        if got != Some((off, len, total)) {
                            return Err(format!(
                                "rank {r} expected {:?} in slot {slot}, found {got:?}",
                                (off, len, total)
                            ));
                        }
                    }
                    Action::Credit { q, consumed } => {
                        side[r].flows.credit_sent(q, consumed);
                        side[r].credits.push_back(consumed);
                    }
                    Action::Local { .. } | Action::MailboxSend { .. } => {}
                }
            }
            (None, 1) => {
                let (slot, ..) = side[r].wire.pop_front().unwrap();
                side[o].flows.arrived(0, slot);
            }
            (None, 2) => {
                let v = side[r].credits.pop_front().unwrap();
                side[o].flows.credit(0, v);
            }
            (None, _) => {
                let s = side[r].completing.pop_front().unwrap();
                m[r].completed(s, true);
            }
        }
    }
    for (r, mach) in m.iter().enumerate() {
        if !mach.is_done() {
            return Err(format!(
                "rank {r} stuck: {:?}",
                mach.waiting(&side[r].flows)
            ));
        }
    }
    Ok(taken)
}

/// Every order of events (actions of both ranks, arrivals, credits, completions) of a
/// small exchange, explored exhaustively by depth-first search over the choices: the
/// orders the verifier samples at random.
#[test]
fn every_event_order_of_a_small_exchange_finishes_correctly() {
    // Rank 0 sends 3 fragments (2 with two slots) then receives 1; rank 1 receives then
    // sends (a credit every fragment either way).
    for (slots, inline_max, len) in [(1, 0, 5), (1, 1, 5), (2, 0, 3), (2, 2, 3)] {
        let s0 = sched(0, vec![send(1, len, &[]), recv(1, 2, &[0])]);
        let s1 = sched(1, vec![recv(0, len, &[]), send(0, 2, &[0])]);
        let c = cfg(slots, 2, inline_max);
        // Depth-first over choice sequences: `path` holds (choice, alternatives) per level.
        let mut path: Vec<(usize, usize)> = Vec::new();
        let mut runs = 0;
        loop {
            let mut depth = 0;
            let mut trail = Vec::new();
            run_pair(&s0, &s1, c, |n| {
                let pick = if depth < path.len() { path[depth].0 } else { 0 };
                trail.push((pick, n));
                depth += 1;
                pick
            })
            .unwrap_or_else(|e| panic!("inline_max {inline_max}, order {trail:?}: {e}"));
            runs += 1;
            path = trail;
            while let Some((pick, n)) = path.pop() {
                if pick + 1 < n {
                    path.push((pick + 1, n));
                    break;
                }
            }
            if path.is_empty() {
                break;
            }
            assert!(runs < 3_000_000, "too many orders to explore");
        }
        eprintln!("slots {slots} inline_max {inline_max}: {runs} orders");
        assert!(runs > 100, "only {runs} orders explored");
    }
}

/// The receives ahead on a queue name the numbers the sender gives their fragments, and
/// whether their dependencies are done.
#[test]
fn receives_ahead_name_their_first_fragments() {
    // Rank 1 receives 5 bytes (3 fragments of 2), then 3 more (2 fragments) after a local
    // step that depends on the first receive, then 2 (1 fragment) with no dependency.
    let copy = Step {
        op: Op::Copy {
            src: Region::new(Buf::Output, 0, 1),
            dst: Region::new(Buf::Scratch, 0, 1),
        },
        deps: vec![0],
    };
    let s1 = sched(
        1,
        vec![recv(0, 5, &[]), copy, recv(0, 3, &[1]), recv(0, 2, &[])],
    );
    let q1 = Queues::new(&s1, &links(1), 1).unwrap();
    let c = cfg(8, 2, 0);
    let mut flows = Flows::new(1, 1);
    // Fragments of an earlier call were consumed on this queue already.
    for slot in 0..4 {
        flows.arrived(0, slot);
        flows.consume(0);
    }
    let mut m = Machine::new(&s1, &q1, c, 1, false, Reuse::default());
    assert_eq!(m.receive_queues(), &[0]);
    let ahead = |m: &Machine<'_>, flows: &Flows| m.receives_ahead(flows, 0).collect::<Vec<_>>();
    assert_eq!(
        ahead(&m, &flows),
        vec![(0, 0, 4, true), (1, 2, 7, false), (2, 3, 9, true)]
    );
    // The sender's numbering: its posts on the queue so far.
    let mut sender = Flows::new(1, 1);
    for _ in 0..4 {
        sender.post(0, 8);
    }
    assert_eq!(
        sender.get(0).posted,
        4,
        "the first fragment of the receive is number 4"
    );
    // Midway through the first receive, the numbers stay.
    flows.arrived(0, 4);
    let a = m.next(&mut flows).unwrap();
    assert!(matches!(a, Action::Recv { step: 0, .. }));
    assert_eq!(ahead(&m, &flows)[1..], [(1, 2, 7, false), (2, 3, 9, true)]);
    for slot in 5..7 {
        flows.arrived(0, slot);
    }
    while m.next(&mut flows).is_some() {}
    assert!(m.step(0).done && m.step(1).done);
    assert_eq!(ahead(&m, &flows), vec![(1, 2, 7, true), (2, 3, 9, true)]);
    // Another call's turn, or mailbox mode: nothing.
    flows.q[0].recv_turn = 1;
    assert!(ahead(&m, &flows).is_empty());
    flows.q[0].recv_turn = 0;
    let mb = Machine::new(&s1, &q1, c, 1, true, Reuse::default());
    assert!(ahead(&mb, &flows).is_empty());
}

#[test]
fn random_orders_of_longer_exchanges_finish_correctly() {
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut rnd = move |n: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % n as u64) as usize
    };
    for slots in 1..=5 {
        for len in [0, 1, 7, 64, 100] {
            let s0 = sched(
                0,
                vec![send(1, len, &[]), recv(1, len, &[]), send(1, 3, &[1])],
            );
            let s1 = sched(
                1,
                vec![send(0, len, &[]), recv(0, len, &[]), recv(0, 3, &[])],
            );
            for _ in 0..20 {
                run_pair(&s0, &s1, cfg(slots, 4, 2), &mut rnd)
                    .unwrap_or_else(|e| panic!("slots {slots} len {len}: {e}"));
            }
        }
    }
}

/// `Flows::post` and `Flows::consume` keep the counters as the machine's own posts and
/// receives do: the same slots, the same window, the same credits due.
#[test]
fn posting_and_consuming_by_hand_match_the_machine() {
    let c = Config::new(1, 4, 10, 1);
    let s0 = sched(0, vec![send(1, 60, &[])]);
    let l0 = links(0);
    let q0 = Queues::new(&s0, &l0, 1).unwrap();
    let mut by_machine = Flows::new(1, 1);
    let mut m = Machine::new(&s0, &q0, c, 1, false, Reuse::default());
    let mut slots = Vec::new();
    while let Some(a) = m.next(&mut by_machine) {
        if let Action::Post { slot, .. } = a {
            slots.push(slot);
        }
    }
    let mut by_hand = Flows::new(1, 1);
    let mut hand = Vec::new();
    while by_hand.get(0).free(c.slots) > 0 {
        hand.push(by_hand.post(0, c.slots));
    }
    assert_eq!(hand, slots);
    assert_eq!(hand, [0, 1, 2, 3]);
    assert_eq!(by_hand.get(0).posted, by_machine.get(0).posted);
    // The receiver's side: nothing to consume, then the arrivals in order.
    let mut rx = Flows::new(1, 1);
    assert_eq!(rx.consume(0), None);
    assert_eq!(rx.get(0).consumed, 0);
    for slot in [0, 1, 2] {
        rx.arrived(0, slot);
    }
    assert_eq!(rx.consume(0), Some(0));
    assert!(!rx.credit_due(0, c.credit_every));
    assert_eq!(rx.consume(0), Some(1));
    assert!(rx.credit_due(0, c.credit_every), "every slots / 2 = 2");
    rx.credit_sent(0, 2);
    assert_eq!(rx.consume(0), Some(2));
    assert!(!rx.credit_due(0, c.credit_every));
    assert_eq!(rx.get(0).consumed, 3);
    // The credit frees the sender's slots.
    by_hand.credit(0, 2);
    assert_eq!(by_hand.get(0).free(c.slots), 2);
    assert_eq!(by_hand.post(0, c.slots), 0);
}

#[test]
fn fragments_and_credits_follow_the_configuration() {
    let c = Config::new(1, 8, 10, 4);
    assert_eq!((c.frag_bytes, c.credit_every), (8, 4));
    assert_eq!(c.fragments(0), 1);
    assert_eq!(c.fragment(0, 0), (0, 0));
    assert_eq!(c.fragments(17), 3);
    assert_eq!(c.fragment(17, 2), (16, 1));
    assert_eq!(
        Config::new(1, 1, 3, 4).frag_bytes,
        4,
        "one element at least"
    );
    assert_eq!(Config::new(1, 1, 3, 4).credit_every, 1);
}

/// The executor's pass, driven against a receiver that never returns credits: the sender
/// posts exactly `slots` fragments and then says it waits for a slot.
#[test]
fn a_sender_stops_at_the_receivers_slots_and_says_so() {
    let s0 = sched(0, vec![send(1, 100, &[])]);
    let l0 = links(0);
    let q0 = Queues::new(&s0, &l0, 1).unwrap();
    let mut flows = Flows::new(1, 1);
    let mut m = Machine::new(&s0, &q0, cfg(3, 10, 0), 1, false, Reuse::default());
    let mut posts = Vec::new();
    let progress = m
        .pass(&mut flows, |_, a| {
            posts.push(*a);
            Ok::<_, ()>(true)
        })
        .unwrap();
    assert!(progress);
    assert_eq!(posts.len(), 3);
    assert!(matches!(
        posts[2],
        Action::Post {
            slot: 2,
            off: 20,
            len: 10,
            ..
        }
    ));
    assert!(!m.pass(&mut flows, |_, _| Ok::<_, ()>(true)).unwrap());
    assert_eq!(
        m.waiting(&flows),
        Some(Waiting::Slot {
            step: 0,
            q: 0,
            posted: 3,
            credit: 0
        })
    );
    // A late, smaller credit value changes nothing; a larger one frees slots.
    flows.credit(0, 2);
    flows.credit(0, 1);
    assert_eq!(flows.get(0).credit, 2);
    let mut n = 0;
    m.pass(&mut flows, |_, a| {
        assert!(matches!(a, Action::Post { slot, .. } if *slot == (3 + n) % 3));
        n += 1;
        Ok::<_, ()>(true)
    })
    .unwrap();
    assert_eq!(n, 2);
}

#[test]
fn a_send_is_done_only_once_its_signaled_fragments_completed() {
    let s0 = sched(0, vec![send(1, 30, &[])]);
    let l0 = links(0);
    let q0 = Queues::new(&s0, &l0, 1).unwrap();
    let mut flows = Flows::new(1, 1);
    let mut m = Machine::new(&s0, &q0, cfg(8, 10, 0), 1, false, Reuse::default());
    m.pass(&mut flows, |_, _| Ok::<_, ()>(true)).unwrap();
    assert!(!m.is_done());
    assert_eq!(
        m.waiting(&flows),
        Some(Waiting::Transport { step: 0, q: 0 })
    );
    m.completed(0, true);
    m.completed(0, true);
    assert!(!m.is_done());
    m.completed(0, true);
    assert!(m.is_done());
    // A completion that comes after the step is done is ignored.
    m.completed(0, true);
    assert!(m.is_done());
    // A failed completion keeps the step from being done.
    let mut flows = Flows::new(1, 1);
    let mut m = Machine::new(&s0, &q0, cfg(8, 10, 0), 1, false, m.into_reuse());
    m.pass(&mut flows, |_, _| Ok::<_, ()>(true)).unwrap();
    m.completed(0, false);
    m.completed(0, true);
    m.completed(0, true);
    assert!(!m.is_done());
    assert!(m.step(0).failed);
    // Inline fragments are done as they are posted.
    let mut flows = Flows::new(1, 1);
    let mut m = Machine::new(&s0, &q0, cfg(8, 10, 10), 1, false, m.into_reuse());
    m.pass(&mut flows, |_, a| {
        assert!(matches!(
            a,
            Action::Post {
                signaled: false,
                ..
            }
        ));
        Ok::<_, ()>(true)
    })
    .unwrap();
    assert!(m.is_done() && !m.outstanding());
}

/// Fragments of the next call that arrive before it starts stay queued for it, and the
/// slot counters carry on across calls.
#[test]
fn early_fragments_wait_for_the_next_call() {
    let s1 = sched(1, vec![recv(0, 5, &[])]);
    let l1 = links(1);
    let q1 = Queues::new(&s1, &l1, 1).unwrap();
    let mut flows = Flows::new(1, 1);
    for slot in [0, 1, 2, 0] {
        flows.arrived(0, slot);
    }
    let mut reuse = Reuse::default();
    let mut slots = Vec::new();
    for _ in 0..2 {
        let mut m = Machine::new(&s1, &q1, cfg(3, 3, 0), 1, false, reuse);
        m.pass(&mut flows, |_, a| {
            if let Action::Recv { slot, .. } = a {
                slots.push(*slot);
            }
            Ok::<_, ()>(true)
        })
        .unwrap();
        assert!(m.is_done());
        reuse = m.into_reuse();
    }
    assert_eq!(slots, [0, 1, 2, 0]);
    assert_eq!(flows.get(0).consumed, 4);
}

#[test]
fn steps_wait_for_their_dependencies() {
    let mut steps = vec![
        Step {
            op: Op::Copy {
                src: Region::new(Buf::Input, 0, 4),
                dst: Region::new(Buf::Output, 0, 4),
            },
            deps: vec![],
        },
        recv(1, 4, &[0]),
    ];
    steps.push(send(1, 4, &[1]));
    let s0 = sched(0, steps);
    let l0 = links(0);
    let q0 = Queues::new(&s0, &l0, 1).unwrap();
    let mut flows = Flows::new(1, 1);
    flows.arrived(0, 0);
    let mut m = Machine::new(&s0, &q0, cfg(4, 8, 0), 1, false, Reuse::default());
    let mut acts = Vec::new();
    m.enabled(&flows, &mut acts);
    assert_eq!(
        acts,
        [Action::Local { step: 0 }],
        "the receive waits for the copy"
    );
    m.commit(&mut flows, &acts[0]);
    m.enabled(&flows, &mut acts);
    assert!(matches!(acts[..], [Action::Recv { step: 1, .. }]));
    m.commit(&mut flows, &acts[0].clone());
    m.enabled(&flows, &mut acts);
    assert!(matches!(acts[..], [Action::Post { step: 2, .. }]));
    assert_eq!(m.steps_done(), 2);
}

#[test]
fn credits_go_back_every_half_of_the_slots() {
    let s1 = sched(1, vec![recv(0, 8, &[])]);
    let l1 = links(1);
    let q1 = Queues::new(&s1, &l1, 1).unwrap();
    let mut flows = Flows::new(1, 1);
    let mut m = Machine::new(
        &s1,
        &q1,
        Config::new(1, 4, 1, 1),
        1,
        false,
        Reuse::default(),
    );
    let mut credits = Vec::new();
    for slot in 0..8u32 {
        flows.arrived(0, slot % 4);
        m.pass(&mut flows, |f, a| {
            if let Action::Credit { q, consumed } = *a {
                f.credit_sent(q, consumed);
                credits.push(consumed);
            }
            Ok::<_, ()>(true)
        })
        .unwrap();
    }
    assert_eq!(credits, [2, 4, 6, 8]);
    assert!(m.is_done());
}

#[test]
fn mailbox_mode_runs_steps_as_their_messages_arrive() {
    let s0 = sched(0, vec![send(1, 4, &[]), recv(1, 4, &[])]);
    let l0 = links(0);
    let q0 = Queues::new(&s0, &l0, 1).unwrap();
    assert!(mailbox_eligible(&s0, 2, 4, 64, |p| p == 1));
    assert!(!mailbox_eligible(&s0, 2, 4, 8, |p| p == 1), "too large");
    assert!(!mailbox_eligible(&s0, 2, 4, 64, |_| false), "no mailboxes");
    let twice = sched(0, vec![send(1, 4, &[]), send(1, 4, &[]), recv(1, 4, &[])]);
    assert!(
        !mailbox_eligible(&twice, 2, 4, 64, |_| true),
        "two messages"
    );
    let mut flows = Flows::new(1, 1);
    let mut m = Machine::new(&s0, &q0, cfg(2, 8, 0), 4, true, Reuse::default());
    let mut seen = Vec::new();
    let arrived = std::cell::Cell::new(false);
    for _ in 0..2 {
        m.pass(&mut flows, |_, a| {
            seen.push(*a);
            Ok::<_, ()>(!matches!(a, Action::Recv { .. }) || arrived.get())
        })
        .unwrap();
        arrived.set(true);
    }
    assert!(m.is_done());
    // Done with its peer: a failed link to it does not concern this call any more.
    assert!(!m.receiving_on(0) && !m.sending_on(0));
    assert_eq!(m.needs_link(0), (false, false));
    assert_eq!(
        seen,
        [
            Action::MailboxSend {
                step: 0,
                q: 0,
                total: 16
            },
            Action::Recv {
                step: 1,
                q: 0,
                slot: 0,
                off: 0,
                len: 16,
                total: 16,
                mailbox: true
            },
            Action::Recv {
                step: 1,
                q: 0,
                slot: 0,
                off: 0,
                len: 16,
                total: 16,
                mailbox: true
            },
        ]
    );
}

/// Two calls of a group on one queue: each takes the fragments of its own transfer, in
/// the order of the calls, whichever is driven first; and a later call posts only once
/// the earlier one has posted everything.
#[test]
fn calls_of_a_group_take_their_turns_on_a_shared_queue() {
    let a = sched(1, vec![recv(0, 8, &[]), send(0, 4, &[])]);
    let b = sched(1, vec![recv(0, 4, &[]), send(0, 4, &[])]);
    let l1 = links(1);
    let (qa, qb) = (
        Queues::new(&a, &l1, 1).unwrap(),
        Queues::new(&b, &l1, 1).unwrap(),
    );
    let c = cfg(8, 4, 0);
    let mut calls = [
        Machine::new(&a, &qa, c, 1, false, Reuse::default()).with_id(0),
        Machine::new(&b, &qb, c, 1, false, Reuse::default()).with_id(1),
    ];
    let mut flows = Flows::new(1, 1);
    flows.pass_turns(&calls);
    // Call 0 has two fragments to receive, call 1 one; all three have arrived.
    for slot in 0..3 {
        flows.arrived(0, slot);
    }
    let mut log = Vec::new();
    for _ in 0..3 {
        for (i, m) in calls.iter_mut().enumerate().rev() {
            while let Some(a) = m.next(&mut flows) {
                log.push((i, a));
            }
        }
        flows.pass_turns(&calls);
    }
    let got: Vec<(usize, u32)> = log
        .iter()
        .filter_map(|(i, a)| match a {
            Action::Recv { slot, .. } => Some((*i, *slot)),
            _ => None,
        })
        .collect();
    assert_eq!(got, [(0, 0), (0, 1), (1, 2)]);
    let posts: Vec<(usize, u32)> = log
        .iter()
        .filter_map(|(i, a)| match a {
            Action::Post { slot, .. } => Some((*i, *slot)),
            _ => None,
        })
        .collect();
    assert_eq!(posts, [(0, 0), (1, 1)], "call 1 posts after call 0");
    assert!(calls[1].step(0).done && calls[0].step(0).done);
}

#[test]
fn queues_refuse_bad_schedules() {
    let bad_peer = sched(0, vec![send(0, 4, &[])]);
    assert!(
        Queues::new(&bad_peer, &links(0), 1)
            .unwrap_err()
            .contains("peer 0")
    );
    let forward = sched(0, vec![send(1, 4, &[1]), recv(1, 4, &[])]);
    assert!(
        Queues::new(&forward, &links(0), 1)
            .unwrap_err()
            .contains("depends on step 1")
    );
}

#[test]
fn mailbox_calls_are_those_every_end_can_read_off_its_schedule() {
    use crate::schedule::{Algorithm, CollectiveKind};
    for kind in [
        CollectiveKind::AllReduce,
        CollectiveKind::AllGather,
        CollectiveKind::Broadcast,
        CollectiveKind::AllToAll,
    ] {
        for algo in [
            Algorithm::Ring,
            Algorithm::RecursiveDoubling,
            Algorithm::Tree,
            Algorithm::Direct,
        ] {
            assert!(mailbox_call(kind, algo), "{kind:?} {algo:?}");
        }
        for algo in [
            Algorithm::Proportional,
            Algorithm::Hierarchical,
            Algorithm::Aggregation,
        ] {
            assert!(!mailbox_call(kind, algo), "{kind:?} {algo:?}");
        }
    }
    assert!(!mailbox_call(CollectiveKind::AllToAllV, Algorithm::Direct));
    // The whole decision: the call's conditions, then the schedule's.
    let s0 = sched(0, vec![send(1, 4, &[]), recv(1, 4, &[])]);
    let (ar, ring) = (CollectiveKind::AllReduce, Algorithm::Ring);
    assert!(mailbox_mode(ar, ring, &s0, 2, 4, 64, |p| p == 1));
    assert!(
        !mailbox_mode(ar, ring, &s0, 2, 4, 8, |p| p == 1),
        "too large"
    );
    assert!(!mailbox_mode(
        ar,
        Algorithm::Hierarchical,
        &s0,
        2,
        4,
        64,
        |_| true
    ));
    assert!(!mailbox_mode(
        CollectiveKind::AllToAllV,
        Algorithm::Direct,
        &s0,
        2,
        4,
        64,
        |_| true
    ));
}
