"""Tensor parallelism: layouts, plans, and parity of HybridParallelStrategy with one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.distributed import run_cases, run_distributed
from helpers.lightning import quiet_trainer
from helpers.parity import STEPS, RecordLoss
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_scale  # noqa: F401  (registers the strategies)
from lightning_scale.callbacks import GradNormMonitor
from lightning_scale.core.parallel.layout import Layout, resolve_layout
from lightning_scale.core.parallel.tensor_parallel import resolve_plan
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPT, GPTConfig, GPTLightningModule, gpt_tensor_parallel_plan
from lightning_scale.plugins.checkpoint_io import load_from_checkpoint
from lightning_scale.strategies import HybridParallelStrategy

CONFIG = GPTConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, block_size=32)


# ---------------------------------------------------------------- layout and plans (no processes)


@pytest.mark.parametrize(
    ("world", "kwargs", "expected"),
    [
        (4, {"tensor_parallel": 2}, Layout(2, 1, 2)),
        (4, {}, Layout(4, 1, 1)),
        (8, {"tensor_parallel": "auto", "devices_per_node": 4}, Layout(2, 1, 4)),
        (4, {"data_parallel": 2, "tensor_parallel": "auto"}, Layout(2, 1, 2)),
    ],
)
def test_resolve_layout(world: int, kwargs: dict, expected: Layout) -> None:
    assert resolve_layout(world, **kwargs) == expected


@pytest.mark.parametrize(
    ("world", "kwargs", "match"),
    [
        (
            4,
            {"data_parallel": 2, "tensor_parallel": 4},
            r"data_parallel=2 x pipeline_parallel=1 x tensor_parallel=4 = 8 processes, but this run has 4",
        ),
        (6, {"tensor_parallel": 4}, r"tensor_parallel=4 = 4 does not divide the 6 processes.*\[1, 2, 3, 6\]"),
        (4, {"tensor_parallel": 0}, r"tensor_parallel=0 must be a positive integer or 'auto'"),
    ],
)
def test_resolve_layout_rejects_bad_sizes(world: int, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_layout(world, **kwargs)


def test_strategy_rejects_bad_sizes_at_construction() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel='two' must be a positive integer or 'auto'"):
        HybridParallelStrategy(tensor_parallel="two")  # type: ignore[arg-type]


def test_strategy_is_registered_by_name() -> None:
    trainer = Trainer(strategy="tensor_parallel", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, HybridParallelStrategy)
    trainer = Trainer(strategy="hybrid", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, HybridParallelStrategy)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (
            GPTConfig(n_heads=6, d_model=96, n_kv_heads=2),
            r"n_heads=6 is not divisible by tensor_parallel=4.*\[1, 2, 3, 6\]",
        ),
        (GPTConfig(n_heads=4, n_kv_heads=1), r"n_kv_heads=1 is not divisible by tensor_parallel=4"),
        (GPTConfig(vocab_size=258), r"vocab_size=258 is not divisible by tensor_parallel=4"),
    ],
)
def test_gpt_plan_rejects_shapes_that_do_not_split(config: GPTConfig, match: str) -> None:
    with torch.device("meta"):
        model = GPT(config)
    with pytest.raises(ValueError, match=match):
        gpt_tensor_parallel_plan(model, 4)


def test_plan_key_matching_nothing_lists_close_names() -> None:
    model = GPT(CONFIG)
    with pytest.raises(ValueError, match=r"key 'blocks.\*.attn.wqq' matches no module of GPT.*'blocks.\*.attn.wq'"):
        resolve_plan(model, {"blocks.*.attn.wqq": "colwise"})


def test_plan_unknown_style_lists_the_valid_ones() -> None:
    with pytest.raises(
        ValueError, match=r"unknown style 'column'. Use one of 'colwise', 'rowwise', 'sequence_parallel'"
    ):
        resolve_plan(GPT(CONFIG), {"head": "column"})
    with pytest.raises(TypeError, match=r"maps to int"):
        resolve_plan(GPT(CONFIG), {"head": 3})


def test_plan_patterns_match_one_segment_and_expand() -> None:
    plan = resolve_plan(GPT(CONFIG), {"blocks.*.mlp.fc": "colwise", "head": "colwise"})
    assert sorted(plan) == ["blocks.0.mlp.fc", "blocks.1.mlp.fc", "head"]
    with pytest.raises(
        ValueError, match=r"matched by tensor-parallel plan keys 'blocks.\*.mlp.fc' and 'blocks.0.mlp.fc'"
    ):
        resolve_plan(GPT(CONFIG), {"blocks.*.mlp.fc": "colwise", "blocks.0.mlp.fc": "rowwise"})


# ---------------------------------------------------------------- a second architecture


class ResidualMLP(nn.Module):
    """Token embedding, residual MLP blocks, output head: not a transformer, not registered."""

    def __init__(self, vocab: int = 256, dim: int = 32, hidden: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"norm": nn.LayerNorm(dim), "up": nn.Linear(dim, hidden), "down": nn.Linear(hidden, dim)})
            for _ in range(depth)
        )
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block["down"](F.gelu(block["up"](block["norm"](x))))
        return self.out(x)


class PlainLM(LightningModule):
    """Written as a user would, with no hook of this package."""

    def __init__(self) -> None:
        super().__init__()
        self.net = ResidualMLP()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = F.cross_entropy(self.net(tokens).flatten(0, 1), targets.flatten())
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class PlannedLM(PlainLM):
    def tensor_parallel_plan(self, tp_size: int, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, str]:
        return {"net.blocks.*.up": "colwise", "net.blocks.*.down": "rowwise"}


# ---------------------------------------------------------------- parity runs


def _local_numel(module: nn.Module) -> int:
    """Elements of the parameters this rank holds (a DTensor counts its local shard)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.parameters())


