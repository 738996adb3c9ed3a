//! Registered buffers: memory registered once with every connection of a communicator, as
//! `ncclCommRegister` and `ncclMemAlloc` do. Calls on it skip the registration every call of
//! an unregistered buffer makes, and a receive into it is written in place by its sender
//! (zero copy: the receiver announces where its destination is, see
//! [`oxccl_core::protocol::Announce`]) where the connection reaches it without a system call:
//! memory from [`Communicator::alloc`] over shm, any registered memory over tcp (an example:
//! [`Registered`]).

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use oxccl_verbs::AccessFlags;

use super::Communicator;
use crate::engine::{Reg, Registry};
use crate::error::{Error, Result};
use crate::{Element, dtype::as_bytes};

/// What registered memory allows its peers: writes in place, besides the local use.
const ACCESS: AccessFlags = AccessFlags::from_bits_truncate(
    AccessFlags::LOCAL_WRITE.bits() | AccessFlags::REMOTE_WRITE.bits(),
);

/// A registration's handle: dropping it deregisters the buffer everywhere (no peer can write
/// it afterwards) and removes it from the communicator.
pub struct Registration {
    registry: Arc<Registry>,
    reg: Arc<Reg>,
}

impl Registration {
    /// The registered bytes' first address.
    pub fn addr(&self) -> usize {
        self.reg.addr
    }

    /// Bytes registered.
    pub fn len(&self) -> usize {
        self.reg.len
    }

    /// Whether no byte is registered.
    pub fn is_empty(&self) -> bool {
        self.reg.len == 0
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        for mr in &self.reg.mrs {
            mr.deregister();
        }
        self.registry.remove(&self.reg);
    }
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Registration {{ addr: {:#x}, len: {} }}",
            self.reg.addr, self.reg.len
        )
    }
}

/// Where a [`Registered`] buffer's memory is.
enum Memory<T> {
    /// The caller's vector.
    Vec(Vec<T>),
    /// Provider memory ([`Communicator::alloc`]): `len` elements at the start of the
    /// registration's first region, which owns the memory (the registration is deregistered
    /// when dropped, the memory freed with the last holder of `reg`).
    Provider { reg: Arc<Reg>, len: usize },
}

/// A buffer registered with a communicator ([`Communicator::register`],
/// [`Communicator::alloc`]): a slice of `T` for every call and for the caller, registered
/// until it is dropped (or [`Registered::into_vec`]).
///
/// While a call runs on it, its peers may write it; between calls nothing touches it.
///
/// ```
/// # use std::time::Duration;
/// # use oxccl::{Communicator, Options, ReduceOp};
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
///         std::thread::spawn(move || -> oxccl::Result<f32> {
///             let comm = Communicator::init(Bootstrap::new(config)?, Options::default())?;
///             // Memory the peers map: receives into it are written in place.
///             let mut grad = comm.alloc::<f32>(1 << 20)?;
///             grad.fill(rank as f32 + 1.0);
///             comm.all_reduce_in_place(&mut grad, ReduceOp::Sum)?;
///             let first = grad[0];
///             // Or a vector of the caller's, registered once and given back at the end.
///             let input = comm.register(vec![1.0f32; 1 << 20])?;
///             let mut output = comm.register(vec![0.0f32; 1 << 20])?;
///             comm.all_reduce(&input, &mut output, ReduceOp::Sum)?;
///             assert_eq!(output.into_vec()?[7], 2.0);
///             drop((grad, input));
///             comm.destroy()?;
///             Ok(first)
///         })
///     })
///     .collect();
/// for r in ranks {
///     assert_eq!(r.join().unwrap()?, 3.0);
/// }
/// # Ok(()) }
/// ```
pub struct Registered<T: Element> {
    // The registration goes first, while the memory is still there.
    registration: Registration,
    memory: Memory<T>,
}

impl<T: Element> Registered<T> {
    /// The registration (its address and length).
    pub fn registration(&self) -> &Registration {
        &self.registration
    }

    /// Deregisters the buffer and gives the vector back; memory from
    /// [`Communicator::alloc`] is copied into a new vector.
    pub fn into_vec(self) -> Result<Vec<T>> {
        let Registered {
            registration,
            memory,
        } = self;
        drop(registration);
        Ok(match memory {
            Memory::Vec(v) => v,
            Memory::Provider { reg, len } => {
                // SAFETY: as in `Deref`: `len` elements of `T` at the region's aligned start.
                unsafe { std::slice::from_raw_parts(reg.addr as *const T, len) }.to_vec()
            }
        })
    }
}

impl<T: Element> Deref for Registered<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.memory {
            Memory::Vec(v) => v,
            // SAFETY: the region holds at least `len * size_of::<T>()` bytes (allocated so),
            // page aligned, zero-filled at first (a valid `T` for every element type), and
            // lives as long as `self`; between calls no peer writes it.
            Memory::Provider { reg, len } => unsafe {
                std::slice::from_raw_parts(reg.addr as *const T, *len)
            },
        }
    }
}

