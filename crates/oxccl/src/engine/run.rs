//! Driving calls: the loops of the slot and mailbox protocols, the completion queues and
//! what arrives through them (fragments, credits, notices), health, timeouts, strays.

use super::mailboxes::PUBLISH_AFTER;
use super::wait;
use super::*;
use crate::flight::{self, Waited};

impl Call<'_, '_> {
    /// A communicator with a failed member cannot run collectives: says so at once, naming
    /// it, even if this call would not talk to it (as NCCL's and Gloo's communicators, it is
    /// broken as a whole). Notices that arrived before the connection failed (a peer that
    /// reported a failure, then closed) explain it better and come first.
    pub(super) fn check_members(&mut self) -> Result<()> {
        let mut failed = None;
        for link in &mut self.eng.links {
            link.refresh_failed();
            if failed.is_none() && link.failed.is_some() {
                failed = Some(link.peer);
            }
        }
        let Some(peer) = failed else { return Ok(()) };
        self.poll_cqs()?;
        let l = self.eng.link_of[peer];
        Err(Error::PeerFailed {
            rank: self.eng.rank,
            op: self.calls[self.cur].desc.to_string(),
            peer,
            detail: format!(
                "{} (found before this call started)",
                self.eng.links[l].failed.as_deref().unwrap_or("failed")
            ),
        })
    }

    /// Runs the calls to the end (or the first error): compiled, in mailboxes, or with slots.
    /// Before it returns success, it makes sure no peer sent this call (or an earlier one)
    /// what it did not take: a disagreement that happened to complete must still be reported.
    pub(super) fn run_to_end(&mut self, timeout: Duration, rec: &mut Record<'_>) -> Result<()> {
        self.check_members()?;
        let mailbox = self.calls[0].mailbox;
        if let Some(prog) = self.calls[0].prog.filter(|_| mailbox) {
            self.run_program(prog, timeout, rec)?;
        } else {
            rec.start(&self.eng.probe);
            if mailbox {
                self.run_mailbox(timeout)?;
            } else {
                self.run(timeout)?;
            }
        }
        // (Polling only if a completion arrived since the last poll: one load each.)
        if self.eng.progress.rang() {
            self.poll_cqs()?;
        }
        self.check_strays(false)
    }

    /// Whether every call is done.
    pub(super) fn all_done(&self) -> bool {
        self.calls.iter().all(One::is_done)
    }

    /// The first call not done (errors are told as its), or the first.
    pub(super) fn lead(&self) -> usize {
        self.calls.iter().position(|o| !o.is_done()).unwrap_or(0)
    }

    /// Reports the steps done to the flight recorder and the fault injector (which may stop
    /// this process after a given step).
    pub(super) fn note_steps(&mut self) {
        let done = self.calls.iter().map(One::steps_done).sum();
        if done != self.reported {
            self.reported = done;
            self.eng
                .probe
                .steps_done
                .store(done as u32, Ordering::Relaxed);
            if let Some(f) = self.eng.faults.as_mut().filter(|f| f.armed) {
                f.steps_done(done);
            }
        }
    }

    /// One round of the slot protocol over every call: what the completion queues hold,
    /// announcements, each call's pass, then turns between the calls. Returns whether
    /// anything moved.
    pub(super) fn round(&mut self, geo: &Geometry) -> Result<bool> {
        let mut progress = self.poll_cqs()?;
        if self.calls.iter().any(|o| o.announce) {
            self.announce_ready();
        }
        for c in 0..self.calls.len() {
            self.cur = c;
            while let Some(a) = self.calls[c].m().next(&mut self.eng.flows) {
                progress |= self.perform(&a, geo)?;
            }
        }
        if self.calls.len() > 1 {
            self.eng
                .flows
                .pass_turns(self.calls.iter().filter_map(|o| o.m.as_ref()));
        }
        self.cur = self.lead();
        Ok(progress)
    }

