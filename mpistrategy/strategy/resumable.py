"""A training DataLoader that continues an epoch where a checkpoint left it.

Lightning gives every rank a ``DistributedSampler``: the indices rank ``r`` of ``N`` visits in epoch ``e`` are a
pure function of (seed, e, r, N), drawn from a generator of their own, not from the global one. So after ``k``
batches of ``b`` samples the rest of the epoch is that order without its first ``k * b`` indices, whatever else
the run did. :class:`ResumableLoader` counts the batches it hands out, reports ``(epoch, k)`` through the
``state_dict`` / ``load_state_dict`` interface Lightning saves in the checkpoint's loop state (so Lightning treats
the loader as resumable), and after a resume starts the interrupted epoch at index ``k * b`` of that order, without
reading the skipped samples. The DataLoader makes its iterator (which draws its base seed from torch's generator)
when the training loop asks for the pass, as without the wrapper, so the random draws around it (in
``on_train_epoch_start``, in the first epoch's setup) come in the order they come under DDP. While a checkpoint's
random state waits to be restored (``restoring``), the iterator is made at the first fetch instead, after the hook
that starts a pass: the strategy restores the state there where the checkpoint was saved at the end of an epoch
(before the next epoch's iterator drew from it, so those draws are made again from it, as in the uninterrupted
run), and in the hook before each batch is fetched where it was saved within an epoch (after its iterator drew);
it checks for a coordinated stop there too, so that all of it happens before the batch's data is read.

Exact for a map-style dataset read through Lightning's ``DistributedSampler`` on the same number of ranks. On a
different number of ranks the order of the epoch is another one: the rest of the interrupted epoch cannot be
recovered, so the loader warns and starts that epoch's order from its beginning (what Lightning does with any
loader it cannot resume). A loader it cannot make resumable (an iterable dataset, a custom sampler or batch
sampler) becomes a :class:`CountedLoader`: its batches pass unchanged, and the same hook runs when a pass starts.

Both tell the strategy how many batches a pass had once its data ended, which the stall watchdog compares with
the other ranks' position (:mod:`mpistrategy.comm.watchdog`: uneven data). Both forward the loader's attributes,
in both directions: what Lightning sets on the loader it was given (``worker_init_fn`` under
``seed_everything(workers=True)``) reaches the DataLoader, and ``isinstance`` sees the loader's class.

Only the training loop's passes (the iterators Lightning's ``CombinedLoader`` makes) are counted and run the
hooks: any other reader of ``trainer.train_dataloader`` (a look at a batch on rank 0 only, to log or plot it) gets
the loader's own iterator, so it neither moves the recorded position nor runs a hook (which may be collective)
on some ranks only.
"""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, Sampler

log = logging.getLogger(__name__)

#: the modules whose iterators are the training loop's passes (Lightning's CombinedLoader, in both packages)
_TRAINING_LOOP_MODULES = frozenset(
    {"lightning.pytorch.utilities.combined_loader", "pytorch_lightning.utilities.combined_loader"}
)


class _SkippingSampler(Sampler[int]):
    """A ``DistributedSampler`` whose next pass may start ``skip`` indices into its order."""

    def __init__(self, sampler: DistributedSampler) -> None:
        self.sampler = sampler
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.sampler), skip, None)

    def __len__(self) -> int:
        return len(self.sampler)


class _LoaderView:
    """A training loader seen through a wrapper: its public attributes are the loader's (read and written), the
    wrapper's own start with ``_``."""

    loader: Any
    _restoring: Callable[[], bool] | None

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "loader" or name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D105
        """The loader's class: ``isinstance(trainer.train_dataloader, DataLoader)`` holds as without the wrapper
        (``type()`` still names the wrapper)."""
        return type(self.loader)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """A copy or pickle of the wrapper is one of the loader alone (without the training loop's hooks)."""
        return self.loader.__reduce_ex__(protocol)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        """A training pass when the training loop asks (see the module docstring), else the loader's iterator."""
        if sys._getframe(1).f_globals.get("__name__") not in _TRAINING_LOOP_MODULES:
            return iter(cast(Iterable[Any], self.loader))
        return self._training_pass()

    def _training_pass(self) -> Iterator[Any]:
        raise NotImplementedError

    def _iterator_now(self) -> Iterator[Any] | None:
        """The loader's iterator, made now unless a random state waits to be restored (then ``None``: made at the
        first fetch, after the hook that starts the pass)."""
        return None if self._restoring is not None and self._restoring() else iter(cast(Iterable[Any], self.loader))


class CountedLoader(_LoaderView):
    """A training loader whose order cannot be resumed: its batches unchanged, and where each pass starts and ends.

    Args:
        loader: any iterable of batches.
        before_pass: called at the first fetch of a pass.
        pass_ended: called with the number of batches of a pass once its data ended.
        restoring: whether a random state waits to be restored (see the module docstring).
    """

    def __init__(
        self,
        loader: object,
        before_pass: Callable[[], None],
        pass_ended: Callable[[int], None] | None = None,
        restoring: Callable[[], bool] | None = None,
    ) -> None:
        self.loader = loader
        self._before_pass = before_pass
        self._pass_ended = pass_ended
        self._restoring = restoring

    def _training_pass(self) -> Iterator[Any]:
        return self._batches_of(self._iterator_now())

    def _batches_of(self, iterator: Iterator[Any] | None) -> Iterator[Any]:
        self._before_pass()
        batches = 0
        for batch in iterator if iterator is not None else cast(Iterable[Any], self.loader):
            batches += 1
            yield batch
        if self._pass_ended is not None:
            self._pass_ended(batches)


