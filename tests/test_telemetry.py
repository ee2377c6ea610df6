"""Telemetry: model facts at every layout, throughput and MFU, cost (callbacks and ``core``)."""

from __future__ import annotations

import math
import os
import re
import socket
import sys
import time
import warnings
from typing import Any

import pytest
import torch
from helpers.distributed import run_cases, run_distributed
from helpers.lightning import quiet_trainer
from helpers.models import StackModule, lm_loss
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import lightning_scale.callbacks._steps as _steps
import lightning_scale.callbacks._telemetry as telemetry
from lightning_scale.callbacks import (
    CallbackGroup,
    CheckpointIntervalAdvisor,
    ConsoleLogger,
    CostMonitor,
    NumericalHealth,
    StepTimeBreakdown,
    StragglerMonitor,
    Throughput,
)
from lightning_scale.callbacks.group import group_callbacks
from lightning_scale.core.checkpoint.interval import daly_interval, young_interval
from lightning_scale.core.parallel.blocks import apply_activation_checkpointing
from lightning_scale.core.telemetry.cost import (
    OFFERS,
    PRICES,
    CostMeter,
    device_offers,
    device_price,
    price_key,
    price_multiplier,
)
from lightning_scale.core.telemetry.health import LossSpikeDetector
from lightning_scale.core.telemetry.model_facts import ModelFacts, transformer_shape
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTConfig, GPTLightningModule
from lightning_scale.strategies import HybridParallelStrategy

CONFIG = GPTConfig(n_layers=2, d_model=32, n_heads=2, block_size=16)
SEQ, BATCH = 16, 4
# N of 6N by hand: per layer qkv 32x96, out 32x32, MLP 32x128 twice; the tied head 32x256.
N = 2 * (32 * 96 + 32 * 32 + 2 * 32 * 128) + 32 * 256
FLOPS_PER_TOKEN = 6 * N + 12 * 2 * 2 * 16 * SEQ
# The peak FLOP/s of tests that read MFU off a real clock: one no CPU reaches on these models, so MFU (never
# logged above 1) is there whatever the machine. 1e9 was reached on an idle 2-core machine (train/mfu missing).
PEAK = 1e15
# tests.helpers.models.StackModule: four MLP blocks (32 -> 64 -> 32) and a 32 -> 256 head, all with
# input gradients (they come after the embedding).
STACK_N = 4 * 2 * 32 * 64 + 32 * 256


class FakeClock:
    """Advances ``step`` seconds at every reading."""

    def __init__(self, step: float) -> None:
        self.step, self.now = step, 0.0

    def __call__(self) -> float:
        self.now += self.step
        return self.now


class Logged(Callback):
    """The telemetry metrics of every optimizer step (after the callbacks before it published)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        keys = [
            k
            for k in trainer.callback_metrics
            if k.split("/")[0] in ("train", "cost", "energy", "checkpoint", "pipeline", "memory")
        ]
        self.steps.append({k: float(trainer.callback_metrics[k]) for k in keys})


def _fit(callbacks: list[Callback], steps: int = 3, **trainer_kwargs: Any) -> Logged:
    seed_everything(0, verbose=False)
    logged = Logged()
    trainer = quiet_trainer(max_steps=steps, callbacks=[*callbacks, logged], **trainer_kwargs)
    trainer.fit(GPTLightningModule(CONFIG), datamodule=TextDataModule(seq_len=SEQ, global_batch_size=BATCH))
    return logged


class _StopsWhileDeciding(Callback):
    """Asks telemetry.should_log before and after setting should_stop (which Lightning also logs at) in one batch."""

    def __init__(self) -> None:
        self.answers: list[tuple[bool, bool]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        before = telemetry.should_log(trainer)
        trainer.should_stop = trainer.should_stop or trainer.global_step == 2
        self.answers.append((before, telemetry.should_log(trainer)))


def test_a_batch_is_a_logging_step_for_every_callback_or_for_none() -> None:
    # Were each callback to decide for itself, those after one that stops the fit would take part in a logging
    # step's shared reduction that those before it skipped. Decided once per batch (of the fit), they agree.
    stopper = _StopsWhileDeciding()
    _fit([stopper], steps=6, log_every_n_steps=3)
    assert stopper.answers == [(False, False), (False, False)]  # stopped at step 2, the second batch
    stopper = _StopsWhileDeciding()
    _fit([stopper], steps=3, log_every_n_steps=2)  # decided anew for each batch
    assert stopper.answers == [(False, False), (True, True)]


# ---------------------------------------------------------------------------- model facts


def test_facts_of_the_gpt_are_analytic_and_match_the_flop_counter() -> None:
    module = GPTLightningModule(CONFIG)
    facts = ModelFacts.of(module)
    assert (facts.source, facts.matmul_parameters) == ("analytic", N)
    assert facts.parameters == sum(p.numel() for p in module.parameters())
    assert facts.non_embedding_parameters == facts.parameters - 256 * 32 - 16 * 32  # token and position tables
    assert facts.flops_per_token(SEQ) == FLOPS_PER_TOKEN
    counted = ModelFacts.of(module)
    counted.shape = None
    tokens = torch.randint(0, 256, (BATCH, SEQ))
    assert counted.measure(module, (tokens, tokens)) and counted.source == "measured"
    assert counted.flops_per_token(SEQ) == pytest.approx(FLOPS_PER_TOKEN, rel=0.02)
    assert module.model.head.weight.device.type == "cpu"  # counted on meta copies, the module untouched


def test_facts_of_hf_configs_a_hook_and_a_model_with_no_config() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    with torch.device("meta"):
        llama = transformers.LlamaForCausalLM(config)
    facts = ModelFacts.of(llama)
    assert facts.source == "analytic" and facts.shape == transformer_shape(config)
    counted = ModelFacts.of(llama)
    counted.shape = None
    assert counted.measure(llama, {"input_ids": torch.randint(0, 128, (2, 32))})
    assert counted.flops_per_token(32) == pytest.approx(facts.flops_per_token(32), rel=0.02)
    # A mixture of experts runs only the routed share of N: no analytic count.
    assert transformer_shape(transformers.MixtralConfig(num_local_experts=4)) is None

    class Hooked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)

        def flops_per_token(self, seq_len: int) -> float:
            return 1000.0 + seq_len

    assert ModelFacts.of(Hooked()).flops_per_token(24) == 1024.0
    mlp = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 3))
    facts = ModelFacts.of(mlp)
    assert facts.source == "none" and facts.flops_per_token(1) is None
    assert facts.measure(mlp, (torch.randn(4, 10), torch.zeros(4)))
    # Forward 2N, weight gradients 2N, input gradients 2N except the first layer's (no input grad).
    assert facts.flops_per_token(1) == 6 * (200 + 60) - 2 * 200


class RecordFacts(Callback):
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.facts = telemetry.model_facts(trainer, pl_module)


def _facts_at(world: int, **layout: int) -> tuple[int, int, int, float | None]:
    seed_everything(0, verbose=False)
    record = RecordFacts()
    strategy = HybridParallelStrategy(**layout, microbatches=2) if world > 1 else "auto"
    trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=1, callbacks=[record])
    trainer.fit(GPTLightningModule(CONFIG), datamodule=TextDataModule(seq_len=SEQ, global_batch_size=BATCH))
    f = record.facts
    local = sum(p.numel() for p in trainer.lightning_module.parameters())
    return (f.parameters, f.non_embedding_parameters, local, f.flops_per_token(SEQ))


class LastMetrics(Callback):
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}


BUBBLE = GPTConfig(n_layers=4, d_model=32, n_heads=2, block_size=16)


def _sleep_in_forward(module: Any, args: Any, output: Any) -> None:
    time.sleep(0.02)


def _bubble(world: int, microbatches: int) -> dict[str, float]:
    """pp=2 1F1B. Each block's forward sleeps 20 ms, so a stage's work per micro-batch is mostly a
    wait no busy core can stretch: the figures hold when the suite's other worker loads the CPU."""
    seed_everything(0, verbose=False)
    last = LastMetrics()
    strategy = HybridParallelStrategy(data_parallel=1, pipeline_parallel=2, microbatches=microbatches)
    module = GPTLightningModule(BUBBLE)
    for block in module.model.blocks.values():
        block.register_forward_hook(_sleep_in_forward)
    # Logged at steps 2 and 4: the last figures leave out the first step's warm-up.
    trainer = quiet_trainer(
        devices=world, strategy=strategy, max_steps=4, log_every_n_steps=2, callbacks=[StepTimeBreakdown(), last]
    )
    trainer.fit(module, datamodule=TextDataModule(seq_len=16, global_batch_size=16))
    return last.metrics


