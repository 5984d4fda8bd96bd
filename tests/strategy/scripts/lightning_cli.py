"""``LightningCLI`` over Lightning's demo ``BoringModel`` and ``BoringDataModule``, as a user writes it, the strategy
chosen on the command line. After ``fit`` every rank writes what it trained with to ``$CLI_REPORT_DIR/rank<r>.json``:
the strategy's settings, the parameters, and the metrics logged (every rank holds every rank's memory)."""

import json
import os

import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

import mpistrategy  # noqa: F401  (registers the strategy names)


class ReportingCLI(LightningCLI):
    def after_fit(self) -> None:
        strategy = self.trainer.strategy
        report = {
            "strategy": type(strategy).__name__,
            "shard": getattr(strategy, "shard", None),
            "sync": type(getattr(strategy, "sync", None)).__name__,
            "aggregator": repr(getattr(strategy, "aggregator", None)),
            "stop_signals": list(getattr(strategy, "_stop_signal_numbers", ())),
            "parameters": torch.cat([p.detach().reshape(-1) for p in self.model.parameters()]).tolist(),
            "metrics": {k: float(v) for k, v in self.trainer.logged_metrics.items()},
        }
        with open(os.path.join(os.environ["CLI_REPORT_DIR"], f"rank{strategy.global_rank}.json"), "w") as handle:
            json.dump(report, handle)


if __name__ == "__main__":
    ReportingCLI(BoringModel, BoringDataModule, seed_everything_default=7)
