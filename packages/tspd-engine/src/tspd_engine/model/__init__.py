"""The model: a Llama-style decoder in torch over a paged KV arena, tensor parallel.

Its config (from ``config.json`` or a GGUF file: ``source``), weights (seeded, from a
safetensors checkpoint or a GGUF file) cut into TP shards, RoPE, paged attention, the forward
(``llama``), the dense reference the tests compare against, the TP math and group, one rank's
KV arena, and the build of a rank's shard. The tokenizers and chat templates are
tspd_serving's (the router uses them without torch).
"""
