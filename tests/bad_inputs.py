"""Bad inputs a user can give the CLI, and the one line each one gets (docs/errors.md).

``python -m tests.bad_inputs`` runs every case and rewrites docs/errors.md;
tests/cli/test_bad_inputs.py runs them too and checks the table is current, so the table stays
true. ``HAND`` and the numeric cases run in-process (``cli.main.main``) with every expensive
step (starting ranks, building the trainer) replaced by a failure: a case that got that far
would not be refused before expensive work. ``LAUNCHED`` cases run as a user runs them, in a
subprocess: under torchrun with two ranks, each its own process, or as one process. Paths
are written relative to a scratch directory, shown as ``$TMP``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "errors.md"
LAUNCHED_HEADING = "## Launched as a user launches them"
# The test-only hook that holds back a chosen rank's checks (its sitecustomize.py).
DELAY_SITE = ROOT / "tests" / "rank_delay_site"
DELAY_VAR = "MEGATRON_GRPO_TEST_RANK_DELAY"
# Under torchrun the cases run with rank 0's checks held back this long: rank 1 refuses
# first, the order in which torchrun used to stop rank 0 before it printed (issue 34).
RANK0_LATE = {0: 1.0, 1: 0.0}

FILES = {
    "bad.yaml": "grpo:\n  group_size: 4\n  oops: [1, 2\nsteps: 3\n",
    "list.yaml": "- 1\n- 2\n",
    "bad.jsonl": '{"question": "q", "answer": "1"}\n{not json\n',
    "empty.jsonl": "",
    "nokey.jsonl": '{"q": "x", "answer": "1"}\n',
    "notobj.jsonl": "[1, 2]\n",
    "afile": "x",
    "judge/config.json": "{}\n",
    "used/metrics.jsonl": '{"step": 1}\n',
    "done/metrics.jsonl": '{"step": 1}\n',
    "done/summary.json": "{}\n",
    # a run that trained its 6 steps: its config, last checkpoint and summary
    "finished/config.yaml": "steps: 6\n",
    "finished/metrics.jsonl": '{"step": 6}\n',
    "finished/checkpoints/step_000006/state.json": '{"step": 6}\n',
    "finished/summary.json": '{"steps": 6, "first_step": 1, "last_step": 6}\n',
    "moe.yaml": "model:\n  hf_path: tiny-moe\n",
    "my_reward.py": "def score(prompt, response, answer):\n    return 1.0\n",
    "broken_reward.py": "def score(:\n",
    "my_env.py": "class Env:\n    def __init__(self, row):\n        pass\n\n    def step(self, text):\n"
    "        return None, 1.0\n\n\nclass NoStep:\n    pass\n\n\ndef not_a_class(row):\n"
    "    return None\n",
}

T = ["train", "--verbose", "--run-dir", "$TMP/run"]
P = ["plan", "--nodes", "1", "--gpus-per-node", "1"]

# (what the user did, argv)
# fmt: off
HAND: list[tuple[str, list[str]]] = [
    ("config file missing", ["train", "--config", "$TMP/missing.yaml"]),
    ("config file YAML syntax error", ["train", "--config", "$TMP/bad.yaml"]),
    ("config file not a mapping", ["train", "--config", "$TMP/list.yaml"]),
    ("unknown key", [*T, "logging.nope=1"]),
    ("unknown key close to a real one", [*T, "grpo.batch.prompt_per_step=4"]),
    ("unknown section", [*T, "nosection.x=1"]),
    ("unknown key in a nested section", [*T, "grpo.loss.nope=1"]),
    ("old key and its new key disagree", [*T, "grpo.clip_eps_low=0.3", "grpo.loss.clip_eps_low=0.25"]),
    ("override without =", [*T, "grpo.group_size"]),
    ("value of the wrong type", [*T, "grpo.group_size=abc"]),
    ("boolean that is not one", [*T, "grpo.red_drop=maybe"]),
    ("choice not offered", [*T, "grpo.advantage=best"]),
    ("choice not offered", [*T, "grpo.loss.policy_loss=magic"]),
    ("choice not offered", [*T, "grpo.loss.loss_agg=median"]),
    ("choice not offered", [*T, "grpo.kl.kl_estimator=k9"]),
    ("choice not offered", [*T, "rollout.placement=elsewhere"]),
    ("choice not offered", [*T, "parallel.backend=mpi"]),
    ("choice not offered", [*T, "sync.method=telepathy"]),
    ("adaptive sync: min interval above max", [*T, "sync.mode=adaptive", "sync.min_interval=5", "sync.max_interval=4"]),
    ("choice not offered", [*T, "model.dtype=int3"]),
    ("vpp without pp", [*T, "parallel.vpp=2"]),
    ("sequence parallel without tp", [*T, "parallel.sequence_parallel=true"]),
    ("top_p above 1", [*T, "rollout.top_p=2"]),
    ("overlong buffer past max_new_tokens", [*T, "grpo.overlong_buffer=1000"]),
    ("dynamic sampling's oversample below 1", [*T, "grpo.dynamic_sampling.oversample=0.5"]),
    ("dynamic sampling's max_rounds below 1", [*T, "grpo.dynamic_sampling.max_rounds=0"]),
    ("truncated sampling", [*T, "rollout.top_k=5"]),
    ("unknown command-line flag", ["train", "--nope"]),
    ("--steps not a number", ["train", "--steps", "many"]),
    ("unknown command", ["trian"]),
    ("run dir is a file", ["train", "--run-dir", "$TMP/afile"]),
    ("run dir holds a finished run", ["train", "--run-dir", "$TMP/used"]),
    ("--resume with no checkpoint", ["train", "--resume", "--run-dir", "$TMP/run"]),
    ("--resume auto on a finished run", ["train", "--resume", "auto", "--run-dir", "$TMP/done"]),
    ("--resume on a finished run (its config.yaml read)", ["train", "--resume", "--run-dir", "$TMP/finished"]),
    ("--resume with a --config of another model", ["train", "--resume", "--run-dir", "$TMP/finished", "--config", "$TMP/moe.yaml"]),
    ("--resume and --overwrite", ["train", "--resume", "--overwrite", "--run-dir", "$TMP/used"]),
    ("--overwrite with another bad input", ["train", "--overwrite", "--run-dir", "$TMP/used", "reward.name=nosuch"]),
    ("tp does not divide the world", [*T, "parallel.tp=2", "parallel.dp=1", "rollout.tp=4"]),
    ("prompts not a multiple of engines", [*T, "rollout.tp=1", "parallel.dp=2", "grpo.batch.prompts_per_step=3"]),
    ("unknown reward", [*T, "reward.name=nosuch"]),
    ("reward module missing", [*T, "reward.name=no_such_pkg.mod:fn"]),
    ("reward function missing", [*T, "reward.name=megatron_grpo.rewards:nope"]),
    ("reward file missing", [*T, "reward.name=$TMP/nope.py:score"]),
    ("reward file broken", [*T, "reward.name=$TMP/broken_reward.py:score"]),
    ("reward function missing in file", [*T, "reward.name=$TMP/my_reward.py:other"]),
    ("format weight with a user reward", [*T, "reward.name=$TMP/my_reward.py:score", "reward.format_weight=0.5"]),
    ("GSM8K reward on synthetic data", [*T, "reward.name=gsm8k"]),
    ("remote reward server not running", [*T, "reward.name=http://127.0.0.1:1/score", "reward.backoff_s=0.05"]),
    ("remote reward URL without a host", [*T, "reward.name=http:///score"]),
    ("format weight with a remote reward", [*T, "reward.name=http://127.0.0.1:1/score", "reward.format_weight=0.5"]),
    ("judge model directory without config.json", [*T, "reward.name=judge:$TMP/nomodel"]),
    ("judge template without {response}", [*T, "reward.name=judge:$TMP/judge", "reward.judge_template=Is {prompt} right?"]),
    ("judge pattern without a group", [*T, "reward.name=judge:$TMP/judge", "reward.judge_pattern=Score"]),
    ("environment module missing", [*T, "env.name=no_such_pkg.envs:Env"]),
    ("environment file missing", [*T, "env.name=$TMP/nope.py:Env"]),
    ("environment class missing in file", [*T, "env.name=$TMP/my_env.py:Other"]),
    ("environment is a function", [*T, "env.name=$TMP/my_env.py:not_a_class"]),
    ("environment without step", [*T, "env.name=$TMP/my_env.py:NoStep"]),
    ("environment name without a class", [*T, "env.name=$TMP/my_env.py"]),
    ("env.max_turns below 1", [*T, "env.name=$TMP/my_env.py:Env", "env.max_turns=0"]),
    ("env.stop not a list of strings", [*T, "env.name=$TMP/my_env.py:Env", "env.stop=[1, '']"]),
    ("environment with a colocated rollout.tp=2", [*T, "env.name=$TMP/my_env.py:Env", "rollout.tp=2"]),
    ("unknown synthetic task", [*T, "data.source=synthetic:nope"]),
    ("data file missing", [*T, "data.source=$TMP/nope.jsonl", "reward.name=gsm8k"]),
    ("data file with a malformed line", [*T, "data.source=$TMP/bad.jsonl", "reward.name=gsm8k", "data.strict=true"]),
    ("data file empty", [*T, "data.source=$TMP/empty.jsonl", "reward.name=gsm8k"]),
    ("data rows without the prompt field", [*T, "data.source=$TMP/nokey.jsonl", "reward.name=gsm8k"]),
    ("data rows that are not objects", [*T, "data.source=$TMP/notobj.jsonl", "reward.name=gsm8k"]),
    ("template without {prompt}", [*T, "data.template=Q:"]),
    ("template with another field", [*T, "data.template={prompt}{x}"]),
    ("model directory missing", [*T, "model.hf_path=$TMP/nomodel"]),
    ("eval.interval on a data file without eval.data", [*T, "eval.interval=5", "data.source=$TMP/bad.jsonl"]),
    ("eval: trainer TP does not divide the heads", ["eval", "--model", "$TMP/hf", "--data", "synthetic:max", "--train-tp", "3"]),
    ("eval: rollout TP does not divide the heads", ["eval", "--model", "$TMP/hf", "--data", "synthetic:max", "--rollout-tp", "3"]),
    ("eval: model missing", ["eval", "--model", "$TMP/nomodel", "--data", "synthetic:max"]),
    ("eval: data file missing", ["eval", "--model", "$TMP/hf", "--data", "$TMP/nope.jsonl"]),
    ("bench sync: rollout TP does not divide the heads", ["bench", "sync", "--model", "$TMP/hf", "--rollout-tp", "3"]),
    ("train: TP does not divide the heads", [*T, "model.hf_path=$TMP/hf", "parallel.tp=3", "parallel.dp=1", "rollout.tp=3"]),
    ("train: TP does not divide the tiny preset's heads", [*T, "parallel.tp=3"]),
    ("convert: checkpoint missing", ["convert", "inspect", "--ckpt", "$TMP/nockpt"]),
    ("convert: HF dir missing", ["convert", "hf-to-mcore", "--hf", "$TMP/nohf", "--out", "$TMP/o"]),
    ("convert: checkpoint not a checkpoint", ["convert", "mcore-to-hf", "--ckpt", "$TMP", "--out", "$TMP/o2"]),
    ("plan: YAML syntax error", [*P, "--config", "$TMP/bad.yaml"]),
    ("plan: unknown key", [*P, "grpo.nope=1"]),
    ("plan: tp does not divide the GPUs", ["plan", "--nodes", "1", "--gpus-per-node", "3", "parallel.tp=2"]),
    ("plan: missing --nodes", ["plan", "--gpus-per-node", "1"]),
    ("train: packing with megatron's unfused attention", [*T, "model.local_attention=unfused"]),
    ("train: token budget below one sequence", [*T, "grpo.batch.micro_batch_tokens=50"]),
    ("train: token budget neither auto nor >= 0", [*T, "grpo.batch.micro_batch_tokens=-2"]),
    ("plan: token budget not a number", [*P, "grpo.batch.micro_batch_tokens=lots"]),
    ("choice not offered", [*T, "model.kernels.liger=maybe"]),
    ("train: Liger and torch.compile both on", [*T, "model.kernels.liger=on", "model.kernels.compile=on"]),
    ("train: Liger on without a GPU", [*T, "model.kernels.liger=on"]),
    ("train: expert parallelism with a dense model", [*T, "parallel.ep=2", "parallel.dp=2", "rollout.tp=1"]),
    ("train: ep does not divide the experts", [*T, "model.hf_path=tiny-moe", "parallel.ep=3", "parallel.dp=3", "rollout.tp=1", "grpo.batch.prompts_per_step=9"]),
    ("train: ep does not divide dp", [*T, "model.hf_path=tiny-moe", "parallel.ep=2", "parallel.tp=2", "parallel.dp=1", "rollout.tp=1"]),
    ("train: tp > 1 with an MoE model, no sequence parallelism", [*T, "model.hf_path=tiny-moe", "parallel.tp=2", "rollout.tp=1"]),
    ("train: routing replay with a dense model", [*T, "rollout.routing_replay=on"]),
    ("train: routing replay with activation recompute", [*T, "model.hf_path=tiny-moe", "rollout.routing_replay=on", "model.recompute=full"]),
    ("choice not offered", [*T, "rollout.routing_replay=sometimes"]),
    ("train: vLLM expert parallelism with rollout.tp=1", [*T, "model.hf_path=tiny-moe", "rollout.expert_parallel=true"]),
    ("train: vLLM expert parallelism with a dense model", [*T, "rollout.expert_parallel=true", "rollout.tp=2", "parallel.dp=2"]),
    ("train: vLLM expert parallelism without a GPU", [*T, "model.hf_path=tiny-moe", "rollout.expert_parallel=true", "rollout.tp=2", "parallel.dp=2"]),
    ("train: context parallelism with Transformer Engine's attention", [*T, "parallel.cp=2", "model.transformer_impl=transformer_engine"]),
]
# fmt: on

# (what the user did, launcher, argv): "torchrun" is `torchrun --standalone
# --nproc-per-node=2 -m megatron_grpo.cli.main ARGV`; "one process" is `megatron-grpo ARGV`,
# which starts torchrun itself once its checks pass. $TMP/ro is a read-only directory.
# fmt: off
LAUNCHED: list[tuple[str, str, list[str]]] = [
    ("run dir is a file", "torchrun", ["train", "--run-dir", "$TMP/afile"]),
    ("run dir on a read-only filesystem", "torchrun", ["train", "--run-dir", "$TMP/ro/run"]),
    ("data file missing", "torchrun", ["train", "--run-dir", "$TMP/run", "data.source=$TMP/nope.jsonl", "reward.name=gsm8k"]),
    ("run dir on a read-only filesystem", "one process", ["train", "--run-dir", "$TMP/ro/run"]),
]
# fmt: on
# torchrun's own lines (its agent's log, then its failure report) start with a glog prefix:
# "E1125 21:25:35.596000 4797 torch/distributed/elastic/multiprocessing/api.py:1002] ...".
TORCHRUN_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ \S*torch/distributed/")


def _numeric_cases() -> list[tuple[str, list[str]]]:
    """Every numeric config key set out of range: -1 (or 0 where 0 is not allowed)."""
    from megatron_grpo.config.schema import Config

    out = []
    cfg = Config()
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(value):
            continue
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or "seed" in f.name:
                continue  # seeds take any integer
            if f.name == "entropy_coef":
                continue  # a negative coefficient is an entropy penalty, not an error
            out.append(
                (f"{section.name}.{f.name} out of range", [*T, f"{section.name}.{f.name}=-2"])
            )
    out.append(("steps out of range", [*T, "steps=0"]))
    return out


def cases() -> list[tuple[str, list[str]]]:
    return HAND + _numeric_cases()


class Expensive(RuntimeError):
    pass


def _refuse(*a, **k):
    raise Expensive("reached expensive work (ranks, model or engine) before refusing")


def run_case(argv: list[str], tmp: Path) -> tuple[int, list[str]]:
    """(exit code, output lines) of ``megatron-grpo *argv`` with $TMP set to ``tmp``."""
    from megatron_grpo.cli import main as cli_main
    from megatron_grpo.distributed import spawn
    from megatron_grpo.trainer import build

    argv = [a.replace("$TMP", str(tmp)) for a in argv]
    out = io.StringIO()
    saved = build.train, spawn.run_under_torchrun, spawn.spawn_ranks
    build.train, spawn.run_under_torchrun, spawn.spawn_ranks = _refuse, _refuse, _refuse
    cwd = os.getcwd()
    try:
        os.chdir(tmp)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                rc = cli_main.main(argv)
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
            except Expensive as e:
                rc, _ = 99, print(f"UNREFUSED: {e}")
            except Exception as e:  # noqa: BLE001 - recorded: a traceback would be a bug
                rc, _ = 98, print(f"Traceback: {type(e).__name__}: {e}")
    finally:
        os.chdir(cwd)
        build.train, spawn.run_under_torchrun, spawn.spawn_ranks = saved
    lines = [x.replace(str(tmp), "$TMP") for x in out.getvalue().splitlines() if x.strip()]
    return rc, lines


def make_files(tmp: Path) -> None:
    from megatron_grpo.models.tiny import build_hf_model

    for name, text in FILES.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(text)
    build_hf_model(tmp / "hf", "tiny", with_tokenizer=True)  # 4 heads, 2 KV heads


def table(results: list[tuple[str, list[str], int, list[str]]]) -> str:
    rows = [
        "# Bad inputs and the one line each gets",
        "",
        "Generated by `python -m tests.bad_inputs` (tests/cli/test_bad_inputs.py checks it is",
        "current): each input is refused before any model is built or engine started, with one",
        "line, exit status 2, no traceback. `$TMP` is a scratch directory; `train` cases run with",
        "`--verbose --run-dir $TMP/run` unless shown otherwise.",
        "",
        "| # | input | command | exit | what it prints |",
        "|---|---|---|---|---|",
    ]
    for i, (what, argv, rc, lines) in enumerate(results, 1):
        shown = " ".join(a for a in argv if a not in T[1:] or argv[:4] != T)
        line = " / ".join(lines).replace("|", "\\|")
        shown = shown.replace("|", "\\|")
        rows.append(f"| {i} | {what} | `{shown}` | {rc} | {line} |")
    return "\n".join(rows) + "\n"


def run_all(tmp: Path) -> list[tuple[str, list[str], int, list[str]]]:
    make_files(tmp)
    return [(what, argv, *run_case(argv, tmp)) for what, argv in cases()]


@contextlib.contextmanager
def read_only_dir(path: Path):
    """``path``, an empty directory nothing here can write into: mode 0o555 for a user, a
    read-only tmpfs mount for root (whom modes do not stop). Raises OSError or
    CalledProcessError where neither is possible (root without the right to mount)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    mount = ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)]
    subprocess.run(mount, check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True, capture_output=True)


