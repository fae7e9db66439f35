"""Prompt data: datasets, synthetic tasks, templates, resumable shuffling."""

from megatron_grpo.data.prompts import LoadReport, Prompt, PromptSource, build_prompt_source

__all__ = ["LoadReport", "Prompt", "PromptSource", "build_prompt_source"]
