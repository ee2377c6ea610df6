"""data_parallel_sync: Local SGD, DiLoCo and Streaming DiLoCo on the data-parallel axis (issue 40).

Exactness against hand computations and against DDP, on a model of the user's own kind (an MLP stack
with its own optimizer), parity across tp/pp layouts, resume between synchronisations, and refusals."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_cases, run_distributed
from helpers.lightning import fit_error, quiet_trainer
from helpers.models import BlockStack, StackModule
from helpers.parity import fit_gpt
from lightning.pytorch import seed_everything
from torch.utils.data import DataLoader, TensorDataset

import lightning_scale  # noqa: F401
from lightning_scale.core.parallel.sync_spec import SyncSpec, diloco, local_sgd, streaming_diloco, sync_spec
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTConfig, GPTLightningModule
from lightning_scale.strategies import HybridParallelStrategy

STEPS = 6


class SGDStack(StackModule):
    """The stack with the optimizer a test picks (SGD is linear in the gradient: Local SGD every step is DDP)."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__(BlockStack(dim=16, vocab=256))
        self.optimizer = optimizer

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def _loader(batch: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (64, 8), generator=g)
    return DataLoader(TensorDataset(x, torch.roll(x, 1, dims=1)), batch_size=batch)


def fit_stack(world: int, steps: int = STEPS, optimizer: str = "sgd", **strategy: Any) -> dict[str, torch.Tensor]:
    seed_everything(0, verbose=False)
    module = SGDStack(optimizer)
    trainer = quiet_trainer(
        devices=world, strategy=HybridParallelStrategy(**strategy), precision="64-true", max_steps=steps
    )
    trainer.fit(module, train_dataloaders=_loader())
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


GPT = GPTConfig(n_layers=2, d_model=32, n_heads=2, block_size=32)
"""The reference model for the layout parity: it has a tensor-parallel plan and a pipeline spec."""


def _gpt(world: int, **layout: Any) -> dict[str, Any]:
    # DiLoCo with Nesterov momentum, AdamW inside, clipping by each replica's own norm
    strategy = HybridParallelStrategy(**layout, data_parallel_sync=diloco(every=2))
    result = fit_gpt(strategy, world, GPT, steps=5)
    return {"state": result["state"], "val": result["val"]}


LAYOUTS = {
    "tp2": lambda world: _gpt(world, data_parallel=2, tensor_parallel=2),
    "pp2": lambda world: _gpt(world, data_parallel=2, pipeline_parallel=2),
}


@pytest.fixture(scope="module")
def layouts() -> list[dict[str, Any]]:
    return run_distributed(run_cases, 4, __name__, "LAYOUTS", timeout=300)


def test_diloco_under_tensor_and_pipeline_parallelism_equals_plain_data_parallelism(
    exact: list[dict[str, Any]], layouts: list[dict[str, Any]]
) -> None:
    reference = exact[0]["gpt_dp2"]
    for rank in layouts:
        for case in ("tp2", "pp2"):
            _close(rank[case]["state"], reference["state"], 1e-9)
            assert rank[case]["val"] == pytest.approx(reference["val"], rel=1e-9)


def _stats(world: int, **strategy: Any) -> dict[str, Any]:
    seed_everything(0, verbose=False)
    trainer = quiet_trainer(devices=world, strategy=HybridParallelStrategy(**strategy), max_steps=4)
    module = SGDStack()
    trainer.fit(module, train_dataloaders=_loader())
    numel = sum(p.numel() for p in module.parameters())
    return trainer.strategy.sync_stats() | {"numel": numel}


