"""``megatron-grpo data``: a GSM8K, MATH or DeepScaleR-style set into the JSONL the configs read.

Each preset names its Hugging Face hub dataset, the columns it has there and the keys the
shipped configs expect (``data.prompt_key`` / ``data.answer_key``):

- ``gsm8k`` (``openai/gsm8k``, config ``main``): question, answer -> ``question``, ``answer``
  (the gold after ``####``, as rewards/gsm8k.py reads it);
- ``math`` (``DigitalLearningGmbH/MATH-lighteval``, Hendrycks et al.'s MATH, all subjects):
  problem, solution -> ``problem``, ``answer`` (the solution, whose ``\\boxed{}`` the math
  reward parses);
- ``deepscaler`` (``agentica-org/DeepScaleR-Preview-Dataset``): problem, answer ->
  ``problem``, ``answer``.

The rows come from ``--input`` (a local .jsonl / .json / .parquet file in the hub's column
layout, e.g. one downloaded on an online machine) or from the hub through the ``datasets``
library where it is installed and the machine is online.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_grpo.config import ConfigError
from megatron_grpo.rewards.gsm8k import extract_gold


@dataclass(frozen=True)
class Preset:
    hub: str
    """The hub dataset's name (``datasets.load_dataset``)."""
    hub_config: str | None
    columns: tuple[str, str]
    """(prompt, answer) columns of the hub's layout."""
    keys: tuple[str, str]
    """(prompt, answer) keys of the written JSONL: what the shipped configs read."""
    answer: Callable[[str], str]
    """The written answer from the hub's answer column."""
    config: str
    """A shipped config that reads this layout (said after writing)."""


PRESETS: dict[str, Preset] = {
    "gsm8k": Preset("openai/gsm8k", "main", ("question", "answer"), ("question", "answer"),
                    extract_gold, "configs/qwen2.5-0.5b-gsm8k.yaml"),
    "math": Preset("DigitalLearningGmbH/MATH-lighteval", None, ("problem", "solution"),
                   ("problem", "answer"), str.strip, "configs/r1-distill-qwen-1.5b-deepscaler.yaml"),
    "deepscaler": Preset("agentica-org/DeepScaleR-Preview-Dataset", None, ("problem", "answer"),
                         ("problem", "answer"), str.strip,
                         "configs/r1-distill-qwen-1.5b-deepscaler.yaml"),
}  # fmt: skip


def read_rows(preset: Preset, split: str, input_path: str | None) -> Iterable[dict[str, Any]]:
    """The rows of ``input_path`` (a local file in the hub's layout), else of the hub."""
    if input_path is not None:
        lower = input_path.lower()
        if not os.path.isfile(input_path):
            raise ConfigError(f"--input {input_path} does not exist: fix the path.")
        if lower.endswith(".parquet"):
            import pyarrow.parquet as pq

            return pq.read_table(input_path).to_pylist()
        if lower.endswith((".jsonl", ".json")):
            return _read_json(input_path)
        raise ConfigError(f"--input {input_path}: pass a .jsonl, .json or .parquet file.")
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"reading {preset.hub} from the hub needs the datasets library: pip install "
            "datasets, or pass --input with a local .jsonl/.parquet copy."
        ) from None
    try:
        return datasets.load_dataset(preset.hub, preset.hub_config, split=split)
    except Exception as e:  # noqa: BLE001 - re-raised with the fix
        raise ConfigError(
            f"loading {preset.hub} (split {split}) from the hub failed ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}): download it on an online machine "
            "and pass --input FILE."
        ) from e


def _read_json(path: str) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        if f.read(1) == "[":
            f.seek(0)
            yield from json.load(f)
            return
        f.seek(0)
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path} line {n} is not JSON ({e.msg}): fix it.") from None


def prepare(
    name: str, out: str | os.PathLike, split: str = "train", input_path: str | None = None,
    limit: int = 0,
) -> tuple[int, Preset]:  # fmt: skip
    """Write preset ``name``'s rows as JSONL at ``out`` (refused if it exists); returns
    (rows written, the preset). A row lacking a column is refused, naming the row."""
    if name not in PRESETS:
        raise ConfigError(f"data set {name!r} is not one of {sorted(PRESETS)}: pick one.")
    out = Path(out)
    if out.exists():
        raise ConfigError(f"--out {out} already exists: remove it or choose another path.")
    preset = PRESETS[name]
    rows = read_rows(preset, split, input_path)
    (p_col, a_col), (p_key, a_key) = preset.columns, preset.keys
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    n = 0
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for i, row in enumerate(rows):
                if limit and n >= limit:
                    break
                if not isinstance(row, dict) or p_col not in row or a_col not in row:
                    have = sorted(row) if isinstance(row, dict) else type(row).__name__
                    raise ConfigError(
                        f"row {i} has {have}, not the {name} columns {p_col!r} and {a_col!r}: "
                        "pass a file in the hub's layout."
                    )
                answer = preset.answer(str(row[a_col]))
                f.write(json.dumps({p_key: row[p_col], a_key: answer}, ensure_ascii=False) + "\n")
                n += 1
        tmp.rename(out)
    finally:
        tmp.unlink(missing_ok=True)
    return n, preset
