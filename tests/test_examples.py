"""Every script in examples/ runs as its docstring says, on CPU at tiny sizes, and stays short.

Each Python example starts its processes through Lightning's launcher, exactly as a user runs it
(``python examples/x.py --tp 2 --pp 2``); the sweep example runs the CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RUN_HERE = {
    "own_model_3d.py",
    "huggingface_llama.py",
    "resume_at_another_layout.py",
    "sweep_and_report.sh",
    "train_gpt.py",
}
"""The examples this module runs; a new example must be added (and run) here."""


def _env() -> dict[str, str]:
    # The CLI entry points live beside this interpreter (a virtual environment need not be activated).
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "OMP_NUM_THREADS": "1", "PATH": path}


def _run(*command: str, cwd: Path, timeout: float = 420) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(command), cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout, check=False
    )


def _out(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout[-4000:] + "\n" + proc.stderr[-4000:]


def _python(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return _run(sys.executable, str(EXAMPLES / script), *args, cwd=cwd)


def _losses(stdout: str, max_steps: int) -> list[float]:
    return [float(x) for x in re.findall(rf"step \d+/{max_steps} \| train/loss ([\d.]+)", stdout)]


def test_every_example_is_short_says_how_to_launch_it_and_is_run_here() -> None:
    scripts = {p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".sh")}
    assert scripts == RUN_HERE, f"run every example in tests/test_examples.py: {sorted(scripts ^ RUN_HERE)}"
    for name in sorted(scripts):
        text = (EXAMPLES / name).read_text()
        assert len(text.splitlines()) < 300, f"{name} has {len(text.splitlines())} lines; examples stay under 300"
        head = text[: text.find('"""', 3) if name.endswith(".py") else text.find("\nset ")]
        assert f"examples/{name}" in head, f"{name}'s docstring (or header comment) must show how to launch it"


@pytest.mark.slow
def test_own_model_trains_at_tensor_and_pipeline_parallel(tmp_path: Path) -> None:
    proc = _python("own_model_3d.py", "--tp", "2", "--pp", "2", "--max-steps", "6", cwd=tmp_path)
    assert proc.returncode == 0, _out(proc)
    assert "HybridParallelStrategy: dp=1 x pp=2 x tp=2 on 4 processes" in proc.stdout + proc.stderr, _out(proc)
    losses = _losses(proc.stdout, 6)
    assert len(losses) == 6 and losses[-1] < losses[0], _out(proc)
    assert re.search(r"validation at step 6 \| val/loss [\d.]+", proc.stdout), _out(proc)


@pytest.mark.slow
def test_hugging_face_llama_trains_with_no_hook(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    proc = _python("huggingface_llama.py", "--tp", "2", "--pp", "2", "--max-steps", "6", cwd=tmp_path)
    assert proc.returncode == 0, _out(proc)
    assert "HybridParallelStrategy: dp=1 x pp=2 x tp=2 on 4 processes" in proc.stdout + proc.stderr, _out(proc)
    assert "already shifted" in proc.stdout + proc.stderr, _out(proc)  # the pipeline read the batch convention
    losses = _losses(proc.stdout, 6)
    assert len(losses) == 6 and losses[-1] < losses[0], _out(proc)


@pytest.mark.slow
def test_a_run_resumes_at_another_layout(tmp_path: Path) -> None:
    first = _python("resume_at_another_layout.py", "--dp", "2", "--max-steps", "4", "--save-every", "2", cwd=tmp_path)
    assert first.returncode == 0, _out(first)
    assert "training at dp=2 tp=1 pp=1 from step 0 to 4" in first.stdout + first.stderr, _out(first)
    second = _python("resume_at_another_layout.py", "--pp", "2", "--max-steps", "6", "--save-every", "2", cwd=tmp_path)
    assert second.returncode == 0, _out(second)
    assert "training at dp=1 tp=1 pp=2 from step 4 to 6" in second.stdout + second.stderr, _out(second)
    assert len(_losses(second.stdout, 6)) == 2, _out(second)  # steps 5 and 6, not from scratch
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "last.ckpt").resolve().name == "epoch=0-step=6.ckpt"  # save_last="link"
    manifests = {
        p.parent.name: json.loads(p.read_text()) for p in ckpt.glob("*/manifest.json") if not p.parent.is_symlink()
    }
    saved = {name: (m["global_step"], m["layout"]["dp"], m["layout"]["pp"]) for name, m in manifests.items()}
    assert saved == {"epoch=0-step=4.ckpt": (4, 2, 1), "epoch=0-step=6.ckpt": (6, 1, 2)}, saved  # keep_last=2


@pytest.mark.slow
def test_a_sweep_and_its_report(tmp_path: Path) -> None:
    # One process per job (the cheapest sweep that still has a layout to skip); the script passes the
    # overrides to every job.
    overrides = [
        "trainer.devices=1",
        "strategy.tensor_parallel=1,2",
        "strategy.pipeline_parallel=1",
        "trainer.max_steps=4",
        "trainer.log_every_n_steps=2",
        "trainer.limit_val_batches=1",
        "callbacks.checkpoint=null",
        "logger=csv",
    ]
    proc = _run("bash", str(EXAMPLES / "sweep_and_report.sh"), *overrides, cwd=tmp_path)
    assert proc.returncode == 0, _out(proc)
    study = tmp_path / "multirun" / "layouts"
    summary = json.loads((study / "sweep.json").read_text())
    assert summary["counts"] == {"completed": 1, "skipped": 1, "failed": 0}, (summary, _out(proc))
    report = (study / "report" / "report.md").read_text()
    assert "| 1 | #0 dp1-tp1-pp1 |" in report and "**skipped**" in report, report[:3000]
    assert (study / "report" / "report.html").is_file() and (
        study / "report" / "conf" / "strategy" / "best.yaml"
    ).is_file()
    assert "the ranking: multirun/layouts/report/report.md" in proc.stdout


def test_train_gpt_runs(tmp_path: Path) -> None:
    proc = _python("train_gpt.py", "--devices", "1", "--max-steps", "4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"step 4/4 \| train/loss [\d.]+", proc.stdout)