def _mixed(world: int, precision: str, accumulate: int, gpt: bool = False, **strategy: Any) -> dict[str, Any]:
    """Mixed precision and gradient accumulation under a periodic mode: its steps counted, one model at the end."""
    seed_everything(0, verbose=False)
    trainer = quiet_trainer(
        devices=world,
        strategy=HybridParallelStrategy(**strategy),
        precision=precision,
        accumulate_grad_batches=accumulate,
        max_steps=4,
    )
    if gpt:  # a model the planner reads (layout="auto")
        module = GPTLightningModule(GPT, learning_rate=3e-3, warmup_steps=2)
        trainer.fit(module, datamodule=TextDataModule(seq_len=32, global_batch_size=8))
    else:
        module = SGDStack("adamw")
        trainer.fit(module, train_dataloaders=_loader())
    chosen = trainer.strategy.options
    return {
        "stats": trainer.strategy.sync_stats(),
        "state": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "layout": (trainer.strategy.layout.dp, trainer.strategy.layout.pp, chosen.data_parallel_mode),
    }


def _refused(world: int, **strategy: Any) -> str:
    trainer = quiet_trainer(devices=world, strategy=HybridParallelStrategy(**strategy), max_steps=2)
    return fit_error(trainer, SGDStack(), train_dataloaders=_loader())


EXACT = {
    "gpt_dp2": lambda world: _gpt(world, data_parallel=2),
    "every_step_link": lambda world: _stats(world, emulated_link={"bandwidth_mbps": 80, "latency_ms": 30}),
    "local_link": lambda world: _stats(
        world, data_parallel_sync=local_sgd(every=2), emulated_link={"bandwidth_mbps": 80, "latency_ms": 30}
    ),
    "diloco_int4": lambda world: _stats(
        world, data_parallel_sync={"mode": "diloco", "every": 2, "compression": "int4"}
    ),
    "bf16_accumulate": lambda world: _mixed(world, "bf16-mixed", 2, data_parallel_sync=diloco(every=2)),
    "fp16_auto": lambda world: _mixed(
        world, "16-mixed", 1, gpt=True, layout="auto", data_parallel_sync=local_sgd(every=2)
    ),
    "too_many_fragments": lambda world: _refused(world, data_parallel_sync=streaming_diloco(every=8, fragments=5)),
    "ddp": lambda world: fit_stack(world),
    "local_sgd_1": lambda world: fit_stack(world, data_parallel_sync=local_sgd(every=1)),
    "local_sgd_3": lambda world: fit_stack(world, optimizer="adamw", data_parallel_sync="local_sgd", sync_every=3),
    "diloco_as_local": lambda world: fit_stack(
        world, optimizer="adamw", data_parallel_sync=diloco(every=3, outer_lr=1.0, outer_momentum=0.0)
    ),
}


@pytest.fixture(scope="module")
def exact() -> dict[str, Any]:
    return run_distributed(run_cases, 2, __name__, "EXACT", timeout=240)


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=tol, atol=tol, msg=name)


def test_local_sgd_every_step_equals_ddp(exact: list[dict[str, Any]]) -> None:
    for rank in exact:
        _close(rank["local_sgd_1"], rank["ddp"], 1e-9)
    _close(exact[0]["local_sgd_1"], exact[1]["local_sgd_1"], 0.0)


def test_diloco_with_unit_outer_step_equals_local_sgd(exact: list[dict[str, Any]]) -> None:
    for rank in exact:
        _close(rank["diloco_as_local"], rank["local_sgd_3"], 1e-9)
        # and it trained differently from DDP (the replicas stepped alone with AdamW)
        assert any((rank["local_sgd_3"][k] - rank["ddp"][k]).abs().max() > 1e-4 for k in rank["ddp"])


# ---------------------------------------------------------------------------------- DiLoCo by hand


