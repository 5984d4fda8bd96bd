"""Training recipes for mpistrategy: Hydra entry point (``mpistrategy.recipes.train``), DataModules, LightningModules
(digits MLP/CNN, synthetic MLP, tensor-parallel and pipeline-parallel MLPs) and the run/sweep summaries."""

from mpistrategy.extras import require

require("train", "mpistrategy-train and the recipes")
