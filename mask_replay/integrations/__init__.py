"""Integrations with sampling stacks; each submodule imports its framework only when imported itself
(`mask_replay.integrations.transformers` needs `pip install 'mask-replay[hf]'`)."""