def _token_loader(batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (8 * STEPS, 17), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch_size, shuffle=False)


def _fit(
    strategy: Any, devices: int, model: str, precision: str = "64-true", batch_per_rank: int | None = None
) -> dict[str, Any]:
    seed_everything(0, verbose=False)
    record = RecordLoss()
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy,
        precision=precision,
        max_steps=STEPS,
        gradient_clip_val=0.5,
        callbacks=[GradNormMonitor(), record],
    )
    if model == "gpt":
        module: LightningModule = GPTLightningModule(CONFIG, learning_rate=3e-3, warmup_steps=3)
        trainer.fit(module, datamodule=TextDataModule(seq_len=32, global_batch_size=8))
        blocks = module.model.blocks
    elif batch_per_rank is None:
        module = PlannedLM() if model == "planned_mlp" else PlainLM()
        trainer.fit(module, datamodule=TextDataModule(seq_len=16, global_batch_size=8))
        blocks = module.net.blocks
    else:
        # A user's own DataLoader: Lightning injects a sampler over the data-parallel ranks.
        module = PlainLM()
        trainer.fit(module, train_dataloaders=_token_loader(batch_per_rank))
        blocks = module.net.blocks
    # Gathered on every rank (the strategy's own checkpoint path gathers to rank 0 only).
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {
        "losses": record.losses,
        "grad_norms": record.grad_norms,
        "state": state,
        "block_numel": _local_numel(blocks),
    }


def _hybrid(
    world: int, dp: int, tp: int, model: str, sp: bool = True, lp: bool = True, precision: str = "64-true"
) -> dict[str, Any]:
    strategy = HybridParallelStrategy(data_parallel=dp, tensor_parallel=tp, sequence_parallel=sp, loss_parallel=lp)
    return _fit(strategy, world, model, precision)


def _assert_parity(results: list[dict[str, Any]], reference: dict[str, Any], rtol: float = 1e-5) -> None:
    for rank, result in enumerate(results):
        assert len(result["losses"]) == len(result["grad_norms"]) == STEPS
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=rtol, atol=0)
        torch.testing.assert_close(result["grad_norms"], reference["grad_norms"], rtol=rtol, atol=0)
        assert result["state"].keys() == reference["state"].keys()
        for name, value in reference["state"].items():
            torch.testing.assert_close(result["state"][name], value, rtol=rtol, atol=1e-7, msg=f"rank {rank} {name}")


