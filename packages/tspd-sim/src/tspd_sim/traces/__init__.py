"""Request traces: the Trace container, loaders (Mooncake, Azure, bundled) and synthetic ones."""

from tspd_sim.traces.loaders import BUNDLED, load_trace, parse_azure, parse_mooncake
from tspd_sim.traces.synthetic import LengthDist, parse_length, synthetic
from tspd_sim.traces.trace import MOONCAKE_BLOCK_TOKENS, Trace

__all__ = [
    "BUNDLED",
    "MOONCAKE_BLOCK_TOKENS",
    "LengthDist",
    "Trace",
    "load_trace",
    "parse_azure",
    "parse_length",
    "parse_mooncake",
    "synthetic",
]
