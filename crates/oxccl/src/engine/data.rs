//! Moving data: locating a call's regions and their registrations, posting fragments (through
//! slots or in place) and mailbox messages, consuming them, credits, announcements, local
//! steps.

use super::*;

impl Call<'_, '_> {
    /// Applies the faults injected into a send to `peer` (link `l`): a drop, a delay, a damaged
    /// header (`hb`).
    #[cold]
    pub(super) fn send_faults(&mut self, l: usize, peer: usize, hb: &mut [u8]) {
        let Some(f) = self.eng.faults.as_mut() else {
            return;
        };
        let what = f.on_send(peer);
        if let Some(d) = what.delay {
            crate::log_warn(format!(
                "fault injection: rank {} waits {d:?} before sending to rank {peer} in {}",
                self.eng.rank, self.calls[self.cur].desc
            ));
            std::thread::sleep(d);
        }
        if what.corrupt {
            crate::log_warn(format!(
                "fault injection: rank {} damages a header sent to rank {peer} in {}",
                self.eng.rank, self.calls[self.cur].desc
            ));
            hb[8] ^= 0x5a;
        }
        if what.drop {
            crate::log_warn(format!(
                "fault injection: rank {} drops its connection to rank {peer} in {}",
                self.eng.rank, self.calls[self.cur].desc
            ));
            self.eng.links[l].qp.disconnect();
        }
    }

    pub(super) fn invalid(&self, msg: String) -> Error {
        Error::InvalidArgument {
            rank: self.eng.rank,
            msg: format!("{}: {msg}", self.calls[self.cur].desc),
        }
    }

    /// Byte address and length of a region, checked against its buffer.
    #[inline]
    pub(super) fn locate(&self, reg: Region) -> Result<(*mut u8, usize)> {
        let one = &self.calls[self.cur];
        let (base, len, start) = one.spans[reg.buf as usize];
        let off = start + reg.offset * one.esize;
        let bytes = reg.len * one.esize;
        if off.checked_add(bytes).is_none_or(|end| end > len) {
            return Err(self.outside(reg, off, bytes, len));
        }
        // SAFETY: `off + bytes <= len`, the length of the buffer `base` points to.
        Ok((unsafe { base.add(off) }, bytes))
    }

    #[cold]
    pub(super) fn outside(&self, reg: Region, off: usize, bytes: usize, len: usize) -> Error {
        self.invalid(format!(
            "step needs bytes {off}..{} of the {:?} buffer, which has {len}",
            off.saturating_add(bytes),
            reg.buf
        ))
    }

    /// The memory region covering `reg`'s buffer on context `ctx`, registered on first use
    /// (or registered already: `Communicator::register`), and `reg`'s offset in it.
    pub(super) fn mr_for(&mut self, reg: Region, ctx: usize) -> Result<(MrRef, usize)> {
        let (ptr, bytes) = self.locate(reg)?;
        let one = &self.calls[self.cur];
        let (base, len, _) = one.spans[reg.buf as usize];
        let off = ptr as usize - base as usize;
        let rank = self.eng.rank;
        if self
            .eng
            .faults
            .as_mut()
            .is_some_and(|f| f.armed && f.refuse_registration())
        {
            return Err(Error::Verbs {
                rank,
                what: format!("{}: registering memory", self.calls[self.cur].desc),
                source: oxccl_verbs::Error::InvalidArgument(
                    "refused by fault injection (OXCCL_FAULT=refuse_reg)".into(),
                ),
            });
        }
        let shared_scratch = reg.buf == Buf::Scratch && !one.own_scratch;
        if !shared_scratch && let Some((i, start, _)) = self.eng.regs.find(ptr as usize, bytes, ctx)
        {
            return Ok((MrRef::Registered(i, ctx), ptr as usize - start));
        }
        if shared_scratch {
            if self.eng.scratch_mrs[ctx].is_none() {
                // SAFETY: the scratch vector lives in the engine and is only replaced (after
                // dropping its registrations) when a call needs more.
                let mr =
                    unsafe { self.eng.pds[ctx].reg_mr_raw(base, len, AccessFlags::LOCAL_WRITE) }
                        .map_err(|e| Error::Verbs {
                            rank,
                            what: "registering scratch memory".into(),
                            source: e,
                        })?;
                self.eng.scratch_mrs[ctx] = Some(mr);
            }
            return Ok((MrRef::Scratch(ctx), off));
        }
        let key = (base as usize, ctx);
        if let Some(i) = one.mrs.mrs.iter().position(|(k, _)| *k == key) {
            return Ok((MrRef::Call(i), off));
        }
        // SAFETY: the call's buffers stay valid and untouched by their owner until the call
        // returns (or its work completes), and the registration is dropped before that
        // (`Call::mrs`); the region is only read locally (no remote access).
        let mr = unsafe { self.eng.pds[ctx].reg_mr_raw(base, len, AccessFlags::LOCAL_WRITE) }
            .map_err(|e| Error::Verbs {
                rank,
                what: "registering the caller's buffer".into(),
                source: e,
            })?;
        self.calls[self.cur].mrs.mrs.push((key, mr));
        Ok((MrRef::Call(self.calls[self.cur].mrs.mrs.len() - 1), off))
    }

