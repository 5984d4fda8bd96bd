"""What the strategy's collective methods do over MPI: reduce, all_gather, object broadcast, metric state gathers
and the broadcast of a module's parameters and buffers from rank 0.

Tensor reductions and gathers go through the differentiable collectives (so ``all_gather(sync_grads=True)`` is
differentiable); small control traffic (objects, barriers, boolean decisions, metric states, the initial broadcast)
goes through the private ``control`` communicator of the :class:`~mpistrategy.comm.topology.Topology`. The control
calls a user or Lightning makes (``broadcast``, ``barrier``, ``reduce_boolean_decision``, metric state gathers) are
checked and counted on the world's :class:`~mpistrategy.comm.communicator.Communicator`, as the tensor collectives
are: a rank in one of them while another is in another collective of the world raises on every rank, naming both
calls, instead of pairing its message with the wrong call; the flight recorder and the stall watchdog see them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from mpi4py import MPI
from torch import nn

from mpistrategy.collectives.reduction import _allgather_front, allreduce
from mpistrategy.comm import calls
from mpistrategy.comm.buffers import mpi_buffer, off_wire, on_wire
from mpistrategy.comm.checks import check_rank, checked
from mpistrategy.comm.communicator import Communicator
from mpistrategy.strategy import failures
from mpistrategy.strategy.sharding import checkpoint as sharded_checkpoint
from mpistrategy.strategy.sharding.optimizer import ShardedOptimizer, unwrapped

_CONSOLIDATION = "consolidated_optimizer_state"  # the call's name in its checks and errors
_OP_NAMES = {
    **{name: name for name in ("sum", "avg", "max", "min", "band", "bor", "bxor")},
    **{"mean": "avg", "product": "prod", "prod": "prod"},
}
#: a bool tensor's reductions as DDP's (gloo's): a sum, mean or maximum is the logical or, a product or minimum the and
_BOOL_OPS = {"sum": "lor", "avg": "lor", "max": "lor", "prod": "land", "min": "land"}


def reduce_op_name(reduce_op: Any) -> str:
    """The allreduce op (``"avg"``, ``"sum"``, ``"prod"``, ...) for Lightning's ``reduce_op``: a string (``"mean"``,
    ``"avg"``, ``"sum"``, ``"product"``, ``"max"``, ``"min"``, ``"band"``, ``"bor"``, ``"bxor"``) or a ``ReduceOp``."""
    if reduce_op is None:
        return "sum"
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
    else:
        name = str(getattr(reduce_op, "name", reduce_op)).rsplit(".", 1)[-1].lower()
    if name not in _OP_NAMES:
        raise ValueError(
            f"reduce: unsupported reduce_op {reduce_op!r}; use 'mean', 'sum', 'product', 'max', 'min', 'band', 'bor', "
            "'bxor' or the matching ReduceOp."
        )
    return _OP_NAMES[name]


def reduce_tensor(tensor: torch.Tensor, reduce_op: Any, comm: Communicator) -> torch.Tensor:
    """``tensor`` reduced over all ranks, in place and returned, as Lightning's DDP does: integer means truncated to
    the dtype, a bool tensor's sum, mean and maximum its logical or, its product and minimum its and. A tensor that
    requires grad keeps its value and gets a new, differentiable result (the adjoint of the sum is the sum of the
    cotangents, of the mean their mean)."""
    op = reduce_op_name(reduce_op)
    if comm.size == 1:
        return tensor
    if tensor.dtype == torch.bool:
        result = allreduce(tensor.contiguous(), _BOOL_OPS.get(op, op), comm)
    elif op == "avg" and not (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
        result = (allreduce(tensor, "sum", comm) / comm.size).to(tensor.dtype)
    else:
        result = allreduce(tensor.contiguous(), op, comm)
    if tensor.requires_grad and torch.is_grad_enabled():
        return result
    with torch.no_grad():
        return tensor.copy_(result)


def all_gather(tensor: torch.Tensor, comm: Communicator, sync_grads: bool) -> torch.Tensor:
    """Every rank's ``tensor`` stacked along a new first dimension (shape ``(world_size, *tensor.shape)``).

    With ``sync_grads`` the result is differentiable: rank r's input gets the sum over ranks of their cotangents
    of block r (the adjoint of allgather under mpistrategy's sum-of-losses convention, as torch.distributed.nn).
    """
    from mpistrategy.collectives.gather import allgather

    source = tensor if sync_grads else tensor.detach()
    with torch.set_grad_enabled(sync_grads and torch.is_grad_enabled()):
        return allgather(source.contiguous().unsqueeze(0), 0, comm)


def _signature(*local: object) -> tuple[tuple, None]:
    """The local check of a control call without arguments to refuse: its signature is its arguments."""
    return local, None


def root_signature(root: int, comm: Communicator, what: str = "broadcast", role: str = "src") -> tuple[tuple, None]:
    """The local check of a control call to or from one rank, ``root`` (named ``role`` in ``what``'s errors)."""
    check_rank(root, comm, what, role)
    return (root,), None


@contextlib.contextmanager
def control_call(
    on: Communicator, what: str, describe: str = "", check: Callable[..., tuple] = _signature, *args: object
) -> Iterator[None]:
    """A control call, registered on ``on`` and checked across ranks there (``check(*args)``: this rank's checks
    and the signature, see :func:`~mpistrategy.comm.checks.checked`) before the block sends anything (see the
    module docstring)."""
    checked(on, what, describe, check, *args)
    try:
        yield
    finally:
        calls.leave()


def gather_tensors(tensor: torch.Tensor, comm: MPI.Intracomm, checked_on: Communicator) -> list[torch.Tensor]:
    """Every rank's ``tensor`` in a list, shapes allowed to differ (torchmetrics' ``dist_sync_fn`` contract)."""
    if comm.Get_size() == 1:
        return [tensor]
    with control_call(checked_on, "metric state sync"):
        return _gather_tensors(tensor, comm)


def metric_gather(comm: MPI.Intracomm, checked_on: Communicator) -> Callable[..., list[torch.Tensor]]:
    """:func:`gather_tensors` over ``comm`` as torchmetrics calls a ``dist_sync_fn`` (``group`` is ignored)."""

    def gather(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        return gather_tensors(tensor, comm, checked_on)

    return gather


def _gather_tensors(tensor: torch.Tensor, comm: MPI.Intracomm) -> list[torch.Tensor]:
    local = on_wire(tensor.detach())
    shapes = comm.allgather((tuple(local.shape), local.dtype))
    dtypes = {dtype for _, dtype in shapes}
    if len(dtypes) != 1:
        raise TypeError(f"metric state sync: ranks hold different dtypes {sorted(map(str, dtypes))} for one state.")
    counts = [int(torch.Size(shape).numel()) for shape, _ in shapes]
    flat = _allgather_front(local.reshape(-1), counts, comm).to(tensor.device)
    return [block.view(shape) for block, (shape, _) in zip(flat.split(counts), shapes, strict=True)]


def broadcast_object(obj: Any, src: int, comm: MPI.Intracomm, checked_on: Communicator) -> Any:
    """Rank ``src``'s ``obj`` (any picklable object, tensors included) on every rank."""
    if comm.Get_size() == 1:
        return obj
    with control_call(checked_on, "broadcast", "src", root_signature, src, checked_on):
        return comm.bcast(obj, root=src)


def optimizer_state_on(
    optimizer: Any, sharded: ShardedOptimizer | None, to: int, comm: MPI.Intracomm, checked_on: Communicator
) -> dict[str, Any] | None:
    """``optimizer``'s whole ``state_dict()`` on rank ``to``, ``None`` elsewhere; ``sharded``: its sharded form,
    whose pieces are gathered (:func:`~mpistrategy.strategy.sharding.checkpoint.consolidated_on`)."""
    with control_call(
        checked_on, _CONSOLIDATION, "to, sharded", _state_signature, optimizer, sharded is not None, to, checked_on
    ):
        return sharded_checkpoint.consolidated_on(optimizer, sharded, to, comm)


def _state_signature(optimizer: Any, sharded: bool, to: int, comm: Communicator) -> tuple[tuple, None]:
    if not isinstance(unwrapped(optimizer), torch.optim.Optimizer):
        raise TypeError(
            f"{_CONSOLIDATION}: expected a torch optimizer (or Lightning's wrapper of one), got "
            f"{type(optimizer).__name__}; pass one of the optimizers the strategy set up."
        )
    root_signature(to, comm, _CONSOLIDATION, "to")
    return (to, sharded), None


def barrier(comm: MPI.Intracomm, checked_on: Communicator) -> None:
    """Wait until every rank has reached its barrier."""
    if comm.Get_size() > 1:
        with control_call(checked_on, "barrier"):
            comm.Barrier()


def reduce_boolean(decision: bool, every: bool, comm: MPI.Intracomm, checked_on: Communicator) -> bool:
    """``decision`` combined over the ranks: true where every rank's is (``every``), else where any rank's is."""
    if comm.Get_size() == 1:
        return bool(decision)
    with control_call(checked_on, "reduce_boolean_decision", "all", _signature, every):
        return bool(comm.allreduce(bool(decision), op=MPI.LAND if every else MPI.LOR))


def broadcast_module_state(module: nn.Module, comm: MPI.Intracomm, root: int = 0) -> None:
    """Overwrite every parameter and buffer of ``module`` with rank ``root``'s values, in place.

    The ranks first check that their modules have the same parameters and buffers (:func:`check_same_module`).
    Tensors are packed into one flat buffer per dtype and device, so the whole model takes a handful of
    broadcasts.
    """
    if comm.Get_size() == 1:
        return
    check_same_module(module, comm, root)
    broadcast_tensors(_unique(list(module.parameters()) + list(module.buffers())), comm, root)


def share_buffers(module: nn.Module, comm: MPI.Intracomm, checked_on: Communicator) -> None:
    """Collective: every rank gets rank 0's buffers of ``module`` (BatchNorm's running statistics, which follow each
    rank's own batches in training), as DDP's buffer broadcast. Registered and checked on ``checked_on`` (the
    number of buffers and of their elements), so a rank elsewhere is named instead of matching another call."""
    buffers = list(module.buffers())
    if not buffers or comm.Get_size() == 1:
        return
    with control_call(
        checked_on, "buffer broadcast", "buffers and elements", _signature, len(buffers), _numel(buffers)
    ):
        broadcast_tensors(buffers, comm)


def _numel(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def broadcast_tensors(tensors: list[torch.Tensor], comm: MPI.Intracomm, root: int = 0) -> None:
    """Overwrite ``tensors`` (the same list on every rank) with rank ``root``'s values, in place: packed into one
    flat buffer per dtype and device (each tensor's elements in its logical order, so any strides: channels_last,
    transposed), one broadcast each."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.dtype, t.device), []).append(t.detach())
    with torch.no_grad():
        for (dtype, device), group in groups.items():
            flat = on_wire(torch.cat([t.reshape(-1) for t in group]))
            comm.Bcast(mpi_buffer(flat), root=root)
            pieces = off_wire(flat, dtype, device).split([t.numel() for t in group])
            torch._foreach_copy_(group, [piece.view(t.shape) for piece, t in zip(pieces, group, strict=True)])


def check_same_module(module: nn.Module, comm: MPI.Intracomm, reference: int = 0) -> None:
    """Collective: raise ``ValueError`` on every rank if the names, shapes or dtypes of ``module``'s parameters and
    buffers differ between the ranks, naming the first difference from rank ``reference``'s, or if a rank's
    ``module`` has submodules that declare their parameters split across the ranks (``split_across_ranks = True``:
    tensor- or pipeline-parallel layers, which rank 0's values would overwrite and gradient averaging would mix)."""
    mine = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in _named_state(module)]
    split = [
        name or type(module).__name__
        for name, child in module.named_modules()
        if getattr(child, "split_across_ranks", False)
    ]
    everyone = comm.allgather((split, mine))
    marked = [(rank, names) for rank, (names, _) in enumerate(everyone) if names]
    if marked:
        rank, names = marked[0]
        listing = ", ".join(repr(name) for name in names[:3]) + (" ..." if len(names) > 3 else "")
        raise failures.mark_raised_on_every_rank(
            ValueError(
                f"rank {rank}'s {listing} hold(s) parameters split across the ranks (split_across_ranks = True), which "
                "data-parallel mpi_ad would overwrite with rank 0's and whose gradients it would average; use "
                "MPIADStrategy(data_parallel=False) (strategy=mpi_ad_model_parallel in the Hydra configs)."
            )
        )
    expected = everyone[reference][1]
    for rank, (_, theirs) in enumerate(everyone):
        if theirs != expected:
            difference = _first_difference(theirs, expected, rank, reference)
            raise failures.mark_raised_on_every_rank(
                ValueError(
                    f"the model differs between ranks: {difference}. Every rank must build the same model (the same "
                    f"layers, shapes and dtypes; initial values may differ, rank {reference}'s are broadcast)."
                )
            )


#: a parameter's or buffer's name, shape and dtype
_Entry = tuple[str, tuple[int, ...], str]


def _named_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(module.named_parameters()) + list(module.named_buffers())


def _first_difference(theirs: list[_Entry], expected: list[_Entry], rank: int, ref: int) -> str:
    for (name, shape, dtype), (ref_name, ref_shape, ref_dtype) in zip(theirs, expected, strict=False):
        if (name, shape, dtype) != (ref_name, ref_shape, ref_dtype):
            return (
                f"rank {rank} has {name!r} of shape {list(shape)} ({dtype}) where rank {ref} has {ref_name!r} of shape "
                f"{list(ref_shape)} ({ref_dtype})"
            )
    return f"rank {rank} has {len(theirs)} parameters and buffers, rank {ref} has {len(expected)}"


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    result = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            result.append(t)
    return result


def attach_metric_sync(module: nn.Module, gather, available) -> int:
    """Make every torchmetrics ``Metric`` inside ``module`` sync over MPI; returns how many were found.

    torchmetrics syncs only when ``distributed_available_fn()`` is true (by default: torch.distributed is
    initialised) and gathers with ``dist_sync_fn``; both are plain attributes read at compute time.
    """
    try:
        from torchmetrics import Metric
    except ImportError:
        return 0
    found = 0
    for sub in module.modules():
        if isinstance(sub, Metric):
            sub.dist_sync_fn = gather
            sub.distributed_available_fn = available
            found += 1
    return found
