"""Lightning Fabric over MPI: an MLP on scikit-learn's digits, data parallel with the ``mpi_ad`` strategy.

    mpiexec -n 2 python recipes/fabric_digits.py                     # 10 epochs, batch 32 per rank, AdamW
    mpiexec -n 2 python recipes/fabric_digits.py --accumulate 2      # two micro-batches per optimizer step
    mpiexec -n 4 python recipes/fabric_digits.py --strategy mpi_local_sgd --checkpoint digits.ckpt

Your own training loop, as with any Fabric strategy: ``fabric.setup`` broadcasts rank 0's weights, the distributed
sampler gives each rank its share of every epoch, ``fabric.backward`` averages the gradients over the ranks,
``fabric.no_backward_sync`` skips that on the micro-batches of an accumulation, ``fabric.all_reduce`` sums the
validation counts. With ``--checkpoint`` the state is saved (by rank 0, atomically) after every epoch and a rerun
continues from it; a SIGTERM or SIGUSR1 (preemption) stops every rank after the same step, the checkpoint is saved
and the job exits 75 ("resume me").
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

import mpistrategy  # noqa: F401  (registers "mpi_ad" and the sync modes' names with Fabric)
from mpistrategy.recipes.data import load_digits_split
from mpistrategy.recipes.models import mlp
from mpistrategy.strategy import MPIADFabricStrategy, StopRequested


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="mpi_ad", help="mpi_ad, or a sync mode's name (mpi_local_sgd, ...)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default=None, help="save here after every epoch; resume from it if present")
    return parser.parse_args(argv)


def evaluate(fabric: Fabric, model: torch.nn.Module, loader: DataLoader) -> tuple[float, float]:
    """Validation loss and accuracy over every rank's share of the validation set."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=fabric.device)  # summed loss, correct, samples
    with torch.no_grad():
        for x, y in loader:
            logits = model(x)
            totals += torch.stack(
                [F.cross_entropy(logits, y, reduction="sum"), (logits.argmax(1) == y).sum(), torch.tensor(len(y))]
            ).to(totals)
    loss, correct, samples = fabric.all_reduce(totals, reduce_op="sum").tolist()
    model.train()
    return loss / samples, correct / samples


def main(argv: list[str] | None = None) -> float:
    args = parse_arguments(argv)
    fabric = Fabric(strategy=args.strategy)
    fabric.launch()
    fabric.seed_everything(args.seed)

    x_train, y_train, x_val, y_val = load_digits_split()
    model = mlp(x_train.shape[1], args.hidden, depth=2, num_classes=10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = fabric.setup(model, optimizer)
    train_loader, val_loader = fabric.setup_dataloaders(
        DataLoader(TensorDataset(x_train, y_train), batch_size=args.batch_size, shuffle=True),
        DataLoader(TensorDataset(x_val, y_val), batch_size=256),
    )
    steps_per_epoch = math.ceil(len(train_loader) / args.accumulate)

    state = {"model": model, "optimizer": optimizer, "epoch": 0}
    if args.checkpoint and os.path.exists(args.checkpoint):
        fabric.load(args.checkpoint, state)
        fabric.print(f"resumed from {args.checkpoint} at epoch {state['epoch']}")
    strategy = fabric.strategy if isinstance(fabric.strategy, MPIADFabricStrategy) else None

    accuracy = 0.0
    try:
        for epoch in range(state["epoch"], args.epochs):
            if strategy is not None:  # epoch-scheduled sync modes (DASO) need the epoch boundaries
                strategy.begin_epoch(epoch, steps_per_epoch, args.epochs)
            summed = torch.zeros((), device=fabric.device)
            for index, (x, y) in enumerate(train_loader):
                steps = (index + 1) % args.accumulate == 0 or index + 1 == len(train_loader)
                with fabric.no_backward_sync(model, enabled=not steps):
                    loss = F.cross_entropy(model(x), y)
                    fabric.backward(loss / args.accumulate)
                summed += loss.detach()
                if steps:
                    optimizer.step()
                    optimizer.zero_grad()
            if strategy is not None:
                strategy.end_epoch()
            train_loss = fabric.all_reduce(summed / len(train_loader), reduce_op="mean").item()
            val_loss, accuracy = evaluate(fabric, model, val_loader)
            fabric.print(
                f"epoch {epoch + 1}/{args.epochs}  train loss {train_loss:.4f}  val loss {val_loss:.4f}  "
                f"val acc {accuracy:.4f}  ({fabric.world_size} ranks)"
            )
            state["epoch"] = epoch + 1
            if args.checkpoint:
                fabric.save(args.checkpoint, state)
    except StopRequested as stop:
        if args.checkpoint:
            fabric.save(args.checkpoint, state)
        fabric.print(f"stopped by {stop.signal_name} in epoch {state['epoch'] + 1}; rerun to redo it and go on")
        raise
    return accuracy


if __name__ == "__main__":
    main()
