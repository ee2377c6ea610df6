"""Elastic world size (issue 27): the data position in samples, gradient accumulation derived from the
micro-batch so the global batch and the optimizer's gradient stay those of any other data-parallel size,
and the acceptance run: two torchrun agents, one lost and back, final parameters equal to a run at world 4
throughout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.distributed import run_distributed
from helpers.lightning import quiet_trainer
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_scale.callbacks.loader_progress import LoaderBatchProgress
from lightning_scale.core.parallel.layout import Layout, resolve_layout
from lightning_scale.core.resilience import check_launched_world, launched_sizes, read_ledger, summarize
from lightning_scale.data import DataParallelSampler, TextDataModule
from lightning_scale.data.sampler import accumulation_steps
from lightning_scale.models import GPTConfig, GPTLightningModule
from lightning_scale.strategies import HybridParallelStrategy

CONFIG = GPTConfig(n_layers=2, d_model=32, n_heads=2, block_size=16, tie_embeddings=True)
GLOBAL_BATCH = 8


# ---------------------------------------------------------------- the sampler: positions in samples


def _loader_batches(sampler: DataParallelSampler, n: int | None = None) -> list[list[int]]:
    loader = DataLoader(list(range(sampler.num_samples_total)), batch_size=sampler.local_batch_size, sampler=sampler)
    batches = [b.tolist() for b in loader]
    return batches if n is None else batches[:n]


def _global_batches(dp_size: int, micro: int | None, samples: int = 103) -> list[list[int]]:
    """Each optimizer step's samples: the union, in rank order, of its loader batches over every rank."""
    ranks = [
        _loader_batches(
            DataParallelSampler(
                samples, global_batch_size=8, dp_rank=r, dp_size=dp_size, micro_batch_size=micro, seed=7
            )
        )
        for r in range(dp_size)
    ]
    steps = accumulation_steps(8, dp_size, micro)
    per_loader_batch = [sum((ranks[r][b] for r in range(dp_size)), []) for b in range(len(ranks[0]))]
    return [sum(per_loader_batch[s * steps : (s + 1) * steps], []) for s in range(len(per_loader_batch) // steps)]


def test_every_data_parallel_and_micro_batch_size_reads_the_same_global_batches_in_the_same_order() -> None:
    reference = _global_batches(1, None)
    assert len(reference) == 12 and all(len(b) == 8 for b in reference)  # 103 // 8; the partial batch dropped
    for dp_size, micro, accumulation in [(1, 2, 4), (2, 2, 2), (2, 4, 1), (4, 1, 2), (4, 2, 1), (8, 1, 1)]:
        sampler = DataParallelSampler(103, global_batch_size=8, dp_size=dp_size, micro_batch_size=micro, seed=7)
        assert sampler.accumulation == accumulation and sampler.loader_batch_size == dp_size * micro
        assert len(sampler) == 12 * accumulation * micro  # whole global batches only, at every size
        assert _global_batches(dp_size, micro) == reference, (dp_size, micro)


def test_a_position_saved_at_one_loader_batch_resumes_at_another_on_the_same_sample() -> None:
    uninterrupted = _global_batches(1, None)
    saver = DataParallelSampler(103, global_batch_size=8, dp_size=4, micro_batch_size=2, seed=7)  # loader batch 8
    saver.set_epoch(0)
    state = saver.state_dict(consumed_batches=3)
    assert state["consumed_samples"] == 24 and state["loader_batch_size"] == 8
    rest = []
    for rank in range(2):
        s = DataParallelSampler(103, global_batch_size=8, dp_rank=rank, dp_size=2, micro_batch_size=2, seed=7)
        s.load_state_dict(state)
        rest.append(_loader_batches(s))  # loader batches of 4 samples from sample 24 on
    merged = [a + b for a, b in zip(*rest, strict=True)]
    assert [merged[i] + merged[i + 1] for i in range(0, len(merged), 2)] == uninterrupted[3:]
    # A state from before positions were counted in samples (next_batch in global batches) still resumes.
    old = {k: v for k, v in state.items() if k not in ("consumed_samples", "loader_batch_size")} | {"next_batch": 3}
    s = DataParallelSampler(103, global_batch_size=8, dp_size=2, micro_batch_size=2, seed=7)
    s.load_state_dict(old)
    assert next(iter(s)) == uninterrupted[3][0]


def test_a_position_inside_an_accumulation_window_is_refused_where_it_is_no_whole_loader_batch() -> None:
    state = DataParallelSampler(103, global_batch_size=8, dp_size=2, micro_batch_size=2).state_dict(consumed_batches=3)
    assert state["consumed_samples"] == 12
    with pytest.raises(
        ValueError,
        match=r"at 12 consumed samples of epoch 0: that is not a whole number of this run's "
        r"loader batches of 8 samples \(4 data-parallel ranks x 2\).*Resume from a "
        r"checkpoint saved at an optimizer step",
    ):
        DataParallelSampler(103, global_batch_size=8, dp_size=4, micro_batch_size=2).load_state_dict(state)
    with pytest.raises(
        ValueError, match=r"saved global_batch_size=8 differs from this run's 16.*micro-batch size may change"
    ):
        DataParallelSampler(103, global_batch_size=16, dp_size=2).load_state_dict(state)


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        (
            (8, 2, 3),
            r"global_batch_size=8 over 2 data-parallel ranks is 4 samples per rank and optimizer step, not a whole "
            r"number of micro-batches of micro_batch_size=3.*Use a micro_batch_size among \[1, 2, 4\], or a "
            r"global_batch_size that is a multiple of 6",
        ),
        ((8, 2, 8), r"4 samples per rank.*micro_batch_size=8"),
        ((8, 1, 0), r"micro_batch_size must be a positive integer or None, got 0"),
        ((8, 3, 1), r"global_batch_size=8 does not split evenly over 3 data-parallel ranks"),
    ],
)
def test_accumulation_that_does_not_divide_is_refused_naming_the_fix(sizes: tuple[int, int, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        accumulation_steps(*sizes)
    if sizes[1] == 1:
        with pytest.raises(ValueError, match=match):
            TextDataModule(global_batch_size=sizes[0], micro_batch_size=sizes[2])


def test_the_fit_loop_position_is_recounted_in_this_runs_loader_batches_or_refused() -> None:
    def checkpoint(ready: int, loader_batch: int) -> dict[str, Any]:
        # Saved in on_train_batch_end: that batch is ready, started and processed, not yet completed.
        counts = {"ready": ready, "started": ready, "processed": ready, "completed": ready - 1}
        loader = {
            "epoch": 0,
            "consumed_samples": ready * loader_batch,
            "loader_batch_size": loader_batch,
            "global_batch_size": 8,
        }
        progress = {"total": dict(counts), "current": dict(counts), "is_last_batch": False}
        return {
            "loops": {"fit_loop": {"state_dict": {"combined_loader": [loader]}, "epoch_loop.batch_progress": progress}}
        }

    grown = checkpoint(ready=6, loader_batch=4)  # 3 steps at dp=2, accumulation 2
    LoaderBatchProgress(8).on_load_checkpoint(None, None, grown)  # type: ignore[arg-type]
    current = grown["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
    assert current == {"ready": 3, "started": 3, "processed": 3, "completed": 2}  # the batch in flight stays one
    shrunk = checkpoint(ready=3, loader_batch=8)
    LoaderBatchProgress(2).on_load_checkpoint(None, None, shrunk)  # type: ignore[arg-type]
    assert shrunk["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"] == {
        "ready": 12,
        "started": 12,
        "processed": 12,
        "completed": 11,
    }
    inside = checkpoint(ready=3, loader_batch=4)  # half-way through an accumulation window of 2
    with pytest.raises(
        ValueError,
        match=r"stands at 3 loader batches of 4 samples \(total\), 12 samples: not a whole "
        r"number of this run's loader batches of 8 samples",
    ):
        LoaderBatchProgress(8).on_load_checkpoint(None, None, inside)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the layout of each world, the launcher's sizes


def test_the_layout_is_re_derived_for_each_world_keeping_tensor_and_pipeline_sizes() -> None:
    for world, dp in [(8, 2), (4, 1)]:
        assert resolve_layout(world, tensor_parallel=2, pipeline_parallel=2) == Layout(dp=dp, pp=2, tp=2)
    assert resolve_layout(2) == Layout(dp=2, pp=1, tp=1) and resolve_layout(4) == Layout(dp=4, pp=1, tp=1)
    with pytest.raises(
        ValueError,
        match=r"pipeline_parallel=2 x tensor_parallel=2 = 4 does not divide the 6 processes.*"
        r"Under an elastic launch \(torchrun --nnodes=MIN:MAX\) every world the job can "
        r"shrink or grow to must be a multiple of 4",
    ):
        resolve_layout(6, tensor_parallel=2, pipeline_parallel=2)
    with pytest.raises(
        ValueError,
        match=r"data_parallel=4 x pipeline_parallel=1 x tensor_parallel=1 = 4 processes, but "
        r"this run has 2.*data_parallel='auto' to fill it \(as an elastic launch",
    ):
        resolve_layout(2, data_parallel=4)


def test_the_trainers_nodes_and_devices_must_be_the_launched_world(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"GROUP_WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}
    assert launched_sizes(env) == {"num_nodes": 1, "devices": 2}
    assert launched_sizes({}) is None and launched_sizes(env | {"WORLD_SIZE": "3"}) is None  # uneven nodes
    check_launched_world(4, num_nodes=2, devices_per_node=2)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(
        ValueError,
        match=r"Trainer\(num_nodes=2, devices=2\) makes 4 processes, but the launcher started 2 "
        r"\(WORLD_SIZE\). This attempt of torchrun has num_nodes=1 x devices=2: pass "
        r"Trainer\(\*\*lightning_scale.core.resilience.launched_sizes\(\), ...\)",
    ):
        check_launched_world(2, num_nodes=2, devices_per_node=2)


# ---------------------------------------------------------------- the optimizer sees the same gradient


class _Gradients(Callback):
    """The whole gradient the optimizer is about to apply, every optimizer step (before clipping)."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        grads = [
            p.grad.detach().flatten().clone() for _, p in sorted(pl_module.named_parameters()) if p.grad is not None
        ]
        self.steps.append(torch.cat(grads))


class _StopAt(Callback):
    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        trainer.should_stop = trainer.should_stop or trainer.global_step == self.step


def _fit(
    devices: int,
    micro: int | None,
    *,
    steps: int,
    accumulate: int = 1,
    checkpoints: str | None = None,
    ckpt_path: str | None = None,
    stop_at: int | None = None,
) -> dict[str, Any]:
    """Train for a schedule of ``steps`` (stopping at ``stop_at``); ``checkpoints``: one every 2 steps there
    (``step=2.ckpt``, ...)."""
    seed_everything(0, verbose=False)
    grads = _Gradients()
    # Also for one process: Lightning's single-device strategy restores an fp64 checkpoint into the module
    # before converting it to fp64 (1e-8 off); this one restores after set-up, exactly.
    strategy = HybridParallelStrategy(data_parallel=devices, hang_timeout=0)
    every = (
        [ModelCheckpoint(checkpoints, every_n_train_steps=2, save_top_k=-1, filename="{step}")] if checkpoints else []
    )
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy,
        precision="64-true",
        max_steps=steps,
        gradient_clip_val=0.5,
        accumulate_grad_batches=accumulate,
        callbacks=[grads, _StopAt(stop_at), *every],
        enable_checkpointing=bool(checkpoints),
    )
    module = GPTLightningModule(CONFIG, learning_rate=3e-3, warmup_steps=2)
    data = TextDataModule(seq_len=16, global_batch_size=GLOBAL_BATCH, micro_batch_size=micro)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    params = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    return {"grads": grads.steps, "params": params, "accumulation": trainer.accumulate_grad_batches}


def _gradients_at_dp2(rank: int, world: int) -> list[dict[str, Any]]:
    return [_fit(2, 2, steps=3), _fit(2, 4, steps=3)]


def test_two_ranks_accumulating_and_one_process_give_the_optimizer_the_same_gradient() -> None:
    whole = _fit(1, None, steps=3)  # the global batch of 8 in one loader batch
    micro = _fit(1, 2, steps=3)
    assert (whole["accumulation"], micro["accumulation"]) == (1, 4)
    (accumulating, plain), _ = run_distributed(_gradients_at_dp2, 2, timeout=180)
    assert (accumulating["accumulation"], plain["accumulation"]) == (2, 1)
    for name, run in {"1 process, accumulation 4": micro, "dp=2, accumulation 2": accumulating, "dp=2": plain}.items():
        assert len(run["grads"]) == len(whole["grads"]) == 3
        for step, (got, want) in enumerate(zip(run["grads"], whole["grads"], strict=True)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14, msg=f"{name}, step {step}")
    # A factor of 2 anywhere (the loss not divided by the accumulation, or divided twice) is far outside that.
    assert whole["grads"][0].norm() > 1e-3


def test_a_checkpoint_at_one_accumulation_resumes_at_another_on_the_same_sample(tmp_path: Path) -> None:
    uninterrupted = _fit(1, None, steps=6, checkpoints=str(tmp_path / "a"))  # loader batch 8
    # Shrink (loader batch 2, accumulation 4, as a smaller world), then grow back (loader batch 8 again).
    with pytest.warns(UserWarning, match=r"Not saving .*step=2.ckpt: the fit is inside a gradient-accumulation window"):
        shrunk = _fit(
            1, 2, steps=6, stop_at=4, ckpt_path=str(tmp_path / "a" / "step=2.ckpt"), checkpoints=str(tmp_path / "b")
        )
    # Lightning's ModelCheckpoint asked to save step 2 again after the window's first micro-batch: refused.
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["step=4.ckpt"]
    grown = _fit(1, None, steps=6, ckpt_path=str(tmp_path / "b" / "step=4.ckpt"))
    assert (shrunk["accumulation"], len(shrunk["grads"]), len(grown["grads"])) == (4, 2, 2)
    for step, (got, want) in enumerate(zip(shrunk["grads"] + grown["grads"], uninterrupted["grads"][2:], strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14, msg=f"step {step + 2}")
    for name, value in uninterrupted["params"].items():
        torch.testing.assert_close(grown["params"][name], value, rtol=1e-10, atol=1e-12, msg=name)


def test_a_trainer_accumulation_that_disagrees_with_the_micro_batch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"Trainer\(accumulate_grad_batches=3\) disagrees with TextDataModule\(micro_batch_size=2\): "
        r"global_batch_size=8 over 1 data-parallel ranks needs 4 micro-batches",
    ):
        _fit(1, 2, steps=1, accumulate=3)
    assert _fit(1, 2, steps=1, accumulate=4)["accumulation"] == 4  # the same value is no conflict


class _StartStep(Callback):
    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.step = trainer.global_step


def _resume_where_one_rank_restarted(rank: int, world: int, root: str) -> list[int]:
    starts = []
    for restarted in (False, True):
        if restarted and rank == 1:  # a node that stayed counts its restarts; one that joined starts at 0
            os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
        start = _StartStep()
        every = ModelCheckpoint(Path(root) / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}")
        trainer = quiet_trainer(
            devices=world,
            strategy=HybridParallelStrategy(hang_timeout=0),
            max_steps=2 + 2 * restarted,
            enable_checkpointing=True,
            callbacks=[start, every],
        )
        trainer.fit(GPTLightningModule(CONFIG), datamodule=TextDataModule(seq_len=16, global_batch_size=4))
        starts.append(start.step)
    return starts


def _own_loader(batch_size: int | None, samples: int = 64) -> DataLoader:
    """A user's own loader (not the package's data module): windows of random tokens; ``None``: a dataset of
    ready batches of 2, loaded without automatic batching (no ``batch_size`` to read)."""
    tokens = torch.randint(0, CONFIG.vocab_size, (samples, 17), generator=torch.Generator().manual_seed(0))
    if batch_size is None:
        return DataLoader([(t[:, :-1], t[:, 1:]) for t in tokens.split(2)], batch_size=None)
    return DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch_size)


def _fit_own_loader(
    devices: int,
    batch_size: int | None,
    *,
    steps: int,
    ckpt: Path,
    resume: bool = False,
    accumulate: int = 1,
    change: str = "refuse",
    callbacks: tuple[Callback, ...] = (),
) -> Trainer:
    seed_everything(0, verbose=False)
    every = ModelCheckpoint(ckpt, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    strategy = HybridParallelStrategy(data_parallel=devices, hang_timeout=0, global_batch_change=change)
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        enable_checkpointing=not resume,
        callbacks=[*callbacks] if resume else [every, *callbacks],
    )
    trainer.fit(
        GPTLightningModule(CONFIG),
        train_dataloaders=_own_loader(batch_size),
        ckpt_path=str(ckpt / "step=2.ckpt") if resume else None,
    )
    return trainer


def _resume_where_one_rank_restarted_and_save_from_an_own_loader(rank: int, world: int, root: str) -> list[int]:
    starts = _resume_where_one_rank_restarted(rank, world, root)
    _fit_own_loader(world, 2, steps=2, ckpt=Path(root) / "own")  # 2 samples per rank and loader batch, at dp=2
    return starts


def test_auto_resume_on_restart_is_decided_over_all_ranks_and_a_resume_at_another_dp_keeps_the_global_batch(
    tmp_path: Path,
) -> None:
    # Decided alone, rank 0 would start afresh while rank 1 waits in the collective search for "latest".
    starts = run_distributed(
        _resume_where_one_rank_restarted_and_save_from_an_own_loader, 2, str(tmp_path), timeout=150
    )
    assert starts == [[0, 2], [0, 2]]
    # A user's own loader (Lightning's DistributedSampler), saved at dp=2 with 2 x 2 = 4 samples a step, resumed by
    # one process: at the same loader batch each step would train on 2, another run than the saved one's.
    own = tmp_path / "own"
    manifest = json.loads((own / "step=2.ckpt" / "manifest.json").read_text())
    assert manifest["batch"] == {"loader_batch": 2, "data_parallel": 2, "accumulate_grad_batches": 1, "samples": 4}
    refused = (
        r"resumes a checkpoint whose optimizer steps trained on 4 samples \(2 per loader batch x data_parallel=2 x "
        r"accumulate_grad_batches=1\); at data_parallel=1 this fit's would train on 2 samples .*Keep 4 samples a step "
        r"with Trainer\(accumulate_grad_batches=2\) or a loader batch_size of 4\..*global_batch_change='allow'"
    )
    with pytest.raises(ValueError, match=refused):
        _fit_own_loader(1, 2, steps=4, ckpt=own, resume=True)
    # Each way of keeping 4 samples a step resumes and trains on; so does the opt-out, with a warning.
    assert _fit_own_loader(1, 2, steps=4, ckpt=own, resume=True, accumulate=2).global_step == 4
    assert _fit_own_loader(1, 4, steps=4, ckpt=own, resume=True).global_step == 4
    # A scheduler's accumulation counts (it sets it on the Trainer only when an epoch starts, after this check).
    scheduler = GradientAccumulationScheduler({0: 2})
    assert _fit_own_loader(1, 2, steps=4, ckpt=own, resume=True, callbacks=(scheduler,)).global_step == 4
    with pytest.warns(UserWarning, match="another global batch"):
        assert _fit_own_loader(1, 2, steps=4, ckpt=own, resume=True, change="allow").global_step == 4
    with pytest.warns(
        UserWarning, match="the training loader has no integer batch_size"
    ):  # ready batches, no batch_size
        assert _fit_own_loader(1, None, steps=4, ckpt=own, resume=True).global_step == 4
    with pytest.raises(ValueError, match=r"global_batch_change='keep' is not one of 'allow', 'refuse'"):
        HybridParallelStrategy(global_batch_change="keep")


# ---------------------------------------------------------------- the acceptance run: a node lost and back

SCRIPT = Path(__file__).resolve().parent / "scripts" / "elastic_world.py"
STEPS, KILL_AT, REJOIN_AT, PACE_S = 40, 6, 12, 0.3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")
    }
    # A fresh store per rendezvous round for the workers (their rank 0 hosts it): with torchrun's shared agent
    # store, agents that restarted a different number of times would key their attempts differently.
    return env | {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (torchrun starts its workers in sessions of their own, so killing the
    agent's process group would leave them running)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _lose_node(agent: subprocess.Popen) -> None:
    """SIGKILL the agent and every process under it at once: a node gone."""
    for pid in [agent.pid, *_descendants(agent.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    agent.wait()


def _events(out: Path) -> list[dict[str, Any]]:
    path = out / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(out: Path, agents: list[subprocess.Popen], what: str, done: Any, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(done(e) for e in _events(out)):
        failed = [a.args for a in agents if a.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            raise AssertionError(f"waiting for {what}: {failed or 'timed out'}; events: {_events(out)[-5:]}")
        time.sleep(0.2)


def elastic_timeline(out: Path, *, killed_at: float, rejoined_at: float) -> dict[str, float]:
    """The wall-clock times (``time.time()``) of the run's events, for goodput accounting: when the node was
    lost (``killed_at``), the last checkpoint committed before it (its manifest's time), when training resumed
    at the smaller world, when the node was started again, and when training resumed at the full world.

    The truth goodput accounting is checked against: what the two interruptions cost is, each, the time from the
    commit of the checkpoint the next attempt resumed from to that attempt's training (the work lost, the
    detection, the rendezvous and the start-up)."""
    manifests = [json.loads(p.read_text()) for p in (out / "ckpt").glob("*/manifest.json")]
    commits = {m["global_step"]: m["created_unix_s"] for m in manifests}
    starts = [e for e in _events(out) if e["event"] == "start"]
    full = next(e for e in starts if e["time"] > rejoined_at and e["world"] == 4)
    return {
        "killed_at": killed_at,
        "last_commit_before_kill": max(t for t in commits.values() if t <= killed_at),
        "resumed_small": next(e["time"] for e in starts if e["time"] > killed_at and e["world"] == 2),
        "rejoined_at": rejoined_at,
        "commit_resumed_full": commits[full["step"]],
        "resumed_full": full["time"],
    }


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_lost_node_shrinks_the_world_and_a_returning_one_grows_it_with_the_parameters_of_a_fixed_world(
    tmp_path: Path,
) -> None:
    env, python = _torchrun_env(), [sys.executable, "-m", "torch.distributed.run"]
    reference = tmp_path / "reference"
    reference.mkdir()
    ref = subprocess.run(
        [*python, "--standalone", "--nproc-per-node=4", str(SCRIPT), str(reference), str(STEPS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert ref.returncode == 0, ref.stderr[-4000:]
    # A user's own script that never destroys its process groups: the strategy ended them at exit (once a
    # rank aborted there after the run, status 134, a gloo thread left to the interpreter's finalisation).
    exit_threads = {p.name: json.loads(p.read_text()) for p in reference.glob("exit-threads-*.json")}
    assert len(exit_threads) == 4 and all(t == [] for t in exit_threads.values()), exit_threads

    out, port = tmp_path / "elastic", _free_port()
    out.mkdir()
    conf = "join_timeout=120,last_call_timeout=6,close_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"

    def agent(name: str, host: bool) -> subprocess.Popen:
        command = [
            *python,
            "--nnodes=1:2",
            "--nproc-per-node=2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=elastic-test",
            "--max-restarts=3",
            "--monitor-interval=0.5",
            f"--rdzv-conf={conf},is_host={int(host)}",
            str(SCRIPT),
            str(out),
            str(STEPS),
            str(PACE_S),
        ]
        log = (out / f"{name}.log").open("w")
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    first, second = agent("agent1", host=True), agent("agent2", host=False)
    agents = [first, second]
    try:
        _wait_for(
            out,
            agents,
            f"step {KILL_AT} at world 4",
            lambda e: e["event"] == "step" and e["world"] == 4 and e["step"] >= KILL_AT,
        )
        killed_at = time.time()
        _lose_node(second)
        agents = [first]
        _wait_for(
            out,
            agents,
            f"step {REJOIN_AT} at world 2",
            lambda e: e["event"] == "step" and e["world"] == 2 and e["step"] >= REJOIN_AT,
        )
        rejoined_at = time.time()
        third = agent("agent2-again", host=False)
        agents = [first, third]
        for a in agents:
            a.wait(timeout=300)
    finally:
        for a in (first, second, *agents):
            if a.poll() is None:
                _lose_node(a)
    logs = {p.name: p.read_text()[-3000:] for p in out.glob("*.log")}
    assert [a.returncode for a in agents] == [0, 0], logs

    events = _events(out)
    starts = [
        (e["world"], e["accumulation"], e["step"], e["resumed_from"] is not None)
        for e in events
        if e["event"] == "start"
    ]
    worlds = {e["world"] for e in events if e["event"] == "step"}
    assert starts[0] == (4, 1, 0, False) and worlds == {2, 4}, starts
    timeline = elastic_timeline(out, killed_at=killed_at, rejoined_at=rejoined_at)
    print("elastic timeline, s after the kill:", {k: round(v - killed_at, 1) for k, v in timeline.items()})
    small = [
        s
        for e, s in zip((e for e in events if e["event"] == "start"), starts)
        if e["time"] == timeline["resumed_small"]
    ][0]
    assert small[:2] == (2, 2) and small[3] and KILL_AT - 2 <= small[2] <= KILL_AT + 2, starts  # the newest checkpoint
    full = [
        s for e, s in zip((e for e in events if e["event"] == "start"), starts) if e["time"] == timeline["resumed_full"]
    ][0]
    assert full[:2] == (4, 1) and full[3] and full[2] >= REJOIN_AT, starts
    at_two = sorted({e["step"] for e in events if e["event"] == "step" and e["world"] == 2})
    assert len(at_two) >= 4 and max(at_two) < STEPS, at_two  # trained at world 2 for a while
    assert events[-1]["event"] == "end" and (events[-1]["step"], events[-1]["world"]) == (STEPS, 4)
    assert (
        timeline["last_commit_before_kill"]
        <= timeline["killed_at"]
        < timeline["resumed_small"]
        < timeline["rejoined_at"]
        < timeline["resumed_full"]
    )

    # Goodput across the four attempts: the lost work and the restarts of the two interruptions (the node lost,
    # then the node back: torchrun stops the survivors to let it in) against the run's own clock, within 10%.
    summary = summarize(read_ledger(out).attempts)
    truth = (timeline["resumed_small"] - timeline["last_commit_before_kill"]) + (
        timeline["resumed_full"] - timeline["commit_resumed_full"]
    )
    print(f"goodput: {summary}; the interruptions' truth {truth:.2f} s")
    assert summary is not None and summary.interruptions == 2, summary
    assert abs(summary.lost_s + summary.restart_s - truth) <= 0.1 * truth, (summary, truth)
    assert 0 < summary.goodput < 1 and summary.lost_s > 0

    want, got = torch.load(reference / "final.pt"), torch.load(out / "final.pt")
    assert want.keys() == got.keys() and all(v.dtype == torch.float64 for v in want.values())
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-9, atol=1e-11, msg=name)


# ---------------------------------------------------------------- the same from the command line


CLI_STEPS, CLI_KILL_AT = 60, 20


def _cli_weights(run_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from lightning_scale.cli.ckpt import consolidate

    (checkpoint,) = [p for p in (run_dir / "checkpoints").glob(f"*step={CLI_STEPS}.ckpt")]
    return load_file(consolidate(checkpoint, out))


def _checkpointed_step(run_dir: Path) -> int:
    steps = [
        json.loads(p.read_text())["global_step"] for p in (run_dir / "checkpoints").glob("*step=*.ckpt/manifest.json")
    ]
    return max(steps, default=-1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_from_the_cli_a_lost_node_shrinks_the_world_in_the_run_directory_and_trains_what_a_fixed_world_does(
    tmp_path: Path,
) -> None:
    """``lightning-scale-train`` under two elastic torchrun agents of one process each (world 2, accumulation 2):
    one agent and its rank SIGKILLed after the step-20 checkpoint; the survivor restarts at world 1 (accumulation 4)
    in the same run directory, resumes the newest checkpoint and completes; in fp64 its final weights equal a run
    at world 2 throughout, started by Lightning's own launcher."""
    overrides = [
        f"trainer.max_steps={CLI_STEPS}",
        "trainer.val_check_interval=1000",
        "validate_before_fit=false",
        "validate_after_fit=false",
        "precision.precision=64-true",
        "data.seq_len=32",
        "data.global_batch_size=4",
        "data.micro_batch_size=1",
        "callbacks.checkpoint.every_n_train_steps=10",
        "logger=none",
    ]
    env = _torchrun_env()
    reference = tmp_path / "reference"
    ref = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_scale.cli.train",
            *overrides,
            "trainer.devices=2",
            f"hydra.run.dir={reference}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert ref.returncode == 0, ref.stderr[-4000:]

    work, port = tmp_path / "elastic", _free_port()
    work.mkdir()
    conf = "join_timeout=120,last_call_timeout=3,close_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"

    def agent(name: str, host: bool) -> subprocess.Popen:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1:2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=cli-elastic",
            "--max-restarts=2",
            "--monitor-interval=0.5",
            f"--rdzv-conf={conf},is_host={int(host)}",
            "-m",
            "lightning_scale.cli.train",
            *overrides,
        ]
        log = (work / f"{name}.log").open("w")
        return subprocess.Popen(
            command, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    first, second = agent("agent1", host=True), agent("agent2", host=False)
    run_dir = work / "outputs" / "torchrun-cli-elastic"  # named by --rdzv-id: the same at every restart
    try:
        deadline = time.monotonic() + 150
        while _checkpointed_step(run_dir) < CLI_KILL_AT:
            assert first.poll() is None and second.poll() is None and time.monotonic() < deadline, (
                "no step-20 checkpoint"
            )
            time.sleep(0.05)
        time.sleep(0.3)  # a few steps past the checkpoint: work the survivor recomputes
        _lose_node(second)
        first.wait(timeout=200)
    finally:
        for a in (first, second):
            if a.poll() is None:
                _lose_node(a)
    logs = {p.name: p.read_text()[-3000:] for p in work.glob("*.log")}
    assert first.returncode == 0, logs
    assert [p.name for p in (work / "outputs").iterdir()] == [run_dir.name], logs

    summary = json.loads((run_dir / "summary.json").read_text())
    job = json.loads((run_dir / "job.json").read_text())
    assert (summary["global_step"], summary["world_size"], job["attempt"]) == (CLI_STEPS, 1, 1), (summary, job)
    assert job["layout"]["name"] == "dp1-tp1-pp1"
    log = (run_dir / "train.log").read_text()  # every attempt's rank 0 appends to it
    assert "dp=2 x pp=1 x tp=1 (ddp) on 2 processes" in log and "dp=1 x pp=1 x tp=1 on 1 processes" in log, log[-3000:]
    assert summary["goodput"]["attempts"] == 2 and summary["goodput"]["interruptions"] == 1, summary["goodput"]
    assert summary["goodput"]["lost_s"] > 0, summary["goodput"]  # the steps after the step-20 checkpoint

    want = _cli_weights(reference, tmp_path / "want.safetensors")
    got = _cli_weights(run_dir, tmp_path / "got.safetensors")
    assert want.keys() == got.keys() and all(v.dtype == torch.float64 for v in want.values())
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-9, atol=1e-11, msg=name)