def launch_argv(launcher: str, argv: list[str]) -> list[str]:
    from megatron_grpo.distributed.spawn import torchrun_argv

    if launcher == "torchrun":
        return torchrun_argv(2, *argv)
    return [sys.executable, "-m", "megatron_grpo.cli.main", *argv]


def snapshot(tmp: Path) -> dict[str, tuple[int, int] | None]:
    """Every path under ``tmp``: (size, mtime) of a file, None for a directory."""
    out: dict[str, tuple[int, int] | None] = {}
    for d, dirs, files in os.walk(tmp):
        for name in dirs:
            out[os.path.relpath(os.path.join(d, name), tmp)] = None
        for name in files:
            st = os.stat(os.path.join(d, name))
            out[os.path.relpath(os.path.join(d, name), tmp)] = (st.st_size, st.st_mtime_ns)
    return out


def delay_env(env: dict[str, str], delays: dict[int, float]) -> dict[str, str]:
    """``env`` with the test-only hook tests/rank_delay_site on PYTHONPATH, delaying global
    rank r's checks by ``delays[r]`` seconds (its docstring says how)."""
    path = [str(DELAY_SITE), str(ROOT), env.get("PYTHONPATH")]
    spec = ",".join(f"{r}:{s}" for r, s in delays.items())
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, path)), DELAY_VAR: spec}