def _dropin(world: int, strategy: str) -> dict[str, Any]:
    return _fit(strategy, world, "plain_mlp", precision="32-true", batch_per_rank=4)


# The runs of one world size share one spawn (a module fixture); each test checks its own case.
CASES_2: dict[str, Any] = {
    "gpt-sequence+loss_parallel": lambda w: _hybrid(w, 1, 2, "gpt"),
    "gpt-plain": lambda w: _hybrid(w, 1, 2, "gpt", sp=False, lp=False),
    "gpt-fp32": lambda w: _hybrid(w, 1, 2, "gpt", precision="32-true"),
    "planned_mlp": lambda w: _hybrid(w, 1, 2, "planned_mlp"),
    "dropin-hybrid": lambda w: _dropin(w, "hybrid"),
    "dropin-ddp": lambda w: _dropin(w, "ddp"),
    "apply-twice": lambda w: _apply_twice(w),
}
CASES_4: dict[str, Any] = {
    "gpt-dp2-tp2": lambda w: _hybrid(w, 2, 2, "gpt"),
    "collectives": lambda w: _collectives(w),
}


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return run_distributed(run_cases, 2, __name__, "CASES_2", timeout=300)


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_distributed(run_cases, 4, __name__, "CASES_4", timeout=300)


@pytest.fixture(scope="module")
def single_gpt() -> dict[str, Any]:
    return _fit("auto", 1, "gpt")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gpt-sequence+loss_parallel", "gpt-plain"])
def test_gpt_tp2_matches_one_process(two: list[dict[str, Any]], single_gpt: dict[str, Any], case: str) -> None:
    results = [r[case] for r in two]
    _assert_parity(results, single_gpt)
    # Memory: each rank holds about half of the transformer blocks' parameters (norms are replicated).
    assert results[0]["block_numel"] <= 0.55 * single_gpt["block_numel"]


@pytest.mark.slow
def test_gpt_dp2_tp2_matches_one_process(four: list[dict[str, Any]], single_gpt: dict[str, Any]) -> None:
    _assert_parity([r["gpt-dp2-tp2"] for r in four], single_gpt)


@pytest.mark.slow
def test_gpt_tp2_fp32_loss_curve_matches_one_process(two: list[dict[str, Any]]) -> None:
    reference = _fit("auto", 1, "gpt", precision="32-true")
    for result in two:
        torch.testing.assert_close(result["gpt-fp32"]["losses"], reference["losses"], rtol=1e-5, atol=0)


@pytest.mark.slow
def test_second_architecture_tp2_matches_one_process(two: list[dict[str, Any]]) -> None:
    reference = _fit("auto", 1, "planned_mlp")
    results = [r["planned_mlp"] for r in two]
    _assert_parity(results, reference)
    assert results[0]["block_numel"] <= 0.55 * reference["block_numel"] + 2 * 32 * 2  # norms replicated


