//! Mailbox calls: their two drivers and how an idle one waits ([`MailboxIdle`]). A call runs
//! either as its protocol machine says, pass after pass ([`Call::run_mailbox`]), or, when it
//! repeats a planned shape, compiled ([`Call::run_program`]): its steps one after the other in
//! the order the machine gave them when the program was compiled and verified
//! ([`oxccl_core::verify::verify_compiled`]), without asking the machine again. The machine is
//! then brought up to date only when something must be told about the call (the links' health,
//! what it waits for in `oxccl status` or a timeout error).

use super::wait;
use super::*;
use oxccl_core::protocol::{Instr, Program};

/// How long a call idles before it publishes what it waits for (`oxccl status`).
pub(super) const PUBLISH_AFTER: Duration = Duration::from_millis(1);

/// The waiting of a mailbox call between messages: the clock is read only once it idles
/// (most small calls never do), and only every 32 idle polls.
#[derive(Default)]
pub(super) struct MailboxIdle<'p> {
    deadline: Option<Instant>,
    graced: bool,
    since: Option<Instant>,
    polls: u32,
    napping: bool,
    /// Whether this idle spell's wait is published for `oxccl status`.
    published: bool,
    /// The program the call runs, if it runs compiled: its machine is told what ran before
    /// anything asks it (the links' health, what the call waits for).
    program: Option<Running<'p>>,
}

/// A compiled call's progress: its program, the instruction it is at, and how many of them
/// its machine has been told of.
struct Running<'p> {
    prog: &'p Program,
    at: usize,
    synced: usize,
}

/// What one idle turn of a mailbox call found.
pub(super) enum Turn {
    /// Look again.
    Again,
    /// The call has waited past its deadline.
    TimedOut,
    /// The call has idled long enough to say what it waits for (once per idle spell).
    Publish(Instant, Instant),
}

impl Call<'_, '_> {
    /// Runs the schedule with the mailbox protocol: the sender stores each message straight
    /// into the peer's mapped mailbox, flags last ([`crate::mailbox`]), and the receiver
    /// polls the flags in its own memory. No request, no completion queue, no credits.
    pub(super) fn run_mailbox(&mut self, timeout: Duration) -> Result<()> {
        let mut idle = MailboxIdle::default();
        let geo = self.eng.geo;
        while !self.calls[self.cur].is_done() {
            let mut progress = false;
            while let Some(a) = self.calls[self.cur].m().next(&mut self.eng.flows) {
                progress |= self.perform(&a, &geo)?;
            }
            if self.calls[self.cur].is_done() {
                break;
            }
            if progress {
                self.mailbox_moved(&mut idle);
                // What is left waits for a message (the sends went out): watch its flag
                // rather than make a pass that finds nothing.
                if !self.eng.policy().yields(self.yields.yielded()) {
                    self.watch_awaited(&geo);
                }
                continue;
            }
            let awaited = self.awaited_message();
            match self.mailbox_idle(&mut idle, timeout, awaited)? {
                Turn::Again => {}
                Turn::TimedOut => return Err(self.timeout_error(timeout)),
                Turn::Publish(since, now) => self.publish_waiting(since, now),
            }
        }
        Ok(())
    }

    /// The link and length of the message the first waiting step of this mailbox call waits
    /// for.
    fn awaited_message(&self) -> Option<(usize, usize)> {
        let one = &self.calls[self.cur];
        let Some(Waiting::Data { step, q }) = one.waiting(&self.eng.flows) else {
            return None;
        };
        let Op::Recv { dst, .. } = one.sched.steps[step].op else {
            return None;
        };
        Some((self.eng.flows.link_channel(q).0, dst.len * one.esize))
    }

    /// Spins a bounded while ([`wait::watch`]) on the flag the first message this mailbox
    /// call waits for will set.
    fn watch_awaited(&mut self, geo: &Geometry) {
        if let Some((l, total)) = self.awaited_message() {
            self.watch_message(l, total, geo, false);
        }
    }

    /// The call moved: a new idle spell starts at its next wait.
    pub(super) fn mailbox_moved(&self, idle: &mut MailboxIdle) {
        idle.since = None;
        idle.polls = 0;
        idle.napping = false;
        if idle.published {
            idle.published = false;
            self.eng.probe.waiting.store(0, Ordering::Relaxed);
        }
    }

