"""A CSVLogger for runs that resume: the metrics of the earlier part of the run are kept.

Lightning's CSV writer deletes an existing ``metrics.csv`` when it starts (and warns). A run resumed in the same run
dir (after a preemption and requeue, or a rerun) then loses the curves of its first part. This logger sets the old
file aside while the writer starts and puts it back, so the resumed run appends to it (the writer rewrites the file
with a wider header if new columns appear). Rank 0 only, like every logger here.
"""

from __future__ import annotations

import csv
import os
from typing import Any

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment


class ResumableCSVLogger(CSVLogger):
    """``lightning.pytorch.loggers.CSVLogger`` that appends to the ``metrics.csv`` it finds instead of deleting it."""

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is not None:
            return self._experiment
        path = os.path.join(self.log_dir, "metrics.csv")
        kept = f"{path}.resumed" if os.path.isfile(path) else None
        if kept:
            os.replace(path, kept)
        experiment = super().experiment
        if kept:
            os.replace(kept, path)
            with open(path, newline="") as handle:
                header = next(csv.reader(handle), [])
            experiment.metrics_keys = sorted(set(experiment.metrics_keys) | set(header))
        return experiment
