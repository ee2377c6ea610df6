"""The oldest torch lightning-scale works with, checked at import (before anything needs it)."""

from __future__ import annotations

import re

__all__ = ["MIN_TORCH", "check_torch_version"]

MIN_TORCH = (2, 13)
"""Must equal the floor of ``torch`` in pyproject.toml (a test checks). 2.13 is the release the
package is built and tested against; the pipeline code also relies on schedules (DualPipeV) of that
release. Every private torch API used is in :mod:`lightning_scale.core.compat`, whose canaries
(``tests/test_compat.py``) set the ceiling in pyproject.toml."""


def check_torch_version(version: str) -> None:
    """Raise ``ImportError`` naming the fix if torch ``version`` is older than :data:`MIN_TORCH`."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) < MIN_TORCH:
        floor = ".".join(map(str, MIN_TORCH))
        raise ImportError(
            f"lightning-scale needs torch>={floor}, but torch {version} is installed. Install a newer torch "
            f"(`pip install 'torch>={floor}'`, on CPU `pip install -c constraints.txt .` from the checkout)."
        )
