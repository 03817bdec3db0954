"""On-disk formats, read and written with bounded memory.

dumps.py (logit dumps: safetensors, .npz, .pt), mask_file.py (mask files: the chunked reader and the
streaming writer), safetensors_stream.py (the one safetensors writer of the project, header parsing,
row reads), safe_output.py (atomic outputs that never replace an input), engine_json.py (saved engine
responses), padded_file.py (the fixed-width [N, W] layout on disk).
"""
