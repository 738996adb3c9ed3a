//! A mailbox call compiled to a straight line: the order in which the protocol machine runs
//! the call's steps, taken once from the machine itself and then replayed without it.
//!
//! A call that repeats a planned shape asks the same questions of its [`Machine`] every time
//! (which step is enabled, which message is awaited) and gets the same answers. [`Program::
//! compile`] runs a mailbox-mode machine once, to its end, with a transport that delivers a
//! message only when nothing else can move: every pass's sends and local steps are taken as
//! the machine offers them, and only when a pass offers nothing but receives is the first of
//! them committed. What comes out is the machine's own order with sends as early and waits as
//! late as it allows: a list of steps ([`Instr`]) that a driver runs one after the other,
//! blocking on each receive until its message is there.
//!
//! Blocking in a fixed order can deadlock where the machine, which looks at every receive in
//! each pass, would not. So a program is used only after [`crate::verify::verify_compiled`]
//! ran every rank's program of the call together over symbolic memory: in order, each receive
//! blocking until its sender ran the matching send, and checked the outcome against the
//! collective's definition. The compiled form is what the verifier checks.
//!
//! ```
//! use oxccl_core::protocol::{Config, Flows, Instr, Machine, Program, Queues, Reuse};
//! use oxccl_core::schedule::{Buf, Op, Region, Schedule, Step};
//!
//! // Rank 0 of a two-rank exchange: receive into the output (reduced with the input), and
//! // send the input; the receive comes first in the schedule.
//! let sched = Schedule {
//!     rank: 0,
//!     steps: vec![
//!         Step {
//!             op: Op::Recv {
//!                 peer: 1,
//!                 channel: 0,
//!                 dst: Region::new(Buf::Output, 0, 2),
//!                 reduce_with: Some(Region::new(Buf::Input, 0, 2)),
//!             },
//!             deps: vec![],
//!         },
//!         Step { op: Op::Send { peer: 1, channel: 0, src: Region::new(Buf::Input, 0, 2) }, deps: vec![] },
//!     ],
//!     scratch: 0,
//! };
//! let queues = Queues::new(&sched, &[usize::MAX, 0], 1)?;
//! let m = Machine::new(&sched, &queues, Config::new(1, 2, 64, 4), 4, true, Reuse::default());
//! let prog = Program::compile(m, &mut Flows::new(1, 1))?;
//! // The send goes first: a rank that blocked on its receive first would wait for a peer
//! // blocked the same way.
//! assert_eq!(prog.instrs(), &[Instr::Send(1), Instr::Recv(0)]);
//! # Ok::<(), String>(())
//! ```

use super::machine::{Action, Flows, Machine};

/// One instruction of a compiled call: a step of its schedule, by index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Instr {
    /// Send the step's source to its peer as one mailbox message.
    Send(u32),
    /// Wait for the peer's mailbox message, then take it into the step's destination (reduced
    /// where the step says).
    Recv(u32),
    /// Run the local step (a copy or a reduction).
    Local(u32),
}

impl Instr {
    /// The schedule step this instruction runs.
    pub fn step(self) -> usize {
        match self {
            Instr::Send(s) | Instr::Recv(s) | Instr::Local(s) => s as usize,
        }
    }
}

/// A mailbox call's steps in the order its driver runs them (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Program {
    instrs: Box<[Instr]>,
}

impl Program {
    /// Compiles the call `m` (a fresh mailbox-mode machine; `flows` its rank's queue state,
    /// which mailbox calls do not change) by running it to its end. Fails if `m` is not in
    /// mailbox mode, or if it stops with steps left (a step that waits on nothing that can
    /// come), naming the step.
    pub fn compile(mut m: Machine<'_>, flows: &mut Flows) -> Result<Program, String> {
        if !m.is_mailbox() {
            return Err("only a mailbox call compiles to a program".into());
        }
        let mut out = Vec::with_capacity(m.schedule().steps.len());
        while !m.is_done() {
            let mut moved = false;
            let mut first_wait = None;
            while let Some(a) = m.next(flows) {
                match a {
                    Action::MailboxSend { step, .. } => out.push(Instr::Send(step as u32)),
                    Action::Local { step } => out.push(Instr::Local(step as u32)),
                    Action::Recv {
                        mailbox: true,
                        step,
                        ..
                    } => {
                        first_wait.get_or_insert((step, a));
                        continue;
                    }
                    other => return Err(format!("a mailbox call offered {other:?}")),
                }
                moved = true;
            }
            if moved {
                continue;
            }
            let Some((step, a)) = first_wait else {
                let step = (0..m.schedule().steps.len())
                    .find(|&s| !m.step(s).done)
                    .unwrap_or(0);
                return Err(format!(
                    "step {step} can never run: it waits for steps that cannot finish"
                ));
            };
            m.commit(flows, &a);
            out.push(Instr::Recv(step as u32));
        }
        Ok(Program {
            instrs: out.into_boxed_slice(),
        })
    }