class SlowRank(Callback):
    """Rank 1 takes 50 ms longer to get each batch (ahead of the monitor in the callback list)."""

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == 1:
            time.sleep(0.05)


def _stragglers(world: int) -> list[tuple[int, int, str, float]]:
    seed_everything(0, verbose=False)
    monitor = StragglerMonitor(factor=1.3)
    trainer = quiet_trainer(
        devices=world, strategy="ddp", max_steps=4, log_every_n_steps=2, callbacks=[SlowRank(), monitor]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer.fit(GPTLightningModule(CONFIG), datamodule=TextDataModule(seq_len=SEQ, global_batch_size=BATCH))
    return monitor.flagged


def _stack_facts(world: int) -> tuple[str, float | None]:
    """A user's module with no config at pp=2: its FLOPs are counted before the cut."""
    seed_everything(0, verbose=False)
    record = RecordFacts()
    trainer = quiet_trainer(
        devices=world,
        strategy=HybridParallelStrategy(data_parallel=1, pipeline_parallel=2, microbatches=2),
        max_steps=1,
        callbacks=[Throughput(peak_flops=1e9), record],
    )
    trainer.fit(StackModule(), datamodule=TextDataModule(seq_len=SEQ, global_batch_size=BATCH))
    return record.facts.source, record.facts.flops_per_token(SEQ)


class _EnergyOnRankOne:
    """NVML's energy counter as if only rank 1's device could be read (mixed nodes, or a permission)."""

    def __init__(self, device: Any) -> None:
        self.available = int(os.environ["RANK"]) == 1

    def take(self) -> float | None:
        return 5.0 if self.available else None


def _cost_on_two(world: int) -> dict[str, float]:
    """CostMonitor on 2 processes with a clock that advances 900 s at every reading; only rank 1 reads
    an energy counter (every rank must still enter the energy all-reduce alike, or the ranks hang)."""
    import lightning_scale.callbacks.cost as cost_module

    real, _steps.clock = _steps.clock, FakeClock(900.0)  # this worker, this case only
    energy, cost_module._Energy = cost_module._Energy, _EnergyOnRankOne  # type: ignore[misc]
    try:
        seed_everything(0, verbose=False)
        trainer = quiet_trainer(
            devices=world,
            strategy="ddp",
            max_steps=4,
            log_every_n_steps=2,
            callbacks=[CostMonitor(price_per_device_hour=3.0)],
        )
        trainer.fit(GPTLightningModule(CONFIG), datamodule=TextDataModule(seq_len=SEQ, global_batch_size=BATCH))
    finally:
        _steps.clock = real
        cost_module._Energy = energy  # type: ignore[misc]
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("cost/", "energy/"))}


class _Part(telemetry.SharedTelemetry):
    """Contributes ``values(rank)`` with ``op`` at each logging step, and logs ``test/<name>``: the step."""

    def __init__(self, name: str, op: str, values: Any, events: list[Any]) -> None:
        super().__init__()
        self.name, self.op, self.values, self.events = name, op, values, events

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if telemetry.should_log(trainer):
            step = trainer.global_step
            self.events.append(("contributed", self.name, step))
            telemetry.contribute(
                trainer,
                self,
                telemetry.Share(
                    self.values(trainer.global_rank),
                    self.op,
                    lambda reduced: self._finish(reduced, step),
                    then=lambda: self.events.append(("then", self.name, step)),
                ),
            )

    def _finish(self, reduced: list[Any], step: int) -> dict[str, float]:
        self.events.append(("finished", self.name, reduced))
        return {f"test/{self.name}": float(step)}


class _CountAllReduces(Callback):
    """``first`` (first in the callback list) and the last: the telemetry's all-reduces in each step."""

    def __init__(self, events: list[Any]) -> None:
        self.events, self.counts, self._n = events, [], 0
        self.first = Callback()
        self.first.on_train_batch_start = lambda *args: setattr(self, "_n", 0)  # type: ignore[method-assign]

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        original = torch.distributed.all_reduce

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._n += sys._getframe(1).f_globals["__name__"] == telemetry.__name__
            return original(*args, **kwargs)

        torch.distributed.all_reduce = counted
        self._restore = lambda: setattr(torch.distributed, "all_reduce", original)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.counts.append(self._n)
        self.events.append(("published", trainer.global_step, float(trainer.callback_metrics.get("test/sum", -1))))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._restore()


def _shared_round(world: int) -> dict[str, Any]:
    """Three telemetry parts (sum, max, gather) with a plain callback among them, at dp=2, logging every 2nd step."""
    seed_everything(0, verbose=False)
    events: list[Any] = []
    count = _CountAllReduces(events)
    parts = [
        _Part("sum", "sum", lambda r: [r + 1.0, 10.0], events),
        Callback(),
        _Part("max", "max", lambda r: [5.0 - r, 7.0 * r], events),
        _Part("gather", "gather", lambda r: [r, -r], events),
    ]
    trainer = quiet_trainer(
        devices=world, strategy="ddp", max_steps=4, log_every_n_steps=2, callbacks=[count.first, *parts, count]
    )
    trainer.fit(GPTLightningModule(CONFIG), datamodule=TextDataModule(seq_len=SEQ, global_batch_size=BATCH))
    return {"events": events, "all_reduces": count.counts}


