"""The block pool (native: ``_pool.pyx``) and the page-id types every scheduler call uses.

Pages are numbered ``1 .. num_pages`` (the arena's page ids, wire.md §4/§5); page 0 is the null
page, is never handed out and never counted. See :class:`BlockPool` for ownership and checks.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from tspd_core.sched._pool import BlockPool

#: Page ids travel as int32 everywhere (page tables, manifests, backend block tables).
PAGE_DTYPE = np.int32
PageArray = NDArray[np.int32]

__all__ = ["PAGE_DTYPE", "BlockPool", "PageArray"]
