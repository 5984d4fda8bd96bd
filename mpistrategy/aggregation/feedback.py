"""Error feedback: what a biased compressor left out of a bucket is added to the bucket's next gradient.

Per bucket ``b`` and rank, with ``g`` the gradient and ``C`` the compressor (Seide et al. 2014; Karimireddy et al.
2019, EF-SGD)::

    p = g + e_b          the value to send
    send C(p)
    e_b <- p - C(p)      the residual, kept on this rank

Nothing is lost: summed over the steps, everything a rank fed in is sent, one step late at most by the part still in
``e_b``. When several backward passes run before one optimizer step (manual optimization), the bucket already holds
the previous combined result when it is combined again; it is then sent again as part of ``p``, and what is not sent
of it stays in ``e_b``, so the invariant still holds.

Residuals live per bucket as flat tensors in the scheme's working dtype (float32 for half-precision buckets); in
checkpoints they are stored per parameter name, so that a resumed run may bucket its parameters differently.
"""

from __future__ import annotations

import torch

from mpistrategy.aggregation.base import GradBucket


class ErrorFeedback:
    """The error-feedback residuals of one rank, one flat tensor per bucket (none until the bucket's first
    compression)."""

    def __init__(self) -> None:
        self._buckets: list[GradBucket] = []
        self._residuals: dict[int, torch.Tensor] = {}

    def setup(self, buckets: list[GradBucket]) -> None:
        """Adopt a (new) bucket layout, carrying the residuals of parameters that are still bucketed over."""
        kept = self.state()
        self._buckets, self._residuals = buckets, {}
        self.load({name: value for name, value in kept.items() if name in self._names()})

    def add_to(self, bucket: GradBucket, values: torch.Tensor) -> torch.Tensor:
        """``values += e_b`` in place (nothing before the bucket's first residual); returns ``values``."""
        residual = self._residuals.get(bucket.index)
        if residual is not None:
            values.add_(residual)
        return values

    def keep(self, bucket: GradBucket, remainder: torch.Tensor) -> None:
        """Make ``remainder`` (``p - C(p)``, flat, owned by the caller no more) the bucket's residual."""
        self._residuals[bucket.index] = remainder

    def drop(self, bucket: GradBucket) -> None:
        """Forget the bucket's residual (after it was sent in full)."""
        self._residuals.pop(bucket.index, None)

    def residual(self, bucket: GradBucket) -> torch.Tensor | None:
        """The bucket's current residual, if any."""
        return self._residuals.get(bucket.index)

    def state(self) -> dict[str, torch.Tensor]:
        """Every residual, per parameter name (copies)."""
        state = {}
        for bucket in self._buckets:
            residual = self._residuals.get(bucket.index)
            if residual is None:
                continue
            for name, offset, numel in zip(bucket.names, bucket.offsets, bucket.numels, strict=True):
                state[name] = residual[offset : offset + numel].clone()
        return state

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Restore residuals from :meth:`state`; a bucket none of whose parameters is in ``state`` has none, a
        parameter missing from a bucket that has one starts from zero."""
        unknown = sorted(set(state) - self._names())
        if unknown:
            raise ValueError(
                f"error feedback: the state holds residuals of parameters this model does not bucket: {unknown[:5]}"
                f"{' ...' if len(unknown) > 5 else ''}; load it into the same model (with the same parameters "
                "requiring gradients)."
            )
        self._residuals = {}
        for bucket in self._buckets:
            present = [name for name in bucket.names if name in state]
            if not present:
                continue
            dtype = state[present[0]].dtype
            residual = torch.zeros(sum(bucket.numels), dtype=dtype, device=bucket.buffer.device)
            for name, offset, numel in zip(bucket.names, bucket.offsets, bucket.numels, strict=True):
                if name not in state:
                    continue
                value = state[name]
                if value.numel() != numel:
                    raise ValueError(
                        f"error feedback: the residual of {name!r} has {value.numel()} elements, but the parameter "
                        f"has {numel}; load the state into the same model."
                    )
                residual[offset : offset + numel] = value.reshape(-1).to(dtype=dtype, device=residual.device)
            self._residuals[bucket.index] = residual

    def _names(self) -> set[str]:
        return {name for bucket in self._buckets for name in bucket.names}
