//! Fault injection, for tests: `OXCCL_FAULT` (or [`Options::faults`](crate::Options::faults))
//! makes chosen ranks misbehave at chosen moments, so that every failure path can be driven
//! on purpose. Off (the default) it costs one branch per call and per fragment.
//!
//! The value is a `;`-separated list of faults, each `KIND[:KEY=VALUE,...]`:
//!
//! | kind | what happens (once) |
//! |---|---|
//! | `kill` | the rank kills itself with `SIGKILL` (a crash, an OOM kill) |
//! | `stop` | the rank stops itself with `SIGSTOP` (a hung process; `SIGCONT` resumes it) |
//! | `drop` | the connection to `peer` fails on this side, as if its cable were cut |
//! | `delay` | the rank sleeps `ms` milliseconds before a send to `peer` (a stalled link) |
//! | `corrupt` | the next fragment header sent to `peer` is damaged on the way |
//! | `refuse_reg` | the next memory registration fails |
//!
//! Keys: `rank` (which rank misbehaves; default every rank), `seq` (the fault arms at the
//! call with this sequence number, as errors and the flight recorder number calls; default
//! 1), `after` (`kill`/`stop`: once this many steps of the call are done; default 0, at its
//! start), `peer` (`drop`/`delay`/`corrupt`: only sends to this rank; default any), `ms`
//! (`delay`; default 1000), `shrink` (`kill`/`stop` only: instead of during a call, in the
//! shrink of this epoch, once the survivors have decided who is excluded and before they build
//! the new communicator: a rank dying during a [`Communicator::shrink`](crate::Communicator::shrink)),
//! `grow` (`kill`/`stop` only: in this communicator's grow of this number, once the members
//! agreed whom to admit and before they make the grown communicator: a member dying during a
//! [`Communicator::grow`](crate::Communicator::grow)),
//! `init` (`kill`/`stop` only: instead of during a call, at this stage of the rank's
//! [`Communicator::init`](crate::Communicator::init); a name or its number):
//!
//! | `init=` | # | the rank dies |
//! |---|---|---|
//! | `join` | 0 | before it joins the store (only where init joins: [`Communicator::init_config_async`](crate::Communicator::init_config_async)) |
//! | `hello` | 1 | before the all-gather of hosts and settings |
//! | `links` | 2 | with its connections made, before it publishes them |
//! | `connect` | 3 | after connecting to its first peer, before the others |
//! | `stored` | 4 | connected, before the store barrier that ends the exchange |
//! | `barrier` | 5 | before the first barrier over the connections |
//!
//! A fault that finds no chance in its call (no send, no registration) fires at the first
//! chance in a later one.
//!
//! ```
//! let f: oxccl::Faults = "stop:rank=1,seq=3;delay:rank=0,peer=2,ms=250".parse().unwrap();
//! assert_eq!(f.len(), 2);
//! assert!("explode:rank=1".parse::<oxccl::Faults>().is_err());
//! ```

use std::str::FromStr;
use std::time::Duration;

/// A moment of init where a `kill`/`stop` fault with `init=` fires (the [module docs](self)'
/// table).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum InitStage {
    /// Before joining the store.
    Join,
    /// Before the all-gather of hosts and settings.
    Hello,
    /// Connections made, before publishing them.
    Links,
    /// After connecting to the first peer.
    Connect,
    /// Before the store barrier that ends the exchange.
    Stored,
    /// Before the first barrier over the connections.
    Barrier,
}

impl InitStage {
    /// Every stage, in the order init reaches them.
    pub const ALL: [InitStage; 6] = [
        InitStage::Join,
        InitStage::Hello,
        InitStage::Links,
        InitStage::Connect,
        InitStage::Stored,
        InitStage::Barrier,
    ];

    /// Its name in `OXCCL_FAULT`.
    pub fn name(self) -> &'static str {
        match self {
            InitStage::Join => "join",
            InitStage::Hello => "hello",
            InitStage::Links => "links",
            InitStage::Connect => "connect",
            InitStage::Stored => "stored",
            InitStage::Barrier => "barrier",
        }
    }
}

impl FromStr for InitStage {
    type Err = String;

