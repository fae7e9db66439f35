"""Old config keys still accepted for one release: each moves to its new place in the raw
config (YAML + overrides) before the tree is built, with a one-line notice naming the new key.

The ``grpo`` section was split into ``grpo.batch``, ``grpo.loss``, ``grpo.kl`` and
``grpo.off_policy`` (issue 44); a key keeps its name and only gains its section, so a run
directory's old flat ``config.yaml`` still loads (``train --resume``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from megatron_grpo.config.schema import ConfigError

REMOVED_IN = "0.3.0"
SHOWN_VAR = "MEGATRON_GRPO_DEPRECATIONS_SHOWN"
"""Set in the environment of the ranks ``train`` starts itself (distributed/spawn.py
``run_under_torchrun``): the process that started them printed the notices already."""

_SECTIONS = {
    "batch": ("prompts_per_step", "sgd_iterations", "mini_batch_size", "micro_batch_size",
              "pack_sequences", "micro_batch_tokens"),
    "loss": ("policy_loss", "clip_eps_low", "clip_eps_high", "dual_clip_c", "rec_clip",
             "rec_weight", "rec_ring_eps_low", "rec_ring_eps_high", "regularizer",
             "regularizer_coef", "loss_agg", "loss_agg_constant", "loss_normalizer",
             "entropy_coef"),
    "kl": ("kl_coef", "kl_estimator", "kl_in_reward", "ref_update_interval"),
    "off_policy": ("ratio_mode", "tis", "tis_cap", "score_alpha"),
}  # fmt: skip

DEPRECATED: dict[str, str] = {
    f"grpo.{key}": f"grpo.{section}.{key}" for section, keys in _SECTIONS.items() for key in keys
}
"""Old dotted key -> its new dotted key."""


def _say(msg: str) -> None:
    """One line on the console's error stream, once per launch: on rank 0, and not again in
    the ranks a ``train`` started (``train``'s console rules: metrics/console.py)."""
    # Not imported here: a config loaded before the console is set up must not load it (nor
    # what its package imports); cli/errors.py's ``_report`` does the same.
    console = sys.modules.get("megatron_grpo.metrics.console")
    if os.environ.get("RANK", "0") == "0" and not os.environ.get(SHOWN_VAR):
        print(msg, file=console.console_err() if console else sys.stderr, flush=True)


def move_deprecated(data: dict, warn: Callable[[str], None] = _say) -> dict:
    """``data`` (the raw nested config) with every old key moved to its new place, one
    ``warn`` line per old key found; ConfigError when an old key and its new key disagree."""
    if not isinstance(data, dict):
        return data  # not a mapping: the loader says so
    out = dict(data)
    for old, new in DEPRECATED.items():
        osec, okey = old.split(".")
        section = out.get(osec)
        if not isinstance(section, dict) or okey not in section:
            continue
        section = out[osec] = dict(section)
        value = section.pop(okey)
        _, nsec, nkey = new.split(".")
        sub = section.get(nsec)
        sub = section[nsec] = dict(sub) if isinstance(sub, dict) else {}
        if nkey in sub and sub[nkey] != value:
            raise ConfigError(
                f"{old}={value!r} and {new}={sub[nkey]!r} are both set: {old} is the old name "
                f"of {new}; keep only {new}."
            )
        sub[nkey] = value
        warn(f"{old} is deprecated: use {new} (the old key is accepted until {REMOVED_IN})")
    return out
