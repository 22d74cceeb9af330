"""The model: a Llama-style decoder in torch over a paged KV arena, tensor parallel.

Its config and tokenizer, weights (seeded or from a checkpoint) cut into TP shards, RoPE,
paged attention, the forward (``llama``), the dense reference the tests compare against, the
TP math and group, one rank's KV arena, and the build of a rank's shard.
"""