    pub(super) fn mr(&self, r: MrRef) -> &MemoryRegion {
        match r {
            MrRef::Scratch(ctx) => self.eng.scratch_mrs[ctx]
                .as_ref()
                .expect("registered by mr_for"),
            MrRef::Call(i) => &self.calls[self.cur].mrs.mrs[i].1,
            MrRef::Registered(i, ctx) => &self.eng.regs.get(i).mrs[ctx],
        }
    }

    /// Stores step `src`'s data as the next mailbox message to `peer`, straight into the
    /// peer's mapped mailbox ([`crate::mailbox::post`]).
    pub(super) fn mailbox_send(&mut self, peer: usize, src: Region, geo: &Geometry) -> Result<()> {
        let rank = self.eng.rank;
        let l = self.eng.link_of[peer];
        let (p, len) = self.locate(src)?;
        let h = self.calls[self.cur].want.from(rank).at(len, 0, len);
        let mut hb = [0u8; SHORT_HEADER];
        h.encode_short(&mut hb);
        if self.eng.faults.as_ref().is_some_and(|f| f.armed) {
            self.send_faults(l, peer, &mut hb);
        }
        let link = &self.eng.links[l];
        // A connection that failed (or was dropped) carries nothing more, as a request would
        // not be executed.
        if link.qp.state() != QpState::Rts {
            return Err(self.link_down(l));
        }
        let m = link.mbox_sent;
        let parity = (m % 2) as usize;
        // SAFETY: bounds-checked by `locate`.
        let data = unsafe { std::slice::from_raw_parts(p as *const u8, len) };
        match &link.outbox {
            Some(outbox) => {
                mailbox::post(outbox, geo.mailbox_offset(parity), &hb, data, m + 1)
                    .map_err(|e| self.invalid(e))?;
            }
            None => {
                // Composed in the staging region, then written whole. The image of parity
                // `parity` is composed again two messages later, once the peer has answered
                // the one between: by then it has read this one, so the write has left.
                let at = geo.stage_mailbox(parity);
                mailbox::post(&link.stage, at, &hb, data, m + 1).map_err(|e| self.invalid(e))?;
                let used = oxccl_core::protocol::mailbox::used(len);
                let sge = [Sge::new(&link.stage, at, used)];
                let wr = SendWr::new(
                    WR_CTRL,
                    WrOp::WriteWithImm {
                        remote: link.remote.at(geo.mailbox_offset(parity) as u64),
                        imm: Imm::Mailbox.encode(),
                    },
                    &sge,
                )
                .unsignaled();
                link.qp
                    .post_send(&[wr])
                    .map_err(|e| self.send_error(l, e))?;
            }
        }
        self.eng.links[l].mbox_sent += 1;
        self.eng.stats.sent += len as u64;
        Ok(())
    }

    /// Consumes `peer`'s next mailbox message into `dst` (reduced with `reduce_with`) if it
    /// has arrived. Its header is checked as soon as it is there, before the rest: a peer in
    /// another call, or sending another length, is found rather than waited for.
    pub(super) fn mailbox_recv(
        &mut self,
        peer: usize,
        dst: Region,
        reduce_with: Option<Region>,
        geo: &Geometry,
    ) -> Result<bool> {
        let l = self.eng.link_of[peer];
        let link = &self.eng.links[l];
        if !link.mailbox_arrived(geo) {
            return Ok(false);
        }
        let flag = link.mbox_recv + 1;
        let inbox = link.inbox(geo);
        let one = &self.calls[self.cur];
        let total = dst.len * one.esize;
        let want = one.want.from(peer).at(total, 0, total);
        if !inbox.header_is(&want) {
            self.check_header(&inbox.header(), peer, total, 0, total)?;
        }
        if !inbox.complete(total, flag) {
            return Ok(false);
        }
        self.bytes_in += total as u64;
        self.eng
            .probe
            .bytes_in
            .store(self.bytes_in, Ordering::Relaxed);
        self.apply(l, inbox.data(), total, dst, reduce_with, 0)?;
        self.count_out(total, reduce_with.is_some());
        self.eng.links[l].mbox_recv += 1;
        Ok(true)
    }

