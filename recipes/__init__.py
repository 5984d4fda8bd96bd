"""Training recipes for mpistrategy: Hydra entry point (``mpistrategy.recipes.train``), DataModules, LightningModules
(digits MLP/CNN, synthetic MLP, tensor-parallel and pipeline-parallel MLPs) and the run/sweep summaries.

The repository keeps them in ``recipes/``; every install (editable or not) makes that folder the package
``mpistrategy.recipes``, the one name to import them by.
"""

from mpistrategy.extras import require

if __name__ != "mpistrategy.recipes":
    raise ImportError(
        f"the recipes were imported as {__name__!r}; import them as 'mpistrategy.recipes' (one name, so that no "
        "module is loaded twice), e.g. 'from mpistrategy.recipes.data import DigitsDataModule'"
    )

require("train", "mpistrategy-train (mpistrategy.recipes)")