    /// A name or its number (the position in [`InitStage::ALL`]).
    fn from_str(s: &str) -> Result<InitStage, String> {
        let s = s.trim();
        if let Ok(n) = s.parse::<usize>() {
            return InitStage::ALL.get(n).copied().ok_or_else(|| {
                format!(
                    "init stage {n} does not exist (0 to {})",
                    InitStage::ALL.len() - 1
                )
            });
        }
        InitStage::ALL
            .into_iter()
            .find(|st| st.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = InitStage::ALL.iter().map(|st| st.name()).collect();
                format!("unknown init stage {s:?} ({})", names.join(", "))
            })
    }
}

/// What a fault does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// `SIGKILL` itself.
    Kill,
    /// `SIGSTOP` itself.
    Stop,
    /// Fail the connection to a peer.
    Drop,
    /// Sleep before a send.
    Delay,
    /// Damage a fragment header.
    Corrupt,
    /// Fail a memory registration.
    RefuseRegistration,
}

/// One fault (see the [module docs](self)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    /// What it does.
    pub kind: FaultKind,
    /// The rank that misbehaves (`None`: every rank).
    pub rank: Option<usize>,
    /// The call it arms at.
    pub seq: u64,
    /// `kill`/`stop`: steps of the call done first.
    pub after: usize,
    /// `drop`/`delay`/`corrupt`: the peer (`None`: any).
    pub peer: Option<usize>,
    /// `delay`: how long.
    pub delay: Duration,
    /// `kill`/`stop`: fire in this shrink epoch (after the decision) instead of in a call.
    pub shrink: Option<u64>,
    /// `kill`/`stop`: fire in this communicator's grow (1 for its first; after the members
    /// agreed whom to admit) instead of in a call.
    pub grow: Option<u64>,
    /// `kill`/`stop`: fire at this stage of init instead of in a call.
    pub init: Option<InitStage>,
}

/// A list of faults, parsed from `OXCCL_FAULT`'s syntax.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Faults(pub Vec<Fault>);

impl Faults {
    /// Number of faults.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl FromStr for Faults {
    type Err = String;

    fn from_str(s: &str) -> Result<Faults, String> {
        let mut out = Vec::new();
        for item in s.split(';').map(str::trim).filter(|i| !i.is_empty()) {
            let (kind, keys) = item.split_once(':').unwrap_or((item, ""));
            let kind = match kind.trim() {
                "kill" => FaultKind::Kill,
                "stop" => FaultKind::Stop,
                "drop" => FaultKind::Drop,
                "delay" => FaultKind::Delay,
                "corrupt" => FaultKind::Corrupt,
                "refuse_reg" => FaultKind::RefuseRegistration,
                k => {
                    return Err(format!(
                        "unknown fault {k:?} in {item:?} (kill, stop, drop, delay, corrupt, \
                         refuse_reg)"
                    ));
                }
            };
            let mut f = Fault {
                kind,
                rank: None,
                seq: 1,
                after: 0,
                peer: None,
                delay: Duration::from_secs(1),
                shrink: None,
                grow: None,
                init: None,
            };
            for kv in keys.split(',').map(str::trim).filter(|k| !k.is_empty()) {
                let (k, v) = kv
                    .split_once('=')
                    .ok_or_else(|| format!("{kv:?} in {item:?} is not KEY=VALUE"))?;
                if k.trim() == "init" {
                    f.init = Some(v.parse().map_err(|e| format!("{e} in {item:?}"))?);
                    continue;
                }
                let n: u64 = v
                    .trim()
                    .parse()
                    .map_err(|_| format!("{k}={v:?} in {item:?}: not a number"))?;
                match k.trim() {
                    "rank" => f.rank = Some(n as usize),
                    "seq" => f.seq = n,
                    "after" => f.after = n as usize,
                    "peer" => f.peer = Some(n as usize),
                    "ms" => f.delay = Duration::from_millis(n),
                    "shrink" => f.shrink = Some(n),
                    "grow" => f.grow = Some(n),
                    k => {
                        return Err(format!(
                            "unknown key {k:?} in {item:?} (rank, seq, after, peer, ms, shrink, \
                             grow, init)"
                        ));
                    }
                }
            }
            out.push(f);
        }
        Ok(Faults(out))
    }
}

/// One rank's faults while it runs: which have fired, which are armed for the current call.
pub(crate) struct Injector {
    faults: Vec<(Fault, bool)>,
    /// Whether some unfired fault is armed for the current call.
    pub armed: bool,
    /// The current call's sequence number.
    current: u64,
}