HFU_CASES: dict[str, tuple[dict[str, int], int, str]] = {
    # (layout, layers, activation_checkpointing); selective wraps every 2nd block of each pipeline rank's.
    "dp2-full": ({"data_parallel": 2}, 3, "full"),
    "dp2-selective": ({"data_parallel": 2}, 3, "selective"),  # 2 of 3 blocks, not 3/2
    "pp2-full": ({"data_parallel": 1, "pipeline_parallel": 2}, 6, "full"),
    "pp2-selective": ({"data_parallel": 1, "pipeline_parallel": 2}, 6, "selective"),  # 2 of each rank's 3
}


def _hfu(world: int, case: str) -> dict[str, Any]:
    """MFU and HFU as logged under the strategy's activation checkpointing, and the blocks it wrapped here."""
    layout, layers, mode = HFU_CASES[case]
    seed_everything(0, verbose=False)
    last = LastMetrics()
    strategy = HybridParallelStrategy(
        **layout,
        activation_checkpointing=mode,
        activation_checkpointing_every=2,
        **({"microbatches": 2} if layout.get("pipeline_parallel", 1) > 1 else {}),
    )
    trainer = quiet_trainer(
        devices=world, strategy=strategy, max_steps=2, callbacks=[Throughput(peak_flops=PEAK), last]
    )
    config = GPTConfig(n_layers=layers, d_model=32, n_heads=2, block_size=16)
    trainer.fit(GPTLightningModule(config), datamodule=TextDataModule(seq_len=SEQ, global_batch_size=BATCH))
    module, pipeline = trainer.lightning_module, trainer.strategy.pipeline
    wrapped = [n for n, m in module.named_modules() if getattr(m, "_lightning_scale_checkpointed", False)]
    held = len(pipeline.block_modules()) if pipeline is not None else layers
    return {"mfu": last.metrics["train/mfu"], "hfu": last.metrics["train/hfu"], "wrapped": wrapped, "held": held}


CASES_2: dict[str, Any] = {
    "cost": _cost_on_two,
    "pp2": lambda w: _facts_at(w, data_parallel=1, pipeline_parallel=2),
    "stack-pp2": _stack_facts,
    "tp2": lambda w: _facts_at(w, data_parallel=1, tensor_parallel=2),
    "bubble-m2": lambda w: _bubble(w, 2),
    "bubble-m8": lambda w: _bubble(w, 8),
    "stragglers": _stragglers,
    "shared-round": _shared_round,
    **{f"hfu-{case}": (lambda w, case=case: _hfu(w, case)) for case in HFU_CASES},
}


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return run_distributed(run_cases, 2, __name__, "CASES_2", timeout=240)


@pytest.mark.parametrize("layout", ["pp2", "tp2"])
def test_parameter_count_and_flops_are_the_whole_models_at_every_layout(two: list[dict[str, Any]], layout: str) -> None:
    whole = _facts_at(1)
    for rank in two:
        params, non_embedding, local, flops = rank[layout]
        assert (params, non_embedding, flops) == (whole[0], whole[1], whole[3])
        if layout == "pp2":
            assert local < params  # each stage holds only its blocks: the facts were taken before the cut


def _training_step_flops(module: GPTLightningModule) -> int:
    tokens = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        module.model(tokens).float().sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("case", list(HFU_CASES))
def test_hfu_is_the_flop_counters_count_of_a_step_with_the_blocks_the_strategy_checkpointed(
    two: list[dict[str, Any]], case: str
) -> None:
    """HFU/MFU against FlopCounterMode over a training step of the whole model (meta tensors) with the
    package's checkpointing wrapped around the very blocks the ranks wrapped; no block is recomputed
    whole (the last linear layer is not) and the head is not at all, so ``1 + f/3`` overstates it."""
    layout, layers, mode = HFU_CASES[case]
    ranks = [rank[f"hfu-{case}"] for rank in two]
    wrapped = sorted({name for rank in ranks for name in rank["wrapped"]})
    pipelined = layout.get("pipeline_parallel", 1) > 1
    held = [rank["held"] for rank in ranks] if pipelined else [layers]
    assert len(wrapped) == (layers if mode == "full" else sum(math.ceil(n / 2) for n in held)), wrapped
    with torch.device("meta"):
        module = GPTLightningModule(GPTConfig(n_layers=layers, d_model=32, n_heads=2, block_size=16))
    plain = _training_step_flops(module)
    for name in wrapped:
        apply_activation_checkpointing([module.get_submodule(name)], "full")
    hardware = _training_step_flops(module)
    for rank in ranks:
        assert rank["hfu"] / rank["mfu"] == pytest.approx(hardware / plain, rel=0.01)


def test_the_measured_bubble_falls_with_microbatches_and_is_near_the_prediction(two: list[dict[str, Any]]) -> None:
    m2, m8 = two[0]["bubble-m2"], two[0]["bubble-m8"]
    assert (m2["pipeline/bubble_predicted"], m8["pipeline/bubble_predicted"]) == pytest.approx((1 / 3, 1 / 9))
    assert m8["pipeline/bubble_measured"] < m2["pipeline/bubble_measured"]
    for metrics in (m2, m8):
        # Within 0.15 of the ideal share. Measured idle: 0.343 and 0.133; with two busy loops beside
        # the two ranks on two cores, 0.384 and 0.206 (the real bubble against CPU work: benchmarks/pipeline.py).
        assert abs(metrics["pipeline/bubble_measured"] - metrics["pipeline/bubble_predicted"]) < 0.15, metrics
        # The stages' compute and idle time add up to the schedule's; the step's parts to the step.
        stages = sum(metrics[f"pipeline/stage{k}/{part}"] for k in (0, 1) for part in ("compute", "idle")) / 2
        bubble = metrics["pipeline/bubble_measured"]
        assert metrics["train/step_time/bubble"] == pytest.approx(bubble * stages, rel=1e-6)
        parts = ("data", "compute", "comm", "optimizer", "checkpoint", "bubble")
        assert metrics["train/step_time/total"] == pytest.approx(sum(metrics[f"train/step_time/{p}"] for p in parts))
        assert metrics["train/step_time/comm"] > 0  # the pipeline's loss broadcast, timed
    assert two[0]["bubble-m8"] == two[1]["bubble-m8"]  # every rank logs the same figures