    /// What an idle call does between rounds: looks for strays, failed links and credits,
    /// then spins, yields or sleeps on the completion queues (at most until `deadline`, or
    /// 50 ms), as long as it has been idle (since `idle_since`).
    pub(super) fn idle(
        &mut self,
        now: Instant,
        idle_since: Instant,
        deadline: Instant,
    ) -> Result<()> {
        self.yields.idled();
        match self.eng.policy().pause(now - idle_since) {
            wait::Pause::Spin => {
                std::hint::spin_loop();
                return Ok(());
            }
            wait::Pause::Yield => {
                // Poll, and let other runnable threads (more ranks than cores) use the CPU.
                self.yields.cede();
                return Ok(());
            }
            wait::Pause::Sleep => {}
        }
        self.wait(
            deadline
                .min(now + Duration::from_millis(50))
                .saturating_duration_since(now),
        )
    }

    /// Looks for what an idle call cannot see in its rounds: data nobody takes, a failed
    /// link, credits written without a completion.
    pub(super) fn inspect(&mut self) -> Result<()> {
        self.check_strays(false)?;
        self.check_health()?;
        // (A credit's completion updates the count; its word in memory is the truth.)
        self.refresh_credits();
        Ok(())
    }

    pub(super) fn run(&mut self, timeout: Duration) -> Result<()> {
        // The clock is read only once the call idles (a call that never waits never reads it).
        let mut deadline: Option<Instant> = None;
        let mut graced = false;
        let geo = self.eng.geo;
        self.check_health()?;
        self.refresh_credits();
        let mut idle_since: Option<Instant> = None;
        // Whether this idle spell's wait is published for `oxccl status`.
        let mut published = false;
        while !self.all_done() {
            let progress = self.round(&geo)?;
            if self.all_done() {
                break;
            }
            if progress {
                idle_since = None;
                if published {
                    published = false;
                    self.eng.probe.waiting.store(0, Ordering::Relaxed);
                }
                continue;
            }
            self.inspect()?;
            let now = Instant::now();
            let deadline = deadline.get_or_insert(now + timeout);
            if expired(deadline, &mut graced, now) {
                return Err(self.timeout_error(timeout));
            }
            let since = *idle_since.get_or_insert(now);
            if !published && now - since >= PUBLISH_AFTER {
                published = true;
                self.publish_waiting(since, now);
            }
            self.idle(now, since, *deadline)?;
        }
        Ok(())
    }

    /// Performs one action of the protocol; returns whether it did something (a mailbox
    /// message that has not arrived, or a credit, is not progress).
    pub(super) fn perform(&mut self, a: &Action, geo: &Geometry) -> Result<bool> {
        let sched = self.calls[self.cur].sched;
        let r = match *a {
            Action::Post {
                step,
                q,
                slot,
                off,
                len,
                total,
                signaled,
            } => {
                let Op::Send { src, .. } = sched.steps[step].op else {
                    unreachable!("a post is a send's")
                };
                let (l, ch) = self.eng.flows.link_channel(q);
                let r = self.post_fragment(step, l, ch, slot, src, (off, len, total), signaled);
                if r.is_err() && signaled {
                    // Not posted: no completion will come for it.
                    self.calls[self.cur].m().completed(step, false);
                }
                r?;
                true
            }
            Action::Recv {
                step,
                mailbox: true,
                ..
            } => {
                let Op::Recv {
                    peer,
                    dst,
                    reduce_with,
                    ..
                } = sched.steps[step].op
                else {
                    unreachable!("a receive's")
                };
                let arrived = self.mailbox_recv(peer, dst, reduce_with, geo)?;
                if arrived {
                    self.calls[self.cur].m().commit(&mut self.eng.flows, a);
                }
                arrived
            }
            Action::Recv {
                step,
                q,
                slot,
                off,
                len,
                total,
                ..
            } => {
                let Op::Recv {
                    dst, reduce_with, ..
                } = sched.steps[step].op
                else {
                    unreachable!("a receive's")
                };
                let (l, ch) = self.eng.flows.link_channel(q);
                self.consume(l, ch, slot, dst, reduce_with, (off, len, total))?;
                true
            }
            Action::MailboxSend { step, .. } => {
                let Op::Send { peer, src, .. } = sched.steps[step].op else {
                    unreachable!("a send's")
                };
                self.mailbox_send(peer, src, geo)?;
                true
            }
            Action::Local { step } => {
                self.run_local(step)?;
                true
            }
            Action::Credit { q, consumed } => {
                self.send_credit(q, consumed, geo);
                false
            }
        };
        self.note_steps();
        Ok(r)
    }

