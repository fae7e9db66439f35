"""The run's Hugging Face model directory: a given one, or a preset built (and warm-started).

A preset (``model.hf_path=tiny``) is built from random weights by rank 0 into
``RUN_DIR/hf_model/<preset>``; with ``model.warm_start_steps > 0`` it is then fine-tuned
with plain supervised learning on the prompt source's gold answers (``transformers`` on
CPU, seconds for the tiny model), because a random model never samples a right answer and
GRPO alone would see no reward signal. Both Megatron and vLLM then start from that
directory. Other ranks wait for the directory's completion marker.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path

from megatron_grpo.config.schema import Config
from megatron_grpo.data import build_prompt_source
from megatron_grpo.models.tiny import PRESETS, build_hf_model
from megatron_grpo.rewards.synthetic import warm_start_target

log = logging.getLogger(__name__)

COMPLETE = ".complete"


def recipe(cfg: Config) -> dict:
    """Everything the prepared model's bytes depend on; a directory built from another
    recipe (an earlier run with another seed or warm start) is rebuilt, never reused."""
    m = cfg.model
    out = {"preset": m.hf_path, "seed": cfg.seed, "warm_start_steps": m.warm_start_steps}
    if m.warm_start_steps:
        out.update(warm_start_lr=m.warm_start_lr, warm_start_batch_size=m.warm_start_batch_size,
                   data=dataclasses.asdict(cfg.data))  # fmt: skip
    return out


def built_recipe(target: Path) -> dict | None:
    """The recipe recorded in ``target``'s completion marker (None: not complete, or written
    by a version that recorded none)."""
    try:
        return json.loads((target / COMPLETE).read_text()).get("recipe")
    except (OSError, ValueError):
        return None


def _build_preset(cfg: Config, target: Path) -> None:
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build_hf_model(tmp, cfg.model.hf_path, seed=cfg.seed, with_tokenizer=True)
    info = {"preset": cfg.model.hf_path, "seed": cfg.seed, "warm_start_steps": 0,
            "recipe": recipe(cfg)}  # fmt: skip
    if cfg.model.warm_start_steps:
        info["warm_start"] = warm_start(tmp, cfg)
        info["warm_start_steps"] = cfg.model.warm_start_steps
    (tmp / COMPLETE).write_text(json.dumps(info, indent=2))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


def check_model_path(cfg: Config) -> None:
    """FileNotFoundError (one line) when ``model.hf_path`` is neither a preset nor an HF dir."""
    path = Path(cfg.model.hf_path)
    if cfg.model.hf_path not in PRESETS and not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.hf_path={cfg.model.hf_path!r} is neither a preset {sorted(PRESETS)} nor a "
            "directory with a config.json: point it at a Hugging Face model directory."
        )


def prepare_model_dir(cfg: Config, rank: int, timeout_s: float) -> Path:
    """The HF directory this run trains; built by rank 0 when ``model.hf_path`` is a preset."""
    if cfg.model.hf_path not in PRESETS:
        check_model_path(cfg)
        return Path(cfg.model.hf_path)
    target = Path(cfg.run_dir) / "hf_model" / cfg.model.hf_path
    want = recipe(cfg)
    if rank == 0 and built_recipe(target) != want:
        if target.exists():
            log.warning("%s was prepared with another recipe (%s): rebuilding it", target,
                        built_recipe(target))  # fmt: skip
        _build_preset(cfg, target)
    deadline = time.monotonic() + timeout_s
    while built_recipe(target) != want:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {rank} waited {timeout_s:.0f}s for rank 0 to build {target}: check rank "
                "0's log (parallel.timeout_s bounds the wait)."
            )
        time.sleep(0.2)
    return target


def warm_start(model_dir: Path, cfg: Config) -> dict:
    """Supervised fine-tuning of the HF model in ``model_dir`` on ``prompt + answer + eos``
    (loss on the answer and eos tokens), written back in place. Returns loss figures."""
    import torch
    import transformers
    from safetensors.torch import save_file

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    source = build_prompt_source(cfg.data, tok)
    torch.manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.model.warm_start_lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(cfg.model.warm_start_steps):
        batch = source.next_batch(cfg.model.warm_start_batch_size)
        seqs, starts = [], []
        for p in batch:
            target = warm_start_target(cfg.data.source, p.row.get("prompt", p.text), p.answer,
                                       p.meta.get("draw", 0))  # fmt: skip
            answer = tok(target, add_special_tokens=False).input_ids + [tok.eos_token_id]
            seqs.append(list(p.prompt_ids) + answer)
            starts.append(len(p.prompt_ids))
        length = max(map(len, seqs))
        ids = torch.full((len(seqs), length), tok.pad_token_id, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        for i, (s, st) in enumerate(zip(seqs, starts)):
            ids[i, : len(s)] = torch.tensor(s)
            labels[i, st : len(s)] = torch.tensor(s[st:])
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = unfuse_experts({k: v.detach() for k, v in model.state_dict().items()})
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for f in model_dir.glob("*.safetensors"):
        f.unlink()
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return {"first_loss": losses[0], "last_loss": losses[-1]}


def unfuse_experts(state: dict) -> dict:
    """A transformers state dict in checkpoint names, contiguous: transformers (v5) holds a
    Qwen3-MoE layer's experts fused in memory (models/qwen3_moe/modeling_qwen3_moe.py
    ``Qwen3MoeExperts``: ``mlp.experts.gate_up_proj`` (E, 2I, h), gate rows first, and
    ``mlp.experts.down_proj`` (E, h, I)), while checkpoints, the layouts and vLLM's loader
    name one tensor per expert (``mlp.experts.{e}.gate_proj.weight``). Dense models pass
    through unchanged."""
    out = {}
    for name, t in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            pre, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{pre}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            pre = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    return out