    /// Consumes the fragment in `slot` of link `l`'s channel `ch` into `dst` (reduced with
    /// `reduce_with`), where it must be bytes `off..off + len` of a transfer of `total`.
    pub(super) fn consume(
        &mut self,
        l: usize,
        ch: usize,
        slot: u32,
        dst: Region,
        reduce_with: Option<Region>,
        (off, len, total): (usize, usize, usize),
    ) -> Result<()> {
        let geo = self.eng.geo;
        let link = &self.eng.links[l];
        let peer = link.peer;
        let slot = slot as usize;
        if slot >= geo.slots {
            return Err(self.mismatch(format!("a fragment named slot {slot}")));
        }
        let base = geo.slot_offset(ch, slot);
        let h = link.header_at(base).map_err(|e| Error::Verbs {
            rank: self.eng.rank,
            what: "reading a slot".into(),
            source: e,
        })?;
        self.check_header(&h, peer, total, off, len)?;
        if h.placed != 0 {
            return self.placed(&h, peer, dst, reduce_with, off, len);
        }
        self.apply(l, base + SLOT_HEADER, len, dst, reduce_with, off)?;
        self.count_out(len, reduce_with.is_some());
        Ok(())
    }

    /// Counts `len` bytes taken out of a slot or mailbox (reduced, or copied).
    pub(super) fn count_out(&mut self, len: usize, reduced: bool) {
        let st = &mut self.eng.stats;
        if reduced {
            st.reduced += len as u64;
        } else {
            st.copied += len as u64;
        }
    }

    /// A fragment whose data the sender wrote in place: it must have gone exactly where this
    /// rank announced (bytes `off..off + len` of `dst`, not reduced), and nothing is left to
    /// copy.
    pub(super) fn placed(
        &mut self,
        h: &Header,
        peer: usize,
        dst: Region,
        reduce_with: Option<Region>,
        off: usize,
        len: usize,
    ) -> Result<()> {
        let (p, n) = self.locate(dst)?;
        let want = p as u64 + off as u64;
        if reduce_with.is_some() || off + len > n || h.placed != want {
            return Err(self.mismatch(format!(
                "rank {peer} wrote bytes {off}..{} of a transfer in place at {:#x}, where this \
                 rank {}",
                off + len,
                h.placed,
                if reduce_with.is_some() {
                    "reduces what it receives and announced no destination".to_string()
                } else {
                    format!("announced {want:#x}")
                }
            )));
        }
        self.eng.stats.received_in_place += len as u64;
        Ok(())
    }

    /// Checks a fragment's header against this call: the fingerprint, then that it is bytes
    /// `progress..progress + expect` of a transfer of `total` bytes.
    pub(super) fn check_header(
        &self,
        h: &Header,
        peer: usize,
        total: usize,
        progress: usize,
        expect: usize,
    ) -> Result<()> {
        let want = self.calls[self.cur].want.from(peer);
        let violation = match h.check(&want, total, progress, expect) {
            Ok(()) => return Ok(()),
            Err(v) => v,
        };
        if violation == Violation::Damaged {
            return Err(Error::PeerFailed {
                rank: self.eng.rank,
                op: self.calls[self.cur].desc.to_string(),
                peer,
                detail: format!(
                    "a fragment header from rank {peer} is damaged (checksum mismatch): the \
                     data was corrupted on the way, so this call cannot trust what it received"
                ),
            });
        }
        if violation == Violation::Fingerprint {
            return Err(self.mismatch(format!(
                "rank {} is in {}, but rank {peer} sent data for {}{}",
                self.eng.rank,
                self.calls[self.cur].desc,
                h.describe(),
                self.our_side(h)
            )));
        }
        if violation == Violation::Position {
            return Err(self.mismatch(format!(
                    "in {}, rank {} expects {total} bytes from rank {peer} (at offset {progress}), which sends {} (at offset {})",
                    self.calls[self.cur].desc, self.eng.rank, h.xfer_len, h.frag_off
                ),
            ));
        }
        Err(self.mismatch(format!(
            "a fragment of {} bytes at offset {progress} of {total}, where the protocol puts \
             {expect}",
            h.frag_len
        )))
    }

