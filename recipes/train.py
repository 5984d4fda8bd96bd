"""``mpistrategy-train``: Hydra-configured Lightning training on MPI ranks.

    mpiexec -n 2 mpistrategy-train                                # the main job (digits MLP, strategy mpi_ad)
    mpiexec -n 4 mpistrategy-train experiment=digits_cnn
    mpiexec -n 2 mpistrategy-train -m model.hidden=64,128 optimizer.lr=0.1,0.05
    mpistrategy-train -m hydra/launcher=slurm model.hidden=64,128
    python -m mpistrategy.recipes.train --cfg job                 # show the composed config

MPI safety (see recipes/hydra_mpi.py): before Hydra composes, rank 0 decides the run id and broadcasts it, so all
ranks use one run dir; only rank 0 writes ``.hydra/``, the log, checkpoints, metrics, the summary and plots; sweeps
run the same points in the same order on every rank. A failure while building is agreed on by all ranks (rank 0
reports it, or the rank that alone had it; every rank exits 1): a configuration error, the same on every rank, is
printed once, by rank 0. So is a setup error that every rank raises together (a sync mode the layout cannot run, a
corrupt checkpoint); any other failure during training aborts the MPI job (the failing rank prints its traceback
once) instead of leaving the other ranks blocked in a collective.

Exit codes: 0 finished; 75 stopped by SIGUSR1/SIGTERM after a checkpoint (:data:`STOPPED_EXIT_CODE
<mpistrategy.strategy.failures.STOPPED_EXIT_CODE>`; the log's last line is the command that resumes: the same
command with ``hydra.run.dir=<the run dir>``, or ``hydra.sweep.dir=<the sweep dir>`` for ``-m``); 1 failed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import stat
import sys
import traceback
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from mpistrategy import conf as _conf
from mpistrategy.comm.errors import by_rank
from mpistrategy.recipes import hydra_mpi
from mpistrategy.recipes.config import explain, register_configs

CONFIG_PACKAGE = "mpistrategy.conf"
CONFIG_DIR = Path(_conf.__file__).resolve().parent
LAST_CHECKPOINT = "last.ckpt"

log = logging.getLogger("mpistrategy.recipes.train")

register_configs()


class BuildError(RuntimeError):
    """Building failed on some rank (its error is reported where it happened): report and exit, no abort needed.
    ``quiet``: another rank prints the same message."""

    def __init__(self, message: str, quiet: bool = False) -> None:
        super().__init__(message)
        self.quiet = quiet


def _failed_ranks(ok: bool) -> list[int]:
    """Collective: the ranks that are not ok. Every rank reaches this point whether it failed or not."""
    oks = hydra_mpi.comm().allgather(ok) if hydra_mpi.size() > 1 else [ok]
    return [r for r, good in enumerate(oks) if not good]


def differing_config(cfg: DictConfig) -> str | None:
    """Collective: ``None`` when every rank composed the same config (resolved), else the values that differ, by
    key and rank (one allgather of a digest; the configs themselves only when the digests differ)."""
    if hydra_mpi.size() == 1:
        return None
    try:
        values = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # noqa: BLE001 - an interpolation that fails is reported by the build on its rank
        values = OmegaConf.to_container(cfg, resolve=False)
    flat = {key: repr(value) for key, value in _dotted(values).items()}
    digest = hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()
    comm = hydra_mpi.comm()
    if len(set(comm.allgather(digest))) == 1:
        return None
    configs = comm.allgather(flat)
    keys = sorted(key for key in set().union(*configs) if len({config.get(key) for config in configs}) > 1)
    listed = [f"{key} ({by_rank(config.get(key, 'unset') for config in configs)})" for key in keys[:5]]
    return ", ".join(listed) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def _dotted(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"a.b.c": leaf}``."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = ((str(index), item) for index, item in enumerate(value))
    else:
        return {prefix: value}
    flat: dict[str, Any] = {}
    for key, item in items:
        flat.update(_dotted(item, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def resume_checkpoint(cfg: DictConfig, output_dir: Path) -> str | None:
    """``cfg.ckpt_path``; else, with ``resume``, the newest checkpoint of this run dir: a stop checkpoint
    (``hpc_ckpt_<n>.ckpt``, written on SIGUSR1/SIGTERM) or ``checkpoints/last.ckpt``. Decided on rank 0 and
    broadcast, so every rank resumes from the same file. A checkpoint found on its own is loaded only when it is a
    regular file this user owns that others may not write (loading a checkpoint unpickles it): otherwise every rank
    raises a :class:`PermissionError` that names the file and the fix."""
    from mpistrategy.recipes.callbacks import list_hpc_checkpoints

    choice: str | None = None
    problem: str | None = None
    if hydra_mpi.rank() == 0:
        if cfg.ckpt_path:
            choice = str(cfg.ckpt_path)
        elif cfg.resume:
            found = list_hpc_checkpoints(output_dir)[-1:] + [output_dir / "checkpoints" / LAST_CHECKPOINT]
            found = [p for p in found if p.is_file()]
            if found:
                choice = str(max(found, key=lambda p: p.stat().st_mtime))
                problem = _foreign_file_problem(os.lstat(choice))
    if hydra_mpi.size() > 1:
        choice, problem = hydra_mpi.comm().bcast((choice, problem), root=0)
    if problem is not None:
        raise PermissionError(
            f"Refusing to resume automatically from {choice}: {problem}, so another user may have written it. "
            f"Check it and pass ckpt_path={choice} to load it, or start afresh with resume=false."
        )
    return choice


def _foreign_file_problem(status: os.stat_result) -> str | None:
    """Why a file with ``status`` may come from another user, or None: it must be a regular file of this user's
    that others may not write (a group that may write is the user's own with a umask of 002)."""
    if not stat.S_ISREG(status.st_mode):
        return "it is not a regular file"
    if status.st_uid != os.getuid():
        return f"it is owned by uid {status.st_uid}, not by this user (uid {os.getuid()})"
    if status.st_mode & stat.S_IWOTH:
        return f"others may write it (mode {stat.filemode(status.st_mode)})"
    return None


def _use_hydra_logging() -> None:
    """``import lightning`` adds its own console handler; with Hydra's logging configured it prints every message
    twice (and on every rank). Let Lightning's loggers propagate to the root logger instead."""
    if logging.getLogger().handlers:
        for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
            logger = logging.getLogger(name)
            for handler in list(logger.handlers):
                if type(handler) is logging.StreamHandler:
                    logger.removeHandler(handler)
            logger.propagate = True


def _quiet_known_warnings() -> None:
    import warnings

    # Lightning 2.6 with torch 2.13 (harmless), and Lightning's hint to use srun, which does not apply to MPI
    # launches (mpiexec inside an allocation is one of the supported ways).
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used")
    # mpistrategy.recipes.loggers.ResumableCSVLogger keeps metrics.csv although Lightning announces it will delete it.
    warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")


def _set_torch_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(int(threads))
        os.environ["OMP_NUM_THREADS"] = str(int(threads))


def _hydra_info() -> dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    hc = HydraConfig.get()
    return {
        "experiment": hc.runtime.choices.get("experiment") or "default",
        "overrides": list(hc.overrides.task),
        "job_num": hc.job.get("num"),
    }


def train(cfg: DictConfig) -> float | None:
    """The Hydra task: build everything from ``cfg``, fit, summarise on rank 0; returns the objective."""
    import lightning as L
    from lightning.pytorch.utilities import rank_zero_only

    import mpistrategy  # noqa: F401  (registers strategy="mpi_ad"; wraps MPI.COMM_WORLD)
    from mpistrategy.recipes.builders import build_run
    from mpistrategy.recipes.summary import SUMMARY_FILE, bytes_sent, parallel_layout, summarize_run
    from mpistrategy.strategy import failures

    rank_zero_only.rank = hydra_mpi.rank()
    _quiet_known_warnings()
    _use_hydra_logging()
    _set_torch_threads(cfg.torch_threads)
    output_dir = Path(cfg.paths.output_dir)
    info = _hydra_info()
    log.info(
        "rank %d of %d: %s %s, run dir %s",
        hydra_mpi.rank(),
        hydra_mpi.size(),
        info.get("experiment", "default"),
        " ".join(info.get("overrides", [])) or "(no overrides)",
        output_dir,
    )

    differing = differing_config(cfg)
    if differing:
        raise BuildError(
            f"the ranks composed different configs: {differing}. Every rank must run the same command with the same "
            "overrides; a value that differs between ranks comes from the environment (an ${oc.env:...} "
            "interpolation, a launcher that passes other arguments to some ranks).",
            quiet=hydra_mpi.rank() != 0,
        )
    # Build on every rank; agree on the outcome before anything collective happens.
    try:
        L.seed_everything(cfg.seed, workers=True, verbose=False)
        run = build_run(cfg)
        error: BaseException | None = None
    except Exception as exc:  # reported below, after the ranks agree
        run, error = None, exc
    failed = _failed_ranks(error is None)
    if error is not None and 0 in failed:
        raise error  # main() reports it on rank 0 (every rank has it when the ranks share the config)
    if error is not None:
        raise BuildError(f"Error: {explain(error)}") from error  # rank 0 did not have it: reported here
    if failed:
        raise BuildError(f"building the run failed on rank(s) {failed}")
    assert run is not None
    if run.trainer.world_size != hydra_mpi.size():
        raise BuildError(
            f"strategy={cfg.strategy.get('name', '?')} makes a Trainer of {run.trainer.world_size} process(es) "
            f"({type(run.trainer.strategy).__name__}) on each of the {hydra_mpi.size()} MPI ranks: every rank would "
            "train alone and write the same run dir. Use an MPI strategy (strategy=mpi_ad, or another choice of "
            "conf/strategy), or run one process.",
            quiet=hydra_mpi.rank() != 0,
        )

    ckpt_path = resume_checkpoint(cfg, output_dir)
    if ckpt_path:
        log.info("resuming from %s", ckpt_path)
    try:
        run.trainer.fit(run.model, datamodule=run.datamodule, ckpt_path=ckpt_path)
        if cfg.test:
            run.trainer.test(run.model, datamodule=run.datamodule)
    except BaseException as exc:
        if failures.is_coordinated_stop(exc):
            _record_stop(cfg, output_dir)
            _log_stop(run, output_dir)
        elif isinstance(exc, Exception) and not failures.raised_on_every_rank(exc):
            failures.abort(exc)  # other ranks may be inside a collective; returns only with one rank
        raise

    trainer = run.trainer
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
    timer = run.callbacks.get("fit_timer")
    if ckpt_path and timer is not None and not timer.steps and (output_dir / SUMMARY_FILE).exists():
        # A rerun of a finished run trains nothing: its summary stays, and so does its objective.
        log.info("the run had finished (%s): nothing trained, %s kept", ckpt_path, output_dir / SUMMARY_FILE)
        kept = json.loads((output_dir / SUMMARY_FILE).read_text())
        return kept.get("metrics", {}).get(cfg.objective)
    if trainer.is_global_zero and cfg.summary.enabled:
        extra: dict[str, Any] = {
            **_hydra_info(),
            "task_name": cfg.task_name,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "epochs": trainer.current_epoch,
            "global_step": trainer.global_step,
            "resumed_from": ckpt_path,
            "run_dir": str(output_dir),
            "metrics": metrics,
            **parallel_layout(trainer.strategy),
            **bytes_sent(trainer.strategy),
            **(timer.stats() if timer is not None else {}),
        }
        csv_logger = run.loggers.get("csv")
        metrics_csv = Path(csv_logger.log_dir) / "metrics.csv" if csv_logger is not None else None
        summarize_run(
            output_dir,
            metrics_csv=metrics_csv,
            extra=extra,
            objective=cfg.summary.metric,
            mode=cfg.summary.mode.value,
            plot=cfg.summary.plot,
            table=cfg.summary.table,
        )
    return metrics.get(cfg.objective)


def _record_stop(cfg: DictConfig, output_dir: Path) -> None:
    """Rank 0, after a coordinated stop (which ends the program before Hydra's end-of-job callbacks): the run's
    ``status.json`` says ``stopped``; in a sweep, the comparison is rewritten with the point listed so."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from mpistrategy.recipes.summary import STOPPED, compare_sweep, write_status

    if hydra_mpi.rank() != 0:
        return
    try:
        write_status(output_dir, _hydra_info().get("overrides", []), STOPPED)
        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            compare_sweep(HydraConfig.get().sweep.dir, cfg.objective)
    except Exception as exc:  # the stop must end the program as decided
        log.warning("could not record the stop in %s: %s", output_dir, exc)


def _log_stop(run: Any, output_dir: Path) -> None:
    """Every rank stopped together on a stop signal (mpi_ad, or the preemption callback), after a checkpoint; the
    stop exception then ends the program with exit code 75. The log says how the run resumes."""
    from mpistrategy.strategy import failures

    if hydra_mpi.rank() != 0:
        return
    preemption = run.callbacks.get("preemption")
    if preemption is not None and getattr(preemption, "requeued", False):
        how = "the requeued SLURM job resumes in the same run dir"
    else:
        command = resume_command()
        ranks = hydra_mpi.size()
        launch = f" on {ranks} ranks again (mpiexec -n {ranks} or the job's launcher)" if ranks > 1 else ""
        how = f"to resume, run{launch}: {command}" if command else f"to resume, rerun it with the run dir {output_dir}"
    log.warning(
        "all ranks stopped at step %d on a stop signal; exit code %d; %s",
        run.trainer.global_step,
        failures.STOPPED_EXIT_CODE,
        how,
    )


_RUN_DIR_KEYS = ("hydra.run.dir", "hydra.sweep.dir")
_PROGRAMS = {"mpistrategy-train": ["mpistrategy-train"], "train.py": ["python", "-m", "mpistrategy.recipes.train"]}


def resume_command(argv: list[str] | None = None) -> str | None:
    """The command that resumes this stopped Hydra run: ``argv`` (default ``sys.argv``) with the run dir named as
    an absolute path, ``hydra.run.dir=<run dir>``, or ``hydra.sweep.dir=<sweep dir>`` for a multirun (the same
    overrides, ``-m`` included). Outside Hydra, None; for another program (a launcher's), ``<the same command>``
    stands for it."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    argv = list(sys.argv if argv is None else argv)
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        key, folder = "hydra.sweep.dir", hc.sweep.dir
    else:
        key, folder = "hydra.run.dir", hc.runtime.output_dir
    run_dir = shlex.quote(f"{key}={Path(folder).resolve()}")
    program = _PROGRAMS.get(Path(argv[0]).name) if argv else None
    if program is None:
        return f"<the same command> {run_dir}"
    args = [a for a in argv[1:] if a.lstrip("+").split("=", 1)[0] not in _RUN_DIR_KEYS]
    return f"{shlex.join([*program, *args])} {run_dir}"


_hydra_main = hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_PACKAGE}", config_name="config")(train)


def main() -> None:
    """Console entry point (``mpistrategy-train``). Collective over ``MPI.COMM_WORLD``: run it on every rank."""
    hydra_mpi.agree_on_run_id()
    hydra_mpi.quiet_other_ranks()
    user_full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    # Hydra then raises instead of printing and exiting, so the message can name the allowed keys.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        _hydra_main()
    except (SystemExit, KeyboardInterrupt):
        raise
    except BuildError as exc:
        if not exc.quiet:
            sys.stderr.write(f"[rank {hydra_mpi.rank()}] {exc}\n")
        sys.exit(1)
    except BaseException as exc:
        if user_full_error:
            raise
        if hydra_mpi.rank() == 0 or hydra_mpi.size() == 1:
            sys.stderr.write(f"Error: {explain(exc)}\n")
            if not _is_config_error(exc):
                sys.stderr.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
            sys.stderr.write("Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n")
        sys.exit(1)


def _is_config_error(exc: BaseException) -> bool:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return isinstance(exc, HydraException | OmegaConfBaseException) or isinstance(
        exc.__cause__, HydraException | OmegaConfBaseException
    )


if __name__ == "__main__":
    main()


__all__ = ["differing_config", "main", "train", "resume_checkpoint", "resume_command"]