impl<T: Element> DerefMut for Registered<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.memory {
            Memory::Vec(v) => v,
            // SAFETY: as in `deref`; `&mut self` makes this the only reference.
            Memory::Provider { reg, len } => unsafe {
                std::slice::from_raw_parts_mut(reg.addr as *mut T, *len)
            },
        }
    }
}

impl<T: Element> std::fmt::Debug for Registered<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.memory {
            Memory::Vec(_) => "vec",
            Memory::Provider { .. } => "provider memory",
        };
        write!(
            f,
            "Registered<{}>({} elements, {kind})",
            T::DTYPE,
            self.len()
        )
    }
}

impl Communicator {
    /// Registers `buf` with every connection of this communicator (`ncclCommRegister`): calls
    /// on it skip the registration an unregistered buffer gets on every call, and over tcp a
    /// receive into it is written in place (over shm, user memory is reached only with a
    /// system call per fragment: [`Communicator::alloc`] gives memory written in place there).
    /// [`Registered::into_vec`] gives the vector back. Local to this rank: peers need not
    /// register theirs.
    pub fn register<T: Element>(&self, buf: Vec<T>) -> Result<Registered<T>> {
        let bytes = as_bytes(&buf);
        let (addr, len) = (bytes.as_ptr() as *mut u8, bytes.len());
        // SAFETY: the vector's heap memory stays where it is, allocated and untouched by
        // anyone else while the `Registered` owns it; the registration is dropped first.
        let registration = unsafe { self.register_raw(addr, len) }?;
        Ok(Registered {
            registration,
            memory: Memory::Vec(buf),
        })
    }

    /// Allocates `count` zeroed elements in memory that every peer of this host maps and that
    /// is registered with every connection (`ncclMemAlloc` plus `ncclCommRegister`): a
    /// receive into it is written in place by its sender, with no copy through the slots
    /// and no system call.
    pub fn alloc<T: Element>(&self, count: usize) -> Result<Registered<T>> {
        let len = count
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| self.register_error(format!("{count} elements do not fit memory")))?;
        let st = self.lock();
        let pds = &st.engine.pds;
        let Some(first) = pds.first() else {
            // No connection (one rank): plain memory will do.
            drop(st);
            return self.register(vec![T::from_f64(0.0); count]);
        };
        let verbs = |what: &str| {
            let what = what.to_string();
            move |source| Error::Verbs {
                rank: self.inner.rank,
                what: what.clone(),
                source,
            }
        };
        // The first context's region owns the memory; the others register the same bytes.
        let mr = first
            .alloc_mr(len.max(1), ACCESS)
            .map_err(verbs("allocating registered memory"))?;
        let addr = mr.as_ptr() as usize;
        let mut mrs = vec![mr];
        for pd in &pds[1..] {
            mrs.push(
                pd.reg_mr_of(&mrs[0], ACCESS)
                    .map_err(verbs("registering allocated memory"))?,
            );
        }
        let registry = st.engine.registry.clone();
        drop(st);
        let registration = self.add(registry, Reg { addr, len, mrs })?;
        Ok(Registered {
            memory: Memory::Provider {
                reg: registration.reg.clone(),
                len: count,
            },
            registration,
        })
    }

    /// Registers `len` bytes at `addr` ([`Communicator::register`]'s work, for memory owned
    /// elsewhere: a tensor held by Python, say).
    ///
    /// # Safety
    /// `addr..addr + len` must be valid, writable memory of this process that stays allocated
    /// until the returned [`Registration`] is dropped. Peers may write it while a call runs on
    /// it.
    pub unsafe fn register_raw(&self, addr: *mut u8, len: usize) -> Result<Registration> {
        if addr.is_null() && len > 0 {
            return Err(self.register_error("a null address".into()));
        }
        let st = self.lock();
        let mut mrs = Vec::with_capacity(st.engine.pds.len());
        for pd in &st.engine.pds {
            // SAFETY: the caller's promise.
            let mr = unsafe { pd.reg_mr_raw(addr, len.max(1), ACCESS) }.map_err(|source| {
                Error::Verbs {
                    rank: self.inner.rank,
                    what: format!("registering {len} bytes at {addr:p}"),
                    source,
                }
            })?;
            mrs.push(mr);
        }
        let registry = st.engine.registry.clone();
        drop(st);
        let reg = Reg {
            addr: addr as usize,
            len,
            mrs,
        };
        self.add(registry, reg)
    }

    /// Adds a registered buffer to `registry`, unless it overlaps one registered already.
    fn add(&self, registry: Arc<Registry>, reg: Reg) -> Result<Registration> {
        let reg = Arc::new(reg);
        registry.insert(reg.clone()).map_err(|(addr, len)| {
            self.register_error(format!(
                "{} bytes at {:#x} overlap a buffer registered already ({len} bytes at \
                 {addr:#x})",
                reg.len, reg.addr
            ))
        })?;
        Ok(Registration { registry, reg })
    }

    fn register_error(&self, msg: String) -> Error {
        Error::InvalidArgument {
            rank: self.inner.rank,
            msg: format!("register: {msg}"),
        }
    }
}
