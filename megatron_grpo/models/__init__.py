"""HF config -> ModelSpec -> megatron-core GPTModel; tiny model and tokenizer builders."""