    /// A program of the given instructions, for tests of the verifier.
    #[cfg(test)]
    pub(crate) fn from_instrs(instrs: Vec<Instr>) -> Program {
        Program {
            instrs: instrs.into_boxed_slice(),
        }
    }

    /// The instructions, in order.
    pub fn instrs(&self) -> &[Instr] {
        &self.instrs
    }

    /// Commits instructions `done` of this program (`done.start` must be how many `m`, a
    /// machine of the same call, has seen already) to `m`, so that it is where the program is:
    /// for a driver that reports what a program waits for with [`Machine::waiting`].
    pub fn replay(&self, m: &mut Machine<'_>, flows: &mut Flows, done: std::ops::Range<usize>) {
        let end = done.end.min(self.instrs.len());
        for &ins in &self.instrs[done.start.min(end)..end] {
            let a = m.mailbox_action(ins.step());
            m.commit(flows, &a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Config, Queues, Reuse, Waiting};
    use crate::schedule::{Algorithm, Collective, Request, build};

    fn request(world: usize, rank: usize, coll: Collective, algo: Algorithm) -> Request {
        Request {
            coll,
            world,
            rank,
            in_place: false,
            hosts: Vec::new(),
            algo,
            chunk: 1 << 20,
            channels: 1,
            weights: Vec::new(),
        }
    }

    fn compiled(req: &Request) -> (crate::schedule::Schedule, Result<Program, String>) {
        let sched = build(req).unwrap();
        let link_of: Vec<usize> = (0..req.world)
            .map(|p| {
                if p == req.rank {
                    usize::MAX
                } else {
                    p - usize::from(p > req.rank)
                }
            })
            .collect();
        let queues = Queues::new(&sched, &link_of, 1).unwrap();
        let m = Machine::new(
            &sched,
            &queues,
            Config::new(1, 8, 4096, 4),
            4,
            true,
            Reuse::default(),
        );
        let p = Program::compile(m, &mut Flows::new(req.world, 1));
        (sched, p)
    }

    /// Every step runs once, after its dependencies, and each send before any receive that
    /// the machine would not have had to wait for first.
    #[test]
    fn a_program_runs_every_step_once_after_its_dependencies() {
        for world in [2, 3, 4, 5, 8] {
            for rank in 0..world {
                let req = request(
                    world,
                    rank,
                    Collective::AllReduce { count: 7 },
                    Algorithm::RecursiveDoubling,
                );
                let (sched, p) = compiled(&req);
                let p = p.unwrap();
                let mut seen = vec![false; sched.steps.len()];
                for ins in p.instrs() {
                    let s = ins.step();
                    assert!(!seen[s], "world {world} rank {rank}: step {s} twice");
                    for &d in &sched.steps[s].deps {
                        assert!(
                            seen[d as usize],
                            "world {world} rank {rank}: {s} before {d}"
                        );
                    }
                    seen[s] = true;
                }
                assert!(
                    seen.iter().all(|&x| x),
                    "world {world} rank {rank}: a step left out"
                );
            }
        }
    }

    #[test]
    fn a_slot_call_does_not_compile_and_replay_reports_the_wait() {
        let req = request(
            2,
            0,
            Collective::AllReduce { count: 4 },
            Algorithm::RecursiveDoubling,
        );
        let sched = build(&req).unwrap();
        let queues = Queues::new(&sched, &[usize::MAX, 0], 1).unwrap();
        let cfg = Config::new(1, 8, 4096, 4);
        let slots = Machine::new(&sched, &queues, cfg, 4, false, Reuse::default());
        assert!(Program::compile(slots, &mut Flows::new(1, 1)).is_err());
        let m = Machine::new(&sched, &queues, cfg, 4, true, Reuse::default());
        let mut flows = Flows::new(1, 1);
        let p = Program::compile(m, &mut flows).unwrap();
        // After the first instruction (the send), the machine says the receive waits for data.
        let mut m = Machine::new(&sched, &queues, cfg, 4, true, Reuse::default());
        p.replay(&mut m, &mut flows, 0..1);
        let recv = p.instrs()[1].step();
        assert!(matches!(p.instrs()[1], Instr::Recv(_)));
        assert_eq!(m.waiting(&flows), Some(Waiting::Data { step: recv, q: 0 }));
        let mut m = Machine::new(&sched, &queues, cfg, 4, true, Reuse::default());
        p.replay(&mut m, &mut flows, 0..1);
        p.replay(&mut m, &mut flows, 1..p.instrs().len());
        assert!(m.is_done());
    }
}
