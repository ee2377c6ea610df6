"""The README's quickstart stays true: CI runs its test command, the example runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_quickstart_has_exactly_the_two_commands_and_ci_runs_the_test_one() -> None:
    quickstart = _bash_blocks()[:2]
    install_and_run, run_tests = (block.strip() for block in quickstart)
    assert "\n" not in install_and_run and install_and_run.endswith("lightning-scale-train")
    assert "\n" not in run_tests and run_tests.endswith("python -m pytest")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert run_tests in ci, ".ci/run must run the README's test command verbatim"
    assert "constraints.txt" in install_and_run and "constraints.txt" in run_tests


def test_constraints_pin_the_cpu_torch_build() -> None:
    lines = [l.strip() for l in (ROOT / "constraints.txt").read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert lines == ["torch==2.13.0"]


def test_example_runs(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--devices", "1", "--max-steps", "4"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"step 4/4 \| train/loss [\d.]+", proc.stdout)