    /// Reads every queue's credit word (what the receiver last reported consumed).
    pub(super) fn refresh_credits(&mut self) {
        let geo = self.eng.geo;
        for (l, link) in self.eng.links.iter().enumerate() {
            for ch in 0..geo.channels {
                let q = self.eng.flows.queue(l, ch);
                self.eng.flows.credit(q, link.credit_word(ch, &geo));
            }
        }
    }

    /// Waits for a completion on the provider contexts (at most `max`); handles what arrives.
    pub(super) fn wait(&mut self, max: Duration) -> Result<()> {
        // Sleep on the context of the link the lead call waits on (the others are polled
        // after at most a millisecond).
        let hint = match self.calls[self.cur].waiting(&self.eng.flows) {
            Some(
                Waiting::Data { q, .. }
                | Waiting::Slot { q, .. }
                | Waiting::Transport { q, .. }
                | Waiting::Earlier { q: Some(q), .. },
            ) => self.eng.links[self.eng.flows.link_channel(q).0].ctx,
            _ => 0,
        };
        let r = self.with_progress(|prog, call| prog.sleep(hint, max, |_, wc| call.handle(wc)));
        match r {
            Ok(_) => Ok(()),
            Err(progress::Waited::Handler(e)) => Err(e),
            Err(progress::Waited::Queue(e)) => Err(Error::Verbs {
                rank: self.eng.rank,
                what: format!("{}: waiting for completions", self.calls[self.cur].desc),
                source: e,
            }),
            Err(progress::Waited::Timeout { .. }) => Ok(()),
        }
    }

    /// Polls every completion queue and handles what they hold; whether anything was there.
    pub(super) fn poll_cqs(&mut self) -> Result<bool> {
        let n = self.with_progress(|prog, call| prog.poll_owned(|_, wc| call.handle(wc)))?;
        Ok(n > 0)
    }

    /// Runs `f` on the engine's progress with this call beside it: the handler of a completion
    /// needs the call mutably, which holds the engine, which holds the progress. (Taken out for
    /// `f`'s length; an empty placeholder allocates nothing.)
    fn with_progress<R>(&mut self, f: impl FnOnce(&mut Progress, &mut Self) -> R) -> R {
        let mut prog = std::mem::take(&mut self.eng.progress);
        let r = f(&mut prog, self);
        self.eng.progress = prog;
        r
    }

    pub(super) fn peer_of_qp(&self, qp_num: u32, ctx_hint: Option<usize>) -> Option<usize> {
        self.eng
            .links
            .iter()
            .position(|l| l.qp.qp_num() == qp_num && ctx_hint.is_none_or(|c| c == l.ctx))
    }

