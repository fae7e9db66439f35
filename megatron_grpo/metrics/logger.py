"""Per-step metrics sinks: metrics.jsonl, TensorBoard, Weights & Biases, a progress bar.

Only rank 0 writes; on other ranks every method is a cheap no-op, so the trainer calls
the logger unconditionally. ``RUN_DIR/metrics.jsonl`` gets one line per step, flushed and
fsync'ed when written, so a crash loses at most the step in flight. On resume from a
checkpoint at step N the file is kept and lines with step > N (written after that
checkpoint by the crashed run) are dropped, so the file always describes one timeline.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from megatron_grpo.config.schema import LoggingConfig
from megatron_grpo.metrics.plots import write_plots
from megatron_grpo.metrics.schema import StepMetrics
from megatron_grpo.metrics.summary import format_summary, write_summary

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"


def read_metrics(path: str | os.PathLike, max_step: int | None = None) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl, keeping those with step <= max_step when given.

    A torn last line (the process died mid-write) is skipped; a malformed line elsewhere
    raises, naming the line.
    """
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break  # torn tail from a crash mid-write
            raise ValueError(
                f"{path}:{i + 1} is not valid JSON ({e}): fix or remove that line."
            ) from e
        if max_step is None or row["step"] <= max_step:
            rows.append(row)
    return rows


def _tb_tag(key: str) -> str:
    if key.startswith("memory/"):
        return key
    if key.startswith("time_"):
        return "time/" + key[len("time_") :]
    if key.startswith("reward") or key == "pass_rate":
        return "reward/" + key
    if key in ("synced", "policy_version", "lag", "sync_bytes", "drift", "interval_since_sync"):
        return "sync/" + key
    if key.startswith(("staleness_", "numerics_", "tis_tokens", "tis_seqs", "tis_mixed_")):
        return "ratio_parts/" + key  # grpo.off_policy.score_alpha (algorithms/staleness.py)
    return "train/" + key


