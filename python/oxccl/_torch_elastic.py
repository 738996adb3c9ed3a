"""Elastic "oxccl" groups for torch (``oxccl.torch.shrink``, ``grow``, ``join``, ``wrap``).

Each function makes an ``oxccl.Communicator`` of a new membership (the survivors of a failure,
the members plus newcomers) and returns a new c10d ``ProcessGroup`` over it: usable as DDP's
``process_group=``, with ``dist.*(group=...)``, and, when it replaces the default group
(``default=``, see below), by everything that uses the default group (``dist.get_rank()``,
``dist.all_reduce(t)``, DDP without ``process_group``). The old group is taken out of torch's
registry; a group made from the default group becomes the default group.

The newcomer side, ``join(store)``, needs the store the members' backend was handed: for a
default group made by ``init_process_group("oxccl", store=S, ...)`` that is ``S`` with the
prefixes c10d adds (``group_name="0"``, the default); under ``init_method`` (``env://``,
``tcp://``) c10d wraps the rendezvous store in ``PrefixStore("default_pg", ...)`` first, so
pass ``dist.PrefixStore("default_pg", S)``.

Registering a group with torch, and replacing the default group, goes through c10d's private
helpers (``_register_pg_in_world``, ``_update_default_pg``,
``_cleanup_process_group_global_state``), the ones its own ``shrink_group`` uses, as torch
2.15 (python/requirements-dev.txt) has them.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from . import _oxccl
from .errors import Aborted, Error, InvalidArgument, PeerFailed, Timeout

__all__ = ["shrink", "grow", "join", "wrap", "backend_store", "is_failure"]

# Where a grow's members tell newcomers the generation of the group they join (so that every
# rank names the new group alike); in the backend's store.
_GENERATION_KEY = "oxccl-torch/generation"


_FAILURES = (PeerFailed, Aborted, Timeout)


def is_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure of a group's membership that ``shrink`` answers: an
    ``oxccl.PeerFailed``, ``Aborted`` or ``Timeout``, raised by a call, or carried by the
    ``RuntimeError`` that DDP's backward raises when a gradient all-reduce failed (torch's
    futures keep only the message, "Got the following error when running the callback:
    PeerFailed: rank 3: ...")."""
    if isinstance(exc, Error):
        return isinstance(exc, _FAILURES)
    if isinstance(exc, RuntimeError):
        text = str(exc)
        return any(f"{k.__name__}: rank " in text for k in _FAILURES)
    return False


def _torch_module() -> Any:
    # oxccl.torch imports this module at its end; by then it is complete.
    from . import torch as t

    return t


def _secs(timeout: Any, what: str) -> Optional[float]:
    """Seconds from a timedelta or a number of seconds (None: the communicator's default)."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    try:
        s = float(timeout)
    except (TypeError, ValueError):
        raise InvalidArgument(
            f"{what}: timeout={timeout!r}: expected seconds or a datetime.timedelta"
        ) from None
    if s <= 0:
        raise InvalidArgument(f"{what}: timeout={timeout!r}: expected a positive number")
    return s


def _group(group: Any, what: str) -> Any:
    if group is not None:
        return group
    if not dist.is_initialized():
        raise InvalidArgument(
            f"{what}: no group given and no default group (init_process_group, or "
            "oxccl.torch.join, makes one)"
        )
    return _c10d._get_default_group()


def _name(generation: int) -> str:
    """The new group's name: alike on every rank (the generation counts reconfigurations),
    made unique in this process if a group of that name exists already."""
    base = f"oxccl/gen{generation}"
    taken = set(_c10d._world.pg_names.values())
    name, k = base, 1
    while name in taken:
        name, k = f"{base}.{k}", k + 1
    return name


def wrap(
    communicator: _oxccl.Communicator,
    store: Any = None,
    *,
    timeout: Any = None,
    default: bool = False,
    generation: int = 0,
    replaces: Any = None,
) -> dist.ProcessGroup:
    """A c10d ``ProcessGroup`` whose CPU backend is a ``ProcessGroupOxccl`` over
    ``communicator``. ``store``: the store the communicator was made over (kept for
    ``split_group``; None: a private HashStore). ``default``: make it torch's default group
    (its ranks are then the global ranks). ``replaces``: a group this one replaces, taken out
    of torch's registry (if it was the default group, ``default`` should be True)."""
    t = _torch_module()
    if not isinstance(communicator, _oxccl.Communicator):
        raise InvalidArgument(
            f"oxccl.torch.wrap: expected an oxccl.Communicator, got {type(communicator).__name__}"
        )
    if store is None:
        store = dist.HashStore()
    be = t.ProcessGroupOxccl(store, 0, 0, timeout, communicator=communicator)
    be.generation = int(generation)
    be._serial = time.monotonic()
    t._GROUPS.add(be)
    rank, size = be.rank(), be.size()
    pg = dist.ProcessGroup(store, rank, size)
    custom = dist.ProcessGroup.BackendType.CUSTOM
    pg._register_backend(torch.device("cpu"), custom, be)
    pg._set_default_backend(custom)
    name = _name(be.generation)
    pg._set_group_name(name)
    pg._set_group_desc(f"oxccl elastic group, generation {be.generation}")
    if replaces is not None and replaces in _c10d._world.pg_map:
        _c10d._cleanup_process_group_global_state(replaces)
    if default and dist.is_initialized():
        current = _c10d._get_default_group()
        if current in _c10d._world.pg_map:
            _c10d._cleanup_process_group_global_state(current)
    _c10d._register_pg_in_world(
        pg,
        backend_name=t.BACKEND,
        # new_group() under a default group prefixes its own names onto this store.
        store=dist.PrefixStore(f"{name}/", store),
        group_name=name,
        backend_config=f"cpu:{t.BACKEND}",
        rank_mapping={r: r for r in range(size)} if default else None,
        add_to_default_tag=default,
    )
    if default:
        _c10d._update_default_pg(pg)
    return pg


