# Only the window's two ends: mark(0) when a recv returns bytes, close() before the next sendmsg.
import shutil
shutil.copy(__import__("os").path.join(__import__("os").path.dirname(__import__("os").path.abspath(__file__)), "probe.rs"),"/work/main/crates/oxccl-verbs/src/probe.rs")
def sub(path, old, new):
    path='/work/main/'+path
    s=open(path).read()
    assert s.count(old)>=1, (path, old)
    s=s.replace(old,new,1); open(path,'w').write(s)
sub('crates/oxccl-verbs/src/lib.rs','mod contract;','#[doc(hidden)]\npub mod probe;\nmod contract;')
R='crates/oxccl-verbs/src/tcp/rx.rs'
sub(R,"        self.hi += n;\n        Ok((n, n < room))","        self.hi += n;\n        if n > 0 { crate::probe::mark(0); }\n        Ok((n, n < room))")
T='crates/oxccl-verbs/src/tcp/tx.rs'
sub(T,"            let r = rustix::net::sendmsg(\n                sock,\n                &iov,","            crate::probe::close();\n            let r = rustix::net::sendmsg(\n                sock,\n                &iov,")
