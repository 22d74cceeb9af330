"""``python -m tspd_bootstrap``: the same as the ``tspd-bootstrap`` command."""

from tspd_bootstrap.cli import main

raise SystemExit(main())
