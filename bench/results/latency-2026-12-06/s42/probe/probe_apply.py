# The window cut into segments: its two ends (probe_min_apply.py, run first), marks 1-22
# between them, and the gap between two empty recvs. The anchors match the session's builds
# (82c6f12, f7499ab); later code may need them moved.
import os,re
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe_min_apply.py")).read())
sub(R,"                rx.saw_frame(h.payload_len());","                crate::probe::mark(1);\n                rx.saw_frame(h.payload_len());")
sub(R,"                rx.state = FRESH;\n                *executed |= self.landed(qp, done, total);","                crate::probe::mark(3);\n                rx.state = FRESH;\n                *executed |= self.landed(qp, done, total);")
s0=open('/work/main/'+R).read(); s0=re.sub(r"(        let mut again = self.read_socket\((&qp, )?i\);)", r"\1\n        crate::probe::mark(4);", s0, count=1); assert 'mark(4)' in s0; open('/work/main/'+R,'w').write(s0)
s0=open('/work/main/'+R).read(); s0=re.sub(r"\n(        let Some\(\(writing, (mr, )?p\)\) = target else \{)", r"\n        crate::probe::mark(2);\n\1", s0, count=1); assert 'mark(2)' in s0; open('/work/main/'+R,'w').write(s0)
M='crates/oxccl-verbs/src/tcp/mod.rs'
sub(M,"                s.driver.store(FREE, Ordering::Release);\n            }\n            Err(THREAD) => self.ask_standby(),","                s.driver.store(FREE, Ordering::Release);\n                crate::probe::mark(5);\n            }\n            Err(THREAD) => self.ask_standby(),")
sub('crates/oxccl-verbs/src/resource/qp.rs',"    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {\n","    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {\n        crate::probe::mark(7);\n")
Q='crates/oxccl-verbs/src/contract/sendq.rs'
s0=open('/work/main/'+Q).read(); s0=re.sub(r"        Ok\(local\) if !q.failing\(\) => return link.post\(qp, wr, (&?local)\),", r"        Ok(local) if !q.failing() => {\n            crate::probe::mark(8);\n            return link.post(qp, wr, \1);\n        }", s0, count=1); assert 'mark(8)' in s0; open('/work/main/'+Q,'w').write(s0)
sub(Q,"        post.next_seq += 1;\n        o.seq = post.next_seq;","        crate::probe::mark(10);\n        post.next_seq += 1;\n        o.seq = post.next_seq;")
T='crates/oxccl-verbs/src/tcp/tx.rs'
sub(T,"        let total: usize = local.iter().map(|l| l.2).sum();\n","        crate::probe::mark(9);\n        let total: usize = local.iter().map(|l| l.2).sum();\n")
sub(T,"        let inline = tx.is_idle() && f.total() <= self.tuning.inline_max;","        crate::probe::mark(11);\n        let inline = tx.is_idle() && f.total() <= self.tuning.inline_max;")
sub(T,"            crate::probe::close();\n","            crate::probe::mark(12);\n            crate::probe::close();\n")
C='crates/oxccl-cli/src/verbs_perf/verbs.rs'
sub(C,"        }\n        spin.progress();\n        Ok(())\n    }\n}","        }\n        oxccl_verbs::probe::mark(6);\n        spin.progress();\n        Ok(())\n    }\n}")
sub(T,"        let (opcode, mut h, payload, dst) = match *op {","        crate::probe::mark(13);\n        let (opcode, mut h, payload, dst) = match *op {")
sub(T,"        // Frames go out in sequence order on every connection (under the post lock).\n        self.sendq.post(","        crate::probe::mark(14);\n        // Frames go out in sequence order on every connection (under the post lock).\n        self.sendq.post(")
sub(Q,"        send(post.next_seq);\n        Ok(())","        crate::probe::mark(16);\n        send(post.next_seq);\n        Ok(())")
sub(T,"                    self.queue_or_keep(0, TxFrame::new(&h, payload, Keep::new()), keep);","                    let f = TxFrame::new(&h, payload, Keep::new());\n                    crate::probe::mark(17);\n                    self.queue_or_keep(0, f, keep);")
sub(R,"        let mut ex = self.exec.lock().unwrap_or_else(|e| e.into_inner());\n        if ex.dropping {","        let mut ex = self.exec.lock().unwrap_or_else(|e| e.into_inner());\n        crate::probe::mark(18);\n        if ex.dropping {")
sub(R,"            drop(writing);\n            self.done_locked(","            crate::probe::mark(19);\n            drop(writing);\n            crate::probe::mark(20);\n            self.done_locked(")
sub(R,"            rx.state = FRESH;\n            return Ok(true);\n        }","            crate::probe::mark(21);\n            rx.state = FRESH;\n            return Ok(true);\n        }")
sub(R,"        drop(rx);\n        if let Err(Stop::Failed(why)) = r {","        crate::probe::mark(22);\n        drop(rx);\n        if let Err(Stop::Failed(why)) = r {")
sub(R,"""        let (n, _) = rustix::net::recv(
            sock,
            &mut self.stage[self.hi..self.hi + room],
            rustix::net::RecvFlags::DONTWAIT,
        )?;""","""        crate::probe::gap_end();
        let r = rustix::net::recv(
            sock,
            &mut self.stage[self.hi..self.hi + room],
            rustix::net::RecvFlags::DONTWAIT,
        );
        if r.is_err() { crate::probe::gap_start(); }
        let (n, _) = r?;""")
