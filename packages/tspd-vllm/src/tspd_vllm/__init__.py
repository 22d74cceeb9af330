"""tspd inside vLLM (see docs/vllm.md)."""