    pub(super) fn handle(&mut self, wc: &WorkCompletion) -> Result<()> {
        let kind = wc.wr_id & (0xff << 56);
        let link = match kind {
            WR_RECV => Some((wc.wr_id & 0xffff_ffff) as usize),
            _ => self.peer_of_qp(wc.qp_num, None),
        };
        if wc.status != WcStatus::Success {
            // The connection is dead: remember why; it fails this call only if the call still
            // needs that peer (a peer that finished and left is no error).
            let Some(l) = link else { return Ok(()) };
            let lk = &mut self.eng.links[l];
            if lk.failed.is_none() {
                let d = lk.qp.error_detail().unwrap_or_default();
                lk.failed = Some(format!(
                    "{:?} on the {} connection{}{d}",
                    wc.status,
                    lk.provider.name(),
                    if d.is_empty() { "" } else { ": " }
                ));
            }
            if kind == WR_DATA {
                self.data_completed(wc.wr_id, false);
            }
            return Ok(());
        }
        match kind {
            WR_RECV => {
                let l = link.unwrap_or(usize::MAX);
                let Some(lk) = self.eng.links.get_mut(l) else {
                    return Ok(());
                };
                let _ = lk.qp.post_recv(&[RecvWr::new(WR_RECV | l as u64, &[])]);
                let Some(v) = wc.imm else { return Ok(()) };
                let geo = self.eng.geo;
                match Imm::decode(v) {
                    Imm::Data { channel: ch, slot } if ch < geo.channels => {
                        let q = self.eng.flows.queue(l, ch);
                        self.eng.flows.arrived(q, slot);
                        self.bytes_in += wc.byte_len as u64;
                        self.eng
                            .probe
                            .bytes_in
                            .store(self.bytes_in, Ordering::Relaxed);
                    }
                    Imm::Mailbox => {
                        lk.mbox_landed += 1;
                        self.bytes_in += wc.byte_len as u64;
                        self.eng
                            .probe
                            .bytes_in
                            .store(self.bytes_in, Ordering::Relaxed);
                    }
                    Imm::Credit { channel: ch } if ch < geo.channels => {
                        let q = self.eng.flows.queue(l, ch);
                        let word = lk.credit_word(ch, &geo);
                        self.eng.flows.credit(q, word);
                    }
                    Imm::Notice(Notice::DumpRequest) => {
                        let peer = lk.peer;
                        crate::flight::dump_on_request(&self.eng.probe, peer);
                    }
                    Imm::Notice(Notice::Failed(dead)) => {
                        let peer = lk.peer;
                        let (culprit, detail) = if dead == self.eng.rank {
                            // Our connection to the reporter failed on its side only.
                            (
                                peer,
                                format!("rank {peer} lost its connection to this rank"),
                            )
                        } else if dead == peer {
                            (
                                peer,
                                format!("rank {peer} reports that its own call failed"),
                            )
                        } else {
                            (dead, format!("rank {peer} reports that rank {dead} failed"))
                        };
                        self.eng.failed_by_notice = true;
                        return Err(Error::PeerFailed {
                            rank: self.eng.rank,
                            op: self.calls[self.cur].desc.to_string(),
                            peer: culprit,
                            detail,
                        });
                    }
                    Imm::Notice(Notice::Aborted) => {
                        let peer = lk.peer;
                        return Err(Error::Aborted {
                            rank: self.eng.rank,
                            op: self.calls[self.cur].desc.to_string(),
                            reason: format!("rank {peer} aborted the communicator"),
                        });
                    }
                    Imm::Mismatch { seq } => {
                        let peer = lk.peer;
                        // A notice about a call this rank has not started (it is behind)
                        // fails that call when it starts, not this one.
                        let last = self.calls.last().map_or(0, |o| o.desc.seq);
                        let ahead = seq.wrapping_sub(last as u32) & 0xff_ffff;
                        if ahead != 0 && ahead < 1 << 23 {
                            self.eng.pending_mismatch.get_or_insert((seq, peer));
                            return Ok(());
                        }
                        let theirs = self
                            .eng
                            .recent
                            .newest_first()
                            .find(|d| d.seq & 0xff_ffff == u64::from(seq))
                            .map_or(format!("call #{seq} (modulo 2^24)"), |d| d.to_string());
                        let detail = if self.eng.is_aggregator(peer) {
                            let addr = self.eng.agg.as_ref().map_or("", |a| a.addr());
                            format!(
                                "the aggregation service at {addr} found that the ranks' calls \
                                 differ in {theirs} (this rank's); this rank is now in {} (the \
                                 service's log names both sides)",
                                self.calls[self.cur].desc
                            )
                        } else {
                            format!(
                                "rank {peer} found that what this rank sent in {theirs} does not \
                                 match its own call; this rank is now in {} (rank {peer}'s error \
                                 names both sides)",
                                self.calls[self.cur].desc
                            )
                        };
                        return Err(Error::Mismatch {
                            rank: self.eng.rank,
                            detail,
                        });
                    }
                    _ => {}
                }
            }
            WR_DATA => {
                // Every fragment is metered, also one an earlier call posted.
                if let Some(m) = link
                    .and_then(|l| self.eng.links.get_mut(l))
                    .and_then(|l| l.meter.as_mut())
                {
                    let now = Instant::now();
                    if let Some(len) = m.completed(now) {
                        self.eng.egress.completed(len, now);
                    }
                }
                self.data_completed(wc.wr_id, true);
            }
            _ => {}
        }
        Ok(())
    }

