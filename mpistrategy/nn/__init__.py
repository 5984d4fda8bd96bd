"""Layers built on the differentiable collectives."""

from mpistrategy.nn.sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