/// A `kill` or `stop` fault of `rank` for shrink epoch `epoch` happens now, if there is one.
pub(crate) fn in_shrink(faults: Option<&Faults>, rank: usize, epoch: u64) {
    raise_at(faults, rank, "shrink epoch", epoch, |f| f.shrink);
}

/// `kill`/`stop` faults armed for grow `g` (`grow=G`) fire here, on the members, once they
/// have agreed whom to admit and before they make the grown communicator.
pub(crate) fn in_grow(faults: Option<&Faults>, rank: usize, g: u64) {
    raise_at(faults, rank, "grow", g, |f| f.grow);
}

/// Raises the signal of each `kill`/`stop` fault for `rank` whose `which` key is `n`.
fn raise_at(
    faults: Option<&Faults>,
    rank: usize,
    what: &str,
    n: u64,
    which: impl Fn(&Fault) -> Option<u64>,
) {
    let Some(faults) = faults else { return };
    for f in &faults.0 {
        if which(f) == Some(n) && f.rank.is_none_or(|r| r == rank) {
            let sig = match f.kind {
                FaultKind::Kill => libc::SIGKILL,
                FaultKind::Stop => libc::SIGSTOP,
                _ => continue,
            };
            crate::log_warn(format!(
                "fault injection: signal {sig} in {what} {n} after the decision"
            ));
            // SAFETY: `raise` has no memory-safety preconditions.
            unsafe { libc::raise(sig) };
        }
    }
}

/// A `kill` or `stop` fault of `rank` for init stage `stage` happens now, if there is one.
pub(crate) fn in_init(faults: Option<&Faults>, rank: usize, stage: InitStage) {
    let Some(faults) = faults else { return };
    for f in &faults.0 {
        if f.init == Some(stage) && f.rank.is_none_or(|r| r == rank) {
            let sig = match f.kind {
                FaultKind::Kill => libc::SIGKILL,
                FaultKind::Stop => libc::SIGSTOP,
                _ => continue,
            };
            crate::log_warn(format!(
                "fault injection: signal {sig} at init stage {}",
                stage.name()
            ));
            // SAFETY: `raise` has no memory-safety preconditions.
            unsafe { libc::raise(sig) };
        }
    }
}

/// What a send must do, as the injector decides.
#[derive(Default)]
pub(crate) struct SendFault {
    pub drop: bool,
    pub delay: Option<Duration>,
    pub corrupt: bool,
}

impl Injector {
    /// The faults of `rank`, or `None` when it has none (the common case: no cost).
    pub(crate) fn for_rank(faults: &Faults, rank: usize) -> Option<Box<Injector>> {
        let mine: Vec<(Fault, bool)> = faults
            .0
            .iter()
            .filter(|f| {
                f.rank.is_none_or(|r| r == rank)
                    && f.shrink.is_none()
                    && f.grow.is_none()
                    && f.init.is_none()
            })
            .map(|f| (f.clone(), false))
            .collect();
        (!mine.is_empty()).then(|| {
            Box::new(Injector {
                faults: mine,
                armed: false,
                current: 0,
            })
        })
    }

    /// At the start of call `seq`; then [`Injector::steps_done`] with 0.
    pub(crate) fn begin(&mut self, seq: u64) {
        self.armed = self.faults.iter().any(|(f, fired)| !fired && f.seq <= seq);
        self.current = seq;
    }

    fn take(&mut self, pick: impl Fn(&Fault) -> bool) -> Option<Fault> {
        let seq = self.current;
        let (f, fired) = self
            .faults
            .iter_mut()
            .find(|(f, fired)| !*fired && f.seq <= seq && pick(f))?;
        *fired = true;
        let f = f.clone();
        self.armed = self.faults.iter().any(|(f, fired)| !fired && f.seq <= seq);
        Some(f)
    }