def _by_hand(rank: int, world: int) -> dict[str, Any]:
    """Two DiLoCo rounds (H=2, plain SGD inside) on a 3-vector, each rank its own gradients."""
    from lightning_scale.core.parallel.sync import PeriodicSync

    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
    inner = torch.optim.SGD([p], lr=0.1)
    sync = PeriodicSync(diloco(every=2, outer_lr=0.7, outer_momentum=0.9), [[("w", p)]], dist.group.WORLD)
    seen, inside = [], None
    for step in range(4):
        p.grad = torch.tensor([rank + 1.0, 2.0 * step - rank, (-1.0) ** (rank + step)], dtype=torch.float64)
        inner.step()
        sync.after_step()
        seen.append(p.detach().clone())
        if step == 2:  # between rounds: the global model is the anchor of the first round, then its own again
            with sync.global_model():
                inside = p.detach().clone()
            assert torch.equal(p, seen[-1])
    return {"seen": seen, "stats": sync.stats, "inside": inside}


def test_two_round_diloco_matches_a_hand_computation() -> None:
    results = run_distributed(_by_hand, 2, timeout=60)
    lr, eta, mu = 0.1, 0.7, 0.9

    def grad(rank: int, step: int) -> list[float]:
        return [rank + 1.0, 2.0 * step - rank, (-1.0) ** (rank + step)]

    anchor, buf = [1.0, -2.0, 0.5], [0.0, 0.0, 0.0]
    for first in (0, 2):  # each round: two inner SGD steps per rank, then the outer Nesterov step
        delta = [sum(lr * (grad(r, first)[i] + grad(r, first + 1)[i]) for r in (0, 1)) / 2 for i in range(3)]
        buf = [mu * b + d for b, d in zip(buf, delta)]
        anchor = [a - eta * (d + mu * b) for a, d, b in zip(anchor, delta, buf)]
        for rank in (0, 1):
            torch.testing.assert_close(
                results[rank]["seen"][first + 1], torch.tensor(anchor, dtype=torch.float64), rtol=0, atol=1e-12
            )
    # between rounds each rank is at its own point; validation's global model is the last anchor
    assert not torch.equal(results[0]["seen"][2], results[1]["seen"][2])
    for rank in (0, 1):
        assert torch.equal(results[rank]["inside"], results[rank]["seen"][1])
    # two exchanges of 3 fp64 values over 2 ranks: 2 * (2 - 1) / 2 * 24 bytes each
    assert results[0]["stats"].exchanges == 2 and results[0]["stats"].bytes_sent == 48.0


def _compressed(rank: int, world: int) -> dict[str, Any]:
    from lightning_scale.core.parallel.sync_exchange import Exchange, ExchangeStats

    torch.manual_seed(rank)
    x = torch.randn(1000, dtype=torch.float64)
    mean = x.clone()
    dist.all_reduce(mean)
    mean /= world
    out = {}
    for kind in ("bf16", "int8", "int4"):
        stats, residual, total = ExchangeStats(), [torch.zeros(1000)], torch.zeros(1000, dtype=torch.float64)
        chunk = torch.zeros(Exchange.chunk_numel(1000, world, kind))
        first = None
        for _ in range(20):
            exchange = Exchange([x], dist.group.WORLD, kind, stats, residuals=residual, chunk_residual=chunk)
            got = exchange.start().finish()[0]
            first = got if first is None else first
            total += got
        out[kind] = {
            "first": (first - mean).abs().max().item(),
            "drift": (total / 20 - mean).abs().max().item(),
            "bytes": stats.bytes_sent / 20,
        }
    return out


def test_compressed_exchanges_average_with_error_feedback() -> None:
    out = run_distributed(_compressed, 2, timeout=60)[0]
    # bytes per exchange: 1000 values (padded) at 2, 1 and 0.5 bytes, plus int scales, ring factor 1 at n=2
    assert out["bf16"]["bytes"] == pytest.approx(2000, rel=0.03)
    assert out["int8"]["bytes"] == pytest.approx(1000 * (1 + 4 / 128), rel=0.03)
    assert out["int4"]["bytes"] == pytest.approx(1000 * (0.5 + 4 / 128), rel=0.03)
    for kind in out:
        # error feedback: what one exchange rounds away comes back in the next, so the mean over many
        # exchanges converges on the true average (no rounding error accumulates)
        assert out[kind]["drift"] < out[kind]["first"] / 5, kind