def _replace(old: Any, be: Any, comm: _oxccl.Communicator, default: Optional[bool]) -> Any:
    was_default = dist.is_initialized() and old is _c10d._get_default_group()
    return wrap(
        comm,
        be._store,
        timeout=be._timeout,
        default=was_default if default is None else default,
        generation=be.generation + 1,
        replaces=old,
    )


def shrink(
    group: Any = None, exclude: Sequence[int] = (), *, default: Optional[bool] = None
) -> dist.ProcessGroup:
    """After a failure (``oxccl.PeerFailed``, ``oxccl.Aborted`` from a faster survivor's
    shrink, or DDP's error carrying one): the group of the survivors, renumbered in order from
    0. Every survivor calls it; they agree through the store on who is gone (a rank that saw no
    failure learns it there), so none needs to know which rank died. ``exclude``: ranks (of
    ``group``) to leave out as well, or, with no failure, the ranks to leave out. The old group
    is stopped (its calls in flight raise) and leaves torch's registry; ``default`` (None: when
    ``group`` is the default group) makes the new one the default group. A rank that the
    others left out gets ``oxccl.Error``; every wait is bounded by the group's timeout."""
    pg = _group(group, "oxccl.torch.shrink")
    be = _torch_module().backend(pg, "oxccl.torch.shrink")
    comm = be.communicator
    exclude = [int(r) for r in exclude]
    new = comm.shrink(exclude) if exclude else comm.shrink_after_failure()
    return _replace(pg, be, new, default)


def grow(group: Any = None, count: int = 1, *, default: Optional[bool] = None) -> dist.ProcessGroup:
    """The group of ``group``'s members and ``count`` newcomers (``oxccl.torch.join`` on
    their side). Collective over the members, with the same ``count``, at a call boundary (no
    call of theirs in flight); members keep their ranks, newcomers get the ranks after, in the
    order they asked. Returns once the newcomers are in; raises ``oxccl.Error`` naming what it
    waited for when they do not come within the group's timeout (``group`` stays usable then),
    or when a member or newcomer dies meanwhile. The old group leaves torch's registry (its
    communicator is left to the garbage collector); ``default`` (None: when ``group`` is the
    default group) makes the new one the default group."""
    pg = _group(group, "oxccl.torch.grow")
    be = _torch_module().backend(pg, "oxccl.torch.grow")
    comm = be.communicator
    if not hasattr(comm, "grow"):
        raise InvalidArgument(
            "oxccl.torch.grow: this oxccl build has no Communicator.grow (it needs the "
            "grow/join support of the Rust library)"
        )
    count = int(count)
    if count < 1:
        raise InvalidArgument(f"oxccl.torch.grow: count={count}: expected 1 or more newcomers")
    if be.rank() == 0:
        # Read by the newcomers once they are in (join): the new group's generation.
        be._store.set(_GENERATION_KEY, str(be.generation + 1))
    new = comm.grow(count)
    return _replace(pg, be, new, default)


def backend_store(store: Any, group_name: Optional[str] = "0") -> Any:
    """The store c10d hands the backend of the group ``group_name`` made over ``store``
    (``PrefixStore("cpu/", PrefixStore(group_name + "/", store))``; the default group of
    ``init_process_group`` is "0"); ``store`` itself when ``group_name`` is None."""
    if group_name is None:
        return store
    return dist.PrefixStore("cpu/", dist.PrefixStore(f"{group_name}/", store))


def join(
    store: Any,
    *,
    group_name: Optional[str] = "0",
    timeout: Any = None,
    default: bool = True,
    job_id: str = "torch",
) -> dist.ProcessGroup:
    """A newcomer's side of ``oxccl.torch.grow``: joins the members' group through ``store``
    (the store their ``init_process_group`` was given, a client of the same TCPStore; see
    ``backend_store`` for ``group_name``) and returns the grown group once their grow admits
    this process, by default as torch's default group (no ``init_process_group`` needed).
    Its rank follows the members'. ``timeout`` (seconds or a timedelta) bounds the wait and
    is the new group's timeout; past it, ``oxccl.Error`` names what it waited for."""
    t = _torch_module()
    if not hasattr(_oxccl.Communicator, "join"):
        raise InvalidArgument(
            "oxccl.torch.join: this oxccl build has no Communicator.join (it needs the "
            "grow/join support of the Rust library)"
        )
    bstore = backend_store(store, group_name)
    seconds = _secs(timeout, "oxccl.torch.join")
    comm = _oxccl.Communicator.join(
        bstore,
        job_id=job_id,
        timeout=seconds,
        options={**t._defaults(), "OXCCL_COMPRESS": "off"},
    )
    try:
        generation = int(bstore.get(_GENERATION_KEY))
    except Exception:  # noqa: BLE001 - members not made by oxccl.torch.grow: count from 1
        generation = 1
    group_timeout = datetime.timedelta(seconds=seconds) if seconds else None
    return wrap(comm, bstore, timeout=group_timeout, default=default, generation=generation)
