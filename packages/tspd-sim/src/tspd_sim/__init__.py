"""tspd simulator: trace replay against tspd's own scheduler and layout planner."""

__version__ = "0.1.0"