    /// Copies or reduces `len` bytes at `off` in link `l`'s receive region into bytes
    /// `progress..` of `dst`.
    pub(super) fn apply(
        &self,
        l: usize,
        off: usize,
        len: usize,
        dst: Region,
        reduce_with: Option<Region>,
        progress: usize,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let link = &self.eng.links[l];
        if off + len > link.slots.len() {
            return Err(self.invalid(format!(
                "a fragment beyond the receive region ({off}+{len})"
            )));
        }
        // Bytes `progress..progress + len` of a region.
        let part = |r: Region| -> Result<*mut u8> {
            let (p, n) = self.locate(r)?;
            if progress + len > n {
                return Err(self.invalid(format!(
                    "a fragment at {progress}+{len} of a region of {n} bytes"
                )));
            }
            // SAFETY: `progress + len <= n`, the region's length (checked above).
            Ok(unsafe { p.add(progress) })
        };
        let dp = part(dst)?;
        // SAFETY: `off + len` lies inside the receive region (checked above); the peer does
        // not write these bytes again until we return its credit or read its next message.
        let data = unsafe { std::slice::from_raw_parts(link.slots.as_ptr().add(off), len) };
        match reduce_with {
            Some(w) => {
                let wp = part(w)?;
                if wp == dp {
                    // SAFETY: `locate` bounds-checked `dp..dp+len` in a buffer the engine
                    // alone uses during the call.
                    let d = unsafe { std::slice::from_raw_parts_mut(dp, len) };
                    reduce::reduce_in_place(
                        self.calls[self.cur].dtype,
                        self.calls[self.cur].op,
                        d,
                        data,
                    );
                } else {
                    check_disjoint(dp, wp, len).map_err(|m| self.invalid(m))?;
                    // SAFETY: both bounds-checked, and disjoint (checked above).
                    let (d, a) = unsafe {
                        (
                            std::slice::from_raw_parts_mut(dp, len),
                            std::slice::from_raw_parts(wp as *const u8, len),
                        )
                    };
                    reduce::reduce_to(
                        self.calls[self.cur].dtype,
                        self.calls[self.cur].op,
                        d,
                        a,
                        data,
                    );
                }
            }
            None => {
                // SAFETY: bounds-checked by `locate`; the receive region is another mapping.
                let d = unsafe { std::slice::from_raw_parts_mut(dp, len) };
                d.copy_from_slice(data);
            }
        }
        Ok(())
    }

    /// A mismatch error; every peer is told (with this call's sequence number), so that its
    /// call, or its next, fails too.
    pub(super) fn mismatch(&self, detail: String) -> Error {
        self.mismatch_at(self.calls[self.cur].desc.seq, detail)
    }

    /// [`Call::mismatch`] about call `seq` (an earlier call's data can be found late).
    pub(super) fn mismatch_at(&self, seq: u64, detail: String) -> Error {
        Engine::notify_all(&self.eng.links, Imm::Mismatch { seq: seq as u32 }.encode());
        Error::Mismatch {
            rank: self.eng.rank,
            detail,
        }
    }

