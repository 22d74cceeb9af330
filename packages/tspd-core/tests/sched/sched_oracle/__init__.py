"""The scheduler's numpy model, the tests' oracle: the native scheduler (``tspd_core.sched``)
must hand out the same pages in the same order, with the same hits, evictions and free-stack
order, call for call (``test_twins.py``, ``test_stateful.py``).

It was the package's own implementation until the rules moved into one native one; it stays
readable numpy, unoptimised where that is clearer, and is never imported by the package.
"""

from sched_oracle.pool import BlockPool
from sched_oracle.prefix import PrefixKvStore
from sched_oracle.scheduler import RequestScheduler

__all__ = ["BlockPool", "PrefixKvStore", "RequestScheduler"]