def exit_codes(report: list[str]) -> tuple[dict[int, int], int | None]:
    """From torchrun's failure report: {global rank: exit code} of every rank it lists, and
    the rank of its root cause (the first failure it saw; None without a report)."""
    text = "\n".join(report)
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank.*\n\s*exitcode\s*:\s*(-?\d+)", text)
    codes = {int(r): int(c) for r, c in found}
    root = re.search(r"Root Cause.*\n(?:.*\n)*?\s*rank\s*:\s*(\d+)", text)
    return codes, int(root.group(1)) if root else None


def run_launched(
    launcher: str, argv: list[str], tmp: Path, timeout: int = 240, delays: dict | None = None
) -> tuple[int, list[str], list[str]]:
    """(exit code of the launcher, the lines the ranks print, torchrun's lines after them)
    of ``argv`` launched by ``launcher`` in a subprocess, in ``tmp`` ($TMP); ``delays``:
    seconds each global rank's checks are held back (:func:`delay_env`)."""
    argv = [a.replace("$TMP", str(tmp)) for a in argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if delays:
        env = delay_env(env, delays)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a launch from a shell, not from inside another job
    # Output to a file, not a pipe: a process left holding a pipe would block the reader.
    log = tmp.parent / f"{tmp.name}.launch.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(launch_argv(launcher, argv), cwd=tmp, env=env, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:  # not refused: it went on to train; stop what it started
                os.killpg(proc.pid, 9)
                proc.wait()
    lines = [x.replace(str(tmp), "$TMP") for x in log.read_text().splitlines() if x.strip()]
    log.unlink()
    cut = next((i for i, x in enumerate(lines) if TORCHRUN_LINE.match(x)), len(lines))
    return proc.returncode, lines[:cut], lines[cut:]


def run_all_launched(tmp: Path) -> list[tuple[str, str, list[str], int, list[str], list[str]]]:
    """Each ``LAUNCHED`` case: (what, launcher, argv, exit, ranks' lines, torchrun's lines).
    Needs ``make_files(tmp)`` and ``$TMP/ro`` made read-only (``read_only_dir``)."""
    return [
        (
            w,
            how,
            argv,
            *run_launched(how, argv, tmp, delays=RANK0_LATE if how == "torchrun" else None),
        )
        for w, how, argv in LAUNCHED
    ]


def launched_table(results: list[tuple[str, str, list[str], int, list[str], list[str]]]) -> str:
    rows = [
        LAUNCHED_HEADING,
        "",
        "The same, in a subprocess the way a run is started: under torchrun with two ranks",
        "(`torchrun --standalone --nproc-per-node=2 -m megatron_grpo.cli.main ...`), each rank",
        "its own process, or `train` as one process, which starts torchrun itself once its",
        "checks pass. Under torchrun rank 0's checks are held back a second (rank 1 refuses",
        "first); every rank makes every check, rank 0 prints the line, every rank exits 2",
        "(above), torchrun's failure report follows (not shown) and torchrun exits 1; no rank",
        "prints a traceback, and nothing under `$TMP` is created or changed. `$TMP/ro` is a",
        "read-only directory.",
        "",
        "| # | input | launch | command | exit | what the ranks print |",
        "|---|---|---|---|---|---|",
    ]
    for i, (what, how, argv, rc, lines, _) in enumerate(results, 1):
        line = " / ".join(lines).replace("|", "\\|")
        shown = " ".join(argv).replace("|", "\\|")
        rows.append(f"| {i} | {what} | {how} | `{shown}` | {rc} | {line} |")
    return "\n".join(rows) + "\n"


def document(results: list, launched: list) -> str:
    """docs/errors.md: the in-process table, the hand-written sections between the two
    tables (kept as docs/errors.md has them), then the launched table."""
    old = DOC.read_text() if DOC.is_file() else ""
    start, end = old.find("\n## "), old.find("\n" + LAUNCHED_HEADING)
    notes = old[start + 1 : end + 1] if 0 <= start < end else ""
    return table(results) + "\n" + notes + launched_table(launched)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        results = run_all(Path(d))
        with read_only_dir(Path(d) / "ro"):
            launched = run_all_launched(Path(d))
    DOC.write_text(document(results, launched))
    bad = [r for r in results if r[2] != 2 or len(r[3]) != 1]
    bad += [r for r in launched if len(r[4]) != 1]
    print(f"{len(results) + len(launched)} inputs, {len(bad)} not one line -> {DOC}")
    for r in bad:
        print(json.dumps(r))
    sys.exit(1 if bad else 0)
