"""Worker-process plumbing shared by PD's transfer workers and EPD's encode workers: ``handle``
(the engine's end of a worker process), ``loop`` (the worker's control thread), ``control`` (the
ZMQ control plane) and ``logs`` (worker logs routed into the engine process)."""
