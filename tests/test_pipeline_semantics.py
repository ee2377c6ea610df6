"""Lightning's semantics under pipeline parallelism: loss names that callbacks monitor, dict batches,
and set-up checks. (Parity, the real loss in ``outputs`` and tied weights with gradient accumulation:
``test_pipeline_parallel.py``.)"""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
from helpers.distributed import run_distributed
from helpers.lightning import fit_error, quiet_trainer
from helpers.models import ViTModule
from helpers.parity import RecordLoss, full_parameters
from lightning.pytorch import Callback, LightningModule, seed_everything
from torch.utils.data import DataLoader, Dataset

import lightning_scale  # noqa: F401
from lightning_scale.core.pipeline.spec import PipelineSpec
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTConfig, GPTLightningModule
from lightning_scale.plugins.checkpoint_io import load_full_checkpoint
from lightning_scale.strategies import HybridParallelStrategy

TIED = GPTConfig(n_layers=4, d_model=32, n_heads=2, block_size=16, tie_embeddings=True)


# ---------------------------------------------------------------- dict batches, through the pipeline_batch hook


class _DictTokens(Dataset):
    def __init__(self, n: int = 32, length: int = 16) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, 64, (n, length + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.blocks = torch.nn.ModuleDict({str(i): torch.nn.Linear(16, 16) for i in range(2)})
        self.out = torch.nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = x + torch.tanh(block(x))
        return self.out(x) if self.out is not None else x


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


class _DictModule(LightningModule):
    """Batches are dicts; ``pipeline_batch`` says which entries are the inputs and the target."""

    def __init__(self, with_hook: bool = True) -> None:
        super().__init__()
        self.net = _Stack()
        if not with_hook:
            self.pipeline_batch = None  # type: ignore[assignment]

    def pipeline_spec(self) -> tuple[str, PipelineSpec]:
        return "net", PipelineSpec(blocks=["blocks.0", "blocks.1"], first=["embed"], last=["out"], loss_fn=_loss)

    def pipeline_batch(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return batch["input_ids"], batch["labels"]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = _loss(self.net(batch["input_ids"]), batch["labels"])
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_dict(strategy: Any, devices: int) -> list[float]:
    seed_everything(0, verbose=False)
    record = RecordLoss()
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy,
        precision="64-true",
        max_steps=4,
        callbacks=[record],
        use_distributed_sampler=False,
    )
    trainer.fit(_DictModule(), DataLoader(_DictTokens(), batch_size=4))
    return record.losses


def _dict_pipeline(rank: int, world: int) -> tuple[list[float], str]:
    losses = _fit_dict(HybridParallelStrategy(data_parallel=1, pipeline_parallel=world, microbatches=2), world)
    strategy = HybridParallelStrategy(data_parallel=1, pipeline_parallel=world, microbatches=2)
    trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=1)
    try:
        trainer.fit(_DictModule(with_hook=False), DataLoader(_DictTokens(), batch_size=4))
        error = "no error"
    except TypeError as err:
        error = str(err)
    return losses, error


@pytest.mark.slow
def test_dict_batches_train_at_pp2_through_the_hook_and_without_it_the_error_names_it() -> None:
    reference = _fit_dict("auto", 1)
    for losses, error in run_distributed(_dict_pipeline, 2, timeout=180):
        torch.testing.assert_close(losses, reference, rtol=1e-9, atol=0)
        assert re.search(r"this batch is a dict with keys \['input_ids', 'labels'\], not \(inputs, target\)", error), (
            error
        )
        assert "Define `pipeline_batch(self, batch) -> (inputs, target)` on _DictModule" in error, error


# ---------------------------------------------------------------- parameters on the model itself (a timm-style ViT)


class _Images(Dataset):
    def __init__(self, n: int = 32) -> None:
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randn(n, 3, 8, 8, dtype=torch.float64, generator=generator)
        self.labels = torch.randint(0, 10, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def _fit_vit(strategy: Any, devices: int, checkpoint: str | None = None) -> dict[str, Any]:
    seed_everything(0, verbose=False)
    record = RecordLoss()
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy,
        precision="64-true",
        max_steps=4,
        callbacks=[record],
        use_distributed_sampler=False,
    )
    module = ViTModule()
    trainer.fit(module, DataLoader(_Images(), batch_size=8))
    if checkpoint is not None:
        trainer.save_checkpoint(checkpoint)
    return {"losses": record.losses, "state": full_parameters(module, devices)}