def test_a_rank_slowed_on_purpose_is_flagged_with_its_host_and_the_other_is_not(two: list[dict[str, Any]]) -> None:
    for rank in two:
        flagged = rank["stragglers"]
        assert flagged and {r for _, r, _, _ in flagged} == {1}, flagged
        assert all(host == socket.gethostname() and ratio > 1.3 for _, _, host, ratio in flagged)


def test_the_telemetry_parts_of_a_logging_step_share_one_all_reduce_and_publish_before_later_callbacks(
    two: list[dict[str, Any]],
) -> None:
    for rank in two:
        events, counts = rank["shared-round"]["events"], rank["shared-round"]["all_reduces"]
        assert counts == [0, 1, 0, 1]  # one all-reduce at each logging step (2 and 4) for the three parts
        for step in (2, 4):
            start = events.index(("contributed", "sum", step))
            assert events[start : start + 10] == [
                ("contributed", "sum", step),
                ("contributed", "max", step),
                ("contributed", "gather", step),
                ("finished", "sum", [1.0 + 2.0, 20.0]),  # summed over the ranks
                ("finished", "max", [5.0, 7.0]),  # the largest of each
                ("finished", "gather", [[0.0, 0.0], [1.0, -1.0]]),  # every rank's, by rank
                ("then", "sum", step),
                ("then", "max", step),
                ("then", "gather", step),
                ("published", step, float(step)),  # in callback_metrics before the callbacks after them run
            ]


def test_stragglers_and_advisor_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"factor=1 must be a number above 1"):
        StragglerMonitor(factor=1)
    with pytest.raises(ValueError, match=r"mtbf_hours=0 must be a positive number of hours"):
        CheckpointIntervalAdvisor(mtbf_hours=0)


# ---------------------------------------------------------------------------- throughput and MFU


def test_throughput_and_mfu_from_a_patched_clock_equal_hand_computed_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_steps, "clock", FakeClock(0.25))  # every step takes 0.25 s
    logged = _fit([Throughput(window=2, peak_flops=1e9, recomputed_flops_per_token=1000.0)], steps=4)
    last = logged.steps[-1]
    tokens_per_sec = BATCH * SEQ / 0.25
    assert last["train/tokens_per_sec"] == pytest.approx(tokens_per_sec)
    assert last["train/tokens_per_sec_per_device"] == pytest.approx(tokens_per_sec)
    assert last["train/samples_per_sec"] == pytest.approx(BATCH / 0.25)
    assert last["train/tokens"] == 4 * BATCH * SEQ
    assert last["train/mfu"] == pytest.approx(FLOPS_PER_TOKEN * tokens_per_sec / 1e9)
    assert last["train/hfu"] == pytest.approx((FLOPS_PER_TOKEN + 1000.0) * tokens_per_sec / 1e9)  # the override
    assert "train/peak_flops_measured" not in last


def test_on_cpu_the_peak_is_measured_and_logged_as_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    last = _fit([Throughput()], steps=2).steps[-1]
    assert last["train/peak_flops_measured"] > 1e8  # any CPU does 0.1 GFLOP/s in fp32
    assert 0 < last["train/mfu"] < 1
    assert last["train/mfu"] == pytest.approx(
        FLOPS_PER_TOKEN * last["train/tokens_per_sec"] / last["train/peak_flops_measured"]
    )  # against the measured peak
    assert "train/hfu" not in last  # nothing recomputed


def test_an_unknown_device_warns_naming_the_override_and_logs_no_mfu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(telemetry, "device_name", lambda trainer: "NVIDIA GeForce RTX 3090")
    with pytest.warns(UserWarning) as warned:
        last = _fit([Throughput(), CostMonitor()], steps=2).steps[-1]
    messages = "\n".join(str(w.message) for w in warned)
    assert re.search(
        r"no dense peak FLOP/s is known for 'NVIDIA GeForce RTX 3090'.*Pass Throughput\(peak_flops=\.\.\.\)", messages
    ), messages
    assert re.search(
        r"no price is known for 'NVIDIA GeForce RTX 3090'.*Pass CostMonitor\(price_per_device_hour=", messages
    ), messages
    assert "train/tokens_per_sec" in last and "train/mfu" not in last and "cost/usd" not in last


