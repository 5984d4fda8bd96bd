"""``mpistrategy-consolidate CHECKPOINT OUT``: a sharded checkpoint as one plain file (one process, no MPI job).

The sharded optimizers' manifests in CHECKPOINT are replaced by their whole ``state_dict()``, read from the shard
files beside it (``CHECKPOINT.shards/``, every file verified); OUT is written atomically and sealed, and loads into
any strategy (``Trainer(strategy="ddp")``, a plain ``torch.load``) or serves inference. OUT must be another file than
CHECKPOINT (writing over it would orphan its shard files). A missing, damaged or unreadable file, or OUT naming
CHECKPOINT, is printed as one line and the command exits 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mpistrategy.strategy.checkpoint_files import CorruptCheckpointError
from mpistrategy.strategy.sharding.checkpoint import consolidate


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mpistrategy-consolidate",
        description="Write a sharded mpi_ad checkpoint as one plain checkpoint (the optimizer state consolidated).",
    )
    parser.add_argument("checkpoint", help="the checkpoint file (its shard files lie in CHECKPOINT.shards/)")
    parser.add_argument("out", help="the plain checkpoint to write")
    arguments = parser.parse_args(argv)
    try:
        consolidate(arguments.checkpoint, arguments.out)  # verifies every file it reads
    except (OSError, ValueError, CorruptCheckpointError) as problem:
        print(f"mpistrategy-consolidate: {problem}", file=sys.stderr)
        return 1
    print(f"wrote {arguments.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
