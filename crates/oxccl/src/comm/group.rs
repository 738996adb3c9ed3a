//! Group calls: several calls run together, as NCCL's `ncclGroupStart`/`ncclGroupEnd` run
//! them, so that a send and a receive with the same peer (or an exchange with every peer) do
//! not wait for each other, and several collectives progress at once.

use std::marker::PhantomData;
use std::time::Duration;

use super::{Buffers, Checked, Communicator};
use crate::dtype::{as_bytes, as_bytes_mut};
use crate::engine::CallSpec;
use crate::error::Result;
use crate::flight;
use crate::schedule::Collective;
use crate::{DataType, Element, ReduceOp};

/// Calls gathered by [`Communicator::group`] and run together by [`Group::end`].
///
/// Each call's arguments are checked when it is added; nothing moves until `end`, which
/// returns once every call of the group is done (or the first error). Every rank must add its
/// calls with a given peer in the same order (sends to a peer in the order of that peer's
/// receives, collectives in one order everywhere), as with NCCL. The buffers stay borrowed
/// until `end`. A group of one call is that call.
///
/// ```
/// # use std::time::Duration;
/// # use oxccl::{Communicator, Options};
/// # use oxccl_bootstrap::{Bootstrap, Config, Secret, StoreServer};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let secret = Secret::new("the job's shared secret")?;
/// # let server = StoreServer::bind("127.0.0.1:0", secret.clone())?;
/// # let addr = server.addr().to_string();
/// let ranks: Vec<_> = (0..2)
///     .map(|rank| {
/// #       let mut config = Config::new(rank, 2, addr.clone(), secret.clone());
/// #       config.serve_store = false;
/// #       config.timeout = Duration::from_secs(20);
///         std::thread::spawn(move || -> oxccl::Result<Vec<u32>> {
///             let comm = Communicator::init(Bootstrap::new(config)?, Options::default())?;
///             let peer = 1 - rank;
///             // Both ranks send first and receive second: alone, a large send would wait
///             // for a receive that cannot start; in a group both progress.
///             let mine = vec![rank as u32; 1 << 20];
///             let mut theirs = vec![0u32; 1 << 20];
///             let mut g = comm.group();
///             g.send(&mine, peer)?;
///             g.recv(&mut theirs, peer)?;
///             g.end()?;
///             comm.destroy()?;
///             Ok(theirs)
///         })
///     })
///     .collect();
/// for (rank, r) in ranks.into_iter().enumerate() {
///     assert!(r.join().unwrap()?.iter().all(|&x| x == 1 - rank as u32));
/// }
/// # Ok(()) }
/// ```
#[must_use = "a group runs nothing until `end`"]
pub struct Group<'c, 'b> {
    comm: &'c Communicator,
    calls: Vec<Pending>,
    /// The buffers the calls name stay borrowed until `end`.
    _bufs: PhantomData<&'b mut [u8]>,
}

/// One call of a group, checked.
struct Pending {
    coll: Collective,
    dtype: DataType,
    op: ReduceOp,
    checked: Checked,
}

impl Communicator {
    /// Starts a group of calls that run together when [`Group::end`] is called
    /// (`ncclGroupStart` ... `ncclGroupEnd`).
    pub fn group(&self) -> Group<'_, '_> {
        Group {
            comm: self,
            calls: Vec::new(),
            _bufs: PhantomData,
        }
    }
}