def _vit_pipelines(rank: int, world: int, out: str) -> dict[str, Any]:
    runs: dict[str, Any] = {
        schedule: _fit_vit(
            HybridParallelStrategy(data_parallel=1, pipeline_parallel=world, microbatches=2, schedule=schedule),
            world,
            f"{out}/{schedule}",
        )
        for schedule in ("1f1b", "zbv")  # zbv: two stages per rank, each holding the ViT's own parameters
    }
    # A buffer of the ViT itself that its forward updates: each stage's copy would drift apart.
    trainer = quiet_trainer(
        devices=world,
        strategy=HybridParallelStrategy(data_parallel=1, pipeline_parallel=world),
        max_steps=2,
        precision="64-true",
    )
    runs["counting"] = fit_error(trainer, ViTModule(count=True), train_dataloaders=DataLoader(_Images(), batch_size=8))
    return runs


@pytest.mark.slow
def test_a_vits_own_parameters_train_once_at_pp2_and_its_checkpoint_holds_the_trained_values(tmp_path: Any) -> None:
    """cls_token and pos_embed sit on the ViT itself, outside every module its spec lists: every stage
    keeps a copy, and the copies take the one-process step together (the last stage's copy used to
    keep its initial values, and the checkpoint could hold that stale copy)."""
    reference = _fit_vit("auto", 1)
    results = run_distributed(_vit_pipelines, 2, str(tmp_path), timeout=240)
    for result in results:  # refused on every rank, after the first step, naming the buffer and the fix
        assert re.search(
            r"Buffers \['seen'\] of TinyViT lie outside every module its pipeline spec places.*the first training "
            r"step changed them.*Put the module that updates them in the spec's first or last",
            result["counting"],
        ), result["counting"]
    # atol: attention's key bias has an exactly-zero gradient (softmax ignores a shift shared by every
    # key); AdamW scales its rounding noise (~1e-17) up to steps of ~1e-11, differently per layout.
    atol = 1e-10
    for schedule in ("1f1b", "zbv"):
        saved = load_full_checkpoint(tmp_path / schedule)["state_dict"]
        assert saved.keys() == reference["state"].keys()
        for name, value in reference["state"].items():
            torch.testing.assert_close(saved[name], value, rtol=1e-9, atol=atol, msg=f"{schedule} checkpoint: {name}")
        for rank, result in enumerate(results):
            run = result[schedule]
            torch.testing.assert_close(run["losses"], reference["losses"], rtol=1e-9, atol=0)
            for name, value in reference["state"].items():
                torch.testing.assert_close(
                    run["state"][name], value, rtol=1e-9, atol=atol, msg=f"{schedule} rank {rank}: {name}"
                )


# ---------------------------------------------------------------- set-up checks


class _Manual(_DictModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def _pp(world: int) -> HybridParallelStrategy:
    return HybridParallelStrategy(data_parallel=1, pipeline_parallel=world, microbatches=2)


def _setup_messages(rank: int, world: int) -> dict[str, Any]:
    from lightning.pytorch.plugins import MixedPrecision

    data = DataLoader(_DictTokens(), batch_size=4)
    manual = fit_error(
        quiet_trainer(devices=world, strategy=_pp(world), max_steps=1), _Manual(), train_dataloaders=data
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(devices=world, strategy=_pp(world), max_steps=1).fit(_DictModule(), data)
    # "16-mixed" on CPU silently becomes bf16; a plugin instance keeps its GradScaler, and the
    # strategy turns it into lightning_scale's MixedPrecision, whose loss scale reaches the schedule.
    fp16 = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=256.0))
    trainer = quiet_trainer(devices=world, strategy=_pp(world), max_steps=2, plugins=[fp16])
    trainer.fit(_DictModule(), data)
    scaled = trainer.precision_plugin.state_dict()
    # bf16-mixed applies inside the schedule: a block's linear computes in bfloat16 on every stage.
    dtypes: list[torch.dtype] = []
    module = _DictModule()
    for block in module.net.blocks.values():
        block.register_forward_hook(lambda m, args, out: dtypes.append(out.dtype))
    quiet_trainer(devices=world, strategy=_pp(world), max_steps=1, precision="bf16-mixed").fit(module, data)
    warned = [str(w.message) for w in caught if "not called" in str(w.message)]
    return {"manual": manual, "warned": warned, "fp16": scaled, "bf16": sorted(set(map(str, dtypes)))}


