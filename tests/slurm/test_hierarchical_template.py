"""slurm/gpu-hierarchical.sbatch, submitted to the real local SLURM (one CPU node): without its GPU request, with
ACCELERATOR=cpu and RANKS_PER_NODE=2 its 4 tasks train DASO as 2 nodes of 2, node-local over gloo."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from tests.slurm._jobs import TEMPLATES, job_env, output_of, sbatch, wait_for

pytestmark = pytest.mark.usefixtures("slurm_cluster")

SMALL = (
    "trainer.max_epochs=3 strategy.warmup_epochs=1 strategy.cooldown_epochs=1 "
    "trainer.log_every_n_steps=1 callbacks.progress_bar.refresh_rate=0 trainer.enable_model_summary=false"
)


def test_hierarchical_gpu_template_runs_daso_on_two_virtual_nodes_of_a_cpu_node(tmp_path: Path) -> None:
    script = tmp_path / "gpu-hierarchical-dry.sbatch"
    lines = (TEMPLATES / "gpu-hierarchical.sbatch").read_text().splitlines(True)
    script.write_text("".join(line for line in lines if "--gpus-per" not in line))
    env = job_env(tmp_path / "logs", OVERRIDES=SMALL, ACCELERATOR="cpu", RANKS_PER_NODE="2", EXPERIMENT="digits_mlp")
    job = sbatch(script, "--nodes=1", "--ntasks-per-node=4", "--cpus-per-task=1", "--time=15", cwd=tmp_path, env=env)
    assert wait_for(job, timeout=900) == "COMPLETED", output_of(tmp_path)

    run_dir = tmp_path / "logs" / "digits_mlp" / "runs" / f"slurm-{job}"
    config = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert config["strategy"]["sync"] == "daso" and config["strategy"]["node_transport"] == "gloo"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["epochs"] == 3
    assert (summary["nodes"], summary["ranks_per_node"]) == (2, [2, 2]) and summary["sync"].startswith("DASO(")
    assert summary["final"]["val/acc"] > 0.8, summary
    sent = summary["bytes_sent"]  # rank 0 is a node leader: it sends inside its node and across nodes
    assert sent["node"] > 0 and sent["inter_node"] > 0 and sent["total"] == sent["node"] + sent["inter_node"]
    with (run_dir / "csv" / "metrics.csv").open() as handle:
        inter_node = [float(row["comm/inter_node_bytes_per_step"]) for row in csv.DictReader(handle)
                      if row.get("comm/inter_node_bytes_per_step")]  # fmt: skip
    assert inter_node and 0 in inter_node and max(inter_node) > 0  # DASO's cycling steps send nothing across
    log = (run_dir / "train.log").read_text()
    assert "daso: epoch 0" in log and "next: cycling" in log
    assert "4 ranks, strategy=daso node_transport=gloo accelerator=cpu ranks_per_node=2" in output_of(tmp_path)