    /// Posts bytes `off..off + len` of `src` (a transfer of `total`) for send step `s` into
    /// `slot` of link `l`'s channel `ch`; copied beside the header unless `signaled`. A
    /// fragment the receiver's announcement names is written in place: its data straight to
    /// the destination, then its header (saying where) through the slot.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn post_fragment(
        &mut self,
        s: usize,
        l: usize,
        ch: usize,
        slot: u32,
        src: Region,
        (off, len, total): (usize, usize, usize),
        signaled: bool,
    ) -> Result<()> {
        let geo = self.eng.geo;
        let rank = self.eng.rank;
        let placed = if signaled && total >= PLACE_MIN {
            self.placement(l, ch, total, off)
        } else {
            None
        };
        let mut h = self.calls[self.cur].want.from(rank).at(total, off, len);
        h.placed = placed.map_or(0, |(addr, _)| addr);
        let slot = slot as usize;
        let stage_off = geo.stage_offset(ch, slot);
        let mut hb = [0u8; SLOT_HEADER];
        h.encode(&mut hb);
        if self.eng.faults.as_ref().is_some_and(|f| f.armed) {
            self.send_faults(l, self.eng.links[l].peer, &mut hb);
        }
        let link = &self.eng.links[l];
        let verbs_err = |what: &str, e| Error::Verbs {
            rank,
            what: what.into(),
            source: e,
        };
        link.stage
            .write(stage_off, &hb)
            .map_err(|e| verbs_err("staging a header", e))?;
        let remote = link.remote.at(geo.slot_offset(ch, slot) as u64);
        let wr_imm = Imm::Data {
            channel: ch,
            slot: slot as u32,
        }
        .encode();
        let inline = !signaled;
        let es = self.calls[self.cur].esize;
        let part = src.sub(off / es, len / es);
        if inline && len > 0 {
            let (p, _) = self.locate(part)?;
            // SAFETY: bounds-checked by `locate`.
            let data = unsafe { std::slice::from_raw_parts(p as *const u8, len) };
            link.stage
                .write(stage_off + SLOT_HEADER, data)
                .map_err(|e| verbs_err("staging a fragment", e))?;
        }
        let wr_id = data_wr_id(self.calls[self.cur].tag, s);
        // Inline: header and data from the staging region. Otherwise the header from staging
        // and the data straight from the caller's (or scratch) memory, registered on first use
        // (or registered already: `Communicator::register`).
        let source = if inline {
            None
        } else {
            Some(self.mr_for(part, self.eng.links[l].ctx)?)
        };
        let link = &self.eng.links[l];
        let head = if inline {
            SLOT_HEADER + len
        } else {
            SLOT_HEADER
        };
        let first = Sge::new(&link.stage, stage_off, head);
        let header_wr = |sges| {
            SendWr::new(
                wr_id,
                WrOp::WriteWithImm {
                    remote,
                    imm: wr_imm,
                },
                sges,
            )
        };
        // A credit owed to this peer rides along: posted in the same list, the provider sends
        // both at once (one sendmsg over tcp), and the peer needs no credit of its own.
        let q = self.eng.flows.queue(l, ch);
        let owed = self.eng.flows.credit_owed(q).filter(|c| {
            link.stage
                .write(geo.stage_credit(ch), &c.to_le_bytes())
                .is_ok()
        });
        let credit_sge = [Sge::new(&link.stage, geo.stage_credit(ch), 8)];
        let mut wrs: smallvec::SmallVec<[SendWr<'_>; 3]> = smallvec::SmallVec::new();
        if owed.is_some() {
            wrs.push(credit_wr(link, ch, &geo, &credit_sge));
        }
        let data;
        let head;
        let both;
        match (source, placed) {
            // In place: the data to the destination, then (ordered after it on the connection)
            // the header alone, whose completion says both are done.
            (Some((r, mr_off)), Some((addr, rkey))) => {
                data = [Sge::new(self.mr(r), mr_off, len)];
                head = [first];
                wrs.push(
                    SendWr::new(
                        wr_id,
                        WrOp::Write {
                            remote: RemoteAddr { addr, rkey },
                        },
                        &data,
                    )
                    .unsignaled(),
                );
                wrs.push(header_wr(&head));
            }
            (Some((r, mr_off)), None) => {
                both = [first, Sge::new(self.mr(r), mr_off, len)];
                wrs.push(header_wr(&both));
            }
            // Inline: the bytes were copied, so nothing waits for the completion (a failure
            // is still reported); without one the tcp target need not ACK each fragment.
            (None, _) => {
                head = [first];
                wrs.push(header_wr(&head).unsignaled());
            }
        }
        let posted = link.qp.post_send(&wrs);
        drop(wrs);
        if let (Ok(()), Some(c)) = (&posted, owed) {
            self.eng.flows.credit_sent(q, c);
        }
        posted.map_err(|e| self.send_error(l, e))?;
        if placed.is_some() {
            self.eng.stats.placed += len as u64;
        } else {
            self.eng.stats.sent += len as u64;
        }
        let link = &mut self.eng.links[l];
        if self.eng.metering
            && let Some(m) = &mut link.meter
        {
            let now = Instant::now();
            m.posted(SLOT_HEADER + len, now);
            self.eng.egress.posted(now);
        }
        Ok(())
    }

    /// Where the receiver on link `l` announced that the fragment being posted on channel
    /// `ch` (bytes `off..` of a transfer of `total`) goes in place, if it did: the address and
    /// the remote key ([`Announce`]).
    pub(super) fn placement(
        &self,
        l: usize,
        ch: usize,
        total: usize,
        off: usize,
    ) -> Option<(u64, u64)> {
        let link = &self.eng.links[l];
        let q = self.eng.flows.queue(l, ch);
        // The machine counted this fragment as posted already.
        let number = self.eng.flows.get(q).posted.checked_sub(1)?;
        let mut b = [0u8; ANNOUNCE];
        (0..ANNOUNCE_RING).find_map(|i| {
            link.slots
                .read(self.eng.geo.announce_offset(ch, i), &mut b)
                .ok()?;
            let a = Announce::decode(&b)?;
            Some((a.place(number, total, off)?, a.rkey))
        })
    }

    /// Offers the senders of the coming receives of calls that may place (up to
    /// [`ANNOUNCE_RING`] ahead on each queue, in order, as far as their dependencies are done)
    /// their destinations, where those are registered memory the link writes without a copy
    /// through the slots ([`Announce`]). Each receive is considered once: the engine keeps,
    /// per queue, the fragment number up to which it has.
    pub(super) fn announce_ready(&mut self) {
        for c in 0..self.calls.len() {
            if !self.calls[c].announce {
                continue;
            }
            self.cur = c;
            for i in 0..self.calls[c].m().receive_queues().len() {
                let q = self.calls[c].m().receive_queues()[i] as usize;
                loop {
                    let from = self.eng.announced[q];
                    let next = self.calls[c]
                        .m()
                        .receives_ahead(&self.eng.flows, q)
                        .take(ANNOUNCE_RING)
                        .find(|&(_, _, first, _)| first >= from);
                    let Some((_, step, first, true)) = next else {
                        break;
                    };
                    let frags = self.announce(step, q, first);
                    self.eng.announced[q] = first + frags;
                }
            }
        }
        self.cur = self.lead();
    }

    /// Announces receive step `step` on queue `q`, whose first fragment is number `first`, if
    /// it can be written in place: a whole receive (not reduced) of at least [`PLACE_MIN`]
    /// bytes into registered memory that the link writes without a system call (over shm,
    /// memory from `Communicator::alloc`). Best effort: a failed post leaves the data to come
    /// through the slots. Returns the step's fragment count.
    pub(super) fn announce(&mut self, step: usize, q: usize, first: u64) -> u64 {
        let one = &self.calls[self.cur];
        let Op::Recv {
            dst, reduce_with, ..
        } = one.sched.steps[step].op
        else {
            return 0;
        };
        let total = dst.len * one.esize;
        let frags = one.cfg.fragments(total) as u64;
        if total < PLACE_MIN || reduce_with.is_some() {
            return frags;
        }
        let Ok((p, _)) = self.locate(dst) else {
            return frags;
        };
        let (l, ch) = self.eng.flows.link_channel(q);
        let link = &self.eng.links[l];
        let Some((_, start, mr)) = self.eng.regs.find(p as usize, total, link.ctx) else {
            return frags;
        };
        if link.provider == Provider::Shm && !mr.is_provider_memory() {
            return frags;
        }
        let a = Announce {
            first,
            frags,
            total: total as u64,
            addr: mr.addr() + (p as usize - start) as u64,
            rkey: mr.rkey(),
        };
        let geo = self.eng.geo;
        let i = (self.eng.announcements[q] % ANNOUNCE_RING as u64) as usize;
        let mut b = [0u8; ANNOUNCE];
        a.encode(&mut b);
        let at = geo.stage_announce(ch, i);
        if link.stage.write(at, &b).is_ok() {
            let sge = [Sge::new(&link.stage, at, ANNOUNCE)];
            let wr = SendWr::new(
                WR_CTRL,
                WrOp::Write {
                    remote: link.remote.at(geo.announce_offset(ch, i) as u64),
                },
                &sge,
            )
            .unsignaled();
            if link.qp.post_send(&[wr]).is_ok() {
                self.eng.announcements[q] += 1;
            }
        }
        frags
    }

    /// The error of a send on link `l`, whose queue pair is no longer connected.
    pub(super) fn link_down(&self, l: usize) -> Error {
        let link = &self.eng.links[l];
        self.link_error(
            l,
            format!(
                "its {} connection is down ({:?})",
                link.provider.name(),
                link.qp.state()
            ),
        )
    }

    /// The error of a post to link `l` that the queue pair refused.
    pub(super) fn send_error(&self, l: usize, e: oxccl_verbs::Error) -> Error {
        let link = &self.eng.links[l];
        self.link_error(
            l,
            format!("posting to its {} connection: {e}", link.provider.name()),
        )
    }

    /// A failure of link `l`'s peer in this call: `what`, and what the queue pair knows.
    fn link_error(&self, l: usize, what: String) -> Error {
        let link = &self.eng.links[l];
        Error::PeerFailed {
            rank: self.eng.rank,
            op: self.calls[self.cur].desc.to_string(),
            peer: link.peer,
            detail: format!(
                "{what}{}",
                link.qp
                    .error_detail()
                    .map(|d| format!(" ({d})"))
                    .unwrap_or_default()
            ),
        }
    }

    /// Returns a credit on queue `q`: the consumed count, written beside the sender's slots.
    /// If the send queue is full, the credit stays due for the next pass.
    pub(super) fn send_credit(&mut self, q: usize, consumed: u64, geo: &Geometry) {
        let (l, ch) = self.eng.flows.link_channel(q);
        let link = &self.eng.links[l];
        let src_off = geo.stage_credit(ch);
        if link.stage.write(src_off, &consumed.to_le_bytes()).is_err() {
            return;
        }
        let sge = [Sge::new(&link.stage, src_off, 8)];
        let wr = credit_wr(link, ch, geo, &sge);
        if link.qp.post_send(&[wr]).is_ok() {
            self.eng.flows.credit_sent(q, consumed);
        }
    }

    pub(super) fn run_local(&mut self, s: usize) -> Result<()> {
        match self.calls[self.cur].sched.steps[s].op {
            Op::Copy { src, dst } => {
                let (sp, n) = self.locate(src)?;
                let (dp, m) = self.locate(dst)?;
                if n != m {
                    return Err(self.invalid(format!("step {s} copies {n} bytes into {m}")));
                }
                if sp != dp && n > 0 {
                    check_disjoint(dp, sp, n).map_err(|m| self.invalid(m))?;
                    // SAFETY: both bounds-checked by `locate` and disjoint.
                    unsafe { std::ptr::copy_nonoverlapping(sp as *const u8, dp, n) };
                    self.eng.stats.local += n as u64;
                }
            }
            Op::Reduce { dst, a, b } => {
                let (dp, n) = self.locate(dst)?;
                let (ap, _) = self.locate(a)?;
                let (bp, _) = self.locate(b)?;
                check_disjoint(dp, bp, n).map_err(|m| self.invalid(m))?;
                // SAFETY: bounds-checked by `locate`; `dst` and `b` are disjoint, and `a` is
                // either `dst` itself or disjoint from it.
                unsafe {
                    let bs = std::slice::from_raw_parts(bp as *const u8, n);
                    if ap == dp {
                        reduce::reduce_in_place(
                            self.calls[self.cur].dtype,
                            self.calls[self.cur].op,
                            std::slice::from_raw_parts_mut(dp, n),
                            bs,
                        );
                    } else {
                        check_disjoint(dp, ap, n).map_err(|m| self.invalid(m))?;
                        let as_ = std::slice::from_raw_parts(ap as *const u8, n);
                        reduce::reduce_to(
                            self.calls[self.cur].dtype,
                            self.calls[self.cur].op,
                            std::slice::from_raw_parts_mut(dp, n),
                            as_,
                            bs,
                        );
                    }
                }
                self.eng.stats.local += n as u64;
            }
            _ => unreachable!("a local step is a copy or a reduction"),
        }
        Ok(())
    }
}

/// The WRITE_WITH_IMM that reports a credit on channel `ch` of `link`: the consumed count,
/// staged in `sge`, into the sender's credit word. Unsignaled: nothing waits for its
/// completion (a failure is still reported), and a software provider (tcp) need not
/// acknowledge it.
fn credit_wr<'a>(link: &Link, ch: usize, geo: &Geometry, sge: &'a [Sge<'a>]) -> SendWr<'a> {
    SendWr::new(
        WR_CTRL,
        WrOp::WriteWithImm {
            remote: link.remote.at(geo.credit_offset(ch) as u64),
            imm: Imm::Credit { channel: ch }.encode(),
        },
        sge,
    )
    .unsignaled()
}
