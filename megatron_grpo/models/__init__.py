"""HF config -> ModelSpec; the tiny model and tokenizer builders; the run's HF model directory."""
