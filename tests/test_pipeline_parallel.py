"""Pipeline parallelism inside Lightning's loop: parity with one process.

The runs of one world size share one spawn (a module fixture); each test checks its own case.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import torch
from helpers.distributed import run_cases, run_distributed
from helpers.lightning import fit_error, quiet_trainer
from helpers.models import BlockStack, ListStack, StackModule
from helpers.parity import STEPS, RecordLoss, assert_parity, fit_gpt, full_parameters, single_process
from lightning.pytorch import LightningModule, seed_everything
from torch.utils.data import DataLoader, TensorDataset

import lightning_scale  # noqa: F401
from lightning_scale.core.pipeline.partition import SCHEDULES
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTConfig, GPTLightningModule
from lightning_scale.plugins.checkpoint_io import load_from_checkpoint
from lightning_scale.strategies import HybridParallelStrategy

CONFIG = GPTConfig(n_layers=4, d_model=32, n_heads=2, block_size=16, tie_embeddings=False)
TIED = GPTConfig(n_layers=4, d_model=32, n_heads=2, block_size=16, tie_embeddings=True)
DEEP = GPTConfig(n_layers=8, d_model=32, n_heads=2, block_size=16, tie_embeddings=True)
TOKENS = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))


def _pipeline(world: int, schedule: str, tp: int = 1) -> HybridParallelStrategy:
    pp = world // tp
    return HybridParallelStrategy(
        data_parallel=1, tensor_parallel=tp, pipeline_parallel=pp, schedule=schedule, microbatches=4
    )


def _predict(world: int, schedule: str) -> list[torch.Tensor]:
    seed_everything(0, verbose=False)
    trainer = quiet_trainer(devices=world, strategy=_pipeline(world, schedule), precision="64-true")
    return trainer.predict(GPTLightningModule(CONFIG), DataLoader(TensorDataset(TOKENS), batch_size=4))


# (case, what it runs) at pp=2: every schedule, fp32, tied weights with gradient accumulation,
# a second architecture, and predict.
PP2_CASES: dict[str, Any] = {
    **{schedule: lambda w, s=schedule: fit_gpt(_pipeline(w, s), w, CONFIG) for schedule in SCHEDULES},
    "fp32": lambda w: fit_gpt(_pipeline(w, "interleaved_1f1b"), w, CONFIG, precision="32-true"),
    **{
        f"tied-accumulate-{s}": lambda w, s=s: fit_gpt(_pipeline(w, s), w, TIED, steps=6, accumulate=2)
        for s in ("1f1b", "interleaved_1f1b")
    },
    "mlp": lambda w: _fit_mlp(HybridParallelStrategy(data_parallel=1, pipeline_parallel=w, microbatches=2), w),
    "module-list": lambda w: _fit_mlp(
        HybridParallelStrategy(data_parallel=1, pipeline_parallel=w, microbatches=2), w, ListStack
    ),
    **{f"predict-{s}": lambda w, s=s: _predict(w, s) for s in ("1f1b", "zbv")},
}
PP4_CASES: dict[str, Any] = {
    # 8 blocks: interleaved runs 8 stages, 2 per rank. The tied embedding and head live on ranks 0
    # and 3 only; their gradients are summed over just those two.
    "pp4-1f1b": lambda w: fit_gpt(_pipeline(w, "1f1b"), w, DEEP),
    "pp4-interleaved_1f1b": lambda w: fit_gpt(_pipeline(w, "interleaved_1f1b"), w, DEEP),
    # Sequence and loss parallel on (the defaults): stages exchange sequence shards, and the last
    # stage's loss runs on vocabulary-sharded logits.
    "pp2-tp2": lambda w: fit_gpt(_pipeline(w, "1f1b", tp=2), w, CONFIG),
}


@pytest.fixture(scope="module")
def pp2() -> list[dict[str, Any]]:
    return run_distributed(run_cases, 2, __name__, "PP2_CASES", timeout=420)


@pytest.fixture(scope="module")
def pp4() -> list[dict[str, Any]]:
    return run_distributed(run_cases, 4, __name__, "PP4_CASES", timeout=420)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_matches_one_process(pp2: list[dict[str, Any]], schedule: str) -> None:
    assert_parity([r[schedule] for r in pp2], single_process(CONFIG))


@pytest.mark.slow
def test_pp2_fp32_loss_curve_matches_one_process(pp2: list[dict[str, Any]]) -> None:
    # In fp32 the loss curve holds to 1e-5 (parameters cannot: AdamW's division by sqrt(v) + eps
    # amplifies reduction-order noise in tiny gradients, so parameter parity is checked in fp64).
    reference = single_process(CONFIG, precision="32-true")
    for result in pp2:
        torch.testing.assert_close(result["fp32"]["losses"], reference["losses"], rtol=1e-5, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_tied_weights_with_gradient_accumulation_match_one_process(pp2: list[dict[str, Any]], schedule: str) -> None:
    # The embedding and head tied across stages sum their gradients once per optimizer step, after the
    # window's last micro-step; summing after every micro-step counted the earlier ones again.
    reference = single_process(TIED, steps=6, accumulate=2)
    assert_parity([r[f"tied-accumulate-{schedule}"] for r in pp2], reference, rtol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["pp4-1f1b", "pp4-interleaved_1f1b"])
def test_pp4_matches_one_process(pp4: list[dict[str, Any]], case: str) -> None:
    assert_parity([r[case] for r in pp4], single_process(DEEP))


@pytest.mark.slow
def test_pp2_by_tp2_matches_one_process(pp4: list[dict[str, Any]]) -> None:
    assert_parity([r["pp2-tp2"] for r in pp4], single_process(CONFIG))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_predict_returns_the_last_stage_output_on_every_rank(pp2: list[dict[str, Any]], schedule: str) -> None:
    seed_everything(0, verbose=False)
    model = GPTLightningModule(CONFIG).double().eval()
    with torch.no_grad():
        expected = [model.model(TOKENS[:4]), model.model(TOKENS[4:])]
    for result in pp2:
        outputs = result[f"predict-{schedule}"]
        assert len(outputs) == 2
        for got, want in zip(outputs, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.slow
def test_second_architecture_pp2_matches_one_process(pp2: list[dict[str, Any]]) -> None:
    reference = _fit_mlp("auto", 1)
    for result in pp2:
        mlp = result["mlp"]
        torch.testing.assert_close(mlp["losses"], reference["losses"], rtol=1e-5, atol=0)
        assert mlp["state"].keys() == reference["state"].keys()
        for name, value in reference["state"].items():
            torch.testing.assert_close(mlp["state"][name], value, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
def test_blocks_in_a_module_list_pipeline_with_parity_and_their_checkpoint_loads_at_pp1(
    pp2: list[dict[str, Any]],
) -> None:
    reference = _fit_mlp("auto", 1, ListStack)
    for result in pp2:
        stack = result["module-list"]
        torch.testing.assert_close(stack["losses"], reference["losses"], rtol=1e-9, atol=0)
        # The stages' full state, under the whole model's names, loads into the unpruned model.
        whole = StackModule(ListStack()).double()
        whole.load_state_dict(stack["state"], strict=True)
        for name, value in reference["state"].items():
            torch.testing.assert_close(whole.state_dict()[name], value, rtol=1e-9, atol=1e-12, msg=name)


# ---------------------------------------------------------------- errors


def _errors(rank: int, world: int, cases: list[tuple[GPTConfig, dict[str, Any]]]) -> list[str]:
    messages = []
    for config, kwargs in cases:
        strategy = HybridParallelStrategy(data_parallel=1, pipeline_parallel=world, **kwargs)
        trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=1)
        data = TextDataModule(seq_len=16, global_batch_size=4)
        messages.append(fit_error(trainer, GPTLightningModule(config), datamodule=data))
    messages.append(_varying_shapes(world))
    return messages


ERRORS = [
    (
        GPTConfig(n_layers=1, tie_embeddings=False),
        {},
        r"pipeline_parallel=2 with 1 stage\(s\) per rank needs 2 blocks, but the model declares 1\. Lower pipeline_parallel",
    ),
    (
        GPTConfig(n_layers=6, tie_embeddings=False),
        {"schedule": "interleaved_1f1b", "microbatches": 4},
        r"schedule='interleaved_1f1b' places 2 stages on each of 2 ranks: the 6 blocks must divide into 4 equal stages",
    ),
    (CONFIG, {"microbatches": 3}, r"microbatches=3 does not divide the per-replica batch of 4 samples"),
]


@pytest.fixture(scope="module")
def errors() -> list[list[str]]:
    return run_distributed(_errors, 2, [(config, kwargs) for config, kwargs, _ in ERRORS], timeout=180)


@pytest.mark.parametrize(
    "case", range(len(ERRORS)), ids=["more-stages-than-blocks", "interleaved-blocks-not-divisible", "microbatches"]
)
def test_pipeline_errors_name_the_fix(errors: list[list[str]], case: int) -> None:
    for messages in errors:
        assert re.search(ERRORS[case][2], messages[case]), messages[case]


def test_batches_of_varying_shape_are_rejected(errors: list[list[str]]) -> None:
    for messages in errors:
        assert "need fixed-shape batches: the first batch had inputs of shape (4, 16), this one (2, 16)" in messages[-1]


def test_unknown_schedule_lists_the_valid_ones() -> None:
    with pytest.raises(
        ValueError, match=r"Unknown pipeline schedule 'pipedream'. Valid schedules: '1f1b', 'dualpipev'"
    ):
        HybridParallelStrategy(pipeline_parallel=2, schedule="pipedream")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"schedule": "interleaved_1f1b", "virtual_stages": 1},
            r"runs several stages per rank; set virtual_stages >= 2",
        ),
        ({"schedule": "1f1b", "microbatches": 1}, r"'1f1b' needs at least as many micro-batches as stages.*>= 2"),
        (
            {"schedule": "interleaved_1f1b", "microbatches": 5},
            r"microbatches=5 must be below 2 or a multiple of the 2 rounds",
        ),
        ({"schedule": "dualpipev", "microbatches": 2}, r"'dualpipev' needs at least .* \(2 x pipeline_parallel = 4\)"),
        ({"virtual_stages": 0}, r"virtual_stages=0 must be a positive integer"),
    ],
    ids=["virtual-stages", "1f1b-microbatches", "interleaved-rounds", "dualpipev-microbatches", "virtual-stages-0"],
)
def test_schedule_settings_torch_would_reject_are_refused_up_front(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HybridParallelStrategy(pipeline_parallel=2, **kwargs)


def test_unknown_partition_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"partition='by_magic' is not one of 'by_cost', 'by_layers', 'by_params'"):
        HybridParallelStrategy(pipeline_parallel=2, partition="by_magic")


def test_a_model_that_declares_no_blocks_is_rejected() -> None:

    from lightning_scale.strategies.hybrid.pipeline_hooks import pipeline_spec_of

    with pytest.raises(ValueError, match=r"declares no blocks: define `pipeline_spec\(self\)"):
        pipeline_spec_of(LightningModule())


def _pp2_fit_and_save(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    seed_everything(0, verbose=False)
    strategy = HybridParallelStrategy(data_parallel=1, pipeline_parallel=world, microbatches=4)
    trainer = quiet_trainer(devices=world, strategy=strategy, precision="64-true", max_steps=3)
    module = GPTLightningModule(CONFIG, learning_rate=3e-3)
    trainer.fit(module, datamodule=TextDataModule(seq_len=16, global_batch_size=8))
    trainer.save_checkpoint(path)
    return full_parameters(module, world)


def _pp2_load(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    strategy = HybridParallelStrategy(data_parallel=1, pipeline_parallel=world, microbatches=4)
    trainer = quiet_trainer(devices=world, strategy=strategy, precision="64-true", max_steps=3, limit_val_batches=1)
    module = GPTLightningModule(CONFIG)
    trainer.validate(module, datamodule=TextDataModule(seq_len=16, global_batch_size=8), ckpt_path=path, verbose=False)
    return full_parameters(module, world)


@pytest.mark.slow
def test_checkpoints_move_between_pp2_and_pp1(tmp_path) -> None:
    saved = run_distributed(_pp2_fit_and_save, 2, str(tmp_path / "pp2.ckpt"), timeout=180)[0]
    # pp=2 -> pp=1: every stage's parameters, under the original names.
    single = load_from_checkpoint(GPTLightningModule, tmp_path / "pp2.ckpt").double()
    assert single.state_dict().keys() == saved.keys()
    for name, value in single.state_dict().items():
        torch.testing.assert_close(value, saved[name].double(), rtol=1e-6, atol=0, msg=name)
    # pp=1 -> pp=2: a plain Lightning checkpoint of the single-process model loads into the stages.
    trainer = quiet_trainer(devices=1, max_steps=0)
    trainer.strategy.connect(single)
    trainer.save_checkpoint(tmp_path / "pp1.ckpt")
    loaded = run_distributed(_pp2_load, 2, str(tmp_path / "pp1.ckpt"), timeout=180)
    for result in loaded:
        for name, value in single.state_dict().items():
            torch.testing.assert_close(result[name].double(), value, rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------- a second architecture, through the public hook


def _fit_mlp(strategy: Any, devices: int, net: type[BlockStack] = BlockStack) -> dict[str, Any]:
    seed_everything(0, verbose=False)
    record = RecordLoss()
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy,
        precision="64-true",
        max_steps=STEPS,
        gradient_clip_val=0.5,
        callbacks=[record],
    )
    module = StackModule(net())
    trainer.fit(module, datamodule=TextDataModule(seq_len=16, global_batch_size=8))
    state = full_parameters(module, devices)
    return {"losses": record.losses, "state": {k: v.detach().clone() for k, v in state.items()}}


def _varying_shapes(world: int) -> str:
    strategy = HybridParallelStrategy(data_parallel=1, pipeline_parallel=world, microbatches=2)
    trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=3, use_distributed_sampler=False)
    tokens = torch.randint(0, 256, (6, 17))
    # 6 samples in batches of 4: the last batch has 2 (no drop_last).
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    return fit_error(trainer, StackModule(), train_dataloaders=loader)


# ---------------------------------------------------------------- by_cost: blocks with known costs


class _SlowBlock(torch.nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.linear = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x + self.linear(x)


SLOW_COSTS = (0.06, 0.01, 0.01, 0.01)


def _partition_ranges(rank: int, world: int) -> dict[str, tuple[Any, ...]]:
    ranges = {}
    for partition in ("by_cost", "by_layers"):
        strategy = HybridParallelStrategy(data_parallel=1, pipeline_parallel=world, microbatches=2, partition=partition)
        trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=1)
        slow = StackModule(BlockStack([_SlowBlock(c) for c in SLOW_COSTS]))
        trainer.fit(slow, datamodule=TextDataModule(seq_len=16, global_batch_size=4))
        part = trainer.strategy.pipeline.partition
        ranges[partition] = (part.ranges, part.costs)
    return ranges


def test_by_cost_puts_the_slow_block_alone_and_beats_by_layers() -> None:
    results = run_distributed(_partition_ranges, 2, timeout=120)
    by_cost, by_layers = [r["by_cost"] for r in results], [r["by_layers"] for r in results]
    assert all(r[0] == ((0, 1), (1, 4)) for r in by_cost), by_cost  # same cut on every rank
    assert by_layers[0][0] == ((0, 2), (2, 4))
    measured_slowest = max(by_cost[0][1])
    assert 0.055 < measured_slowest < 0.12  # the 0.06 s block (plus small first/last costs)
    # by_layers' stages under the same known costs: 0.07 vs 0.02 s; by_cost's: 0.06 vs 0.03 s.
    known = SLOW_COSTS
    assert max(sum(known[a:b]) for a, b in by_cost[0][0]) < max(sum(known[a:b]) for a, b in by_layers[0][0])
