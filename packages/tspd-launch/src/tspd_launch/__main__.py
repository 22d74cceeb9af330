"""``python -m tspd_launch``: the same as the ``tspd-launch`` command."""

from tspd_launch.cli import console

raise SystemExit(console())
