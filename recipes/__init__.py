"""Training recipes for mpistrategy: Hydra entry point (``recipes.train``), DataModules, LightningModules
(digits MLP/CNN, synthetic MLP, tensor-parallel and pipeline-parallel MLPs) and the run/sweep summaries."""
