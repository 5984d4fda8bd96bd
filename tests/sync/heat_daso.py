"""A small pure-Python model of heat's DASO (``heat/optim/dp_optimizer.py``: ``DASO.step``, ``_global_sync``,
``_gs_send_params``, ``_gs_rcv_update_params``, ``_local_update``, ``epoch_loss_logic``; ``heat/optim/utils.py``:
``DetectMetricPlateau``), written in heat's imperative style, on ``N`` simulated nodes of ``R`` simulated ranks.

Each rank holds a float64 parameter vector. One training step per rank: a gradient from the test's function,
averaged over the node's ranks when heat's DDP gradient sync is on, then plain SGD, then :meth:`HeatDASO.step`.
Every step's decisions are recorded in :attr:`HeatDASO.events` for comparison with mpistrategy's DASO.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

Gradient = Callable[[torch.Tensor, int, int], torch.Tensor]  # (parameters, rank, global step) -> gradient


@dataclass
class Event:
    """What heat did after one step."""

    send_mod: int | None = None  # the local rank whose model was sent (None: no send)
    downcast: bool = False  # the send travelled in the downcast dtype (heat: global_skip < 1)
    blocking: bool = False  # the send was received at once and replaced the model
    merged: bool = False  # a send in flight was merged (and not overwritten by a blocking receive)
    broadcast_from: int | None = None  # the local rank whose model every node took (heat's _local_update)
    local_sync_next: bool = True  # DDP's require_backward_grad_sync for the next step


@dataclass
class HeatDASO:
    nodes: int
    per_node: int
    total_epochs: int
    warmup_epochs: int
    cooldown_epochs: int
    first_skips: tuple[int, int, int]  # heat hard-codes (4, 1, 1) at the end of warm-up
    max_gs: int = 8
    skip_reduction_factor: int = 2
    local_skip_factor: int = 4
    stability_level: float = 0.05
    lr: float = 0.05
    x: list[torch.Tensor] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    schedules: list[tuple[int, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.size = self.nodes * self.per_node
        self.global_skip = self.local_skip = self.batches_to_wait = 0
        self.current_batch, self.last_batch, self.epoch = 0, 0, 0
        self.send_mod, self.send_mod_m1 = 0, None
        self.prev_params: list[list[tuple[torch.Tensor, int]]] = [[] for _ in range(self.size)]
        self.require_backward_grad_sync = True
        self.best, self.num_bad_epochs = math.inf, 0
        self.event = Event()

    def group(self, local: int) -> list[int]:
        return [node * self.per_node + local for node in range(self.nodes)]

    def node_of(self, rank: int) -> list[int]:
        first = rank // self.per_node * self.per_node
        return list(range(first, first + self.per_node))

    # ------------------------------------------------------------------------------------------ one step

    def train_step(self, gradient: Gradient, global_step: int) -> None:
        grads = [gradient(self.x[r], r, global_step) for r in range(self.size)]
        if self.require_backward_grad_sync:
            grads = [sum(grads[q] for q in self.node_of(r)) / self.per_node for r in range(self.size)]
        for r in range(self.size):
            self.x[r] = self.x[r] - self.lr * grads[r]
        self.event = Event()
        self.step()
        self.event.local_sync_next = self.require_backward_grad_sync
        self.events.append(self.event)

    def step(self) -> None:
        batch = self.current_batch
        next_batch = batch + 1
        gs, ls = self.global_skip, self.local_skip
        gmod = batch % gs if gs > 0 else 0
        lmod = batch % ls if ls > 0 else 0
        btw = self.batches_to_wait if self.batches_to_wait + batch <= self.last_batch else self.last_batch - batch
        if batch == self.last_batch or gmod == 0:
            return self.global_sync(btw)
        if next_batch % gs == 0:
            self.require_backward_grad_sync = True
            self.current_batch += 1
            return
        if gmod < btw:
            self.current_batch += 1
            if next_batch == self.last_batch:
                self.require_backward_grad_sync = True
            return
        elif gmod == btw:
            self.receive_and_merge()
            self.local_update(self.send_mod_m1)
            if ls > 1:
                self.require_backward_grad_sync = False
        if ls == 1 and next_batch != self.last_batch:
            self.current_batch += 1
            self.require_backward_grad_sync = True
            return
        if lmod == 0:
            self.require_backward_grad_sync = False
        elif next_batch % ls == 0:
            self.require_backward_grad_sync = True
        if next_batch == self.last_batch:
            self.require_backward_grad_sync = True
        self.current_batch += 1

    def global_sync(self, batches_to_wait: int) -> None:
        current = self.group(self.send_mod)
        downcast = self.global_skip < 1
        total = sum(self.x[r] for r in current)
        for r in current:
            self.prev_params[r].append((total.clone(), batches_to_wait))
        self.event.send_mod, self.event.downcast = self.send_mod, downcast
        if self.batches_to_wait != 0:
            self.receive_and_merge()
            self.local_update(self.send_mod_m1)
        if self.current_batch == self.last_batch or self.batches_to_wait == 0:
            for r in current:
                assert len(self.prev_params[r]) == 1
                received, _ = self.prev_params[r].pop(0)
                self.x[r] = received / len(current)
            self.local_update(self.send_mod)
            self.event.blocking, self.event.merged, self.event.broadcast_from = True, False, None
            self.send_mod_m1 = None
            if self.current_batch == self.last_batch:
                self.send_mod = 0
                self.epoch += 1
                self.current_batch = 0
            else:
                self.current_batch += 1
                self.send_mod = (self.send_mod + 1) % self.per_node
        else:
            self.current_batch += 1
            self.send_mod_m1 = self.send_mod
            self.send_mod = (self.send_mod + 1) % self.per_node

    def receive_and_merge(self) -> None:
        if self.send_mod_m1 is None:
            return
        merged = False
        for r in self.group(self.send_mod_m1):
            if not self.prev_params[r]:
                continue
            received, between = self.prev_params[r].pop(0)
            numer = between * 2.0 if between > 0 else 1.0
            denom = float(self.nodes + numer)
            self.x[r] = self.x[r] * (numer / denom) + received / denom
            merged = True
        self.event.merged = self.event.merged or merged

    def local_update(self, sending: int | None) -> None:
        if sending is None:
            return
        self.event.broadcast_from = sending
        for node in range(self.nodes):
            source = self.x[node * self.per_node + sending]
            for local in range(self.per_node):
                self.x[node * self.per_node + local] = source.clone()

    # --------------------------------------------------------------------------------------- epoch's end

    def epoch_loss_logic(self, rank_losses: list[float]) -> None:
        avg_loss = sum(rank_losses) / len(rank_losses)
        if self.epoch < self.warmup_epochs:
            self.global_skip = self.local_skip = self.batches_to_wait = 0
        else:
            if self.warmup_epochs == self.epoch:
                self.global_skip, self.local_skip, self.batches_to_wait = self.first_skips
            if self.epoch >= self.total_epochs - self.cooldown_epochs:
                self.global_skip = self.local_skip = self.batches_to_wait = 0
            else:
                self.adapt(avg_loss)
        self.schedules.append((self.global_skip, self.local_skip, self.batches_to_wait))

    def adapt(self, avg_loss: float) -> None:
        comp = self.best * (1.0 - self.stability_level) if self.best >= 0 else self.best * (1 + self.stability_level)
        if avg_loss < comp:
            self.best, self.num_bad_epochs = avg_loss, 0
        else:
            self.num_bad_epochs += 1
        stable = self.num_bad_epochs > 2
        if stable:
            self.num_bad_epochs = 0
        if stable and self.global_skip > 1:
            self.global_skip //= self.skip_reduction_factor
            self.local_skip //= self.skip_reduction_factor
            self.batches_to_wait -= 1
            if self.global_skip > 0:
                if self.batches_to_wait == 0:
                    self.batches_to_wait = 1
                if self.local_skip == 0:
                    self.local_skip = 1
        elif self.global_skip == 1 and stable:
            self.global_skip = self.max_gs
            self.local_skip = self.max_gs // self.local_skip_factor
            self.batches_to_wait = self.max_gs // self.local_skip_factor
