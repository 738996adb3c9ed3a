//! Mailbox calls: how an idle one waits ([`MailboxIdle`], shared by both drivers), and the
//! driver of a compiled call ([`Program`]): the steps of a call that repeats a planned shape,
//! run one after the other in the order the protocol machine gave them when the program was
//! compiled and verified ([`oxccl_core::verify::verify_compiled`]), without asking the machine
//! again. The machine is brought up to date only when something must be told about the call
//! (what it waits for, in `oxccl status` or a timeout error).

use super::*;
use oxccl_core::protocol::{Instr, Program};

/// How long a call idles before it publishes what it waits for (`oxccl status`).
pub(super) const PUBLISH_AFTER: Duration = Duration::from_millis(1);

/// The waiting of a mailbox call between messages: the clock is read only once it idles
/// (most small calls never do), and only every 32 idle polls.
#[derive(Default)]
pub(super) struct MailboxIdle {
    deadline: Option<Instant>,
    graced: bool,
    since: Option<Instant>,
    polls: u32,
    napping: bool,
    /// Whether this idle spell's wait is published for `oxccl status`.
    published: bool,
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

    /// One idle turn of a mailbox call whose next message is link `l`'s, of `total` bytes:
    /// spins on the word it waits for, or yields; every 32 turns also polls the completion
    /// queues (notices, failed connections and data that does not belong to the call arrive
    /// there), checks the links and the clock, and spins, yields or naps by how long the call
    /// has idled.
    pub(super) fn mailbox_idle(
        &mut self,
        idle: &mut MailboxIdle,
        timeout: Duration,
        awaited: Option<(usize, usize)>,
    ) -> Result<Turn> {
        let geo = self.eng.geo;
        idle.polls += 1;
        // (Once napping, every pass is long anyway: look at everything each time.)
        if !idle.napping && !idle.polls.is_multiple_of(32) {
            if self.eng.spin_now.is_zero() || self.spun_out {
                std::thread::yield_now();
            } else if let Some((l, total)) = awaited {
                // Watch the one word the call waits for, rather than make passes: the message
                // is taken as soon as it lands.
                self.spin_on_message(l, total, &geo);
            } else {
                std::hint::spin_loop();
            }
            return Ok(Turn::Again);
        }
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
        if waited < self.eng.spin_now {
            std::hint::spin_loop();
        } else if waited < self.eng.yield_for {
            self.spun_out = true;
            std::thread::yield_now();
        } else {
            // Nothing to sleep on: nap briefly.
            idle.napping = true;
            std::thread::sleep(Duration::from_micros(100));
        }
        if !idle.published && waited >= PUBLISH_AFTER {
            idle.published = true;
            return Ok(Turn::Publish(since, now));
        }
        Ok(Turn::Again)
    }

    /// Spins (a bounded while) on the word link `l`'s next message of `total` bytes will set:
    /// its flag, then its stamp.
    #[inline(never)]
    pub(super) fn spin_on_message(&self, l: usize, total: usize, geo: &Geometry) {
        let link = &self.eng.links[l];
        let flag = link.mbox_recv + 1;
        if let Some(w) = link.inbox(geo).awaited(total, flag) {
            for _ in 0..MAILBOX_SPIN {
                if w.load(Ordering::Acquire) == flag {
                    return;
                }
                std::hint::spin_loop();
            }
        }
    }

    /// Runs the lone mailbox call as compiled: `prog`'s instructions in order, each receive
    /// waiting (as [`Call::mailbox_idle`] says) until its message is there.
    pub(super) fn run_program(&mut self, prog: &Program, timeout: Duration) -> Result<()> {
        let mut synced = 0;
        let r = self.run_instrs(prog, timeout, &mut synced);
        if let Err(k) = r {
            // Tell the machine what ran, for what the error says of the call.
            self.sync_machine(prog, &mut synced, k.at);
            return Err(k.error.unwrap_or_else(|| self.timeout_error(timeout)));
        }
        self.eng
            .probe
            .steps_done
            .store(prog.instrs().len() as u32, Ordering::Relaxed);
        Ok(())
    }

    /// [`Call::run_program`]'s loop; fails with the instruction it stopped at and the error
    /// (none: the call timed out).
    fn run_instrs(
        &mut self,
        prog: &Program,
        timeout: Duration,
        synced: &mut usize,
    ) -> std::result::Result<(), Stopped> {
        let geo = self.eng.geo;
        let sched = self.calls[0].sched;
        let mut idle = MailboxIdle::default();
        for (k, &ins) in prog.instrs().iter().enumerate() {
            let at = |error| Stopped { at: k, error };
            let s = ins.step();
            match (ins, &sched.steps[s].op) {
                (Instr::Send(_), &Op::Send { peer, src, .. }) => self
                    .mailbox_send(peer, src, &geo)
                    .map_err(|e| at(Some(e)))?,
                (Instr::Local(_), _) => self.run_local(s).map_err(|e| at(Some(e)))?,
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
                    while !self
                        .mailbox_recv(peer, dst, reduce_with, &geo)
                        .map_err(|e| at(Some(e)))?
                    {
                        match self
                            .mailbox_idle(&mut idle, timeout, awaited)
                            .map_err(|e| at(Some(e)))?
                        {
                            Turn::Again => {}
                            Turn::TimedOut => return Err(at(None)),
                            Turn::Publish(since, now) => {
                                self.sync_machine(prog, synced, k);
                                self.publish_waiting(since, now);
                            }
                        }
                    }
                    self.mailbox_moved(&mut idle);
                }
                _ => unreachable!("a program's instruction is its step's kind (Program::compile)"),
            }
        }
        Ok(())
    }

    /// Brings the call's machine from instruction `synced` of `prog` to `k` (it has run the
    /// first `k`), and says so to the flight recorder.
    #[cold]
    fn sync_machine(&mut self, prog: &Program, synced: &mut usize, k: usize) {
        if k > *synced {
            prog.replay(&mut self.calls[0].m, &mut self.eng.flows, *synced..k);
            *synced = k;
        }
        self.note_steps();
    }
}

/// Where [`Call::run_program`] stopped: the instruction, and why (`None`: time ran out).
struct Stopped {
    at: usize,
    error: Option<Error>,
}
