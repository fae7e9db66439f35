"""``bench train``'s console table (the command: ``bench/train/run.py``)."""

from __future__ import annotations

from megatron_grpo.bench.common import format_table

PHASE_WIDTHS = (9, 11, 9, 11)
"""A phase's columns: seconds, tokens/s, MFU, peak GiB."""
WIDTHS = (-18, *PHASE_WIDTHS, *PHASE_WIDTHS)
"""The side, then its train step's columns and its log-prob pass's."""


def _packing(budget: int | None) -> str:
    return f"packed, {budget:,} tokens per micro-batch" if budget else "padded rows"


def _num(x: float | None, fmt: str, na: str = "n/a") -> str:
    return na if x is None else format(x, fmt)


def _phase_cells(d: dict) -> tuple[str, ...]:
    """One phase's four cells (seconds, tokens/s, MFU, peak GiB), or CUDA OOM in the last."""
    if d.get("oom"):
        return ("", "", "", "CUDA OOM")
    mfu = None if d["mfu"] is None else 100 * d["mfu"]
    return (f"{d['median_s']:.4f}", f"{d['useful_tokens_per_s']:,.0f}",
            _num(mfu, ".1f") + ("%" if mfu is not None else ""), _num(d["peak_gib"], ".2f"))  # fmt: skip


def train_table(res: dict) -> str:
    """The console table of a ``bench train`` result."""
    titles = ("side", "s", "tok/s", "MFU 6N", "peak GiB", "s", "tok/s", "MFU 2N", "peak GiB")
    return format_table(titles, _side_rows(res), WIDTHS, head=_heading_lines(res),
                        foot=_foot_lines(res))  # fmt: skip


def _foot_lines(res: dict) -> list[str]:
    """Largest sequences (--search), log-prob parity, the first step, how MFU is counted."""
    lines = []
    if res["search"]:
        lines.append(_largest_trainable_line(res["sides"]))
    lines += _parity_lines(res["logprob_parity"] or {})
    fs = {n: s.get("first_step") for n, s in res["sides"].items()}
    if all(fs.values()):
        lines.append(
            "first step: "
            + "; ".join(
                f"{n} loss {v['loss']:.6f} grad norm {v['grad_norm']:.6f}" for n, v in fs.items()
            )
        )
    lines.append(
        f"MFU: {res['flop_params'] / 1e6:.1f}M matmul parameters x 6 (train) / 2 "
        "(log-prob) FLOPs per useful token, attention FLOPs not included "
        "(JSON: mfu_with_attention)"
    )
    return lines


def _heading_lines(res: dict) -> list[str]:
    """What ran (model, device, batch, packing, steps) and the phases over the columns."""
    b, spec = res["batch"], res["spec"]
    return [
        f"bench train: {res['preset']} ({res['sides']['project']['num_parameters'] / 1e6:.1f}M "
        f"params, {spec['num_layers']} layers), {res['device_name']}, {res['dtype']}, peak "
        f"{_num(res['peak_tflops'], '.0f')} TFLOP/s",
        f"batch: {b['rows']} rows, prompts ~{b['prompt_len']}, responses {b['min_len']}.."
        f"{b['max_len']} (seed {b['seed']}): {b['useful_tokens']:,} useful tokens, "
        f"{b['padded_tokens']:,} padded; micro-batch {b['micro_batch_size']} rows (project: "
        f"{_packing(b['project_micro_batch_tokens'])}; hf-packed: "
        f"{_packing(b.get('hf_packed_micro_batch_tokens'))}); median of "
        f"{res['steps']} after {res['warmup']} warm-up",
        f"{'':<18}{'train step':^40}{'log-prob pass':^40}",
    ]


def _side_rows(res: dict) -> list[tuple[str, ...] | str]:
    """One row per side (both phases), then each side's tokens/s against the project's (a
    line over each phase's four columns)."""
    rows: list[tuple[str, ...] | str] = []
    for name, s in res["sides"].items():
        label = name + (" +liger" if s.get("liger") else "")
        rows.append((label, *_phase_cells(s["train"]), *_phase_cells(s["logprob"])))
    for name in res["sides"]:
        r = res["ratio"].get(name) if name != "project" else None
        if r:
            rows.append(
                f"{'project/' + name:<18}{_num(r['train'], '.2f') + 'x tokens/s':>40}"
                f"{_num(r['logprob'], '.2f') + 'x tokens/s':>40}"
            )
    return rows


def _largest_trainable_line(sides: dict) -> str:
    """``--search``: each side's largest sequence that trains, and where it ran out."""
    parts = []
    for name, s in sides.items():
        ls = s["largest_trainable"]
        fail = [t["length"] for t in ls["tried"] if not t["ok"]]
        ok = [t for t in ls["tried"] if t["ok"]]
        at = f" ({ok[-1]['peak_gib']:.1f} GiB)" if ok and ok[-1]["peak_gib"] else ""
        end = f", {fail[0]:,} OOM" if fail else f", cap {ls['cap']:,}"
        parts.append(f"{name} {_num(ls['largest'], ',')}{at}{end}")
    return "largest sequence that trains: " + "; ".join(parts)


def _parity_lines(par: dict) -> list[str]:
    """The sides' log-prob agreement on the same weights (and hf-packed against hf)."""
    lines = []
    if "max_abs_diff" in par:
        lines.append(
            f"log-prob parity on the same initial weights: max |diff| "
            f"{par['max_abs_diff']:.2e}, mean {par['mean_abs_diff']:.2e} over "
            f"{par['tokens']:,} tokens"
        )
    packed = par.get("hf-packed_vs_hf")
    if packed:
        lines.append(
            f"hf-packed vs hf log-probs: max |diff| {packed['max_abs_diff']:.2e}, mean "
            f"{packed['mean_abs_diff']:.2e} (padding removed, same weights)"
        )
    return lines
