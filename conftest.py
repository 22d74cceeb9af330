"""Suite-wide test settings (every package's tests and the cross-package ones)."""

from __future__ import annotations

from hypothesis import settings

# Hypothesis's default 200 ms deadline per example is a timing assertion: on a loaded 2-core CI
# machine a correct example can take longer and fail the run. No property test here is about
# speed (benchmarks are), so the suite turns the deadline off; print_blob lets a failure be
# replayed exactly with @reproduce_failure.
settings.register_profile("tspd", deadline=None, print_blob=True)
settings.load_profile("tspd")
