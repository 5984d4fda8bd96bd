"""Gradient buckets and the backward hooks that start their combination while backward is still running.

Layout (:mod:`~mpistrategy.strategy.reducer.layout`, a pure function of the parameters' sizes): the parameters that
require gradients are taken in reverse registration order (roughly the order their gradients become ready in
backward) and packed into flat buckets, one dtype and device per bucket: the first bucket closes once it reaches
``first_bucket_cap_mb`` (DDP makes it small, 1 MB, so that communication starts early; here it defaults to the
others' cap), the others at ``bucket_cap_mb`` (25 MB, DDP's default). Every parameter's ``.grad`` is a view into its
bucket, so the combined result lands directly in ``.grad``: nothing is flattened before or copied back after
communication.

A parameter of at least ``own_bucket_mb`` (1 MB) gets a bucket of its own whose buffer *is* its ``.grad``
(Horovod reduces tensors above its fusion threshold the same way): autograd's fresh gradient after
``zero_grad(set_to_none=True)`` is combined in place where autograd stored it, so these gradients are neither
zeroed nor accumulated into a flat buffer each step (four passes over their memory fewer). Fusing gains nothing
at that size: one message per megabyte costs microseconds of latency.

Memory (:mod:`~mpistrategy.strategy.reducer.memory`; unless ``MPISTRATEGY_SHM=0``, see
:mod:`mpistrategy.comm.shm`): the host buckets live in one shared segment over the ranks of this machine,
so that the node-local allreduce reads every rank's bucket where backward wrote it and reduces it in place, with no
copy. Where buckets are summed in shared memory (inside the node, for the sync modes that sum there,
:attr:`~mpistrategy.sync.base.SyncMode.sums_in_node`; over the world, for the mean when every rank is on this
machine), large gradients move into the segment too: their hook copies autograd's fresh gradient into their bucket
once (the copy the allreduce would otherwise make into its staging area), and the optimizer's ``zero_grad`` treats
them as any other gradient. With every rank on this machine and the mean they also join the regular buckets (fewer
buckets, fewer waits for the other ranks); otherwise the layout stays, as compressors, which work per bucket, need.
The segment is freed when the buckets are rebuilt and by :meth:`GradientReducer.remove`, after the gradients in it
are copied out.

CUDA buckets (:mod:`~mpistrategy.strategy.reducer.peer_sums`, :mod:`~mpistrategy.strategy.reducer.staging`,
:mod:`~mpistrategy.strategy.reducer.deferred`): where every rank shares one GPU and the aggregator is the mean, the
buckets are averaged in each other's device memory; elsewhere, where MPI cannot read device memory, each goes
through a page-locked host mirror; a compressor, which works on the device before MPI sees the data, starts them
after backward.

The pass (:mod:`~mpistrategy.strategy.reducer.gradient_reducer`): buckets start in index order as their gradients
land (:mod:`~mpistrategy.strategy.reducer.launch`), the ranks exchange which parameters they used
(:mod:`~mpistrategy.strategy.reducer.usage`), and the optimizers' ``zero_grad`` zeroes the buckets in place
(:mod:`~mpistrategy.strategy.reducer.zero_grad`).
"""

from mpistrategy.strategy.reducer.gradient_reducer import BucketLayoutError, GradientReducer
from mpistrategy.strategy.reducer.layout import (
    BucketLayout,
    BucketSpec,
    LayoutPolicy,
    ParameterPlace,
    ParameterSpec,
    assign_buckets,
    plan_layout,
)

__all__ = [
    "BucketLayout",
    "BucketLayoutError",
    "BucketSpec",
    "GradientReducer",
    "LayoutPolicy",
    "ParameterPlace",
    "ParameterSpec",
    "assign_buckets",
    "plan_layout",
]