# ---------------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"data_parallel_sync": "diloco"}, "needs H"),
        ({"data_parallel_sync": "local_sgd", "sync_every": 0}, "sync_every=0 must be a positive integer"),
        ({"data_parallel_sync": {"mode": "diloco", "every": 4, "outer_lr": 0}}, "outer_lr=0 must be a positive"),
        (
            {"data_parallel_sync": {"mode": "diloco", "every": 4, "outer_momentum": 1.0}},
            r"outer_momentum=1.0 must be in \[0, 1\)",
        ),
        ({"data_parallel_sync": {"mode": "streaming_diloco", "every": 4, "fragments": 8}}, "fragments=8 > every=4"),
        ({"data_parallel_sync": {"mode": "diloco", "every": 4, "fragments": 2}}, "are streaming_diloco's"),
        ({"data_parallel_sync": "gossip", "sync_every": 2}, "'gossip' is not one of"),
        ({"data_parallel_sync": {"mode": "diloco", "every": 4, "compression": "fp8"}}, "compression='fp8' is not one"),
        ({"data_parallel_sync": {"mode": "diloco", "every": 4, "lr": 1}}, r"unknown keys \['lr'\]"),
        ({"data_parallel_sync": diloco(every=4), "sync_every": 5}, "disagree"),
        (
            {"data_parallel_sync": "diloco", "sync_every": 4, "data_parallel_mode": "fsdp"},
            "Use data_parallel_mode='ddp'",
        ),
        ({"data_parallel_sync": "diloco", "sync_every": 4, "gradient_compression": "bf16"}, "Compress its exchange"),
        ({"data_parallel_sync": "local_sgd", "sync_every": 4, "static_graph": True}, "does not use"),
        ({"data_parallel_sync": 3}, "must be a mode name"),
        ({"sync_every": 50}, "sync_every=50 is H of a periodic mode"),
        ({"emulated_link": {"bandwidth_mbps": 0}}, "bandwidth_mbps=0 must be a positive"),
        ({"emulated_link": {"latency_ms": 5}}, "needs bandwidth_mbps"),
        ({"emulated_link": {"bandwidth_mbps": 10}, "gradient_compression": "fp16"}, "would replace or change it"),
    ],
)
def test_bad_values_are_refused_when_the_strategy_is_built(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        HybridParallelStrategy(**kwargs)


def test_more_fragments_than_blocks_are_refused_before_any_process_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.strategies.launchers import subprocess_script

    def started(*_: Any) -> None:
        raise AssertionError("a child process was started before the refusal")

    monkeypatch.setattr(subprocess_script._SubprocessScriptLauncher, "_call_children_scripts", started)
    monkeypatch.setattr(torch.distributed, "init_process_group", started)
    strategy = HybridParallelStrategy(data_parallel_sync=streaming_diloco(every=8, fragments=5))
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=2)
    with pytest.raises(
        ValueError, match=r"streaming_diloco\(fragments=5\).*SGDStack has 4 blocks\. Use fragments <= 4"
    ):
        trainer.fit(SGDStack(), train_dataloaders=_loader())
    # a model that declares no blocks: refused as early, with the hook to define
    trainer = quiet_trainer(
        devices=2,
        strategy=HybridParallelStrategy(data_parallel_sync=streaming_diloco(every=8, fragments=2)),
        max_steps=2,
    )
    with pytest.raises(ValueError, match=r"declares none: define `pipeline_spec\(self\)`"):
        trainer.fit(_Blockless(), train_dataloaders=_loader())


def test_the_launcher_does_not_keep_the_strategy_alive() -> None:
    # A run keeps its launcher to wait for its children; holding the strategy (its mesh, its process groups)
    # from there would keep the groups' threads alive past the run's end.
    import gc
    import weakref

    strategy = HybridParallelStrategy(data_parallel_sync=streaming_diloco(every=8, fragments=2))
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=2)
    launcher, ref = strategy.launcher, weakref.ref(strategy)
    assert launcher is not None
    del trainer, strategy
    gc.collect()
    assert ref() is None


