"""tspd's reference engine: a small Llama-style decoder over a paged KV arena, tensor parallel
across rank processes, driven by tspd_core's request scheduler and device token feed.

See docs/engine.md. The front doors: ``tspd_engine.loop.engine.Engine`` (one rank,
in-process), ``tspd_engine.rank.launch.launch`` -> ``EngineHandle`` with an ``EngineClient``
(``tspd_engine.rank.client``: rank processes), ``tspd_engine.node.run.run_node`` (a serving
node) and ``tspd-engine {generate,serve}`` (``python -m tspd_engine``). This file imports
nothing: a process that needs one light module (the launcher parsing its flags) does not pay
for torch's import.
"""
