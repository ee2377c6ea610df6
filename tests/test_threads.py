"""The strategy's processes share the host's cores (issue 39): with ``OMP_NUM_THREADS`` unset, every rank
runs ``cores // processes`` intra-op threads, not torch's one-per-core default; a user's choice stands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_scale.core.parallel.threads import cores_available, share_cores

# A user's script, re-run per rank by Lightning's launcher; each rank records its threads after fit.
SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from lightning.pytorch import Trainer
    from lightning_scale.models import GPTConfig, GPTLightningModule
    from lightning_scale.strategies import HybridParallelStrategy
    from torch.utils.data import DataLoader, TensorDataset

    if sys.argv[2] != "-":
        torch.set_num_threads(int(sys.argv[2]))  # the user's own choice, in the script
    config = GPTConfig(vocab_size=32, block_size=8, n_layers=1, n_heads=2, d_model=8)
    module = GPTLightningModule(config)
    tokens = torch.randint(0, 32, (8, 9))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=HybridParallelStrategy(2, hang_timeout=0), max_steps=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, data)
    out = os.path.join(sys.argv[1], f"rank{trainer.global_rank}.json")
    with open(out, "w") as f:
        json.dump({"threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}, f)
    """
)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    return {**env, **extra}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("user_threads", [None, 3], ids=["unset", "set_num_threads"])
def test_every_rank_shares_the_cores_unless_the_user_chose(tmp_path: Path, user_threads: int | None) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(user_threads or "-")],
        env=_clean_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    if user_threads is None:
        # Both ranks, the launched child included (Lightning's launcher sets only its own process).
        expected = max(1, cores_available() // 2)
        assert [r["threads"] for r in ranks] == [expected, expected], ranks
        assert [r["omp"] for r in ranks] == [str(expected)] * 2
    else:
        assert [r["threads"] for r in ranks] == [user_threads, user_threads], ranks


def _in_fresh_process(code: str, **env: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], env=_clean_env(**env), capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_share_cores_leaves_an_exported_omp_num_threads_alone() -> None:
    code = (
        "import torch; from lightning_scale.core.parallel.threads import share_cores; "
        "print(share_cores(64), torch.get_num_threads())"
    )
    before = _in_fresh_process("import torch; print(torch.get_num_threads())", OMP_NUM_THREADS="2")
    assert _in_fresh_process(code, OMP_NUM_THREADS="2") == f"None {before}"
    # Unset: at least one thread each, even with more processes than cores.
    assert _in_fresh_process(code) == "1 1"


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_share_cores_rejects_a_process_count_that_is_not_a_positive_integer(bad: object) -> None:
    with pytest.raises(ValueError, match=r"processes_per_host=.*must be a positive integer"):
        share_cores(bad)  # type: ignore[arg-type]
