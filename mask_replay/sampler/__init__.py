"""The sampler side: everything that produces a mask.

capture.py (the capture ops' Python API), profiles/ (an engine's own support recomputed from saved
logits), adapters/ (masks read from vLLM and SGLang responses, padded layouts).
"""