class MetricsLogger:
    """Writes each step's metrics to every enabled sink (rank 0 only).

    Args:
        run_dir: the run directory (created if missing).
        logging_cfg: which sinks are on (``config.logging``).
        total_steps: ``config.steps``, for the progress bar's ETA.
        rank: this process's global rank; only rank 0 writes anything.
        resume_step: the checkpoint step this run resumes from; metrics.jsonl lines and
            TensorBoard events after it are dropped. None is a fresh run: it starts the
            file over (same as resuming from step 0).
        run_config: the resolved config as a dict, sent to wandb.
        stream: where the progress bar writes (stderr by default).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        logging_cfg: LoggingConfig,
        total_steps: int,
        rank: int,
        *,
        resume_step: int | None = None,
        run_config: Mapping[str, Any] | None = None,
        stream: IO[str] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.cfg = logging_cfg
        self.total_steps = total_steps
        self.rank = rank
        self.enabled = rank == 0
        self.rows: list[dict[str, Any]] = []
        self._file: IO[str] | None = None
        self._tb: Any = None
        self._wandb: Any = None
        self._bar: Any = None
        self._wall_offset = 0.0
        self._start = time.perf_counter()
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._open_jsonl(resume_step)
        if logging_cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events the crashed run wrote after the checkpoint.
            purge = (resume_step or 0) + 1
            self._tb = SummaryWriter(str(self.run_dir / TENSORBOARD_DIR), purge_step=purge)
        if logging_cfg.wandb_project:
            self._wandb = self._init_wandb(logging_cfg.wandb_project, run_config, resume_step)
        if logging_cfg.progress:
            from tqdm import tqdm

            initial = resume_step or 0
            self._bar = tqdm(
                total=total_steps,
                initial=initial,
                unit="step",
                # tqdm's own rate left out: the postfix's s/step (the last step's time) is the
                # one figure, not two different averages side by side
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]",
                dynamic_ncols=True,
                file=stream if stream is not None else sys.stderr,
                mininterval=1.0,
            )

    # -- sinks -------------------------------------------------------------------------------
    def _open_jsonl(self, resume_step: int | None) -> None:
        path = self.run_dir / METRICS_FILE
        # A fresh run (resume_step None) in a used run_dir starts the timeline over: it is
        # a resume from step 0, and the old lines all have step > 0.
        keep = resume_step or 0
        if path.exists():
            old = read_metrics(path)
            self.rows = [r for r in old if r["step"] <= keep]
            dropped = len(old) - len(self.rows)
            if dropped:
                log.warning(
                    "%s: dropping %d line(s) after step %d (not in the resumed timeline)",
                    path,
                    dropped,
                    keep,
                )
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "w") as f:
                for row in self.rows:
                    f.write(json.dumps(row, allow_nan=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            walls = [r["wall_s"] for r in self.rows if isinstance(r.get("wall_s"), (int, float))]
            self._wall_offset = walls[-1] if walls else 0.0
        self._file = open(path, "a")  # noqa: SIM115 - held open for the whole run

    @staticmethod
    def _init_wandb(
        project: str, run_config: Mapping[str, Any] | None, resume_step: int | None
    ) -> Any:
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                f"logging.wandb_project={project!r} but the wandb package is not installed: "
                "`pip install -e '.[wandb]'` (or `pip install wandb`), or set "
                "logging.wandb_project=null."
            ) from e
        return wandb, project, dict(run_config or {}), resume_step

    def _wandb_run(self) -> Any:
        # Started on first use, so a run that crashes during setup leaves no empty wandb run.
        if isinstance(self._wandb, tuple):
            wandb, project, run_config, resume_step = self._wandb
            id_file = self.run_dir / WANDB_ID_FILE
            run_id = (
                id_file.read_text().strip()
                if resume_step is not None and id_file.exists()
                else None
            )
            run = wandb.init(
                project=project,
                dir=str(self.run_dir),
                config=run_config,
                id=run_id,
                resume="allow" if run_id else None,
            )
            id_file.write_text(str(run.id))
            self._wandb = run
        return self._wandb

    # -- public ------------------------------------------------------------------------------
    def log(self, metrics: StepMetrics | Mapping[str, Any]) -> dict[str, Any] | None:
        """Record one step; returns the row written (None on ranks other than 0)."""
        if not self.enabled:
            return None
        m = metrics if isinstance(metrics, StepMetrics) else StepMetrics.from_mapping(metrics)
        row = m.to_row()
        if self.rows and row["step"] <= self.rows[-1]["step"]:
            raise ValueError(
                f"step {row['step']} logged after step {self.rows[-1]['step']}: steps must "
                "increase (on resume, pass resume_step to MetricsLogger)."
            )
        row["wall_s"] = self._wall_offset + time.perf_counter() - self._start
        assert self._file is not None
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.rows.append(row)

        step = row["step"]
        scalars = {
            k: float(v)
            for k, v in row.items()
            if isinstance(v, (int, float)) and k not in ("step", "wall_s")
        }
        for boundary, snap in (row.get("gpu_memory") or {}).items():  # GPU only
            scalars.update({f"memory/{boundary}_{k}": float(v) for k, v in snap.items()})
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(_tb_tag(k), v, step)
        if self._wandb is not None:
            self._wandb_run().log({_tb_tag(k): v for k, v in scalars.items()}, step=step)
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix_str(self._postfix(row), refresh=False)
        return row

    @staticmethod
    def _postfix(row: Mapping[str, Any]) -> str:
        parts = []
        if row.get("reward_mean") is not None:
            parts.append(f"reward {row['reward_mean']:.3f}")
        if row.get("policy_version") is not None:
            parts.append(f"policy v{row['policy_version']} lag {row.get('lag')}")
        if row.get("synced"):
            parts.append("synced")
        if row.get("time_step") is not None:
            parts.append(f"{row['time_step']:.2f} s/step")
        return ", ".join(parts)

    def finish(
        self, sync_interval: int, sync_mode: str = "fixed", max_drift: float | None = None
    ) -> str:
        """Write summary.json (and the plots when enabled), close every sink, return the summary.

        Covers every step in metrics.jsonl, including those before a resume. Returns "" on
        ranks other than 0.
        """
        if not self.enabled:
            return ""
        s = write_summary(self.run_dir, self.rows, sync_interval, sync_mode)
        if self.cfg.plots and self.rows:
            write_plots(self.run_dir, self.rows, max_drift)
        if self._wandb is not None and not isinstance(self._wandb, tuple):
            self._wandb.summary.update({k: v for k, v in s.items() if not isinstance(v, dict)})
        self.close()
        return format_summary(s)

    def close(self) -> None:
        """Close every sink (idempotent); ``finish`` calls it."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            if not isinstance(self._wandb, tuple):
                self._wandb.finish()
            self._wandb = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
