"""Sharded optimizer state over MPI (ZeRO stages 1 and 2): ``MPIADStrategy(shard="optimizer" | "gradients")``.

- :mod:`~mpistrategy.strategy.sharding.options`: the option's values and the configurations it runs with;
- :mod:`~mpistrategy.strategy.sharding.layout`: which elements each rank's shard holds (a pure function of the
  parameter sizes and the number of shards);
- :mod:`~mpistrategy.strategy.sharding.group`: the ranks that split one copy of the state;
- :mod:`~mpistrategy.strategy.sharding.flat`: the parameters in flat buffers, the allgather of updated shards;
- :mod:`~mpistrategy.strategy.sharding.optimizer`: the user's optimizer stepping only this rank's shard;
- :mod:`~mpistrategy.strategy.sharding.training`: what the data-parallel engine drives each step.
"""

from __future__ import annotations

from mpistrategy.strategy.sharding.options import SHARD_MODES

__all__ = ["SHARD_MODES"]