class _Blockless(SGDStack):
    pipeline_spec = None


def test_the_forms_a_config_gives_read_as_one_spec() -> None:
    assert sync_spec("diloco", 50) == diloco(every=50)
    assert sync_spec({"mode": "local_sgd", "every": 8}) == local_sgd(every=8)
    assert sync_spec({"mode": "diloco"}, 10) == diloco(every=10)
    spec = streaming_diloco(every=8, fragments=4)
    assert spec.offsets() == [2, 4, 6, 0] and spec.due(6) == [2] and spec.due(16) == [3]
    assert sync_spec("every_step") == SyncSpec()
    # local SGD is the outer step of lr 1 without momentum, whatever a mapping carried of DiLoCo's defaults
    assert sync_spec({"mode": "local_sgd", "every": 4, "outer_lr": 0.7, "outer_momentum": 0.9}) == local_sgd(every=4)
    assert (local_sgd(every=4).outer_lr, local_sgd(every=4).outer_momentum) == (1.0, 0.0)
    assert "streaming_diloco(every=8" in spec.describe()


# ---------------------------------------------------------------------------------- resume between syncs


class Crash(Exception):
    pass


def _resume(world: int, sync: Any, tmp: str, total: int = 7, at: int = 5) -> dict[str, Any]:
    """``total`` steps uninterrupted, and ``at`` steps (a checkpoint there, then a crash) resumed to ``total``."""
    from lightning.pytorch import Callback
    from lightning.pytorch.callbacks import ModelCheckpoint

    class CrashAfter(Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == at:
                raise Crash

    def run(steps: int, callbacks: list[Any], ckpt: str | None = None) -> SGDStack:
        seed_everything(0, verbose=False)
        module = SGDStack("adamw")
        strategy = HybridParallelStrategy(data_parallel_sync=sync)
        trainer = quiet_trainer(
            devices=world,
            strategy=strategy,
            precision="64-true",
            max_steps=steps,
            callbacks=callbacks,
            enable_checkpointing=bool(callbacks),
        )
        try:
            # the package's loader resumes mid-epoch where the checkpoint left it
            trainer.fit(module, datamodule=TextDataModule(seq_len=8, global_batch_size=8), ckpt_path=ckpt)
        except Crash:
            pass
        return module

    whole = run(total, [])
    saver = ModelCheckpoint(dirpath=tmp, every_n_train_steps=at, save_top_k=-1, save_last=False)
    run(total, [saver, CrashAfter()])
    (path,) = [os.path.join(tmp, p) for p in os.listdir(tmp)]
    resumed = run(total, [], ckpt=path)
    return {
        "whole": {k: v.clone() for k, v in whole.state_dict().items()},
        "resumed": {k: v.clone() for k, v in resumed.state_dict().items()},
    }


def _resumes(rank: int, world: int, tmp: str) -> dict[str, Any]:
    return {
        "diloco": _resume(world, diloco(every=3), f"{tmp}/diloco"),
        # a fragment's exchange in flight at the checkpoint (fragment 1 starts after step 4, lands after 5),
        # int8 error feedback on both sides
        "streaming": _resume(
            world, streaming_diloco(every=4, fragments=2, overlap=True, compression="int8"), f"{tmp}/streaming", at=4
        ),
    }


def test_a_run_killed_between_synchronisations_resumes_exactly(tmp_path: Any) -> None:
    for rank in run_distributed(_resumes, 2, str(tmp_path), timeout=240):
        for case in ("diloco", "streaming"):
            _close(rank[case]["resumed"], rank[case]["whole"], 1e-9)


def test_the_exchange_is_counted_and_the_emulated_link_delays_it(exact: list[dict[str, Any]]) -> None:
    for rank in exact:
        every, local, int4 = rank["every_step_link"], rank["local_link"], rank["diloco_int4"]
        fp32 = 4 * every["numel"]  # each rank sends 2 (n - 1) / n = 1 x the fp32 gradients or parameters
        # every step: DDP's buckets through the link's hook (one bucket here), 4 steps
        assert every["mode"] == "every_step" and every["exchanges"] == 4 and every["bytes_sent"] == 4 * fp32
        # local SGD every 2 of 4 steps: 2 exchanges, half the bytes, each blocked >= the link's 30 ms
        assert local["exchanges"] == 2 and local["bytes_sent"] == 2 * fp32
        assert local["blocked_s"] >= 2 * (0.030 + fp32 * 8 / 80e6)
        # int4 with a scale per 128 values: about 1/7.5 of fp32's bytes
        assert int4["exchanges"] == 2 and 2 * fp32 / 8 < int4["bytes_sent"] < 2 * fp32 / 7


def test_more_fragments_than_blocks_are_refused_at_set_up(exact: list[dict[str, Any]]) -> None:
    for rank in exact:
        assert "needs at least one block per fragment" in rank["too_many_fragments"]
        assert "has 4 blocks. Use fragments <= 4" in rank["too_many_fragments"]


def test_mixed_precision_accumulation_and_auto_layouts_run_periodic_modes(exact: list[dict[str, Any]]) -> None:
    for case in ("bf16_accumulate", "fp16_auto"):
        first, second = (rank[case] for rank in exact)
        # 4 optimizer steps (8 micro-batches under accumulation), an exchange after every second one
        assert first["stats"]["exchanges"] == 2, case
        _close(first["state"], second["state"], 0.0)  # the fit ends with one model on every replica
    # layout="auto" under a periodic mode plans replicas only
    assert exact[0]["fp16_auto"]["layout"][2] == "ddp"


# ---------------------------------------------------------------------------------- the command line, SIGKILL


def test_a_diloco_job_sigkilled_between_synchronisations_resumes_to_the_uninterrupted_result(
    tmp_path: Any, data_cache: Any
) -> None:
    """``lightning-scale-train strategy.data_parallel_sync=diloco strategy.sync_every=4``: checkpoints every
    10 steps (between the synchronisations after steps 8 and 12), every process SIGKILLed after step 13,
    relaunched with ``ckpt_path=latest``: the final validation loss is the uninterrupted job's, bit for bit."""
    import json
    import signal

    from helpers.lightning import SlowSteps
    from test_cli import _env, _train, _train_until

    common = (
        "strategy.data_parallel_sync=diloco",
        "strategy.sync_every=4",
        "trainer.max_steps=24",
        "trainer.val_check_interval=24",
        "trainer.limit_val_batches=2",
        "callbacks.checkpoint.every_n_train_steps=10",
        "callbacks.console.every_n_steps=1",
        "data.seq_len=64",
        "data.global_batch_size=4",
        "+callbacks.slow._target_=helpers.lightning.SlowSteps",
        "+callbacks.slow.after_step=10",
        "+callbacks.slow.seconds=2",
    )
    env = _env(LIGHTNING_SCALE_CACHE=str(data_cache), PYTHONPATH=os.path.dirname(__file__))
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    proc = _train(f"hydra.run.dir={whole}", *common, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the killed run sleeps after each step past the checkpoint, so the kill lands before its end
    status, out = _train_until(
        "step 13/24", signal.SIGKILL, f"hydra.run.dir={killed}", *common, env=env | {SlowSteps.ENV: "1"}
    )
    assert status == -signal.SIGKILL, out[-3000:]
    proc = _train(f"hydra.run.dir={killed}", *common, "ckpt_path=latest", timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Restored all states from the checkpoint at" in proc.stdout + proc.stderr
    summary = json.loads((killed / "summary.json").read_text())
    reference = json.loads((whole / "summary.json").read_text())
    assert summary["global_step"] == reference["global_step"] == 24
    assert summary["final_val_loss"] == reference["final_val_loss"]