class Opaque(StackModule):
    """No config, no forward, and a training step that needs the batch's values."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        keep = int(batch[0][0, 0].item()) % 3 + 1
        return lm_loss(self.net(batch[0][:, :keep]), batch[1][:, :keep])


def _mfu_of(module: Any) -> tuple[Throughput, float | None, float]:
    seed_everything(0, verbose=False)
    logged, throughput = Logged(), Throughput(peak_flops=PEAK)
    trainer = quiet_trainer(max_steps=2, callbacks=[throughput, logged])
    trainer.fit(module, datamodule=TextDataModule(seq_len=SEQ, global_batch_size=BATCH))
    return throughput, logged.steps[-1].get("train/mfu"), logged.steps[-1]["train/tokens_per_sec"]


def test_a_user_module_with_no_config_or_forward_has_its_training_step_counted() -> None:
    throughput, mfu, tokens_per_sec = _mfu_of(StackModule())
    assert throughput.facts.source == "measured" and throughput.facts.flops_per_token(SEQ) == 6 * STACK_N
    assert tokens_per_sec > 0 and mfu == pytest.approx(6 * STACK_N * tokens_per_sec / PEAK)  # the counted FLOPs


def test_a_user_module_is_counted_before_the_pipeline_cuts_it(two: list[dict[str, Any]]) -> None:
    for rank in two:
        assert rank["stack-pp2"] == ("measured", 6 * STACK_N)


def test_a_model_without_flops_warns_naming_the_hook() -> None:
    with pytest.warns(UserWarning, match=r"FLOPs per token of Opaque are unknown.*Define Opaque\.flops_per_token"):
        assert _mfu_of(Opaque())[1] is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"window": 0}, r"window=0 must be a positive integer \(1 or more\)\. It counts optimizer steps\."),
        ({"peak_flops": -1.0}, r"peak_flops=-1.0 must be a positive number of FLOP/s per device"),
        (
            {"recomputed_flops_per_token": -1.0},
            r"recomputed_flops_per_token=-1.0 must be a number >= 0: the FLOPs "
            r"per token that recomputing .* Pass None to have them counted",
        ),
    ],
)
def test_throughput_rejects_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Throughput(**kwargs)


def test_checkpointed_blocks_whose_recomputation_was_not_counted_warn_naming_the_override() -> None:
    throughput = Throughput()
    throughput.facts = ModelFacts.of(GPTLightningModule(CONFIG))
    throughput.facts.checkpointed_blocks = (0, 1)
    throughput._warned_recomputed = False
    with pytest.warns(
        UserWarning,
        match=r"wraps 2 blocks, but what their recomputation costs was not counted.*"
        r"train/hfu is not logged\. Pass Throughput\(recomputed_flops_per_token=\.\.\.\)",
    ):
        assert throughput._recomputed(SEQ) == 0.0


# ---------------------------------------------------------------------------- step time, checkpoint interval


def test_young_and_daly_intervals() -> None:
    cost, mtbf = 60.0, 24 * 3600.0
    assert young_interval(cost, mtbf) == pytest.approx(math.sqrt(2 * 60 * 86400))
    ratio = cost / (2 * mtbf)
    assert daly_interval(cost, mtbf) == pytest.approx(
        young_interval(cost, mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost
    )
    assert daly_interval(100.0, 40.0) == 40.0  # a checkpoint costing more than two MTBFs: every MTBF
    with pytest.raises(ValueError, match=r"cost_s=-1 must be >= 0 and mtbf_s=1 > 0"):
        young_interval(-1, 1)


def test_step_time_parts_and_the_checkpoint_interval_from_timed_saves(tmp_path: Any) -> None:
    save = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    advisor = CheckpointIntervalAdvisor(mtbf_hours=24)
    logged = _fit([StepTimeBreakdown(), advisor, save], steps=4, enable_checkpointing=True)
    last = logged.steps[-1]
    parts = [last[f"train/step_time/{p}"] for p in ("data", "compute", "comm", "optimizer", "checkpoint")]
    assert all(p >= 0 for p in parts) and last["train/step_time/compute"] > 0
    # ModelCheckpoint saves after the other callbacks' batch end: step 2's save is in step 3's figures.
    assert logged.steps[2]["train/step_time/checkpoint"] > 0 and logged.steps[1]["train/step_time/checkpoint"] == 0
    assert last["train/step_time/total"] == pytest.approx(sum(parts))
    assert "pipeline/bubble_measured" not in last and last["train/step_time/comm"] == 0  # one process: none
    assert torch.distributed.all_reduce.__name__ == "all_reduce"  # the timing wrappers are gone after the fit
    cost = last["checkpoint/save_s"]
    assert cost > 0 and last["checkpoint/interval_daly_s"] == pytest.approx(daly_interval(cost, 24 * 3600))
    assert last["checkpoint/interval_daly_steps"] > 0


# ---------------------------------------------------------------------------- cost


def test_one_hour_on_eight_devices_costs_eight_device_hours() -> None:
    meter = CostMeter(usd_per_device_hour=2.5)
    meter.advance(seconds=3600.0, devices=8, tokens=1e6)
    metrics = meter.metrics(steps_done=100, max_steps=300, devices=8, seconds_per_step=36.0)
    assert metrics["cost/usd"] == pytest.approx(8 * 2.5)
    assert metrics["cost/usd_per_1m_tokens"] == pytest.approx(20.0)
    assert metrics["cost/projected_usd"] == pytest.approx(3 * 20.0)
    assert metrics["cost/projected_hours"] == pytest.approx(3.0)
    assert "energy/kwh" not in metrics  # no power readings: no energy, never a guess
    meter.advance(seconds=3600.0, devices=8, tokens=0, joules=7.2e6)
    assert meter.metrics(steps_done=0, max_steps=None, devices=8, seconds_per_step=None, grid_kg_co2_per_kwh=0.5)[
        "energy/co2_kg"
    ] == pytest.approx(1.0)


def test_cost_counts_every_device(two: list[dict[str, Any]]) -> None:
    for rank in two:
        # Readings at fit start, at the logging steps 2 and 4 and at the end: 2700 s on 2 devices at $3/h.
        assert rank["cost"]["cost/usd"] == pytest.approx(2700 / 3600 * 2 * 3.0)
        assert rank["cost"]["cost/usd_per_1m_tokens"] == pytest.approx(
            rank["cost"]["cost/usd"] / (4 * BATCH * SEQ) * 1e6
        )
        # Only rank 1 could read its energy: both ranks entered the energy all-reduce (or the fit would
        # have hung), and a partial sum is not reported as the job's energy.
        assert "energy/kwh" not in rank["cost"]


def test_every_price_row_has_a_source_and_a_month() -> None:
    offers = [price for prices in OFFERS.values() for price in prices]
    assert len(offers) > len(PRICES) and all(PRICES[key] is prices[0] for key, prices in OFFERS.items())
    for price in offers:
        assert re.fullmatch(r"https?://\S+.*", price.source), price  # a URL first, then how it was read
        assert re.fullmatch(r"20\d\d-(0[1-9]|1[0-2])", price.date), price
        assert price.usd_per_device_hour > 0 and price.offer, price
    # Other clouds than AWS are listed, and their offers are alternatives, never the default.
    assert any("Lambda" in p.offer for p in offers) and all(p.offer.startswith("AWS") for p in PRICES.values())


def test_prices_are_per_gpu_of_the_8_gpu_instances_after_the_2025_cut() -> None:
    # AWS's June 2025 on-demand prices of the nodes people train on, divided by their 8 GPUs.
    assert device_price("NVIDIA H100 80GB HBM3").usd_per_device_hour == pytest.approx(55.04 / 8)
    assert device_price("NVIDIA H200").usd_per_device_hour == pytest.approx(63.296 / 8)
    assert device_price("NVIDIA A100-SXM4-40GB").usd_per_device_hour == pytest.approx(21.957642 / 8)
    assert device_price("NVIDIA A100-SXM4-80GB").usd_per_device_hour == pytest.approx(27.44705 / 8)
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-16GB"):
        assert "8x" in device_price(name).offer and device_price(name).date >= "2024-06", name
    for name in ("NVIDIA L4", "NVIDIA L40S", "NVIDIA A10G", "Tesla T4"):  # rented singly: labelled so
        assert "1-GPU instance" in device_price(name).offer, name
    assert [p.offer.split(",")[0] for p in device_offers("NVIDIA H100 80GB HBM3")] == [
        "AWS p5.48xlarge",
        "Lambda gpu_8x_h100_sxm5",
    ]


def test_a100_40gb_and_80gb_are_priced_apart_and_a_size_is_never_guessed() -> None:
    assert price_key("NVIDIA A100-SXM4-80GB") == price_key("NVIDIA A100 80GB PCIe") == "A100 80GB"
    assert price_key("NVIDIA A100-SXM4-40GB") == price_key("NVIDIA A100-PCIE-40GB") == "A100 40GB"
    big, small = device_price("NVIDIA A100-SXM4-80GB"), device_price("NVIDIA A100-SXM4-40GB")
    assert big.usd_per_device_hour > small.usd_per_device_hour and "80GB" in big.offer and "40GB" in small.offer
    assert (
        device_price("Tesla V100-SXM2-32GB").usd_per_device_hour
        > device_price("Tesla V100-SXM2-16GB").usd_per_device_hour
    )
    assert (
        price_key("NVIDIA A100") is None and device_price("NVIDIA A100") is None and device_offers("NVIDIA A100") == ()
    )
    assert price_key("NVIDIA H100 80GB HBM3") == "H100 SXM"  # priced by chip alone where memory does not differ


def test_prices_are_checked() -> None:
    assert device_price("NVIDIA GeForce RTX 3090") is None and device_offers("NVIDIA GeForce RTX 3090") == ()
    assert price_multiplier("spot") < price_multiplier("reserved") < price_multiplier("on_demand") == 1.0
    with pytest.raises(ValueError, match=r"pricing='cheap' must be one of \['on_demand', 'reserved', 'spot'\]"):
        CostMonitor(pricing="cheap")
    with pytest.raises(ValueError, match=r"price_per_device_hour=-2 must be a non-negative number"):
        CostMonitor(price_per_device_hour=-2)


def test_cost_monitor_takes_the_table_price_of_the_device_by_chip_and_memory(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_steps, "clock", FakeClock(600.0))  # ten simulated minutes per reading
    monkeypatch.setattr(telemetry, "device_name", lambda trainer: "NVIDIA A100-SXM4-80GB")
    with caplog.at_level("INFO"):
        last = _fit([CostMonitor()], steps=3).steps[-1]
    assert last["cost/usd"] == pytest.approx(3 * 600 / 3600 * 27.44705 / 8)  # p4de.24xlarge / 8, not p4d's 40GB
    assert re.search(r"\$3\.431/device-hour x 1\.0 \(AWS p4de\.24xlarge.*2025-06, https://.*also Lambda", caplog.text)


@pytest.mark.parametrize("sharded", [False, True], ids=["ckpt-file", "sharded-dir"])
def test_cost_is_booked_per_device_hour_and_continues_after_resume(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, sharded: bool
) -> None:
    monkeypatch.setattr(_steps, "clock", FakeClock(600.0))  # ten simulated minutes per reading
    strategy = (lambda: HybridParallelStrategy()) if sharded else (lambda: "auto")
    save = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_last=False)
    logged = _fit(
        [CostMonitor(price_per_device_hour=6.0, target_loss=100.0), save],
        steps=3,
        enable_checkpointing=True,
        strategy=strategy(),
    )
    first = logged.steps[-1]
    # Readings: fit start, then one per step: 3 x 10 minutes on one device at $6/h.
    assert first["cost/usd"] == pytest.approx(3 * 600 / 3600 * 6.0)
    assert first["cost/usd_per_1m_tokens"] == pytest.approx(first["cost/usd"] / (3 * BATCH * SEQ) * 1e6)
    assert first["cost/hours_to_target"] == pytest.approx(600 / 3600)  # train/loss <= 100 at the first step
    assert first["cost/projected_hours"] == pytest.approx(3 * 600 / 3600)  # max_steps reached
    assert "energy/kwh" not in first
    seed_everything(0, verbose=False)
    logged = Logged()
    trainer = quiet_trainer(
        max_steps=4, strategy=strategy(), callbacks=[CostMonitor(price_per_device_hour=6.0), logged]
    )
    trainer.fit(
        GPTLightningModule(CONFIG),
        datamodule=TextDataModule(seq_len=SEQ, global_batch_size=BATCH),
        ckpt_path=save.best_model_path or save.last_model_path,
    )
    resumed = logged.steps[-1]
    # The saved total (3 steps and the save's reading) plus this run's start and one step.
    assert resumed["cost/usd"] > first["cost/usd"] + 600 / 3600 * 6.0
    assert resumed["cost/hours_to_target"] == pytest.approx(600 / 3600)  # kept from the first run


# ---------------------------------------------------------------------------- numerical health


class NaNAt(GPTLightningModule):
    """The loss is NaN at one global step, once."""

    def __init__(self, bad_step: int) -> None:
        super().__init__(CONFIG, learning_rate=3e-3)
        self.bad_step, self.fired = bad_step, False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step == self.bad_step and not self.fired:
            self.fired = True
            return loss * float("nan")
        return loss


class Snapshots(Callback):
    """A flat copy of the parameters after every batch (after the callbacks before it)."""

    def __init__(self) -> None:
        self.after: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.after.append(torch.cat([p.detach().flatten().clone() for p in pl_module.parameters()]))


def _health_run(
    policy: str, tmp_path: Any, steps: int = 6, bad_step: int = 3
) -> tuple[Any, NumericalHealth, Snapshots, list[str]]:
    seed_everything(0, verbose=False)
    health, snaps = NumericalHealth(policy, min_history=2), Snapshots()
    save = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    trainer = quiet_trainer(
        max_steps=steps, strategy=HybridParallelStrategy(), enable_checkpointing=True, callbacks=[health, snaps, save]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(NaNAt(bad_step), datamodule=TextDataModule(seq_len=SEQ, global_batch_size=BATCH))
    return trainer, health, snaps, [str(w.message) for w in caught]


@pytest.mark.parametrize("policy", ["warn", "skip", "stop", "rollback"])
def test_an_injected_nan_triggers_each_policy(policy: str, tmp_path: Any) -> None:
    trainer, health, snaps, messages = _health_run(policy, tmp_path)
    assert health.events[0][:2] == (3, "non-finite loss (nan)")
    assert len(health.events) == 1 or policy == "warn"  # warned, the NaN step poisons the weights: NaN after
    assert any("NumericalHealth at global step 3: non-finite loss (nan)" in m for m in messages), messages
    bad = 3  # the batch index of the NaN step (one batch per step)
    finite = bool(torch.isfinite(snaps.after[-1]).all())
    if policy == "warn":
        assert not finite  # the NaN step was taken
        return
    assert finite
    if policy != "rollback":
        assert torch.equal(snaps.after[bad], snaps.after[bad - 1])  # the NaN step was not taken
    if policy == "skip":
        assert len(snaps.after) == 6 and health.skipped == 1
    elif policy == "stop":
        assert len(snaps.after) == bad + 1 and trainer.should_stop
    else:
        # Rolled back to the step-2 checkpoint (after batch index 1), then trained to the end.
        assert health.rollbacks == 1 and any("rolled back to" in m and "step=2" in m for m in messages), messages
        assert torch.equal(snaps.after[bad], snaps.after[1])
        assert len(snaps.after) == 6 and not torch.equal(snaps.after[-1], snaps.after[bad])


def test_a_loss_spike_is_flagged_and_ordinary_noise_is_not() -> None:
    detector = LossSpikeDetector(window=10, zscore=4.0, min_history=5)
    for value in (2.0, 2.1, 1.9, 2.05, 1.95, 2.0, 2.02):
        assert detector.check(value).healthy
    spike = detector.check(5.0)
    assert not spike.healthy and spike.zscore > 4 and "loss spike: 5 is" in spike.reason
    assert detector.check(1.98).healthy  # the spike did not enter the window
    assert not detector.check(2.0, grad_norm=float("inf")).healthy


def test_health_needs_our_precision_plugin_and_valid_arguments() -> None:
    with pytest.raises(ValueError, match=r"policy='undo' must be one of"):
        NumericalHealth("undo")
    with pytest.raises(ValueError, match=r"min_history=1 must be an integer between 2 and window=100"):
        NumericalHealth(min_history=1)
    trainer = quiet_trainer(max_steps=1, callbacks=[NumericalHealth("skip")])
    with pytest.raises(
        ValueError, match=r"precision plugin is .*Pass Trainer\(plugins=\[MixedPrecision\('32-true'\)\]\)"
    ):
        trainer.fit(GPTLightningModule(CONFIG), datamodule=TextDataModule(seq_len=SEQ, global_batch_size=BATCH))


class InfGradAt(Callback):
    """An infinite gradient (the loss finite) at global step 2."""

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_step == 2:
            next(pl_module.parameters()).grad.view(-1)[0] = float("inf")


@pytest.mark.parametrize("check", [True, False])
def test_a_non_finite_gradient_with_a_finite_loss_is_caught_when_the_norm_is_checked(check: bool) -> None:
    seed_everything(0, verbose=False)
    health = NumericalHealth("skip", check_grad_norm=check)
    trainer = quiet_trainer(max_steps=4, strategy=HybridParallelStrategy(), callbacks=[InfGradAt(), health])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(GPTLightningModule(CONFIG), datamodule=TextDataModule(seq_len=SEQ, global_batch_size=BATCH))
    # Unchecked, the infinite gradient is applied, and the next step's loss is NaN.
    expected = (2, "non-finite gradient norm (inf)") if check else (3, "non-finite loss (nan)")
    assert [e[:2] for e in health.events] == [expected]
    assert trainer.precision_plugin.stats_every_step is False  # put back when the fit ended


def test_energy_comes_from_nvml_counters_and_is_absent_without_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML and a GPU do not exist here: a stand-in module with NVML's three calls (its counter in mJ)."""
    from lightning_scale.callbacks.cost import _Energy

    readings = iter([1_000_000.0, 4_600_000.0, 8_200_000.0])  # mJ since the driver loaded
    fake = type(sys)("pynvml")
    fake.nvmlInit = lambda: None
    fake.nvmlDeviceGetHandleByIndex = lambda index: f"gpu{index}"
    fake.nvmlDeviceGetTotalEnergyConsumption = lambda handle: next(readings)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    energy = _Energy(torch.device("cuda", 1))
    assert energy.available and energy.take() == pytest.approx(3600.0) and energy.take() == pytest.approx(3600.0)
    assert not _Energy(torch.device("cpu")).available and _Energy(torch.device("cpu")).take() is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert not _Energy(torch.device("cuda", 0)).available


