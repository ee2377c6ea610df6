"""A command imports what it needs (issue 39): ``import lightning_scale``, ``lightning-scale-plan`` and
``lightning-scale-ckpt`` import no Lightning (seconds: torchmetrics, and transformers through it), yet
``Trainer(strategy="hybrid")`` works once both are imported, in either order and from any module of the
package (lightning_scale/_strategy_registration.py). Each check runs in a fresh interpreter: what a
process has imported is the point."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("lightning", "torchmetrics", "transformers", "matplotlib")
REGISTERED = """
from lightning.pytorch.strategies import StrategyRegistry
assert {"hybrid", "pipeline", "tensor_parallel"} <= set(StrategyRegistry), sorted(StrategyRegistry)
assert "lightning_scale.strategies" in sys.modules  # registered by the package, not by the import below
from lightning_scale.strategies import HybridParallelStrategy
assert StrategyRegistry["hybrid"]["strategy"] is HybridParallelStrategy
assert "lightning_scale.integrations.huggingface" in sys.modules  # the Hugging Face plans, registered beside them
assert not [f for f in sys.meta_path if type(f).__name__ == "_RegisterWhenLightningLoads"]  # the finder is gone
"""


def _python(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_planner_and_checkpoint_commands_import_no_lightning_then_lightning_gets_the_strategies() -> None:
    _python(
        "import sys\n"
        "import lightning_scale.cli.ckpt, lightning_scale.cli.plan\n"
        "from lightning_scale.models import GPTConfig, PRESETS\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not heavy, f'imported {heavy}'\n"
        "import lightning\n" + REGISTERED
    )


@pytest.mark.parametrize(
    "first",
    [
        # Lightning first imported inside a module the strategies import from (half run when it loads).
        "from lightning_scale.plugins import MixedPrecision",
        "from lightning_scale.models import GPTLightningModule",
    ],
)
def test_the_strategies_register_when_a_module_of_the_package_imports_lightning_first(first: str) -> None:
    _python(f"import sys\n{first}\n" + REGISTERED)
