"""The user's optimizer, made to step only this rank's shard: any elementwise torch optimizer, groups kept.

:class:`ShardedOptimizer` splits the optimizer's parameters into spaces (one per dtype and device), puts each space
into a flat buffer (:class:`~mpistrategy.strategy.sharding.flat.FlatParameters`) and replaces, in place, each
parameter group's ``"params"`` by the pieces of this rank's shard that belong to the group's parameters. The
optimizer object stays the user's (Lightning's wrappers, learning-rate schedulers and the group hyperparameters
keep working); it now creates state only for the pieces: ``1/N`` of the whole. Each piece is a parameter of its
own, so a piece of a parameter without a gradient has ``.grad`` ``None`` and is skipped, as the whole parameter
would be, and per-parameter counters (Adam's ``step``) stay exact.

The driver gives the pieces their gradients after backward (:meth:`ShardedOptimizer.use_parameter_gradients` under
``shard="optimizer"``, where the averaged ``.grad`` of every parameter exists: pieces are views of it; the gradient
shards under ``shard="gradients"``), and after the step calls :meth:`ShardedOptimizer.after_step`: every space's
updated shards are allgathered into every rank's parameters.

Gradient clipping by norm must see the whole gradient: :meth:`ShardedOptimizer.clip_grad_norm_` takes the norm of
this rank's pieces and combines it over the shard group, ``||g||_p = (sum_r ||g_r||_p^p)^(1/p)`` (the maximum
for ``p = inf``). Clipping by value is elementwise and needs nothing.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from mpi4py import MPI
from torch import nn

from mpistrategy.strategy.sharding import state as state_rules
from mpistrategy.strategy.sharding.flat import FlatParameters
from mpistrategy.strategy.sharding.layout import Piece

#: (the space, the piece): where a piece tensor comes from
PieceRef = tuple[FlatParameters, Piece]


def unwrapped(optimizer: Any) -> Any:
    """The optimizer a Lightning or Fabric wrapper holds (as ``_optimizer``), or ``optimizer`` itself."""
    return getattr(optimizer, "_optimizer", optimizer)


class ShardedOptimizer:
    """``optimizer`` stepping this rank's shard of its parameters (see the module docstring).

    Args:
        optimizer: the user's optimizer, with its parameter groups over the model's parameters and no state yet
            (state it has is kept: each piece gets its part).
        comm: the shard group's communicator.
        launch_order: the parameters' order in the flat buffers (the order of their gradients in backward).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, comm: MPI.Intracomm, launch_order: Sequence[nn.Parameter]):
        self.optimizer = optimizer
        self.comm = comm
        self.params: list[nn.Parameter] = [p for group in optimizer.param_groups for p in group["params"]]
        self._group_sizes = [len(group["params"]) for group in optimizer.param_groups]
        self.shapes = [tuple(p.shape) for p in self.params]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        existing = optimizer.state_dict() if optimizer.state else None
        self.spaces = [FlatParameters(space, comm) for space in _spaces(self.params, launch_order)]
        self._refs: dict[int, PieceRef] = {}
        self._group_ranges: list[tuple[int, int]] = []
        self.overflow_anywhere = False  # whether some rank's gradient was not finite at the last check
        self._following: Callable[..., Any] | None = None  # the step wrapper of follow_parameter_gradients
        self._own_step: Callable[..., Any] | None = None  # an instance's own step it replaced (a scheduler's wrapper)
        self._shard_groups()
        if existing is not None:
            self.load_plain(existing)

    def _shard_groups(self) -> None:
        """Replace each group's parameters by their pieces in this shard (group order, then element order)."""
        pieces_of: dict[int, list[tuple[torch.Tensor, PieceRef]]] = {}
        for space in self.spaces:
            for piece, tensor in zip(space.pieces, space.tensors, strict=True):
                index = self._index[id(space.params[piece.index])]
                pieces_of.setdefault(index, []).append((tensor, (space, piece)))
        position = 0
        for group in self.optimizer.param_groups:
            mine = [item for p in group["params"] for item in pieces_of.get(self._index[id(p)], [])]
            group["params"] = [tensor for tensor, _ in mine]
            self._refs.update({id(tensor): ref for tensor, ref in mine})
            self._group_ranges.append((position, position + len(mine)))
            position += len(mine)

    @property
    def pieces(self) -> list[torch.Tensor]:
        """The piece tensors the optimizer steps, in its order (the order of ``optimizer.state_dict()``)."""
        return [tensor for group in self.optimizer.param_groups for tensor in group["params"]]

    def origin(self, tensor: torch.Tensor) -> tuple[int, int, int]:
        """``(parameter index, start, stop)`` of a piece tensor: which elements of which of the optimizer's
        original parameters (in its original order) it is."""
        space, piece = self._refs[id(tensor)]
        return self._index[id(space.params[piece.index])], piece.start, piece.stop

    # ------------------------------------------------------------------------------------------------ gradients

    def use_parameter_gradients(self) -> None:
        """Point each piece's ``.grad`` at its elements of its parameter's ``.grad`` (``None`` where that is)."""
        for tensor in self.pieces:
            space, piece = self._refs[id(tensor)]
            grad = space.params[piece.index].grad
            tensor.grad = None if grad is None else grad.reshape(-1)[piece.start : piece.stop]

    def follow_parameter_gradients(self) -> None:
        """Under ``shard="optimizer"``: take the parameters' ``.grad`` again before each step and each norm, so that
        a ``.grad`` the user replaces after backward (``p.grad = None`` to skip a layer, ``p.grad = p.grad * mask``)
        is the one stepped, as by the unsharded optimizer. ``optimizer.step`` is wrapped: a closure's backward comes
        first. :meth:`stop_following` undoes it."""
        optimizer, own_step = self.optimizer, self.optimizer.step

        def step(_optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
            if closure is None:
                self.use_parameter_gradients()
                return own_step()

            def closure_then_gradients() -> Any:
                loss = closure()
                self.use_parameter_gradients()
                return loss

            return own_step(closure_then_gradients)

        self._own_step = own_step if "step" in vars(optimizer) else None
        # a bound method, as torch's learning-rate schedulers expect of optimizer.step when they wrap it
        self._following = optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]

    def stop_following(self) -> None:
        """Give the optimizer its own ``step`` back (if nothing wrapped it since)."""
        following, self._following = self._following, None
        if following is not None and vars(self.optimizer).get("step") is following:
            if self._own_step is None:
                del self.optimizer.step
            else:
                self.optimizer.step = self._own_step  # type: ignore[method-assign]

    def gradients(self) -> list[torch.Tensor]:
        """The pieces' gradients (taken from the parameters' current ``.grad`` again under ``shard="optimizer"``)."""
        if self._following is not None:
            self.use_parameter_gradients()
        return [t.grad for t in self.pieces if t.grad is not None]

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The ``norm_type``-norm of the whole gradient: this rank's pieces' norm combined over the shard group."""
        grads = self.gradients()
        local = float(torch.nn.utils.get_total_norm(grads, norm_type)) if grads else 0.0
        if math.isinf(norm_type):
            total = self.comm.allreduce(local, op=MPI.MAX)
        else:
            total = self.comm.allreduce(local**norm_type, op=MPI.SUM) ** (1.0 / norm_type)
        reference = grads[0] if grads else self.spaces[0].flat
        return torch.tensor(total, dtype=reference.dtype, device=reference.device)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole gradient (collective over the shard group): the
        gradients are scaled by ``min(1, max_norm / (||g|| + 1e-6))``; returns ``||g||``."""
        total = self.grad_norm(norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from the sharded optimizer is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "error_if_nonfinite=False."
            )
        torch.nn.utils.clip_grads_with_norm_(self.pieces, max_norm, total)
        return total

    def groups_problem(self) -> ValueError | None:
        """The error to raise if parameter groups were added since the optimizer was sharded, else ``None``."""
        if len(self.optimizer.param_groups) == len(self._group_sizes):
            return None
        return ValueError(
            f"shard (sharded optimizer state): {type(self.optimizer).__name__} has "
            f"{len(self.optimizer.param_groups)} parameter groups, {len(self._group_sizes)} when it was sharded: "
            "optimizer.add_param_group during training (as "
            "Lightning's BaseFinetuning callbacks do when they unfreeze) is not supported with sharded state. "
            "Give configure_optimizers every group from the start (frozen parameters included: they are "
            "skipped until they get gradients), or use shard=None."
        )

    def agree_on_nonfinite(self) -> None:
        """If some rank's pieces hold an infinite or NaN gradient, put a NaN into this rank's too (collective over
        the shard group), so that an overflow check (a ``GradScaler``'s) skips the step on every rank alike; a rank
        whose pieces hold no gradient keeps the answer for the scaler (:meth:`report_to_scaler`)."""
        grads = self.gradients()
        local = bool(grads) and not all(bool(torch.isfinite(g).all()) for g in grads)
        self.overflow_anywhere = bool(self.comm.allreduce(local, op=MPI.LOR))
        if self.overflow_anywhere and grads and not local:
            grads[0].view(-1)[0] = float("nan")

    def report_to_scaler(self, scaler: Any) -> None:
        """After ``scaler.unscale_`` of this optimizer found no gradient on this rank (its pieces got none, or it
        has none), record the ranks' agreed overflow as this rank's check: the scaler then steps (or skips) and
        updates its scale as every other rank's does, instead of refusing to step without a check."""
        found = scaler._per_optimizer_states[id(self.optimizer)]["found_inf_per_device"]
        if not found:
            device = self.spaces[0].flat.device
            found[device] = torch.full((1,), float(self.overflow_anywhere), device=device)

    # ------------------------------------------------------------------------------------------------ step

    def after_step(self) -> int:
        """After the optimizer step: allgather every space's shards (collective over the shard group); returns the
        bytes this rank sent."""
        sent = 0
        for space in self.spaces:
            if any(param.requires_grad for param in space.params):  # a frozen space did not change
                space.allgather()
                sent += space.shard.nbytes
        return sent

    # ------------------------------------------------------------------------------------------------ state

    def param_groups(self) -> list[dict[str, Any]]:
        """The groups' hyperparameters, each with ``"params"``: its parameters' indices in the original order (what
        ``optimizer.state_dict()`` of the unsharded optimizer gives)."""
        groups, position = [], 0
        for group, count in zip(self.optimizer.param_groups, self._group_sizes, strict=True):
            hyperparameters = {key: value for key, value in group.items() if key != "params"}
            groups.append({**hyperparameters, "params": list(range(position, position + count))})
            position += count
        return groups

    def shard_state(self) -> list[tuple[int, int, int, dict[str, Any]]]:
        """This rank's optimizer state: ``(parameter index, start, stop, state)`` per piece."""
        state = self.optimizer.state
        return [(*self.origin(t), dict(state.get(t, {}))) for t in self.pieces]

    def load(self, param_groups: list[dict[str, Any]], state_of: Callable[[int, int, int], dict[str, Any]]) -> None:
        """Load the groups' hyperparameters and each piece's state, ``state_of(index, start, stop)`` (through the
        optimizer's ``load_state_dict``, which casts the state to each piece's dtype and device)."""
        pieces = self.pieces
        if len(param_groups) != len(self.optimizer.param_groups):
            raise ValueError(
                f"the saved optimizer has {len(param_groups)} parameter groups and this one "
                f"{len(self.optimizer.param_groups)}: configure_optimizers must build the same groups."
            )
        states = {}
        for number, tensor in enumerate(pieces):
            piece_state = state_of(*self.origin(tensor))
            if piece_state:
                states[number] = piece_state
        groups = [
            {**{k: v for k, v in saved.items() if k != "params"}, "params": list(range(low, high))}
            for saved, (low, high) in zip(param_groups, self._group_ranges, strict=True)
        ]
        self.optimizer.load_state_dict({"state": states, "param_groups": groups})

    def load_plain(self, plain: dict[str, Any]) -> None:
        """Load a plain ``state_dict()`` of the unsharded optimizer (over the original parameters)."""
        if len(plain.get("state", {})) and max(plain["state"]) >= len(self.params):
            raise ValueError(
                f"the optimizer state holds parameter {max(plain['state'])}, but this optimizer steps "
                f"{len(self.params)} parameters: the model or the optimizer's parameter groups differ."
            )
        state = plain.get("state", {})
        self.load(
            plain["param_groups"],
            lambda index, start, stop: state_rules.piece_of(state.get(index, {}), self.shapes[index], start, stop),
        )


