"""Integrations with sampling stacks, one folder per framework: transformers/, trl/, vllm_support/ (the vLLM
plugin and the CPU colocate workaround), verl/. Each imports its framework only when imported itself
(`mask_replay.integrations.transformers` needs `pip install 'mask-replay[hf]'`)."""