    /// One idle turn of a mailbox call whose next message is link `l`'s, of `total` bytes
    /// (`awaited`): watches the word it waits for ([`wait::watch`]: spinning, or yielding once
    /// the call's policy says so), or on a written mailbox polls the completion queues. Every
    /// [`wait::WATCH_YIELDS`] turns, and after a watch that did not see its word, it also
    /// polls the completion queues (notices, failed connections and data that does not belong
    /// to the call arrive there), checks the links and the clock, and spins, yields or sleeps
    /// by how long the call has idled ([`wait::Policy::pause`]).
    pub(super) fn mailbox_idle(
        &mut self,
        idle: &mut MailboxIdle,
        timeout: Duration,
        awaited: Option<(usize, usize)>,
    ) -> Result<Turn> {
        let geo = self.eng.geo;
        let policy = self.eng.policy();
        idle.polls += 1;
        // A written mailbox's message is there once its completion is: look for it.
        let written = awaited.is_some_and(|(l, _)| self.eng.links[l].outbox.is_none());
        // (Once napping, every pass is long anyway: look at everything each time.)
        if !idle.napping && !idle.polls.is_multiple_of(wait::WATCH_YIELDS) {
            let yielding = policy.yields(self.yields.yielded());
            if written {
                if self.written_idle(idle, &policy, yielding)? {
                    return Ok(Turn::Again);
                }
            } else {
                // Watch the one word the call waits for, rather than make passes: the message
                // is taken as soon as it lands. A watch (64 spins or 32 yields) stands for many
                // passes, so the clock is read after one that fails.
                let watched =
                    awaited.and_then(|(l, total)| self.watch_message(l, total, &geo, yielding));
                match watched {
                    Some(false) => idle.polls = idle.polls.next_multiple_of(wait::WATCH_YIELDS),
                    _ => return Ok(Turn::Again),
                }
            }
        }
        self.sync_machine(idle);
        self.yields.idled();
        self.poll_cqs()?;
        self.check_strays(true)?;
        self.check_health()?;
        let now = Instant::now();
        if expired(
            idle.deadline.get_or_insert(now + timeout),
            &mut idle.graced,
            now,
        ) {
            return Ok(Turn::TimedOut);
        }
        let since = *idle.since.get_or_insert(now);
        let waited = now - since;
        match policy.pause(waited) {
            wait::Pause::Spin => std::hint::spin_loop(),
            wait::Pause::Yield => {
                self.yields.cede();
            }
            wait::Pause::Sleep if written => {
                // Sleep on the completion queues, where the message's completion comes.
                idle.napping = true;
                let deadline = idle.deadline.unwrap_or(now);
                self.wait(
                    deadline
                        .min(now + Duration::from_millis(50))
                        .saturating_duration_since(now),
                )?;
            }
            wait::Pause::Sleep => {
                // Nothing to sleep on: nap briefly.
                idle.napping = true;
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        if !idle.published && waited >= PUBLISH_AFTER {
            idle.published = true;
            return Ok(Turn::Publish(since, now));
        }
        Ok(Turn::Again)
    }

    /// An idle turn of a call that waits for a written mailbox's message: polls the completion
    /// queues, then spins, or yields (`yielding`, or the spin is over). A pass here is a system
    /// call or more (the provider reads its sockets): the clock costs little beside it, so the
    /// spin is measured in time, not passes, and a short one (a peer shares this CPU) yields as
    /// soon as it is over. False when the call has waited long enough to sleep: the full pass
    /// does that. (Kept out of [`Call::mailbox_idle`], whose mapped mailboxes' path it would
    /// only lengthen.)
    #[inline(never)]
    fn written_idle(
        &mut self,
        idle: &mut MailboxIdle,
        policy: &wait::Policy,
        yielding: bool,
    ) -> Result<bool> {
        if self.poll_cqs()? {
            return Ok(true);
        }
        self.yields.idled();
        let since = *idle.since.get_or_insert_with(Instant::now);
        match policy.pause(since.elapsed()) {
            wait::Pause::Sleep => Ok(false),
            wait::Pause::Spin if !yielding => Ok(true),
            _ => {
                self.yields.cede();
                Ok(true)
            }
        }
    }

    /// Watches ([`wait::watch`], spinning or `yielding`) the word link `l`'s next message of
    /// `total` bytes will set: its flag, then its stamp. `None` where there is no word to
    /// watch (a written mailbox: its completion says when, not its flags; or the message is
    /// whole); otherwise whether the word was set. The wait and its yields are noted in the
    /// call's [`wait::Yields`].
    #[inline(never)]
    pub(super) fn watch_message(
        &mut self,
        l: usize,
        total: usize,
        geo: &Geometry,
        yielding: bool,
    ) -> Option<bool> {
        let link = &self.eng.links[l];
        link.outbox.as_ref()?;
        let flag = link.mbox_recv + 1;
        let w = link.inbox(geo).awaited(total, flag)?;
        Some(wait::watch(w, flag, yielding, &mut self.yields))
    }

    /// Runs the lone mailbox call as compiled: `prog`'s instructions in order, each receive
    /// waiting (as [`Call::mailbox_idle`] says) until its message is there.
    pub(super) fn run_program(
        &mut self,
        prog: &Program,
        timeout: Duration,
        rec: &mut Record<'_>,
    ) -> Result<()> {
        let mut idle = MailboxIdle {
            program: Some(Running {
                prog,
                at: 0,
                synced: 0,
            }),
            ..MailboxIdle::default()
        };
        let r = self.run_instrs(prog, timeout, &mut idle, rec);
        // (A program with no receive made no record yet: make it before the steps are told.)
        rec.start(&self.eng.probe);
        match r {
            Ok(()) => {
                self.eng
                    .probe
                    .steps_done
                    .store(prog.instrs().len() as u32, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                // Tell the machine what ran, for what the error says of the call.
                self.sync_machine(&mut idle);
                Err(e.unwrap_or_else(|| self.timeout_error(timeout)))
            }
        }
    }

    /// [`Call::run_program`]'s loop; fails with the error (none: the call timed out).
    fn run_instrs(
        &mut self,
        prog: &Program,
        timeout: Duration,
        idle: &mut MailboxIdle<'_>,
        rec: &mut Record<'_>,
    ) -> std::result::Result<(), Option<Error>> {
        let geo = self.eng.geo;
        let sched = self.calls[0].sched;
        for (k, &ins) in prog.instrs().iter().enumerate() {
            if let Some(p) = idle.program.as_mut() {
                p.at = k;
            }
            let s = ins.step();
            match (ins, &sched.steps[s].op) {
                (Instr::Send(_), &Op::Send { peer, src, .. }) => {
                    self.mailbox_send(peer, src, &geo)?
                }
                (Instr::Local(_), _) => self.run_local(s)?,
                (
                    Instr::Recv(_),
                    &Op::Recv {
                        peer,
                        dst,
                        reduce_with,
                        ..
                    },
                ) => {
                    let awaited = Some((self.eng.link_of[peer], dst.len * self.calls[0].esize));
                    // The sends before this wait are out: the record costs nothing now.
                    rec.start(&self.eng.probe);
                    while !self.mailbox_recv(peer, dst, reduce_with, &geo)? {
                        match self.mailbox_idle(idle, timeout, awaited)? {
                            Turn::Again => {}
                            Turn::TimedOut => return Err(None),
                            Turn::Publish(since, now) => self.publish_waiting(since, now),
                        }
                    }
                    self.mailbox_moved(idle);
                }
                _ => unreachable!("a program's instruction is its step's kind (Program::compile)"),
            }
        }
        Ok(())
    }

    /// Tells a compiled call's machine which of its program's instructions ran (none of a
    /// call its machine drives), and the flight recorder how many.
    #[cold]
    fn sync_machine(&mut self, idle: &mut MailboxIdle<'_>) {
        let Some(p) = idle.program.as_mut() else {
            return;
        };
        if p.at > p.synced {
            p.prog.replay(
                self.calls[0].machine(&mut self.eng.reuse),
                &mut self.eng.flows,
                p.synced..p.at,
            );
            p.synced = p.at;
        }
        self.note_steps();
    }
}
