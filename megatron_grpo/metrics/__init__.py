"""Per-step metrics (schema, sinks, phase timer), the end-of-run summary and plots."""

from megatron_grpo.metrics.logger import METRICS_FILE, MetricsLogger, read_metrics
from megatron_grpo.metrics.plots import plot_reward, plot_step_times, write_plots
from megatron_grpo.metrics.schema import FIELD_NAMES, PHASES, StepMetrics
from megatron_grpo.metrics.summary import (
    SUMMARY_FILE,
    format_summary,
    summarize,
    summary,
    write_summary,
)
from megatron_grpo.metrics.timer import PhaseTimer

Timer = PhaseTimer

__all__ = [
    "FIELD_NAMES",
    "METRICS_FILE",
    "PHASES",
    "SUMMARY_FILE",
    "MetricsLogger",
    "PhaseTimer",
    "StepMetrics",
    "Timer",
    "format_summary",
    "plot_reward",
    "plot_step_times",
    "read_metrics",
    "summarize",
    "summary",
    "write_plots",
    "write_summary",
]