def test_set_up_refuses_manual_optimisation_runs_fp16_loss_scaling_and_names_bypassed_methods_once() -> None:
    results = run_distributed(_setup_messages, 2, timeout=180)
    for result in results:
        assert re.search(
            r"_Manual uses manual optimisation \(automatic_optimization=False\), which pipeline_parallel=2 cannot run",
            result["manual"],
        ), result["manual"]
        assert result["fp16"]["precision"] == "16-mixed" and result["fp16"]["scaler"]["steps"] == 2, result["fp16"]
        assert result["fp16"]["scaler"]["scale"] == 256.0 and result["fp16"]["skipped_steps"] == 0
        assert result["bf16"] == ["torch.bfloat16"], result["bf16"]  # each rank's own block, in bf16
    # Its training_step runs (on the last stage, per micro-batch): nothing it defines is bypassed.
    assert results[0]["warned"] == [], results[0]["warned"]


# ---------------------------------------------------------------- loss names that callbacks monitor


def _monitored(rank: int, world: int, out: str) -> dict[str, Any]:
    from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    seed_everything(0, verbose=False)
    names = {"train": "train_loss", "val": "my_loss"}
    strategy = HybridParallelStrategy(data_parallel=1, pipeline_parallel=world, microbatches=2, loss_name=names)
    checkpoint = ModelCheckpoint(dirpath=f"{out}/ckpt", monitor="my_loss", save_top_k=1, filename="best")
    record, val = RecordLoss("train_loss"), []

    class _Val(Callback):
        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            val.append(float(trainer.callback_metrics["my_loss"]))

    trainer = quiet_trainer(
        devices=world,
        strategy=strategy,
        max_steps=4,
        val_check_interval=2,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=CSVLogger(out),
        enable_checkpointing=True,
        callbacks=[
            checkpoint,
            EarlyStopping(monitor="my_loss", patience=5),
            LearningRateMonitor("step"),
            record,
            _Val(),
        ],
    )
    trainer.fit(GPTLightningModule(TIED, warmup_steps=2), datamodule=TextDataModule(seq_len=16, global_batch_size=4))
    return {
        "best": float(checkpoint.best_model_score),
        "path": checkpoint.best_model_path,
        "val": val,
        "train": record.losses,
        "keys": sorted(trainer.callback_metrics),
    }


@pytest.mark.slow
def test_modelcheckpoint_and_early_stopping_monitor_the_pipeline_loss_under_its_chosen_name(tmp_path: Any) -> None:
    for result in run_distributed(_monitored, 2, str(tmp_path), timeout=180):
        assert len(result["val"]) == 2 and len(result["train"]) == 4
        assert result["best"] == pytest.approx(min(result["val"]))
        assert result["path"].endswith("best.ckpt")
        assert "my_loss" in result["keys"] and "train_loss" in result["keys"], result["keys"]
        # The module's own step runs on the last stage, so its own names are logged too, as in one process.
        assert "train/loss" in result["keys"] and "val/loss" in result["keys"], result["keys"]
    assert (tmp_path / "ckpt" / "best.ckpt").is_dir()


@pytest.mark.parametrize(
    ("loss_name", "match"),
    [
        (
            "my_loss",
            r"loss_name='my_loss' would log the training, validation and test losses under one name.*'\{stage\}_loss'",
        ),
        ({"valid": "x"}, r"keys must be among 'test', 'train', 'val'.*unknown: \['valid'\]"),
        ("{stage}/{metric}", r"loss_name='\{stage\}/\{metric\}' is not a template with only \{stage\} in braces"),
    ],
)
def test_a_loss_name_that_cannot_work_is_refused_when_the_strategy_is_built(loss_name: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HybridParallelStrategy(pipeline_parallel=2, loss_name=loss_name)