class ResumableLoader(_LoaderView):
    """``loader`` (its attributes are forwarded) plus its position in the current epoch.

    Args:
        loader: a DataLoader over a map-style dataset whose batch sampler is a ``BatchSampler`` over a
            ``DistributedSampler`` (see :func:`make_resumable`).
        before_batch: called before each batch is fetched.
        before_pass: called at the first fetch of a pass.
        pass_ended: called with the number of batches a pass fetched once its data ended.
        restoring: whether a random state waits to be restored (see the module docstring).
    """

    def __init__(
        self,
        loader: DataLoader,
        before_batch: Callable[[], None],
        before_pass: Callable[[], None] | None = None,
        pass_ended: Callable[[int], None] | None = None,
        restoring: Callable[[], bool] | None = None,
    ) -> None:
        self.loader = loader
        self._restoring = restoring
        batch_sampler = loader.batch_sampler
        assert isinstance(batch_sampler, BatchSampler)
        if not isinstance(batch_sampler.sampler, _SkippingSampler):
            batch_sampler.sampler = _SkippingSampler(cast(DistributedSampler, batch_sampler.sampler))
        self._order: _SkippingSampler = batch_sampler.sampler
        self._batch_size: int = batch_sampler.batch_size
        self._before_batch = before_batch
        self._before_pass = before_pass
        self._pass_ended = pass_ended
        self._batches = 0
        self._resume_at: dict[str, int] | None = None

    def _training_pass(self) -> Iterator[Any]:
        self._batches = skipped = self._skip_for_resume()
        self._order.skip = skipped * self._batch_size
        return self._batches_of(skipped, self._iterator_now())

    def _batches_of(self, skipped: int, iterator: Iterator[Any] | None) -> Iterator[Any]:
        """The pass's batches, the first ``skipped`` left out, from ``iterator`` (``None``: made at the first fetch;
        a pass Lightning makes but never reads, such as that of an epoch restarted at its end, then draws nothing
        from the random generators)."""
        if self._before_pass is not None:
            self._before_pass()
        if iterator is None:
            iterator = iter(self.loader)
        while True:
            self._before_batch()
            try:
                batch = next(iterator)
            except StopIteration:
                if self._pass_ended is not None:
                    self._pass_ended(self._batches - skipped)
                return
            self._batches += 1
            yield batch

    #: the keys of :meth:`state_dict`
    STATE_KEYS = ("epoch", "batches", "num_batches", "num_replicas")

    def state_dict(self) -> dict[str, int]:
        """The position: ``batches`` of ``num_batches`` done in ``epoch``, by ``num_replicas`` ranks."""
        return {
            "epoch": self._order.sampler.epoch,
            "batches": self._batches,
            "num_batches": len(self.loader),
            "num_replicas": self._order.sampler.num_replicas,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`) at the next ``iter()``."""
        self._resume_at = dict(state)

    def _skip_for_resume(self) -> int:
        """Set up the pass that continues a loaded position; returns the batches it skips (0 if none)."""
        state, self._resume_at = self._resume_at, None
        if state is None or state["batches"] >= state["num_batches"] or state["batches"] == 0:
            return 0
        replicas, batches = self._order.sampler.num_replicas, len(self.loader)
        if state["num_replicas"] != replicas or state["num_batches"] != batches:
            if self._order.sampler.rank == 0:
                _warn_cannot_continue(state, replicas, batches)
            return 0
        self._order.set_epoch(state["epoch"])
        return state["batches"]


def _warn_cannot_continue(state: dict[str, int], replicas: int, batches: int) -> None:
    log.warning(
        "mpi_ad: the checkpoint stopped in the middle of epoch %d (%d of %d batches per rank done, %d ranks); "
        "this run has %d ranks and %d batches per rank per epoch, so the sampler orders that epoch "
        "differently and it cannot continue where it stopped: its remaining steps read the first batches of "
        "this run's order instead, and training no longer matches an uninterrupted run. Resume on %d ranks "
        "with the same data and batch size for an exact continuation.",
        state["epoch"],
        state["batches"],
        state["num_batches"],
        state["num_replicas"],
        replicas,
        batches,
        state["num_replicas"],
    )


def make_resumable(
    loader: object,
    before_batch: Callable[[], None],
    before_pass: Callable[[], None] | None = None,
    pass_ended: Callable[[int], None] | None = None,
    restoring: Callable[[], bool] | None = None,
) -> ResumableLoader | None:
    """``loader`` as a :class:`ResumableLoader`, or ``None`` when its order is not a pure function of the epoch
    (not a DataLoader, an iterable dataset, a batch sampler other than ``BatchSampler``, a sampler other than
    ``DistributedSampler``)."""
    loader = unwrapped(loader)
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return None
    batch_sampler = loader.batch_sampler
    if type(batch_sampler) is not BatchSampler:
        return None
    sampler = batch_sampler.sampler
    inner = sampler.sampler if isinstance(sampler, _SkippingSampler) else sampler
    if type(inner) is not DistributedSampler:
        return None
    return ResumableLoader(loader, before_batch, before_pass, pass_ended, restoring)


def unwrapped(loader: object) -> object:
    """The loader a training loader wrapper of this module holds, else ``loader`` itself."""
    return loader.loader if isinstance(loader, _LoaderView) else loader
