"""Multi-turn episodes on an engine (``env.name``; docs/environments.md): the model acts, the
environment answers, turn by turn, and the trainer gets one ``Sample`` per episode.

Every active episode's next turn is one request of one batched ``generate``; the environment
calls of a turn run side by side in threads under ``env.timeout_s``
(``environments.runner``). The model's tokens and log-probs are kept exactly as the engine
sampled them, never decoded and re-encoded; only the environment's reply is tokenized (in
the chat template's tool turn with ``data.template=chat``, raw otherwise) and appended with
mask 0. An episode runs on one engine within one ``generate`` of the rollout, so all its
turns are sampled from the same weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_grpo.algorithms.seeds import turn_seed
from megatron_grpo.config.schema import EnvConfig
from megatron_grpo.environments.contract import load_environment
from megatron_grpo.environments.runner import EnvRunner
from megatron_grpo.rollout.samples import Sample, request_seeds

_PLACEHOLDER = "\x00MGRPO_{}\x00"

StepPrompts = tuple[list, int] | tuple[list, int, list]
"""One step's ``(prompt_ids, seed)`` for ``Rollout.launch``, with its data rows
(``(prompt_ids, seed, rows)``) when episodes are multi-turn."""


def agent_loop(cfg: Any, hf_dir: Any) -> AgentLoop | None:
    """The run's ``AgentLoop`` (``env.name`` set; the tokenizer of ``hf_dir``), else None."""
    if not cfg.env.multi_turn:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    return AgentLoop(cfg.env, tokenizer, chat=cfg.data.template == "chat")


@dataclass
class _Episode:
    prompt_ids: list[int]
    seed: int
    env: Any = None
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    calls: int = 0
    reward: float | None = None
    end: str = ""
    finish: str = "stop"
    version: str | None = None
    routed: Any = None

    def sample(self) -> Sample:
        return Sample(self.prompt_ids, self.response, self.logprobs, self.finish,
                      weight_version=self.version, routed_experts=self.routed,
                      response_mask=self.mask, turns=self.turns, env_reward=self.reward,
                      env_end=self.end, env_calls=self.calls)  # fmt: skip


class ReplyEncoder:
    """Token ids of an environment's reply: raw text, or the chat template's tool turn
    (its user turn where the template has no tool role), closing the model's turn first."""

    def __init__(self, tokenizer: Any, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.prefix, self.suffix = ("", "") if not chat else self._tool_turn()
        eos = tokenizer.eos_token_id
        self.eos_id = eos
        self.eos_text = tokenizer.convert_ids_to_tokens(eos) if eos is not None else None

    def _tool_turn(self) -> tuple[str, str]:
        a, r = _PLACEHOLDER.format("A"), _PLACEHOLDER.format("R")
        for role in ("tool", "user"):
            msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": a},
                    {"role": role, "content": r}]  # fmt: skip
            try:
                text = self.tokenizer.apply_chat_template(
                    msgs, add_generation_prompt=True, tokenize=False
                )
            except Exception:  # noqa: BLE001 - a template without this role: try the next
                continue
            if a in text and r in text:
                between = text.split(a, 1)[1]
                prefix, suffix = between.split(r, 1)
                return prefix, suffix
        raise ValueError(
            "data.template=chat: the tokenizer's chat template renders neither a tool nor a "
            "user turn after an assistant turn; use a raw data.template with env.name."
        )

    def encode(self, reply: str, model_turn: Sequence[int]) -> list[int]:
        prefix = self.prefix
        if prefix and model_turn and model_turn[-1] == self.eos_id and self.eos_text:
            if prefix.startswith(self.eos_text):  # the model closed its own turn
                prefix = prefix[len(self.eos_text) :]
        ids = self.tokenizer.encode(prefix + reply + self.suffix, add_special_tokens=False)
        return list(ids)


class AgentLoop:
    """Runs a rollout's episodes on one engine: ``generate`` takes what
    ``RolloutEngine.generate`` takes plus the episodes' data rows, and returns one
    ``Sample`` per episode, prompt-major, as a one-turn generate would."""

    def __init__(self, env: EnvConfig, tokenizer: Any, chat: bool) -> None:
        self.cfg = env
        self.runner = EnvRunner(load_environment(env.name), env.timeout_s, env.num_workers)
        self.replies = ReplyEncoder(tokenizer, chat)
        self.tokenizer = tokenizer

    def generate(self, engine: Any, prompt_ids: Sequence[Sequence[int]], rows: Sequence[dict],
                 *, n: int, max_new_tokens: int, seeds: Sequence[int] | None = None,
                 seed: int | None = None, **sampling: Any) -> list[Sample]:  # fmt: skip
        """``n`` episodes per prompt, prompt i's episode j seeded as a one-turn generate
        seeds sample j of request i (``request_seeds``: ``seeds[i]``, else
        ``seed + i*n``, the engine's seed without one; then ``+ j``)."""
        base = seed if seed is not None or seeds is not None else engine.seed
        first = request_seeds(seeds, base or 0, n, len(prompt_ids))
        episodes = [_Episode(list(p), first[i] + j) for i, p in enumerate(prompt_ids)
                    for j in range(n)]  # fmt: skip
        built = self.runner.build([dict(rows[i]) for i in range(len(prompt_ids)) for _ in range(n)])
        for ep, out in zip(episodes, built):
            ep.calls += 1
            if out.status == "ok":
                ep.env = out.value
            else:
                ep.end, ep.reward = out.status, 0.0
        for turn in range(self.cfg.max_turns):
            active = [ep for ep in episodes if not ep.end]
            if not active:
                break
            self._turn(engine, active, turn, max_new_tokens, sampling)
        return [ep.sample() for ep in episodes]

    def _turn(self, engine: Any, active: list[_Episode], turn: int, budget: int,
              sampling: dict[str, Any]) -> None:  # fmt: skip
        cap = self.cfg.max_turn_tokens or budget
        out = engine.generate(
            [ep.prompt_ids + ep.response for ep in active], n=1,
            seeds=[turn_seed(ep.seed, turn) for ep in active], max_new_tokens=budget,
            max_tokens_each=[min(cap, budget - len(ep.response)) for ep in active],
            stop=self.cfg.stop or None, **sampling,
        )  # fmt: skip
        texts, stepping = [], []
        for ep, s in zip(active, out):
            ep.response += s.response_ids
            ep.logprobs += s.logprobs
            ep.mask += [1] * len(s.response_ids)
            ep.turns += 1
            ep.version, ep.routed = s.weight_version, s.routed_experts
            if len(ep.response) >= budget:  # the response budget is spent mid-turn
                ep.end, ep.finish = "truncated", "length"
                continue
            texts.append(self.tokenizer.decode(s.response_ids, skip_special_tokens=True))
            stepping.append((ep, s.response_ids))
        results = self.runner.step([ep.env for ep, _ in stepping], texts)
        last = turn + 1 == self.cfg.max_turns
        for (ep, turn_ids), res in zip(stepping, results):
            ep.calls += 1
            if res.status != "ok":
                ep.end, ep.reward = res.status, 0.0
                continue
            reply, reward = res.value
            if reward is not None:
                ep.reward = reward
            if reply is None:
                ep.end = "done"
            elif last:
                ep.end = "max_turns"
            else:
                ids = self.replies.encode(reply, turn_ids)
                if len(ep.response) + len(ids) >= budget:  # no room for the model's next turn
                    ep.end, ep.finish = "truncated", "length"
                    continue
                ep.response += ids
                ep.logprobs += [0.0] * len(ids)
                ep.mask += [0] * len(ids)