#: torch optimizers whose step is not elementwise: what each does that a shard of the elements cannot
_NOT_ELEMENTWISE = {
    "LBFGS": "its step reads the whole gradient and keeps its own list of the parameters",
    "Adafactor": "it factors the second moment of a matrix into row and column statistics",
    "Muon": "it orthogonalises each weight matrix's update as a whole",
    "SparseAdam": "it needs sparse gradients of whole embedding tables",
}


def check_shardable(optimizer: torch.optim.Optimizer, model_params: Sequence[nn.Parameter] | None) -> None:
    """Raise unless ``optimizer`` can step a shard of the elements: its update must be elementwise (the same on
    a piece of a parameter as on the whole), it must not keep a list of its parameters beside its groups (it would
    go on stepping the whole parameters), and, where given, every parameter must be one of ``model_params`` (the
    gradient reducer averages only the model's gradients)."""
    name = type(optimizer).__name__
    reason = next((why for base, why in _NOT_ELEMENTWISE.items() if _is_torch_optimizer(optimizer, base)), None)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    mine = {id(p) for p in params}
    if reason is None:
        cached = [key for key, value in vars(optimizer).items() if _holds_any(value, mine)]
        if cached:
            reason = f"it keeps its parameters in optimizer.{cached[0]} beside its parameter groups"
    if reason is not None:
        raise ValueError(
            f"shard (sharded optimizer state): {name} cannot step a shard of the parameters: {reason}. Use an "
            "optimizer whose update is elementwise (SGD, Adam, AdamW, RMSprop, Adagrad, ...), or shard=None."
        )
    if model_params is not None:
        known = {id(p) for p in model_params}
        foreign = [p for p in params if id(p) not in known]
        if foreign:
            raise ValueError(
                f"shard='optimizer': {name} steps {len(foreign)} tensor(s) that are not parameters of the model (the "
                f"first of shape {tuple(foreign[0].shape)}), whose gradients the ranks would not average. Register "
                "them on the module as nn.Parameter, or use shard='gradients' (it averages every gradient the "
                "optimizer steps)."
            )


def _is_torch_optimizer(optimizer: torch.optim.Optimizer, name: str) -> bool:
    base = getattr(torch.optim, name, None)
    return isinstance(base, type) and isinstance(optimizer, base)


def _holds_any(value: object, params: set[int]) -> bool:
    """Whether ``value`` is a list or tuple holding one of the tensors whose ids are ``params``."""
    return isinstance(value, (list, tuple)) and any(id(item) in params for item in value)


def _spaces(params: Sequence[nn.Parameter], launch_order: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` split by dtype, device and whether they train now (frozen parameters form spaces of their own, so
    that the trainable ones are split evenly), each in launch order (then the others in optimizer order)."""
    position = {id(p): i for i, p in enumerate(launch_order)}
    ordered = sorted(params, key=lambda p: position.get(id(p), len(position)))
    spaces: dict[tuple[torch.dtype, torch.device, bool], list[nn.Parameter]] = {}
    for param in ordered:
        spaces.setdefault((param.dtype, param.device, not param.requires_grad), []).append(param)
    return [spaces[key] for key in sorted(spaces, key=lambda key: key[2])]
