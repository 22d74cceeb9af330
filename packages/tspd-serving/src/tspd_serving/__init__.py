"""What serving a model needs without running it, shared by the router and the engine (no
torch, no other tspd package): ``tokenizer`` (the interface and the seeded model's byte
tokenizer), ``hf_tokenizer`` (a real model's, from ``tokenizer.json`` or a GGUF vocabulary:
``gguf_vocab`` over ``gguf_file``'s metadata reader), ``chat_template`` (sandboxed Jinja),
``models`` (``--model DIR | FILE.gguf | NAME``), ``http`` (an HTTP server's limits and body
reader), ``cliargs`` (the flags every serving program shares) and ``errors``."""