impl<'b> Group<'_, 'b> {
    /// Adds a call on raw bytes of `dtype` ([`Communicator::run`]'s arguments), checked now.
    pub fn run(
        &mut self,
        coll: &Collective,
        dtype: DataType,
        op: ReduceOp,
        bufs: Buffers<'b>,
    ) -> Result<()> {
        let checked = self.comm.check_call(coll, dtype, bufs)?;
        self.calls.push(Pending {
            coll: coll.clone(),
            dtype,
            op,
            checked,
        });
        Ok(())
    }

    fn typed<T: Element>(
        &mut self,
        coll: Collective,
        op: ReduceOp,
        input: &'b [T],
        output: &'b mut [T],
    ) -> Result<()> {
        let bufs = Buffers::OutOfPlace {
            input: as_bytes(input),
            output: as_bytes_mut(output),
        };
        self.run(&coll, T::DTYPE, op, bufs)
    }

    /// Adds a send of `buf` to `peer` ([`Communicator::send`]).
    pub fn send<T: Element>(&mut self, buf: &'b [T], peer: usize) -> Result<()> {
        let count = buf.len();
        self.typed(
            Collective::Send { count, peer },
            ReduceOp::Sum,
            buf,
            &mut [],
        )
    }

    /// Adds a receive of `buf.len()` elements from `peer` ([`Communicator::recv`]).
    pub fn recv<T: Element>(&mut self, buf: &'b mut [T], peer: usize) -> Result<()> {
        let count = buf.len();
        self.typed(Collective::Recv { count, peer }, ReduceOp::Sum, &[], buf)
    }

    /// Adds an all-reduce ([`Communicator::all_reduce`]).
    pub fn all_reduce<T: Element>(
        &mut self,
        input: &'b [T],
        output: &'b mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let count = input.len();
        self.typed(Collective::AllReduce { count }, op, input, output)
    }

    /// Adds an in-place all-reduce ([`Communicator::all_reduce_in_place`]).
    pub fn all_reduce_in_place<T: Element>(
        &mut self,
        buf: &'b mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let coll = Collective::AllReduce { count: buf.len() };
        self.run(&coll, T::DTYPE, op, Buffers::InPlace(as_bytes_mut(buf)))
    }

    /// Adds an in-place broadcast from `root` ([`Communicator::broadcast_in_place`]).
    pub fn broadcast_in_place<T: Element>(&mut self, buf: &'b mut [T], root: usize) -> Result<()> {
        let coll = Collective::Broadcast {
            count: buf.len(),
            root,
        };
        self.run(
            &coll,
            T::DTYPE,
            ReduceOp::Sum,
            Buffers::InPlace(as_bytes_mut(buf)),
        )
    }

    /// Adds an all-gather ([`Communicator::all_gather`]).
    pub fn all_gather<T: Element>(&mut self, input: &'b [T], output: &'b mut [T]) -> Result<()> {
        let count = input.len();
        self.typed(
            Collective::AllGather { count },
            ReduceOp::Sum,
            input,
            output,
        )
    }

    /// Adds a reduce-scatter ([`Communicator::reduce_scatter`]).
    pub fn reduce_scatter<T: Element>(
        &mut self,
        input: &'b [T],
        output: &'b mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let count = output.len();
        self.typed(Collective::ReduceScatter { count }, op, input, output)
    }

    /// Calls added so far.
    pub fn len(&self) -> usize {
        self.calls.len()
    }

    /// Whether no call was added.
    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// Runs every call of the group together, within the communicator's timeout
    /// ([`Communicator::timeout`]), and returns once all are done or one failed (the first
    /// error; the communicator is then failed, as after any failed call).
    pub fn end(self) -> Result<()> {
        let timeout = self.comm.timeout();
        self.end_timeout(timeout)
    }

    /// [`Group::end`] with its own timeout for the whole group.
    pub fn end_timeout(self, timeout: Duration) -> Result<()> {
        let comm = self.comm;
        if self.calls.is_empty() {
            return Ok(());
        }
        comm.wait_for_queue();
        let mut guard = comm.lock();
        let st = &mut *guard;
        comm.check_usable(st, &self.calls[0].coll)?;
        let mut prepared = Vec::with_capacity(self.calls.len());
        for c in &self.calls {
            prepared.push(comm.prepare(st, &c.coll, c.dtype, c.op, c.checked.in_place)?);
        }
        let probe = &comm.inner.probe;
        let ids: Vec<u64> = prepared
            .iter()
            .map(|p| flight::start(probe, &p.info()))
            .collect();
        let specs: Vec<CallSpec<'_>> = self
            .calls
            .iter()
            .zip(&prepared)
            .map(|(c, p)| c.checked.spec(&p.planned.plan, p.desc, c.dtype, c.op))
            .collect();
        let r = st.engine.execute_group(&specs, timeout);
        drop(specs);
        for (id, p) in ids.into_iter().zip(&prepared) {
            flight::end(probe, id, &p.desc, &r);
        }
        let r = r.map_err(|e| comm.failed(st, e));
        drop(guard);
        r?;
        for c in &self.calls {
            let k = &c.checked;
            comm.finish_avg(&c.coll, c.dtype, c.op, &k.raw, k.in_place, k.out_len);
        }
        Ok(())
    }
}

impl std::fmt::Debug for Group<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.calls.iter().map(|c| c.coll.name()).collect();
        f.debug_struct("Group")
            .field("rank", &self.comm.inner.rank)
            .field("calls", &names)
            .finish()
    }
}
