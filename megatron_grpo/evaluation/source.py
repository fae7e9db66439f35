"""Where ``megatron-grpo eval`` takes a model from, and how its weights reach the policy.

Model sources (:func:`resolve_model`):

- an HF directory (``config.json`` + safetensors): ``layouts.io.load_hf_into_megatron``;
- a training run directory, its ``checkpoints/`` or a ``step_NNNNNN/`` directory: the
  ``policy`` part's ``model`` state via dist_checkpointing (any TP/PP); config and tokenizer
  from ``--hf-config``, else the run's ``config.yaml`` (``model.hf_path``);
- a ``convert hf-to-mcore`` output: its dist checkpoint; config and tokenizer from its
  ``hf/`` folder (or ``--hf-config``).

For Megatron checkpoints vLLM starts from dummy weights (``load_format="dummy"``): every
value it generates with came through the bridge.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megatron_grpo.checkpoint import load_checkpoint
from megatron_grpo.checkpoint.conversion import HF_SUBDIR, INFO_FILE, CheckpointInfo, run_hf_dir
from megatron_grpo.checkpoint.store import is_complete, resolve_checkpoint
from megatron_grpo.config import ConfigError
from megatron_grpo.models.spec import load_spec

SourceKind = Literal["hf", "training", "converted"]


@dataclass(frozen=True)
class ModelSource:
    """Where the weights and the HF config/tokenizer come from."""

    kind: SourceKind
    path: Path
    """The HF directory, the training step directory, or the converted checkpoint."""
    hf_dir: Path
    """config.json + tokenizer files (the weights too when ``kind == "hf"``)."""
    step: int | None = None

    def describe(self) -> str:
        if self.kind == "hf":
            return f"{self.path} (HF directory)"
        if self.kind == "training":
            return f"{self.path} (training checkpoint, step {self.step})"
        step = f", step {self.step}" if self.step is not None else ""
        return f"{self.path} (converted Megatron checkpoint{step})"


def resolve_model(model: str, hf_config: str | None = None) -> ModelSource:
    """Classify ``--model`` (see the module docstring); errors name the path and the fix."""
    path = Path(model)
    override = Path(hf_config) if hf_config else None
    if override is not None and not (override / "config.json").is_file():
        raise ConfigError(f"--hf-config {override} has no config.json: pass an HF directory.")
    if not path.is_dir():
        raise ConfigError(
            f"--model {model}: no such directory; pass an HF model directory, a training run "
            "(or its checkpoints/step_NNNNNN) or a `convert hf-to-mcore` output."
        )
    if (path / INFO_FILE).is_file():
        info = CheckpointInfo.read(path)
        hf = override or path / HF_SUBDIR
        if not (hf / "config.json").is_file():
            raise ConfigError(f"{path} carries no {HF_SUBDIR}/config.json: pass --hf-config.")
        if info is not None and info.model_spec() != load_spec(hf):
            raise ConfigError(
                f"--hf-config {hf} describes another model than {path} was written for "
                f"({info.model_spec().family}, {info.model_spec().num_layers} layers)."
            )
        return ModelSource("converted", path, hf, info.step if info else None)
    if (path / "config.json").is_file():
        if not any(path.glob("*.safetensors")):
            raise ConfigError(f"--model {model} has a config.json but no *.safetensors weights.")
        return ModelSource("hf", path, override or path)
    if is_complete(path) or (path / "checkpoints").is_dir() or path.name == "checkpoints":
        step_dir = resolve_checkpoint(path)
        if not (step_dir / "policy").is_dir():
            raise ConfigError(f"{step_dir} has no policy/ part: it is not a training checkpoint.")
        state = json.loads((step_dir / "state.json").read_text())
        hf = override or run_hf_dir(step_dir.parent.parent)
        return ModelSource("training", step_dir, hf, state.get("step"))
    raise ConfigError(
        f"--model {model} is neither an HF directory (config.json), a training run / "
        "checkpoints / step_NNNNNN directory (state.json), nor a converted checkpoint "
        f"({INFO_FILE}): point it at one of those."
    )


def load_megatron_weights(policy, source: ModelSource) -> None:
    """Fill ``policy`` (any TP/PP) from a Megatron checkpoint; collective over the world.

    dist_checkpointing stores global tensors and the vocabulary rows allow a different
    padding, so the saving layout does not matter (docs/convert.md)."""
    if source.kind == "training":
        # Only the model: the template has no optimizer entries, and dist_checkpointing's
        # default strictness (ASSUME_OK_UNEXPECTED) skips the checkpoint's extra keys.
        loaded = load_checkpoint(
            source.path, {"policy": policy.sharded_state_dict()}, restore_rng=False
        )
        policy.load_sharded_state_dict(loaded.state_dicts["policy"])
    else:
        from megatron.core import dist_checkpointing

        policy.load_sharded_state_dict(
            dist_checkpointing.load(policy.sharded_state_dict(), str(source.path))
        )