# ---------------------------------------------------------------------------- the console


@pytest.mark.parametrize("grouped", [False, True], ids=["apart", "in-a-group"])
def test_console_lines_show_the_figures_published_at_their_step_whatever_the_callback_order(
    capsys: pytest.CaptureFixture[str], grouped: bool
) -> None:
    # The console listed first, as conf/callbacks/default.yaml lists it: it still prints after Throughput, in
    # the command line's group of them too (the console runs after the group's other members).
    console = ConsoleLogger(every_n_steps=2, metrics=("train/tokens_per_sec",))
    checkpoint = ModelCheckpoint(dirpath=None, save_top_k=0)
    callbacks: list[Callback] = [console, checkpoint, Throughput(window=1, peak_flops=1e9)]
    logged = _fit(
        group_callbacks(callbacks) if grouped else callbacks, steps=4, log_every_n_steps=2, enable_checkpointing=True
    )
    printed = [float(x) for x in re.findall(r"train/tokens_per_sec ([\d.]+)", capsys.readouterr().out)]
    published = [logged.steps[step - 1]["train/tokens_per_sec"] for step in (2, 4)]
    assert printed == pytest.approx(published, abs=1e-4)
    assert len(set(published)) == 2  # the two steps' figures differ: a stale line would be seen


def test_console_lines_reach_their_log_for_the_runs_log_file(caplog: pytest.LogCaptureFixture) -> None:
    from lightning_scale.callbacks.console import CONSOLE_LOG

    handler = caplog.handler
    CONSOLE_LOG.addHandler(handler)
    CONSOLE_LOG.setLevel("INFO")
    try:
        _fit([ConsoleLogger(every_n_steps=2)], steps=2)
    finally:
        CONSOLE_LOG.removeHandler(handler)
    assert [r.getMessage().split(" | ")[0] for r in caplog.records if r.name == CONSOLE_LOG.name] == ["step 2/2"]


