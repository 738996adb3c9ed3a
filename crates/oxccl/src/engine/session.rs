//! Calls in flight: calls started without waiting (`Communicator::start`) run together, as a
//! group's calls do, and more join while they run. Each call in flight owns its state (its
//! protocol machine, its own scratch space) and has its own deadline; the driver
//! ([`Engine::drive`]) runs rounds over all of them until one is done, its caller wants the
//! engine back (calls to admit, a blocking call waiting), or a failure; then the caller lets
//! done calls land ([`Engine::land`]) and admits new ones ([`Engine::fly`]).
//!
//! Calls share queues by turns in the order they joined, as a group's do, so every rank must
//! start its calls with a given peer in the same order; unlike a group's, the set is never
//! closed, so a send and a receive started one after the other with the same peer progress
//! together whenever they are started. Calls in mailbox mode run alone (the caller admits
//! nothing else meanwhile, and waits for the set to empty first).

use super::*;

/// A call in flight's buffers, owned with it: its scratch space.
pub(crate) struct Scratch(Vec<u64>);

impl Engine {
    /// Makes `spec` ready to fly as number `id` of the set, with its own scratch space (kept
    /// in `scratch` as long as the call flies). Fails as a call alone would before it moves
    /// anything (a plan whose schedule does not fit this communicator).
    pub(crate) fn fly<'p>(
        &mut self,
        spec: &CallSpec<'p>,
        id: usize,
        scratch: &mut Scratch,
    ) -> Result<One<'p>> {
        self.recent.push(spec.desc);
        self.regs.refresh(&self.registry);
        let words = (spec.plan.sched.scratch * spec.dtype.size()).div_ceil(8);
        scratch.0 = vec![0u64; words];
        let queues = self.queues_of(spec)?;
        let mut one = self.prepare_call(spec, queues, id, 0, false);
        one.spans[Buf::Scratch as usize] = (scratch.0.as_mut_ptr() as *mut u8, words * 8, 0);
        one.own_scratch = true;
        Ok(one)
    }

    /// Drives the calls in flight (`calls`, each with its deadline) until one of them is
    /// done, `stop()` says to (checked between rounds: a cheap load), about `max` passed
    /// without progress, or a call fails (every connection is then quiesced). Does not
    /// remove done calls: [`Engine::land`] does.
    pub(crate) fn drive(
        &mut self,
        calls: &mut [One<'_>],
        deadlines: &[(Instant, Duration)],
        stop: &dyn Fn() -> bool,
        max: Duration,
    ) -> Result<()> {
        self.failed_by_notice = false;
        let mut call = Call::new(self, calls);
        call.eng
            .flows
            .pass_turns(call.calls.iter().filter_map(|o| o.m.as_ref()));
        let r = call
            .check_members()
            .and_then(|()| call.drive(deadlines, stop, max));
        if r.is_err() {
            call.stop_after_error();
        }
        let yields = call.yields;
        self.adapt_spin(yields);
        r
    }

    /// Takes the calls that are done out of the set (in order), renumbering the others;
    /// returns the positions they had. Once the set is empty, gives turns back. (Data no
    /// call takes is found while calls fly, by [`Engine::drive`]'s idle rounds, and after,
    /// by the next call.)
    pub(crate) fn land(&mut self, calls: &mut Vec<One<'_>>) -> Vec<usize> {
        let done: Vec<usize> = (0..calls.len()).filter(|&i| calls[i].is_done()).collect();
        for &i in done.iter().rev() {
            calls.remove(i);
        }
        for (i, o) in calls.iter_mut().enumerate() {
            o.m().set_id(i as u32);
        }
        if calls.is_empty() {
            self.flows.reset_turns();
        }
        done
    }
}

impl Scratch {
    /// No scratch space yet.
    pub(crate) fn new() -> Scratch {
        Scratch(Vec::new())
    }
}

impl Call<'_, '_> {
    /// Rounds until a call is done, `stop()`, about `max` without progress, or a failure
    /// (a call past its deadline: a timeout naming it).
    fn drive(
        &mut self,
        deadlines: &[(Instant, Duration)],
        stop: &dyn Fn() -> bool,
        max: Duration,
    ) -> Result<()> {
        let geo = self.eng.geo;
        self.check_health()?;
        self.refresh_credits();
        let mut idle_since: Option<Instant> = None;
        let mut graced = false;
        loop {
            let progress = self.round(&geo)?;
            if self.calls.iter().any(One::is_done) || stop() {
                return Ok(());
            }
            if progress {
                idle_since = None;
                continue;
            }
            self.inspect()?;
            let now = Instant::now();
            // The first call past its deadline (after one grace period, as a call alone).
            let late = deadlines.iter().position(|&(d, _)| {
                now >= d + if graced {
                    TIMEOUT_GRACE
                } else {
                    Duration::ZERO
                }
            });
            if let Some(c) = late {
                if graced {
                    self.cur = c;
                    return Err(self.timeout_error(deadlines[c].1));
                }
                graced = true;
            }
            let since = *idle_since.get_or_insert(now);
            if now - since >= max {
                return Ok(());
            }
            let first = deadlines.iter().map(|d| d.0).min().unwrap_or(now + max);
            self.idle(now, since, first.min(since + max))?;
        }
    }
}
