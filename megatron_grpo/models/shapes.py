"""Which model shape a dry run plans with: a config.json, a preset, or the config's model.

The GPU configs point ``model.hf_path`` at directories users download; the plan must work
before the download, so the shape can come from elsewhere. Order of precedence:

1. ``--model-config PATH``: a Hugging Face ``config.json`` (or a directory holding one);
2. ``--preset NAME``: one of ``models.tiny.PRESETS`` (e.g. ``Qwen2.5-7B``);
3. ``model.hf_path`` when it is a preset name;
4. ``model.hf_path`` when it is a directory with a ``config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_grpo.config.schema import ConfigError
from megatron_grpo.models.spec import ModelSpec, spec_from_hf_config
from megatron_grpo.models.tiny import CHARSET, PRESETS, SPECIAL_TOKENS, hf_config_dict


def preset_spec(name: str) -> ModelSpec:
    """The ModelSpec of a preset; the tiny preset's vocabulary is the character tokenizer's."""
    if name not in PRESETS:
        raise ConfigError(f"--preset {name!r} is not a preset: choose one of {sorted(PRESETS)}.")
    cfg = hf_config_dict(name)
    cfg.setdefault("vocab_size", len(SPECIAL_TOKENS) + len(CHARSET))
    return spec_from_hf_config(cfg)


def resolve_spec(
    hf_path: str, *, model_config: str | None = None, preset: str | None = None
) -> tuple[ModelSpec, str]:
    """(spec, where the shape came from). Raises ConfigError naming the ways to fix it."""
    if model_config and preset:
        raise ConfigError("pass either --model-config or --preset, not both.")
    if model_config:
        path = Path(model_config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(
                f"--model-config {model_config!r}: no such config.json; pass a Hugging Face "
                "config.json or the directory that holds it."
            )
        return spec_from_hf_config(json.loads(path.read_text())), str(path)
    if preset:
        return preset_spec(preset), f"preset {preset}"
    if hf_path in PRESETS:
        return preset_spec(hf_path), f"preset {hf_path}"
    path = Path(hf_path) / "config.json"
    if path.is_file():
        return spec_from_hf_config(json.loads(path.read_text())), str(path)
    raise ConfigError(
        f"model.hf_path={hf_path!r} has no config.json (not downloaded yet?): plan with the "
        f"shape of a preset (--preset, one of {sorted(PRESETS)}) or an HF config "
        "(--model-config path/to/config.json)."
    )