# ---------------------------------------------------------------------------- a CPU's peak


class _BusyThenSteadyClock:
    """``perf_counter`` for :mod:`lightning_scale.core.telemetry.peaks`: each reading advances ``tick`` seconds,
    20 times that during the first ``busy`` readings (a busy moment of the machine)."""

    def __init__(self, tick: float, busy: int) -> None:
        self.tick, self.busy, self.now, self.readings = tick, busy, 0.0, 0

    def perf_counter(self) -> float:
        self.readings += 1
        self.now += self.tick * (20 if self.readings <= self.busy else 1)
        return self.now


def test_a_busy_moment_does_not_set_the_measured_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_scale.core.telemetry import peaks

    size, tick = 16, 1e-3
    clock = _BusyThenSteadyClock(tick, busy=4)  # the first timing on a busy machine
    monkeypatch.setattr(peaks, "time", clock)
    monkeypatch.setattr(peaks, "_MEASURED", {})
    peak = peaks.measured_peak("float32", size=size, seconds=50 * tick)
    assert peak == pytest.approx(2 * size**3 / tick, rel=0.05)  # the steady rate: the median of the repeats


def test_a_dtype_without_fast_kernels_is_measured_on_a_smaller_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    # float16 matmuls on a CPU took 1.7 s each at 1024^2: 7 repeats of 2 made a 2-step fp16 run spend
    # 30 s measuring its peak. Here every matmul takes 1 s of a fake clock: the size halves down to 128.
    from lightning_scale.core.telemetry import peaks

    class Clock:
        now = 0.0

        def perf_counter(self) -> float:
            return self.now

    clock, sizes, real_mm = Clock(), [], torch.mm

    def slow_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        sizes.append(a.shape[0])
        clock.now += 1.0
        return real_mm(a, b)

    monkeypatch.setattr(peaks, "time", clock)
    monkeypatch.setattr(peaks, "_MEASURED", {})
    monkeypatch.setattr(peaks.torch, "mm", slow_mm)
    peak = peaks.measured_peak("float16", size=1024, seconds=0.05)
    assert sorted(set(sizes), reverse=True) == [1024, 512, 256, 128]
    assert peak == pytest.approx(2 * 128**3)  # each repeat: two 1-s calls of 2 * 128^3 FLOPs


