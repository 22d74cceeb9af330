"""tspd core: the per-rank PD transfer peer, its layout planner, request scheduler and token feed.

Dependency direction (kept one-way): ``layout`` and ``sched`` import numpy only, so the
simulator stays light; ``pd`` and ``epd`` build on them plus Mooncake, ZMQ and torch.
"""

__version__ = "0.1.0"