    /// A data fragment completed: tells the call that posted it (by its tag), if it is one of
    /// these (an inline fragment's completion may come during a later call).
    pub(super) fn data_completed(&mut self, wr_id: u64, ok: bool) {
        for one in self.calls.iter_mut() {
            if let Some(s) = data_wr_step(wr_id, one.tag) {
                one.m().completed(s, ok);
                return;
            }
        }
    }

    /// Fails the call if a connection it still needs has failed (a queue pair in ERR counts,
    /// even before a completion says so), or if the communicator was aborted.
    pub(super) fn check_health(&mut self) -> Result<()> {
        for l in 0..self.eng.links.len() {
            self.eng.links[l].refresh_failed();
            if self.check_link(l).is_err() {
                // What arrived before the connection failed comes first: a notice (a peer that
                // reported a failure, then closed) explains it better, and the last data of a
                // peer that finished this call and left (its completions may still wait in
                // the completion queue) means the link is no longer needed.
                self.poll_cqs()?;
                self.check_link(l)?;
            }
        }
        if self.eng.abort.is_set() {
            return Err(Error::Aborted {
                rank: self.eng.rank,
                op: self.calls[self.cur].desc.to_string(),
                reason: self.eng.abort.reason().to_string(),
            });
        }
        Ok(())
    }

    /// Fails the call if link `l` has failed and a step not yet done involves its peer.
    pub(super) fn check_link(&self, l: usize) -> Result<()> {
        let peer = self.eng.links[l].peer;
        let Some(why) = &self.eng.links[l].failed else {
            return Ok(());
        };
        // Data that arrived before the failure still counts: in slots, or a message waiting in
        // the mailbox (a peer that sent its last message and closed at once).
        let link = &self.eng.links[l];
        let ch = self.eng.geo.channels;
        let nothing_left = (0..ch).all(|c| self.eng.flows.get(l * ch + c).arrived.is_empty())
            && !(self.calls[self.cur].mailbox && link.mailbox_arrived(&self.eng.geo));
        let (sends, recvs) = self
            .calls
            .iter()
            .map(|o| o.m.as_ref().map_or((true, true), |m| m.needs_link(l)))
            .fold((false, false), |(a, b), (c, d)| (a || c, b || d));
        let needed = sends || (recvs && nothing_left);
        if needed {
            return Err(Error::PeerFailed {
                rank: self.eng.rank,
                op: self.calls[self.cur].desc.to_string(),
                peer,
                detail: why.clone(),
            });
        }
        Ok(())
    }