def test_the_peak_is_measured_once_per_machine_and_recorded_for_the_study(tmp_path: Any) -> None:
    from lightning_scale.core.telemetry.peaks import machine_key, recorded_peak

    path, calls = tmp_path / "study" / "peaks.json", []

    def measure() -> float:
        calls.append(1)
        return 3e10 + len(calls)

    key = machine_key("float32", 2)
    assert recorded_peak(path, key, measure) == (3e10 + 1, True)
    assert recorded_peak(path, key, measure) == (3e10 + 1, False)  # read, not measured again
    assert recorded_peak(path, machine_key("float64", 2), measure) == (3e10 + 2, True)
    assert len(calls) == 2 and socket.gethostname() in key and "processes=2" in key
    # Every job of a study then divides by the same figure.
    first = _fit([Throughput(window=1, peak_file=path)], steps=2).steps[-1]
    second = _fit([Throughput(window=1, peak_file=path)], steps=2).steps[-1]
    assert first["train/peak_flops_measured"] == second["train/peak_flops_measured"]


def test_an_mfu_above_one_is_a_measurement_error_never_logged_as_utilisation() -> None:
    with pytest.warns(
        UserWarning, match=r"x the peak of .* which is a measurement error, so train/mfu and train/hfu are not logged"
    ):
        last = _fit([Throughput(window=1, peak_flops=1.0, recomputed_flops_per_token=1e6)], steps=2).steps[-1]
    assert "train/mfu" not in last and "train/hfu" not in last
    # What is still logged is the model's own FLOPs at the measured rate (one device).
    assert last["train/tokens_per_sec"] > 0
    assert last["train/achieved_tflops_per_device"] == pytest.approx(
        FLOPS_PER_TOKEN * last["train/tokens_per_sec"] / 1e12
    )


def test_padding_left_out_of_the_token_count_leaves_the_flops_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_steps, "clock", FakeClock(0.25))
    half = _fit([Throughput(window=2, peak_flops=1e12, token_count=lambda batch: batch[0].numel() // 2)], steps=4)
    whole = _fit([Throughput(window=2, peak_flops=1e12)], steps=4)
    assert half.steps[-1]["train/tokens_per_sec"] == pytest.approx(whole.steps[-1]["train/tokens_per_sec"] / 2)
    assert half.steps[-1]["train/mfu"] == pytest.approx(whole.steps[-1]["train/mfu"])
    assert whole.steps[-1]["train/batches_per_sec"] == pytest.approx(1 / 0.25)
    assert whole.steps[-1]["train/achieved_tflops_per_device"] == pytest.approx(
        FLOPS_PER_TOKEN * BATCH * SEQ / 0.25 / 1e12
    )


# ---------------------------------------------------------------------------- memory


def test_memory_on_cpu_is_the_processs_resident_set() -> None:
    import resource

    from lightning_scale.callbacks import MemoryMonitor

    last = _fit([MemoryMonitor()], steps=2, log_every_n_steps=1).steps[-1]
    with open("/proc/self/status") as f:
        status = {
            line.split(":")[0]: int(line.split()[1]) * 1024 / 2**30 for line in f if line.startswith(("VmRSS", "VmHWM"))
        }
    rss_now = status["VmRSS"]
    # getrusage's peak lags the resident set (it read below it under two test workers); the kernel's
    # high-water mark does not.
    peak_now = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30, status["VmHWM"])
    assert 0 < last["memory/rss_gib"] <= last["memory/peak_rss_gib"] <= peak_now
    assert last["memory/rss_gib"] == pytest.approx(rss_now, rel=0.2)


def test_memory_on_a_gpu_is_the_intervals_peaks_and_the_allocators_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU here: CUDA's allocator statistics as the driver would give them (hardware that does not exist).
    from lightning_scale.callbacks import MemoryMonitor

    peaks = {"allocated": 3 * 2**30, "reserved": 5 * 2**30}
    resets: list[Any] = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peaks["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: peaks["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_alloc_retries": 2, "num_ooms": 1})
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    monitor = MemoryMonitor()
    monitor._device = torch.device("cuda", 0)
    assert monitor.read() == {
        "memory/peak_allocated_gib": 3.0,
        "memory/peak_reserved_gib": 5.0,
        "memory/alloc_retries": 2.0,
        "memory/ooms": 1.0,
    }
    assert resets == [torch.device("cuda", 0)]  # the next interval starts from zero


# ---------------------------------------------------------------------------- GPU timing (no GPU here)


class _GPUClock:
    """CUDA events on a fake GPU whose clock advances ``tick`` seconds at every recorded event (the
    host's clock, patched separately, disagrees); ``waits`` counts the reads that synchronise."""

    def __init__(self, tick: float) -> None:
        self.tick, self.now, self.waits = tick, 0.0, 0
        clock = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.at: float | None = None

            def record(self, stream: Any = None) -> None:
                clock.now += clock.tick
                self.at = clock.now

            def synchronize(self) -> None:
                clock.waits += 1

            def elapsed_time(self, end: Any) -> float:
                return (end.at - self.at) * 1e3  # milliseconds, as CUDA gives them

        self.Event = Event


class _WaitsPerStep(Callback):
    def __init__(self, gpu: _GPUClock) -> None:
        self.gpu, self.waits = gpu, []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.waits.append(self.gpu.waits)


@pytest.mark.parametrize("grouped", [False, True], ids=["apart", "grouped"])
def test_on_a_gpu_the_spans_are_cuda_event_times_read_only_at_logging_steps(
    monkeypatch: pytest.MonkeyPatch, grouped: bool
) -> None:
    gpu = _GPUClock(tick=0.1)
    monkeypatch.setattr(torch.cuda, "Event", gpu.Event)
    monkeypatch.setattr(_steps, "clock", FakeClock(5.0))  # the host's clock: must not be what is reported

    class OnGPU(StepTimeBreakdown):
        def record_options(self, trainer: Any) -> dict[str, Any]:
            return super().record_options(trainer) | {"cuda": True}  # a CPU trainer, timed as on a GPU

    waits = _WaitsPerStep(gpu)
    timed = OnGPU()
    last = _fit([CallbackGroup([timed]) if grouped else timed, waits], steps=4, log_every_n_steps=2).steps[-1]
    # Every span is one event apart on the GPU's clock: 0.1 s each, whatever the host's clock said.
    for part in ("data", "compute", "optimizer"):
        assert last[f"train/step_time/{part}"] == pytest.approx(0.1), part
    assert last["train/step_time/total"] == pytest.approx(0.3)
    # Events are read (waited for) at the logging steps 2 and 4 only, never on the steps between: one
    # wait per span, steps 1-2's compute and optimizer and step 2's data (step 1 has no data span before
    # it), then steps 3-4's three spans each.
    assert waits.waits == [0, 5, 5, 11]