    /// After `done` steps of the call: a `kill` or `stop` due now happens here.
    pub(crate) fn steps_done(&mut self, done: usize) {
        let due =
            |f: &Fault| matches!(f.kind, FaultKind::Kill | FaultKind::Stop) && f.after <= done;
        while let Some(f) = self.take(due) {
            let sig = if f.kind == FaultKind::Kill {
                libc::SIGKILL
            } else {
                libc::SIGSTOP
            };
            crate::log_warn(format!(
                "fault injection: {} at call #{} after {done} steps",
                if f.kind == FaultKind::Kill {
                    "SIGKILL"
                } else {
                    "SIGSTOP"
                },
                self.current
            ));
            // To this thread (`raise` is `tgkill`), so that it stops before its next
            // instruction: a signal to the process may be taken by another thread first,
            // and this one would run on until that thread stops the group.
            // SAFETY: `raise` has no memory-safety preconditions.
            unsafe { libc::raise(sig) };
        }
    }

    /// Before a send to `peer`.
    pub(crate) fn on_send(&mut self, peer: usize) -> SendFault {
        let mut out = SendFault::default();
        let for_peer =
            |k: FaultKind| move |f: &Fault| f.kind == k && f.peer.is_none_or(|p| p == peer);
        if self.take(for_peer(FaultKind::Drop)).is_some() {
            out.drop = true;
        }
        if let Some(f) = self.take(for_peer(FaultKind::Delay)) {
            out.delay = Some(f.delay);
        }
        out.corrupt = self.take(for_peer(FaultKind::Corrupt)).is_some();
        out
    }

    /// Before a memory registration: whether to refuse it.
    pub(crate) fn refuse_registration(&mut self) -> bool {
        self.take(|f| f.kind == FaultKind::RefuseRegistration)
            .is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_kind_and_key() {
        let f: Faults = "kill:rank=2,seq=5,after=3; stop ;drop:peer=1;delay:ms=20;corrupt:rank=0;refuse_reg:seq=9"
            .parse()
            .unwrap();
        assert_eq!(f.len(), 6);
        assert_eq!(
            f.0[0],
            Fault {
                kind: FaultKind::Kill,
                rank: Some(2),
                seq: 5,
                after: 3,
                peer: None,
                delay: Duration::from_secs(1),
                shrink: None,
                grow: None,
                init: None,
            }
        );
        assert_eq!(f.0[1].kind, FaultKind::Stop);
        assert_eq!(f.0[1].seq, 1);
        assert_eq!(f.0[2].peer, Some(1));
        assert_eq!(f.0[3].delay, Duration::from_millis(20));
        assert_eq!(f.0[5].kind, FaultKind::RefuseRegistration);
        for bad in ["boom", "kill:rank", "kill:rank=x", "kill:when=3"] {
            let e = bad.parse::<Faults>().unwrap_err();
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
        assert!("".parse::<Faults>().unwrap().is_empty());
        let f: Faults = "kill:rank=1,init=connect;stop:init=5".parse().unwrap();
        assert_eq!(f.0[0].init, Some(InitStage::Connect));
        assert_eq!(f.0[1].init, Some(InitStage::Barrier));
        assert!(
            Injector::for_rank(&f, 1).is_none(),
            "init faults are not a call's"
        );
        for bad in ["kill:init=later", "kill:init=6"] {
            let e = bad.parse::<Faults>().unwrap_err();
            assert!(
                e.contains("init stage") && e.contains(&format!("{bad:?}")),
                "{e}"
            );
        }
        for st in InitStage::ALL {
            assert_eq!(st.name().parse::<InitStage>(), Ok(st));
        }
    }

    #[test]
    fn faults_fire_once_for_their_rank_from_their_call_on() {
        let f: Faults = "delay:rank=1,seq=3,peer=2,ms=5;corrupt:rank=0;refuse_reg:rank=1,seq=4"
            .parse()
            .unwrap();
        assert!(Injector::for_rank(&f, 2).is_none());
        let mut i = Injector::for_rank(&f, 1).unwrap();
        i.begin(2);
        assert!(!i.armed);
        assert!(i.on_send(2).delay.is_none());
        i.begin(3);
        assert!(i.armed);
        assert!(i.on_send(0).delay.is_none(), "only sends to peer 2");
        assert!(!i.refuse_registration(), "not before call 4");
        assert_eq!(i.on_send(2).delay, Some(Duration::from_millis(5)));
        assert!(!i.armed);
        i.begin(5);
        assert!(i.armed, "a fault that missed its call fires later");
        assert!(i.refuse_registration());
        assert!(!i.refuse_registration(), "once");
        i.begin(6);
        assert!(!i.armed);
    }
}
