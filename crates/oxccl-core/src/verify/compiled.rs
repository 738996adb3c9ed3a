//! The verifier for compiled calls ([`Program`]): every rank's program of one mailbox call,
//! run together over symbolic memory exactly as the executor runs it: instructions in order,
//! each receive blocking until its sender has run the matching send.
//!
//! Each program is deterministic and a receive can take only the one message its peer sends
//! it in the call, so the ranks form a Kahn network: whether they finish, and what they
//! compute, does not depend on how their instructions interleave. One run in a fixed order
//! decides it for every order.

use super::{POISON, RankState, Sym, check_results, initial_states, run_local};
use crate::protocol::{Config, Flows, Instr, Machine, Program, Queues, Reuse};
use crate::schedule::{Op, Request, Schedule, build};

/// Builds every rank's schedule from `reqs` (one per rank, in rank order: one mailbox call),
/// compiles each to a [`Program`] from its mailbox-mode protocol machine, and runs the
/// programs together (see the module docs). Returns the programs, in rank order, or the first
/// violation: a program that runs a step before its dependency or twice or never, a deadlock
/// (naming each blocked rank and what it waits for), a second message to a peer whose mailbox
/// still holds one, a message of the wrong length, or a wrong result.
///
/// ```
/// use oxccl_core::protocol::Instr;
/// use oxccl_core::schedule::{Algorithm, Collective, Request};
/// let reqs: Vec<Request> = (0..4)
///     .map(|rank| Request {
///         coll: Collective::AllReduce { count: 3 },
///         world: 4,
///         rank,
///         in_place: false,
///         hosts: Vec::new(),
///         algo: Algorithm::RecursiveDoubling,
///         chunk: 1 << 16,
///         channels: 1,
///         weights: Vec::new(),
///     })
///     .collect();
/// let progs = oxccl_core::verify::verify_compiled(&reqs).unwrap();
/// // Recursive doubling on 4 ranks: two exchanges, each a send then a receive.
/// assert!(matches!(progs[0].instrs(), [Instr::Send(_), Instr::Recv(_), Instr::Send(_), Instr::Recv(_), ..]));
/// ```
pub fn verify_compiled(reqs: &[Request]) -> Result<Vec<Program>, String> {
    let n = reqs.len();
    if n == 0 || n > 64 {
        return Err(format!("verify runs 1..=64 ranks, got {n}"));
    }
    let mut scheds = reqs
        .iter()
        .enumerate()
        .map(|(r, req)| build(req).map_err(|e| format!("rank {r}: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    let mut ranks = initial_states(reqs, &mut scheds)?;
    if scheds.len() != n {
        return Err("an aggregation call does not run in mailboxes".into());
    }
    let progs = scheds
        .iter()
        .enumerate()
        .map(|(r, s)| compile(r, n, s).map_err(|e| format!("rank {r}: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    run(&scheds, &progs, &mut ranks)?;
    check_results(reqs, &ranks)?;
    Ok(progs)
}

/// Rank `r`'s program of `sched` (of `n` ranks; the link to peer `p` is numbered `p`).
fn compile(r: usize, n: usize, sched: &Schedule) -> Result<Program, String> {
    let link_of: Vec<usize> = (0..n)
        .map(|p| if p == r { usize::MAX } else { p })
        .collect();
    let queues = Queues::new(sched, &link_of, 1)?;
    // Mailbox mode ignores slots and fragments; elements are one symbol each.
    let m = Machine::new(
        sched,
        &queues,
        Config::new(1, 2, 1, 1),
        1,
        true,
        Reuse::default(),
    );
    Program::compile(m, &mut Flows::new(n, 1))
}

/// A message in a mailbox: its elements and whose start its sender had heard of.
struct Message {
    data: Vec<Sym>,
    know: u64,
}

/// Runs the programs to their end, or fails naming the first violation or the deadlock.
fn run(scheds: &[Schedule], progs: &[Program], ranks: &mut [RankState]) -> Result<(), String> {
    let n = progs.len();
    // (sender · n + receiver) → the message not taken yet.
    let mut boxes: Vec<Option<Message>> = (0..n * n).map(|_| None).collect();
    // Messages sent per (sender, receiver): the call has at most one each way.
    let mut sent = vec![0u8; n * n];
    let mut pc = vec![0usize; n];
    let mut done: Vec<Vec<bool>> = scheds.iter().map(|s| vec![false; s.steps.len()]).collect();
    loop {
        let mut moved = false;
        for r in 0..n {
            while let Some(&ins) = progs[r].instrs().get(pc[r]) {
                let s = ins.step();
                let fail = |e: String| format!("rank {r} instruction {} (step {s}): {e}", pc[r]);
                let step = scheds[r]
                    .steps
                    .get(s)
                    .ok_or_else(|| fail("no such step".into()))?;
                if done[r][s] {
                    return Err(fail("runs the step a second time".into()));
                }
                if let Some(d) = step.deps.iter().find(|&&d| !done[r][d as usize]) {
                    return Err(fail(format!("runs before its dependency, step {d}")));
                }
                let st = &mut ranks[r];
                match (ins, &step.op) {
                    (Instr::Send(_), &Op::Send { peer, src, .. }) => {
                        let data = st.read(src).map_err(fail)?;
                        if data.contains(&POISON) {
                            return Err(fail(format!("sends unwritten data from {src:?}")));
                        }
                        let w = r * n + peer;
                        if sent[w] > 0 {
                            return Err(fail(format!(
                                "sends rank {peer} a second message in one call (its mailbox \
                                 holds one)"
                            )));
                        }
                        sent[w] += 1;
                        boxes[w] = Some(Message {
                            data,
                            know: st.know,
                        });
                    }
                    (
                        Instr::Recv(_),
                        &Op::Recv {
                            peer,
                            dst,
                            reduce_with,
                            ..
                        },
                    ) => {
                        let Some(msg) = boxes[peer * n + r].take() else {
                            break;
                        };
                        if msg.data.len() != dst.len {
                            return Err(fail(format!(
                                "receives {} elements from rank {peer}, which sent {}",
                                dst.len,
                                msg.data.len()
                            )));
                        }
                        let value = match reduce_with {
                            Some(w) => {
                                let local = st.read(w).map_err(fail)?;
                                super::reduce_slices(&local, &msg.data).map_err(fail)?
                            }
                            None => msg.data,
                        };
                        st.write(dst, &value).map_err(fail)?;
                        st.know |= msg.know;
                    }
                    (Instr::Local(_), Op::Copy { .. } | Op::Reduce { .. }) => {
                        run_local(&scheds[r], st, s).map_err(fail)?;
                    }
                    (ins, op) => return Err(fail(format!("{ins:?} for a step that is {op:?}"))),
                }
                done[r][s] = true;
                pc[r] += 1;
                moved = true;
            }
        }
        if pc
            .iter()
            .zip(progs)
            .all(|(&p, prog)| p == prog.instrs().len())
        {
            break;
        }
        if !moved {
            let blocked: Vec<String> = (0..n)
                .filter_map(|r| {
                    let ins = *progs[r].instrs().get(pc[r])?;
                    let from = match scheds[r].steps[ins.step()].op {
                        Op::Recv { peer, .. } => peer,
                        _ => usize::MAX,
                    };
                    Some(format!(
                        "rank {r} at instruction {} waits for rank {from}'s message (step {})",
                        pc[r],
                        ins.step()
                    ))
                })
                .collect();
            return Err(format!(
                "deadlock in the compiled programs: {}",
                blocked.join("; ")
            ));
        }
    }
    for (r, done) in done.iter().enumerate() {
        if let Some(s) = done.iter().position(|&d| !d) {
            return Err(format!("rank {r}: step {s} is not in the program"));
        }
    }
    if let Some(w) = boxes.iter().position(Option::is_some) {
        return Err(format!(
            "rank {} sent rank {} a message it never took",
            w / n,
            w % n
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::mailbox_eligible;
    use crate::schedule::{Algorithm, Buf, Collective, Region, Step};

    fn reqs(n: usize, coll: Collective, algo: Algorithm, in_place: bool) -> Vec<Request> {
        (0..n)
            .map(|rank| Request {
                coll: coll.clone(),
                world: n,
                rank,
                in_place,
                hosts: Vec::new(),
                algo,
                chunk: 1 << 16,
                channels: 1,
                weights: Vec::new(),
            })
            .collect()
    }

    /// Every collective and algorithm whose schedules run in mailboxes compiles to programs
    /// that finish with the collective's result, for 1 to 9 ranks.
    #[test]
    fn every_mailbox_call_compiles_to_programs_that_verify() {
        use Algorithm::*;
        let mut checked = 0;
        for n in 1..=9 {
            for count in [0, 1, 5] {
                let root = n / 2;
                let calls = [
                    (
                        Collective::AllReduce { count },
                        vec![Ring, RecursiveDoubling],
                    ),
                    (
                        Collective::Broadcast { count, root },
                        vec![Tree, Chain, Direct],
                    ),
                    (
                        Collective::Reduce { count, root },
                        vec![Tree, Chain, Direct],
                    ),
                    (
                        Collective::AllGather { count },
                        vec![Ring, RecursiveDoubling, Direct],
                    ),
                    (Collective::ReduceScatter { count }, vec![Ring, Direct]),
                    (Collective::AllToAll { count }, vec![Direct]),
                    (Collective::Gather { count, root }, vec![Direct]),
                    (Collective::Scatter { count, root }, vec![Direct]),
                    (Collective::Barrier, vec![Dissemination]),
                ];
                for (coll, algos) in calls {
                    for algo in algos {
                        for in_place in [false, true] {
                            let rs = reqs(n, coll.clone(), algo, in_place);
                            if in_place && coll.in_place_offsets(n, 0).is_none() {
                                continue;
                            }
                            let Ok(scheds) = rs.iter().map(build).collect::<Result<Vec<_>, _>>()
                            else {
                                continue;
                            };
                            // Only what the executor would run in mailboxes.
                            if !scheds
                                .iter()
                                .all(|s| mailbox_eligible(s, n, 4, 1 << 20, |_| true))
                            {
                                continue;
                            }
                            verify_compiled(&rs).unwrap_or_else(|e| {
                                panic!("{} {algo:?} n={n} count={count}: {e}", coll.name())
                            });
                            checked += 1;
                        }
                    }
                }
            }
        }
        assert!(checked >= 70, "only {checked} calls were mailbox calls");
    }

    fn step(op: Op, deps: Vec<u32>) -> Step {
        Step { op, deps }
    }

    /// Two ranks that each receive before they send, the send depending on the receive: the
    /// compiled programs deadlock, and the verifier says who waits for whom.
    #[test]
    fn programs_that_wait_for_each_other_are_a_deadlock() {
        let rs = reqs(
            2,
            Collective::AllReduce { count: 2 },
            Algorithm::RecursiveDoubling,
            false,
        );
        let sched = |r: usize| Schedule {
            rank: r,
            steps: vec![
                step(
                    Op::Recv {
                        peer: 1 - r,
                        channel: 0,
                        dst: Region::new(Buf::Output, 0, 2),
                        reduce_with: Some(Region::new(Buf::Input, 0, 2)),
                    },
                    vec![],
                ),
                step(
                    Op::Send {
                        peer: 1 - r,
                        channel: 0,
                        src: Region::new(Buf::Input, 0, 2),
                    },
                    vec![0],
                ),
            ],
            scratch: 0,
        };
        let scheds = vec![sched(0), sched(1)];
        let progs: Vec<Program> = (0..2).map(|r| compile(r, 2, &scheds[r]).unwrap()).collect();
        let mut scheds2 = scheds.clone();
        let mut ranks = initial_states(&rs, &mut scheds2).unwrap();
        let e = run(&scheds, &progs, &mut ranks).unwrap_err();
        assert!(e.contains("deadlock"), "{e}");
        assert!(
            e.contains("rank 0 at instruction 0 waits for rank 1"),
            "{e}"
        );
        assert!(
            e.contains("rank 1 at instruction 0 waits for rank 0"),
            "{e}"
        );
    }

    /// A program whose order breaks a dependency, that runs a step twice, or that leaves a
    /// step out, is refused.
    #[test]
    fn a_tampered_program_is_refused() {
        let rs = reqs(
            4,
            Collective::AllReduce { count: 2 },
            Algorithm::RecursiveDoubling,
            false,
        );
        let mut scheds: Vec<Schedule> = rs.iter().map(|r| build(r).unwrap()).collect();
        let good = verify_compiled(&rs).unwrap();
        let ranks = initial_states(&rs, &mut scheds).unwrap();
        let with0 = |p: Program| {
            let mut all = good.clone();
            all[0] = p;
            run(&scheds, &all, &mut ranks.clone())
        };
        let ins = good[0].instrs();
        let rev = with0(Program::from_instrs(ins.iter().rev().copied().collect())).unwrap_err();
        assert!(
            rev.contains("rank 0") && rev.contains("dependency"),
            "{rev}"
        );
        let twice: Vec<Instr> = [ins[0]].iter().chain(ins).copied().collect();
        let twice = with0(Program::from_instrs(twice)).unwrap_err();
        assert!(twice.contains("second"), "{twice}");
        let short = with0(Program::from_instrs(ins[..ins.len() - 1].to_vec())).unwrap_err();
        assert!(short.contains("rank 0"), "{short}");
        run(&scheds, &good, &mut ranks.clone()).unwrap();
    }
}
