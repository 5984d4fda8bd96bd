"""Local SGD (post-local SGD): local steps, with the model averaged over all ranks every ``period`` steps.

Optimizer steps ``s = 0, 1, 2, ...``:

- warm-up, ``s < warmup_steps``: gradients averaged over all ranks every step (as flat data parallelism);
- afterwards every step is local (no gradient communication) and after step ``s`` with
  ``(s - warmup_steps + 1) % period == 0`` the model state (trainable parameters and floating-point buffers) is
  replaced by its mean over all ranks, ``x <- (1/P) sum_r x_r``.

With ``period=1`` and plain SGD this equals flat averaging: ``(1/P) sum_r (x - lr g_r) = x - lr (1/P) sum_r g_r``.
Optimizer states (momentum, Adam moments) are not averaged, as in torch's ``PeriodicModelAverager``; they stay
each rank's own. The state in a checkpoint is the step counter: resuming inside a period continues it.
"""

from __future__ import annotations

from typing import Any

from mpistrategy.aggregation.base import Aggregator, GradBucket
from mpistrategy.comm.checks import is_integer
from mpistrategy.sync.averaging import ModelAverager
from mpistrategy.sync.base import SyncConfigurationError, SyncContext, SyncMode


def check_positive(what: str, name: str, value: object, minimum: int = 1) -> int:
    """``value`` as an int, or a :class:`SyncConfigurationError` naming the field and the valid range."""
    if not is_integer(value) or value < minimum:
        raise SyncConfigurationError(f"{what}: {name}={value!r} must be an integer >= {minimum}.")
    return int(value)


class LocalSGD(SyncMode):
    """Post-local SGD over all ranks (see the module docstring).

    Args:
        period: ``H``, the number of local steps between two model averages (>= 1).
        warmup_steps: optimizer steps of per-step gradient averaging before local steps begin (>= 0).
    """

    name = "local_sgd"
    one_optimizer_fix = "use one optimizer (or sync='flat')"
    replicas = "rank"
    route = "world"

    def __init__(self, period: int = 8, warmup_steps: int = 0) -> None:
        self.period = check_positive(self.name, "period", period)
        self.warmup_steps = check_positive(self.name, "warmup_steps", warmup_steps, minimum=0)
        self.step = 0

    def setup(self, context: SyncContext) -> None:
        super().setup(context)
        self.averager = ModelAverager(context.module, context.topology, context.traffic, self.route)

    def setup_buckets(self, buckets: list[GradBucket]) -> None:
        ctx = self.ctx
        ctx.aggregator.setup(self.aggregation_context(buckets, ctx.topology.gradients, ctx.topology.num_nodes > 1))

    def gradient_aggregator(self) -> Aggregator | None:
        return self.ctx.aggregator if self.step < self.warmup_steps else None

    def uses_aggregator(self) -> bool:
        """Only the warm-up steps average gradients."""
        return self.warmup_steps > 0

    def averages_after_this_step(self) -> bool:
        """Whether the model is averaged after the current step."""
        return self.step >= self.warmup_steps and (self.step - self.warmup_steps + 1) % self.period == 0

    def after_optimizer_step(self) -> None:
        if self.averages_after_this_step():
            self.averager.assign(self.averager.average())
        self.step += 1

    def finish(self) -> None:
        self.averager.close()

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(period={self.period}, warmup_steps={self.warmup_steps})"