    /// Tells the flight recorder what this idle call waits for (once per idle spell, off the
    /// fast path), for `oxccl status`.
    #[cold]
    pub(super) fn publish_waiting(&self, idle_since: Instant, now: Instant) {
        let flows = &self.eng.flows;
        let peer_of = |q: usize| self.eng.links[flows.link_channel(q).0].peer;
        let one = &self.calls[self.cur];
        let (step, waited) = match one.waiting(flows) {
            Some(Waiting::Data { step, q }) if one.mailbox => {
                (step, Waited::Mailbox { peer: peer_of(q) })
            }
            Some(Waiting::Data { step, q }) => (
                step,
                Waited::Data {
                    peer: peer_of(q),
                    channel: flows.link_channel(q).1,
                },
            ),
            Some(Waiting::Slot { step, q, .. }) => (
                step,
                Waited::Slot {
                    peer: peer_of(q),
                    channel: flows.link_channel(q).1,
                },
            ),
            Some(Waiting::Transport { step, q }) => (step, Waited::Transport { peer: peer_of(q) }),
            Some(Waiting::Earlier { step, q: Some(q) })
                if matches!(one.sched.steps[step].op, Op::Send { .. }) =>
            {
                (step, Waited::EarlierSend { peer: peer_of(q) })
            }
            Some(Waiting::Earlier { step, .. }) => (step, Waited::Earlier),
            None => (0, Waited::Earlier),
        };
        let idle_ns = u64::try_from((now - idle_since).as_nanos()).unwrap_or(u64::MAX);
        flight::publish_waiting(
            &self.eng.probe,
            waited,
            step,
            flight::now_ns().saturating_sub(idle_ns),
        );
    }

    pub(super) fn timeout_error(&self, timeout: Duration) -> Error {
        let flows = &self.eng.flows;
        let peer_of = |q: usize| self.eng.links[flows.link_channel(q).0].peer;
        let w = self.calls[self.cur].waiting(flows);
        let (step, waiting, peer) = match w {
            Some(Waiting::Data { step, q }) if self.calls[self.cur].mailbox => (
                step,
                format!("waiting for rank {}'s message in its mailbox", peer_of(q)),
                Some(peer_of(q)),
            ),
            Some(Waiting::Data { step, q }) => (
                step,
                format!(
                    "waiting for data from rank {} (channel {})",
                    peer_of(q),
                    flows.link_channel(q).1
                ),
                Some(peer_of(q)),
            ),
            Some(Waiting::Slot {
                step, q, posted, ..
            }) => {
                let (l, ch) = flows.link_channel(q);
                let link = &self.eng.links[l];
                (
                    step,
                    format!(
                        "waiting for rank {} to free a slot (channel {ch}, {posted} fragments \
                         posted, {} consumed)",
                        link.peer,
                        link.credit_word(ch, &self.eng.geo)
                    ),
                    Some(link.peer),
                )
            }
            Some(Waiting::Transport { step, q }) => (
                step,
                format!(
                    "waiting for the transport to finish a send to rank {}",
                    peer_of(q)
                ),
                Some(peer_of(q)),
            ),
            Some(Waiting::Earlier { step, q: Some(q) })
                if matches!(self.calls[self.cur].sched.steps[step].op, Op::Send { .. }) =>
            {
                (
                    step,
                    format!("waiting to send to rank {} after earlier steps", peer_of(q)),
                    Some(peer_of(q)),
                )
            }
            Some(Waiting::Earlier { step, .. }) => {
                (step, "waiting for earlier steps".to_string(), None)
            }
            None => (0, "waiting for earlier steps".to_string(), None),
        };
        Error::Timeout {
            rank: self.eng.rank,
            op: Box::new(self.calls[self.cur].desc),
            timeout,
            waiting,
            peer,
            step,
            steps: self.calls[self.cur].sched.steps.len(),
            bytes: self.bytes_in,
        }
    }

    /// After an error: quiesces the connections ([`Call::quiesce`]) and forgets what the
    /// meters counted in flight.
    pub(super) fn stop_after_error(&mut self) {
        self.quiesce();
        for m in self.eng.links.iter_mut().filter_map(|l| l.meter.as_mut()) {
            m.reset_in_flight();
        }
        self.eng.egress.reset_in_flight();
    }

