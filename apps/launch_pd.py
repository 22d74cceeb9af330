#!/usr/bin/env python3
"""tspd's launcher from a checkout: ``python apps/launch_pd.py ROLE ...`` is ``tspd-launch
ROLE ...`` (:mod:`tspd_launch.cli`), named ``launch_pd.py`` in its messages and manual, and
starting its children (``local``'s roles, the demo's ``local``) through this same file."""

from __future__ import annotations

import sys
from pathlib import Path

from tspd_launch import cli

ENTRY = cli.Entry("launch_pd.py", "python apps/launch_pd.py",
                  (sys.executable, str(Path(__file__).resolve())))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, ENTRY)


if __name__ == "__main__":
    raise SystemExit(cli.finish(main()))
