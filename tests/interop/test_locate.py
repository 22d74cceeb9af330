"""Where the interop tests find TokenSpeed's runtime: the fixture beside the repository, or
the ``python/`` folder ``TSPD_TOKENSPEED_PYTHON`` names; the skip message says how to point
them at a checkout when neither holds it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tspd_testing.interop import env as tokenspeed_env


def _missing(env_value: str | None) -> str:
    """``tokenspeed_env.MISSING`` as a fresh interpreter sees it with the variable given."""
    env = {k: v for k, v in os.environ.items() if k != tokenspeed_env.ENV_VAR}
    if env_value is not None:
        env[tokenspeed_env.ENV_VAR] = env_value
    code = "from tspd_testing.interop import env; print(env.MISSING)"
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip()


def test_a_folder_without_tokenspeed_is_refused_with_the_way_to_fix_it(tmp_path: Path) -> None:
    message = _missing(str(tmp_path))
    assert message == (
        f"TokenSpeed's runtime not found (TSPD_TOKENSPEED_PYTHON={tmp_path} has no "
        "tokenspeed/runtime/pd/cache_protocol.py): set TSPD_TOKENSPEED_PYTHON to the python/ "
        "folder of a TokenSpeed checkout at commit f4d8ec6e039c (lightseekorg/tokenspeed)"
    )


def test_the_variable_names_a_checkout_outside_the_fixture_layout(tmp_path: Path) -> None:
    if tokenspeed_env.MISSING:
        pytest.skip(tokenspeed_env.MISSING)
    # A checkout somewhere else: a link to the runtime this run found.
    (tmp_path / "python").symlink_to(tokenspeed_env.PYTHON, target_is_directory=True)
    assert _missing(str(tmp_path / "python")) == "None"
    # The variable wins over the fixture: a wrong folder is refused even with the fixture there.
    assert _missing(str(tmp_path)).startswith("TokenSpeed's runtime not found")