    /// After an error: stop every connection (so no transport still reads the caller's
    /// buffers) and drain what completes, briefly.
    pub(super) fn quiesce(&mut self) {
        // Wait (briefly) for the transport to finish reading the caller's buffers; only links
        // still busy after that are stopped, so peers are not told that a live rank failed.
        let end = Instant::now() + Duration::from_millis(500);
        while self
            .calls
            .iter()
            .any(|o| o.m.as_ref().is_some_and(Machine::outstanding))
        {
            if Instant::now() >= end {
                for l in &self.eng.links {
                    l.qp.to_error();
                }
                break;
            }
            let _ = self.with_progress(|prog, call| {
                prog.poll_owned(|_, wc| {
                    if wc.wr_id & (0xff << 56) == WR_DATA {
                        call.data_completed(wc.wr_id, false);
                    }
                    Ok::<(), ()>(())
                })
            });
            std::thread::yield_now();
        }
    }

    /// Data that no step of this call will take: a fragment in a slot with no receive left
    /// for its (peer, channel), or a message in a mailbox this call does not read. Data for a
    /// later call (a peer that is ahead) is fine; data for this call or an earlier one means
    /// the ranks disagree about what they are doing.
    pub(super) fn check_strays(&self, mailbox: bool) -> Result<()> {
        let geo = self.eng.geo;
        let nch = geo.channels;
        let flows = &self.eng.flows;
        for (l, link) in self.eng.links.iter().enumerate() {
            for ch in 0..nch {
                let q = flows.queue(l, ch);
                let waiting = self
                    .calls
                    .iter()
                    .any(|o| !o.mailbox && o.m.as_ref().is_some_and(|m| m.receiving_on(q)));
                let Some(&slot) = flows.get(q).arrived.front() else {
                    continue;
                };
                if waiting || slot as usize >= geo.slots {
                    continue;
                }
                if let Ok(h) = link.header_at(geo.slot_offset(ch, slot as usize)) {
                    self.stray(&h, link.peer)?;
                }
            }
            // In a mailbox call, a message from a peer it receives from is its own.
            let ours = mailbox
                && self.calls[0]
                    .sched
                    .steps
                    .iter()
                    .any(|s| matches!(s.op, Op::Recv { peer, .. } if peer == link.peer));
            if !ours && link.mailbox_arrived(&geo) {
                self.stray(&link.inbox(&geo).header(), link.peer)?;
            }
        }
        Ok(())
    }

    pub(super) fn stray(&self, h: &Header, peer: usize) -> Result<()> {
        let p2p = h.coll == CollectiveKind::Send.code()
            || self.calls.iter().any(|o| o.desc.coll.is_point_to_point());
        // A later call's data is a peer that is ahead, not a mismatch (sequence numbers
        // compare with wrap-around: init's probe numbers its calls just below 0). In a group,
        // later than its last call.
        let last = self.calls.last().map_or(0, |o| o.desc.seq);
        let later = (h.seq.wrapping_sub(last) as i64) > 0;
        if h.magic == protocol::MAGIC && (p2p || later) {
            return Ok(());
        }
        Err(self.mismatch_at(
            h.seq,
            format!(
                "rank {} is in {}, but rank {peer} sent data this call does not expect, for \
                 {}{}",
                self.eng.rank,
                self.calls[self.cur].desc,
                h.describe(),
                self.our_side(h)
            ),
        ))
    }

    /// This rank's own side of an earlier call a peer's data belongs to, when it still knows
    /// it: ", where this rank ran broadcast #1 (...)".
    pub(super) fn our_side(&self, h: &Header) -> String {
        self.eng
            .recent
            .newest_first()
            .find(|d| d.seq == h.seq && h.seq != self.calls[self.cur].desc.seq)
            .map_or(String::new(), |d| format!(", where this rank ran {d}"))
    }
}
