"""tspd core: the per-rank PD transfer peer, its layout planner, request scheduler and token feed.

Dependency direction (kept one-way): ``layout`` and ``sched`` import numpy only, so the
simulator and the router stay light; ``pd``, ``epd`` and ``feed`` build on them plus Mooncake,
ZMQ and torch, which only the ``tspd-core[pd]`` extra installs.
"""

__version__ = "0.1.0"
