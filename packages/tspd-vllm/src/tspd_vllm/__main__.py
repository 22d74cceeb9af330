"""``python -m tspd_vllm``: the same as the ``tspd-vllm`` command."""

import sys

from tspd_vllm.cli import main

sys.exit(main())