@pytest.mark.slow
def test_unmodified_module_under_hybrid_matches_lightning_ddp(two: list[dict[str, Any]]) -> None:
    for result in two:
        a, b = result["dropin-hybrid"], result["dropin-ddp"]
        assert len(a["losses"]) == STEPS
        torch.testing.assert_close(a["losses"], b["losses"], rtol=1e-6, atol=0)
        for name, value in b["state"].items():
            torch.testing.assert_close(a["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def _apply_twice(world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_scale.core.parallel.tensor_parallel import apply_tensor_parallel

    model = GPT(CONFIG)
    mesh = init_device_mesh("cpu", (world,))
    apply_tensor_parallel(model, mesh, gpt_tensor_parallel_plan(model, world))
    assert model.head.weight is model.tok_emb.weight  # the tied pair is still one parameter
    with pytest.raises(ValueError, match=r"already holds DTensor parameters.*Apply a plan once") as info:
        apply_tensor_parallel(model, mesh, gpt_tensor_parallel_plan(model, world))
    return str(info.value)


def test_a_plan_on_modules_that_already_hold_dtensors_is_rejected(two: list[dict[str, Any]]) -> None:
    assert all("already holds DTensor" in r["apply-twice"] for r in two)


# ---------------------------------------------------------------- checkpoints at tp=2


def _fit_with_checkpoint(rank: int, world: int, root: str, resume: str | None) -> dict[str, Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    seed_everything(0, verbose=False)
    record = RecordLoss()
    every_3 = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    trainer = quiet_trainer(
        devices=world,
        strategy=HybridParallelStrategy(tensor_parallel=world),
        precision="64-true",
        max_steps=6,
        gradient_clip_val=0.5,
        callbacks=[record, every_3],
        enable_checkpointing=True,
    )
    module = GPTLightningModule(CONFIG, learning_rate=3e-3, warmup_steps=3)
    trainer.fit(module, datamodule=TextDataModule(seq_len=32, global_batch_size=8), ckpt_path=resume)
    trainer.save_checkpoint(f"{root}/final-{'resumed' if resume else 'straight'}.ckpt")  # every rank enters
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {"losses": record.losses, "state": state}


def _straight_then_resumed(rank: int, world: int, root: str) -> tuple[dict[str, Any], dict[str, Any]]:
    straight = _fit_with_checkpoint(rank, world, root, None)
    return straight, _fit_with_checkpoint(rank, world, root, f"{root}/step=3.ckpt")


@pytest.mark.slow
def test_checkpoint_saved_at_tp2_loads_at_tp1_and_resumes_at_tp2(tmp_path) -> None:
    root = str(tmp_path)
    straight, resumed = run_distributed(_straight_then_resumed, 2, root, timeout=180)[0]
    # Whole tensors under the original names: the plain (tp=1) model loads it as it is.
    reloaded = load_from_checkpoint(GPTLightningModule, f"{root}/final-straight.ckpt")
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, straight["state"][name].to(value.dtype)), name  # loaded as fp32
    # Weights, optimizer and scheduler state and the data position restored: steps 4-6 are the same.
    torch.testing.assert_close(resumed["losses"], straight["losses"][3:], rtol=1e-9, atol=0)
    for name, value in straight["state"].items():
        torch.testing.assert_close(resumed["state"][name], value, rtol=1e-9, atol=1e-12, msg=name)


def _collectives(world: int) -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    strategy = HybridParallelStrategy(data_parallel=2, tensor_parallel=2)
    trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=1)
    trainer.strategy._lightning_module = PlainLM()  # setup_environment hands the mesh to the module
    trainer.strategy.setup_environment()
    value = torch.tensor([float(rank)])
    strategy.barrier()
    return {
        "mean": float(strategy.reduce(value.clone(), reduce_op="mean")),
        "sum": float(strategy.reduce(value.clone(), reduce_op="sum")),
        "broadcast": strategy.broadcast({"from": rank}, src=1),
        "gathered": strategy.all_gather(value).flatten().tolist(),
        "sampler": strategy.distributed_sampler_kwargs,
        "mesh": dict(zip(strategy.device_mesh.mesh_dim_names, strategy.device_mesh.shape, strict=True)),
    }


def test_collectives_and_data_parallel_coordinates_on_a_2x2_mesh(four: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(result["collectives"] for result in four):
        assert r["mean"] == 1.5 and r["sum"] == 6.0
        assert r["broadcast"] == {"from": 1}
        assert r["gathered"] == [0.0, 1.0, 2.0, 3.0]
        assert r["mesh"] == {"dp": 2, "pp": 1, "tp": 2}
        # tp is innermost: ranks 0,1 form replica 0 and ranks 2,3 replica 1, and read the same data.
        assert r["sampler"] == {"num_replicas": 2, "rank": rank // 2}
