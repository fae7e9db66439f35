"""Prompt sources: datasets, synthetic tasks, templates, resumable seeded shuffling.

Design: docs/rewards-and-data.md, "Prompt sources (data/prompts.py)".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from megatron_grpo.rewards.synthetic import get_task, synthetic_example

log = logging.getLogger(__name__)

_FIRST_ROWS = 5


@dataclass(frozen=True)
class Prompt:
    """One prompt: rendered ``text``, its token ids, the gold ``answer`` and ``meta``.

    ``meta``: ``row`` (0-based row of the source), ``epoch``, ``draw`` (0-based count of
    prompts drawn before this one over the run).
    """

    text: str
    prompt_ids: list[int]
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)
    row: dict[str, Any] = field(default_factory=dict)
    """The data row as read (every key), with ``prompt`` (before the template) and
    ``answer`` (a string): what a multi-turn environment is built from (``env.name``)."""


@dataclass
class LoadReport:
    """What loading kept and skipped: ``skipped[reason] = count``, ``first_rows[reason]``."""

    source: str
    total: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    first_rows: dict[str, list[int]] = field(default_factory=dict)

    def skip(self, reason: str, row: int) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        rows = self.first_rows.setdefault(reason, [])
        if len(rows) < _FIRST_ROWS:
            rows.append(row)

    def summary(self) -> str:
        parts = [
            f"{reason}={n} (first rows {self.first_rows[reason]})"
            for reason, n in sorted(self.skipped.items())
        ]
        return f"{self.source}: kept {self.kept} of {self.total} rows" + (
            f"; skipped {', '.join(parts)}" if parts else ""
        )


class PromptSource:
    """Seeded, resumable stream of :class:`Prompt` over validated rows (docs/rewards-and-data.md, "Prompt sources")."""

    def __init__(self, prompts: list[Prompt], seed: int, report: LoadReport) -> None:
        if not prompts:
            raise ValueError(
                f"{report.summary()}: no usable prompt. Check data.prompt_key / "
                "data.answer_key against the file's columns, or raise data.max_prompt_tokens."
            )
        self._prompts = prompts
        self.seed = seed
        self.report = report
        self.epoch = 0
        self.index = 0
        self._order: list[int] = self._permutation(0)
        h = hashlib.sha256()
        for p in prompts:
            h.update(p.text.encode("utf-8", "surrogatepass") + b"\0")
            h.update(p.answer.encode("utf-8", "surrogatepass") + b"\1")
        self.fingerprint = h.hexdigest()[:16]

    def __len__(self) -> int:
        return len(self._prompts)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self._prompts)))
        random.Random(f"{self.seed}|{epoch}").shuffle(order)
        return order

    def next_batch(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts; crosses epoch boundaries (reshuffling) as needed."""
        out = []
        for _ in range(n):
            if self.index == len(self._order):
                self.epoch += 1
                self.index = 0
                self._order = self._permutation(self.epoch)
            p = self._prompts[self._order[self.index]]
            draw = self.epoch * len(self._prompts) + self.index
            out.append(
                Prompt(
                    p.text,
                    p.prompt_ids,
                    p.answer,
                    {**p.meta, "epoch": self.epoch, "draw": draw},
                    p.row,
                )
            )
            self.index += 1
        return out

    def reshuffled(self, seed: int) -> PromptSource:
        """A second stream over the same prompts in another order (``seed``), at its start:
        what dynamic sampling's further rounds draw from (``rollout.ahead.WindowBuffer``)."""
        return PromptSource(self._prompts, seed, self.report)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "num_rows": len(self._prompts),
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_rows"] != len(self._prompts) or state["fingerprint"] != self.fingerprint:
            raise ValueError(
                f"prompt-source state was saved over {state['num_rows']} rows (fingerprint "
                f"{state['fingerprint']}) but this source has {len(self._prompts)} rows "
                f"(fingerprint {self.fingerprint}): resume with the same data.source, keys, "
                "template and max_prompt_tokens, or start a fresh run."
            )
        if state["seed"] != self.seed:
            raise ValueError(
                f"prompt-source state has shuffle_seed={state['seed']} but data.shuffle_seed="
                f"{self.seed}: set data.shuffle_seed={state['seed']} to resume this run."
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)


# ---------------------------------------------------------------------------- row reading
_BAD_JSON = object()


def _read_jsonl(path: str) -> Iterator[Any]:
    with open(path, encoding="utf-8") as f:
        head = f.read(1)
        f.seek(0)
        if head == "[":  # a JSON array file
            yield from json.load(f)
            return
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                yield _BAD_JSON


def _missing(src: str) -> str:
    return (
        f"data.source={src!r} does not exist: fix the path, name a Hugging Face hub dataset "
        "instead (data.split picks its split), or write the file from one with "
        f"`megatron-grpo data gsm8k|math|deepscaler --out {src}`."
    )


def _read_rows(data_cfg) -> Iterable[Any]:
    src = data_cfg.source
    lower = src.lower()
    if lower.endswith((".jsonl", ".json")):
        if not os.path.exists(src):
            raise FileNotFoundError(_missing(src))
        return _read_jsonl(src)
    import datasets

    if lower.endswith(".parquet"):
        if not os.path.exists(src):
            raise FileNotFoundError(_missing(src))
        return datasets.Dataset.from_parquet(src)
    if lower.endswith(".arrow"):
        if not os.path.exists(src):
            raise FileNotFoundError(_missing(src))
        return datasets.Dataset.from_file(src)
    if os.path.isdir(src):
        ds = datasets.load_from_disk(src)
        if isinstance(ds, datasets.DatasetDict):
            if data_cfg.split not in ds:
                raise ValueError(
                    f"{src} has splits {list(ds)}, not data.split={data_cfg.split!r}: set "
                    "data.split to one of them."
                )
            ds = ds[data_cfg.split]
        return ds
    try:
        return datasets.load_dataset(src, split=data_cfg.split)
    except Exception as e:  # noqa: BLE001 - re-raised with the fix
        raise ValueError(
            f"data.source={src!r} is not a local .jsonl/.json/.parquet/.arrow file or dataset "
            f"directory, and loading it from the Hugging Face hub failed ({type(e).__name__}: "
            f"{e}): fix the path, or download the dataset on an online machine."
        ) from e


