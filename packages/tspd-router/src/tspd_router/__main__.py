"""``python -m tspd_router``: the same as the ``tspd-router`` command."""

from tspd_router.cli import main

raise SystemExit(main())