def _row_fields(row: Any, prompt_key: str, answer_key: str) -> tuple[str | None, str, str]:
    """``(reason or None, prompt, answer)``."""
    if row is _BAD_JSON:
        return "bad_json", "", ""
    if not isinstance(row, dict):
        return "not_an_object", "", ""
    if prompt_key not in row or answer_key not in row:
        return "missing_key", "", ""
    prompt, answer = row[prompt_key], row[answer_key]
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(prompt, str) or not isinstance(answer, str):
        return "not_string", "", ""
    if not prompt.strip() or not answer.strip():
        return "empty", "", ""
    return None, prompt, answer


# ------------------------------------------------------------------------------ templates
def make_renderer(template: str, tokenizer):
    """``render(prompt) -> text`` for a ``{prompt}`` format string or ``chat``."""
    if template == "chat":
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "data.template=chat needs a tokenizer with a chat template: use a model whose "
                "tokenizer has one, or a format string such as data.template='Q: {prompt}\\nA:'."
            )

        def render(prompt: str) -> str:
            return tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )

        return render
    try:
        template.format(prompt="")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"data.template={template!r} is not a format string with only {{prompt}} ({e!r}): "
            "write e.g. 'Question: {prompt}\\nAnswer:' (double literal braces as {{ }}), or chat."
        ) from None
    if "{prompt}" not in template:
        raise ValueError(
            f"data.template={template!r} has no {{prompt}} placeholder: the prompt would be lost."
        )
    return lambda prompt: template.format(prompt=prompt)


# -------------------------------------------------------------------------------- builder
def build_prompt_source(data_cfg, tokenizer=None) -> PromptSource:
    """Load, validate, render and tokenize the prompts of ``data_cfg`` (docs/rewards-and-data.md, "Prompt sources").

    ``tokenizer``: a Hugging Face tokenizer; ``None`` (dry runs) leaves ``prompt_ids`` empty
    and skips the length check. Templates other than ``chat`` are tokenized with the
    tokenizer's special tokens (e.g. BOS); the chat template already contains them.
    """
    report = LoadReport(source=data_cfg.source)
    kept = _rendered_rows(data_cfg, make_renderer(data_cfg.template, tokenizer), report)
    ids: list[list[int]] = [[] for _ in kept]
    if tokenizer is not None and kept:
        add_special = data_cfg.template != "chat"
        enc = tokenizer([k[0] for k in kept], add_special_tokens=add_special)
        ids = [list(x) for x in enc["input_ids"]]
    prompts = []
    for (text, answer, row_no, row), prompt_ids in zip(kept, ids):
        if tokenizer is not None and len(prompt_ids) > data_cfg.max_prompt_tokens:
            if data_cfg.strict:
                _fail(data_cfg, "too_long", row_no, f"{len(prompt_ids)} tokens > "
                      f"data.max_prompt_tokens={data_cfg.max_prompt_tokens}")  # fmt: skip
            report.skip("too_long", row_no)
            continue
        prompts.append(Prompt(text, prompt_ids, answer, {"row": row_no}, row))
    report.kept = len(prompts)
    if report.skipped:
        log.warning("%s", report.summary())
    else:
        log.info("%s", report.summary())
    return PromptSource(prompts, data_cfg.shuffle_seed, report)


def _source_rows(data_cfg) -> tuple[Iterable[Any], str, str]:
    """The raw rows of ``data.source`` (a synthetic task or a file) and their prompt and
    answer keys."""
    if not data_cfg.source.startswith("synthetic:"):
        return _read_rows(data_cfg), data_cfg.prompt_key, data_cfg.answer_key
    task = data_cfg.source.split(":", 1)[1]
    get_task(task)  # unknown task -> error naming the choices
    rows = (
        {"prompt": p, "answer": a}
        for p, a in (
            synthetic_example(task, data_cfg.synthetic_difficulty, i, data_cfg.split)
            for i in range(data_cfg.synthetic_size)
        )
    )
    return rows, "prompt", "answer"


def _rendered_rows(data_cfg, render, report: LoadReport) -> list[tuple[str, str, int, dict]]:
    """``(rendered prompt, answer, row number, row)`` of every valid row; an invalid one
    fails (``data.strict``) or is skipped and counted in ``report``."""
    rows, prompt_key, answer_key = _source_rows(data_cfg)
    kept: list[tuple[str, str, int, dict]] = []
    for row_no, row in enumerate(rows):
        report.total += 1
        reason, prompt, answer = _row_fields(row, prompt_key, answer_key)
        if reason is not None:
            if data_cfg.strict:
                _fail(data_cfg, reason, row_no,
                      f"needs non-empty {prompt_key!r} and {answer_key!r} strings")  # fmt: skip
            report.skip(reason, row_no)
            continue
        kept.append((render(prompt), answer, row_no, {**row, "prompt": prompt, "answer": answer}))
    return kept


def _fail(data_cfg, reason: str, row_no: int, detail: str) -> None:
    raise ValueError(
        f"{data_cfg.source} row {row_no} (0-based): {reason} ({detail}); fix the row or set "
        "data.strict=false to skip and count such rows."
    )
