"""``MixedPrecision`` under ``HybridParallelStrategy``: bf16 computes in bf16 at every layout, fp16
overflows skip the same step on every rank from one collective, the scaler resumes exactly, and
fp16/bf16 train as well as fp32.

The runs of one world size share one spawn (a module fixture); each test checks its own case.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.distributed import run_cases, run_distributed
from helpers.lightning import quiet_trainer
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import lightning_scale  # noqa: F401
from lightning_scale.callbacks import GradNormMonitor
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTConfig, GPTLightningModule
from lightning_scale.plugins import MixedPrecision
from lightning_scale.plugins.checkpoint_io import load_full_checkpoint
from lightning_scale.strategies import HybridParallelStrategy

CONFIG = GPTConfig(n_layers=4, d_model=32, n_heads=2, block_size=16, tie_embeddings=False)
SMALL = GPTConfig(n_layers=2, d_model=64, n_heads=4, block_size=32)  # the convergence runs
CURVE_STEPS = 6
INJECT_STEP = 2  # the optimizer step (0-based) whose gradient gets an inf
CKPT_DIR_ENV = "PRECISION_TEST_CKPT_DIR"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Watch(Callback):
    """Every rank's view of each optimizer step: loss, skip, scale, LR, collectives in the decision,
    the dtypes every ``nn.Linear`` computed in, and (optionally) an inf injected into one gradient."""

    def __init__(self, inject: tuple[int, str] | None = None) -> None:
        self.inject = inject  # (global rank, parameter name) at INJECT_STEP
        self.steps: list[dict[str, Any]] = []
        self.dtypes: set[str] = set()
        self.weight_dtypes: set[str] = set()
        self.before: dict[str, Any] = {}
        self.unchanged: dict[str, bool] = {}
        self._mode: CommDebugMode | None = None

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        def record(mod: nn.Module, args: Any, out: torch.Tensor) -> None:
            self.dtypes.add(str(out.dtype))
            self.weight_dtypes.add(str(mod.weight.dtype))  # bf16 under FSDP2's policy, fp32 under autocast

        for m in pl_module.modules():
            if isinstance(m, nn.Linear):
                m.register_forward_hook(record)

    def _state(self, trainer: Trainer, pl_module: Any) -> dict[str, Any]:
        optimizer = trainer.optimizers[0]
        return {
            "params": {n: _local(p.detach()).clone() for n, p in pl_module.named_parameters()},
            "optimizer": [
                {k: _local(v).clone() for k, v in optimizer.state[p].items() if isinstance(v, torch.Tensor)}
                for g in optimizer.param_groups
                for p in g["params"]
            ],
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict()["last_epoch"],
        }

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == INJECT_STEP:
            self.before = self._state(trainer, pl_module)

    def on_after_backward(self, trainer: Trainer, pl_module: Any) -> None:
        if self.inject is not None and trainer.global_step == INJECT_STEP and trainer.global_rank == self.inject[0]:
            grad = dict(pl_module.named_parameters())[self.inject[1]].grad
            _local(grad).view(-1)[0] = float("inf")

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        # From here to the end of the step: norm, overflow decision, clipping, logging, step.
        self._mode = CommDebugMode()
        self._mode.__enter__()

    def on_exception(self, trainer: Trainer, pl_module: Any, exception: BaseException) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        collectives = None
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            collectives, self._mode = self._mode.get_total_counts(), None
        plugin = trainer.precision_plugin
        self.steps.append(
            {
                "loss": float(trainer.callback_metrics["train/loss"]),
                "skipped": getattr(plugin, "last_step_skipped", None),  # None: Lightning's own plugin
                "scale": getattr(plugin, "loss_scale", None),
                "lr": trainer.optimizers[0].param_groups[0]["lr"],
                "scheduler_steps": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
                "collectives": collectives,
                "grad_norm": float(norm)
                if (norm := trainer.callback_metrics.get("train/grad_norm")) is not None
                else None,
            }
        )
        if trainer.global_step == INJECT_STEP + 1 and self.before:
            after = self._state(trainer, pl_module)
            self.unchanged = {
                "params": all(torch.equal(after["params"][n], v) for n, v in self.before["params"].items()),
                "optimizer": all(
                    torch.equal(a[k], b[k]) for a, b in zip(after["optimizer"], self.before["optimizer"]) for k in b
                ),
                "scheduler": after["scheduler"] == self.before["scheduler"],
            }


def _fit(
    strategy: Any,
    devices: int,
    precision: str | MixedPrecision,
    *,
    config: GPTConfig = CONFIG,
    steps: int = CURVE_STEPS,
    watch: Watch | None = None,
    extra: list[Callback] | None = None,
    ckpt_path: str | None = None,
    val_batches: int = 0,
) -> dict[str, Any]:
    seed_everything(0, verbose=False)
    watch = watch or Watch()
    plugins = [precision] if isinstance(precision, MixedPrecision) else []
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        gradient_clip_val=1.0,
        callbacks=[GradNormMonitor(), watch, *(extra or [])],
        limit_val_batches=val_batches,
        val_check_interval=None,
        check_val_every_n_epoch=None,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in extra or []),
        **({"plugins": plugins} if plugins else {"precision": precision}),
    )
    module = GPTLightningModule(config, learning_rate=3e-3, warmup_steps=3)
    datamodule = TextDataModule(seq_len=min(16, config.block_size), global_batch_size=8)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    result: dict[str, Any] = {
        "steps": watch.steps,
        "dtypes": sorted(watch.dtypes),
        "weight_dtypes": sorted(watch.weight_dtypes),
        "unchanged": watch.unchanged,
        "plugin": type(trainer.precision_plugin).__name__,
        "state": trainer.precision_plugin.state_dict(),
    }
    if val_batches:
        result["val"] = trainer.validate(module, datamodule=datamodule, verbose=False)[0]["val/loss"]
    optimizer = trainer.optimizers[0]
    result["optimizer_dtypes"] = sorted(
        {str(v.dtype) for s in optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")}
    )
    result["param_dtypes"] = sorted({str(p.dtype) for p in module.parameters()})
    # FSDP2's policy per sharded module: (param, reduce, output) dtypes.
    result["fsdp_policies"] = sorted(
        {
            tuple(
                str(d)
                for d in (
                    m._get_fsdp_state()._mp_policy.param_dtype,
                    m._get_fsdp_state()._mp_policy.reduce_dtype,
                    m._get_fsdp_state()._mp_policy.output_dtype,
                )
            )
            for m in module.modules()
            if isinstance(m, FSDPModule)
        }
    )
    return result


def _hybrid(dp: int = 1, tp: int = 1, pp: int = 1, **kwargs: Any) -> HybridParallelStrategy:
    if pp > 1:
        kwargs.setdefault("microbatches", 4 if dp == 1 else 2)
    return HybridParallelStrategy(data_parallel=dp, tensor_parallel=tp, pipeline_parallel=pp, **kwargs)


def _fp16(**kwargs: Any) -> MixedPrecision:
    # A moderate scale: the tiny GPT's fp16 gradients never overflow by themselves.
    return MixedPrecision("fp16-mixed", init_scale=2.0**10, growth_interval=1000, **kwargs)


def _resume(world: int) -> dict[str, Any]:
    """fp16 at dp=2: an uninterrupted run, and one resumed from its step-4 checkpoint (an injected
    overflow at step 2 and a hysteresis of 2 leave non-trivial scaler state there)."""
    root = Path(os.environ[CKPT_DIR_ENV])

    def plugin() -> MixedPrecision:
        return MixedPrecision("fp16-mixed", init_scale=2.0**10, growth_interval=2, hysteresis=2)

    inject = (1, "model.blocks.0.mlp.fc.weight")
    full = _fit(_hybrid(dp=world), world, plugin(), steps=8, watch=Watch(inject))
    checkpoint = ModelCheckpoint(dirpath=root, every_n_train_steps=4, save_top_k=-1)
    first = _fit(_hybrid(dp=world), world, plugin(), steps=8, watch=Watch(inject), extra=[checkpoint])
    saved = load_full_checkpoint(next(root.glob("*step=4.ckpt")))
    restored: dict[str, Any] = {}

    class Restored(Callback):
        def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
            restored.update(trainer.precision_plugin.state_dict())

    ckpt = str(next(root.glob("*step=4.ckpt")))
    rest = _fit(_hybrid(dp=world), world, plugin(), steps=8, extra=[Restored()], ckpt_path=ckpt)
    return {"full": full, "first": first, "rest": rest, "restored": restored, "saved": saved["MixedPrecision"]}


def _converge(world: int, precision: str | MixedPrecision) -> dict[str, Any]:
    return _fit(_hybrid(dp=world), world, precision, config=SMALL, steps=150, val_batches=4)


PP_SCHEDULES = ("1f1b", "zbv", "interleaved_1f1b", "dualpipev")
WORLD2: dict[str, Any] = {
    **{f"bf16-pp2-{s}": lambda w, s=s: _fit(_hybrid(pp=w, schedule=s), w, "bf16-mixed") for s in PP_SCHEDULES},
    "bf16-tp2": lambda w: _fit(_hybrid(tp=w), w, "bf16-mixed"),
    "bf16-dp2-fsdp": lambda w: _fit(_hybrid(dp=w, data_parallel_mode="fsdp"), w, "bf16-mixed"),
    "bf16-dp2-hsdp": lambda w: _fit(_hybrid(dp=w, data_parallel_mode="hsdp"), w, "bf16-mixed"),
    "bf16-dp2-fsdp-reduce-bf16": lambda w: _fit(
        _hybrid(dp=w, data_parallel_mode="fsdp_grad_op"), w, MixedPrecision("bf16-mixed", reduce_dtype="bfloat16")
    ),
    "fp16-inject-tp2": lambda w: _fit(_hybrid(tp=w), w, _fp16(), watch=Watch((1, "model.blocks.0.mlp.fc.weight"))),
    # Rank 0 holds the first stage, which has no loss.
    "fp16-inject-pp2": lambda w: _fit(_hybrid(pp=w), w, _fp16(), watch=Watch((0, "model.blocks.0.mlp.fc.weight"))),
    "fp16-inject-dp2-fsdp": lambda w: _fit(
        _hybrid(dp=w, data_parallel_mode="fsdp"), w, _fp16(), watch=Watch((1, "model.blocks.1.attn.wq.weight"))
    ),
    "resume": _resume,
    "converge-fp32": lambda w: _converge(w, "32-true"),
    "converge-bf16": lambda w: _converge(w, "bf16-mixed"),
    "converge-fp16": lambda w: _converge(w, MixedPrecision("fp16-mixed")),
}
# dp=2 x pp=2 x tp=2; ranks are (dp, pp, tp) row-major: rank 5 is dp 1, stage 0 (no loss), tp 1.
WORLD8: dict[str, Any] = {
    "bf16-3d": lambda w: _fit(_hybrid(dp=2, tp=2, pp=2), w, "bf16-mixed"),
    "fp16-inject-3d": lambda w: _fit(
        _hybrid(dp=2, tp=2, pp=2), w, _fp16(), watch=Watch((5, "model.blocks.0.mlp.fc.weight"))
    ),
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    env = {CKPT_DIR_ENV: str(tmp_path_factory.mktemp("precision-ckpt"))}
    ranks = run_distributed(run_cases, 2, __name__, "WORLD2", timeout=480, env=env)
    return {case: [r[case] for r in ranks] for case in WORLD2}


@pytest.fixture(scope="module")
def world8() -> dict[str, list[Any]]:
    ranks = run_distributed(run_cases, 8, __name__, "WORLD8", timeout=480)
    return {case: [r[case] for r in ranks] for case in WORLD8}


@pytest.fixture(scope="module")
def bf16_reference() -> dict[str, Any]:
    """bf16-mixed in one process, with Lightning's own strategy and precision plugin."""
    return _fit("auto", 1, "bf16-mixed")


def _check_bf16(results: list[dict[str, Any]], reference: dict[str, Any], fsdp: bool = False) -> None:
    assert reference["dtypes"] == ["torch.bfloat16"]
    ref = [s["loss"] for s in reference["steps"]]
    for result in results:
        assert result["plugin"] == "MixedPrecision"
        assert result["dtypes"] == ["torch.bfloat16"], result["dtypes"]  # every rank's own linears
        # FSDP2's MixedPrecisionPolicy hands the forward bf16 parameters; autocast casts inside each op.
        assert result["weight_dtypes"] == ["torch.bfloat16" if fsdp else "torch.float32"], result["weight_dtypes"]
        losses = [s["loss"] for s in result["steps"]]
        torch.testing.assert_close(losses, ref, rtol=1e-2, atol=0)
        assert result["optimizer_dtypes"] == ["torch.float32"] and result["param_dtypes"] == ["torch.float32"]
        # One for the norm, the overflow decision and clipping; one for the preemption flag, which the strategy
        # agrees on inside its optimizer step (its resilience collaborator).
        assert all(s["collectives"] == 2 for s in result["steps"]), [s["collectives"] for s in result["steps"]]


@pytest.mark.parametrize(
    "case", [*(f"bf16-pp2-{s}" for s in PP_SCHEDULES), "bf16-tp2", "bf16-dp2-fsdp", "bf16-dp2-hsdp"]
)
def test_bf16_computes_in_bf16_on_every_rank_and_follows_one_process(
    world2: dict[str, list[Any]], bf16_reference: dict[str, Any], case: str
) -> None:
    _check_bf16(world2[case], bf16_reference, fsdp=case.endswith("sdp"))


def test_fsdp_runs_mixed_precision_as_its_own_policy(world2: dict[str, list[Any]]) -> None:
    bf16, fp32, none = "torch.bfloat16", "torch.float32", "None"
    # Blocks keep bf16 outputs; the modules the step calls return fp32 (the loss is computed in fp32).
    assert world2["bf16-dp2-fsdp"][0]["fsdp_policies"] == [(bf16, fp32, none), (bf16, fp32, fp32)]
    assert world2["bf16-dp2-fsdp-reduce-bf16"][0]["fsdp_policies"] == [(bf16, bf16, none), (bf16, bf16, fp32)]
    assert world2["bf16-dp2-fsdp-reduce-bf16"][0]["weight_dtypes"] == [bf16]
    assert world2["bf16-tp2"][0]["fsdp_policies"] == []  # autocast there


def test_bf16_at_dp2_tp2_pp2(world8: dict[str, list[Any]], bf16_reference: dict[str, Any]) -> None:
    _check_bf16(world8["bf16-3d"], bf16_reference)


def _check_injected(results: list[dict[str, Any]]) -> None:
    pattern = [[s["skipped"] for s in r["steps"]] for r in results]
    expected = [i == INJECT_STEP for i in range(CURVE_STEPS)]
    assert pattern == [expected] * len(results), pattern  # the same step skipped everywhere
    for result in results:
        scales = [s["scale"] for s in result["steps"]]
        assert scales == [2.0**10] * INJECT_STEP + [2.0**9] * (CURVE_STEPS - INJECT_STEP), scales
        assert result["unchanged"] == {"params": True, "optimizer": True, "scheduler": True}
        # The scheduler counts good steps: it stands still on the skipped one and moves on after it.
        assert [s["scheduler_steps"] for s in result["steps"]] == [1, 2, 2, 3, 4, 5]
        assert result["steps"][INJECT_STEP]["lr"] == result["steps"][INJECT_STEP - 1]["lr"]
        assert result["state"]["skipped_steps"] == 1 and result["state"]["scaler"]["skipped_steps"] == 1
        assert result["steps"][INJECT_STEP]["grad_norm"] == float("inf")
        # One for the norm, the overflow decision and clipping; one for the preemption flag, which the strategy
        # agrees on inside its optimizer step (its resilience collaborator).
        assert all(s["collectives"] == 2 for s in result["steps"]), [s["collectives"] for s in result["steps"]]
    assert len({repr(r["state"]) for r in results}) == 1


@pytest.mark.parametrize("case", ["fp16-inject-tp2", "fp16-inject-pp2", "fp16-inject-dp2-fsdp"])
def test_an_inf_on_one_rank_skips_the_same_step_everywhere(world2: dict[str, list[Any]], case: str) -> None:
    _check_injected(world2[case])


def test_the_loss_scale_reaches_the_pipeline_schedule(world2: dict[str, list[Any]]) -> None:
    # Before the injected step, fp16 gradient norms (unscaled) agree across layouts: the pipeline's
    # micro-batch losses were scaled as much as the others' were unscaled.
    norms = {
        case: [s["grad_norm"] for s in world2[case][0]["steps"][:INJECT_STEP]]
        for case in ("fp16-inject-tp2", "fp16-inject-pp2", "fp16-inject-dp2-fsdp")
    }
    for case, values in norms.items():
        torch.testing.assert_close(values, norms["fp16-inject-tp2"], rtol=2e-2, atol=0, msg=case)


def test_an_inf_on_one_rank_skips_the_same_step_at_dp2_tp2_pp2(world8: dict[str, list[Any]]) -> None:
    _check_injected(world8["fp16-inject-3d"])


def test_a_resumed_run_restores_the_scaler_and_continues_identically(world2: dict[str, list[Any]]) -> None:
    for result in world2["resume"]:
        full, first, rest = result["full"], result["first"], result["rest"]
        assert first["steps"] == full["steps"]
        at_4 = result["saved"]
        assert at_4["scaler"]["growth_tracker"] == 1 and at_4["skipped_steps"] == 1
        assert result["restored"] == at_4
        # Steps 5..8: losses, scales and skips as if never interrupted; the same final scaler state.
        for key in ("loss", "scale", "skipped", "lr"):
            assert [s[key] for s in rest["steps"]] == [s[key] for s in full["steps"][4:]], key
        assert rest["state"] == full["state"]
    # Growth every 2 good steps; the overflow at step 2 (hysteresis 2) skips without backing off.
    assert [s["scale"] for s in world2["resume"][0]["full"]["steps"]][:5] == [
        2.0**10,
        2.0**11,
        2.0**11,
        2.0**11,
        2.0**12,
    ]


def test_fp16_and_bf16_train_as_well_as_fp32(world2: dict[str, list[Any]]) -> None:
    fp32 = world2["converge-fp32"][0]["val"]
    for case, dtype in [("converge-fp32", "float32"), ("converge-bf16", "bfloat16"), ("converge-fp16", "float16")]:
        assert all(r["dtypes"] == [f"torch.{dtype}"] for r in world2[case]), case  # plain DDP computes in it too
        val = world2[case][0]["val"]
        assert val == pytest.approx(fp32, rel=0.02), (case, val, fp32)
    assert fp32 < 0.75 * world2["converge-fp32"][0]["steps"][0]["loss"]  # it did learn
    assert (
        world2["converge-fp16"][0]["state"]["skipped_steps"]
        == world2["converge-fp16"][0]["state"]["scaler"]["skipped_steps"]
    )


def test_trainer_precision_strings_use_this_plugin_and_others_are_refused() -> None:
    from lightning.pytorch.plugins import HalfPrecision
    from lightning.pytorch.plugins import MixedPrecision as LightningMixedPrecision

    for string, expected in [
        ("bf16-mixed", "bf16-mixed"),
        ("32-true", "32-true"),
        ("bf16-true", "bf16-true"),
        ("64-true", "64-true"),
    ]:
        trainer = quiet_trainer(devices=1, strategy="hybrid", precision=string)
        assert isinstance(trainer.precision_plugin, MixedPrecision) and trainer.precision_plugin.precision == expected
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning: "16-mixed is not supported on CPU, using bf16-mixed"
        assert (
            quiet_trainer(devices=1, strategy="hybrid", precision="16-mixed").precision_plugin.precision == "bf16-mixed"
        )
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0, growth_interval=7)
    converted = quiet_trainer(
        devices=1, strategy="hybrid", plugins=[LightningMixedPrecision("16-mixed", "cpu", scaler)]
    ).precision_plugin
    assert converted.precision == "16-mixed" and converted.loss_scale == 128.0 and converted.scaler.growth_interval == 7
    with pytest.raises(
        ValueError,
        match=r"cannot use HalfPrecision\(precision='16-true'\).*plugins=\[lightning_scale.plugins.MixedPrecision",
    ):
        quiet_trainer(devices=1, strategy="hybrid", plugins=[HalfPrecision("16-true")])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"precision": "fp8"},
            r"precision='fp8' is not one of '16-mixed', '32-true', '64-true', 'bf16-mixed', 'bf16-true', 'fp16-mixed'",
        ),
        (
            {"precision": "bf16-true", "init_scale": 1024.0},
            r"init_scale=1024.0: loss-scaler options apply to precision='fp16-mixed' only",
        ),
        (
            {"precision": "bf16-mixed", "hysteresis": 2},
            r"hysteresis=2: loss-scaler options apply to precision='fp16-mixed' only",
        ),
        ({"precision": "fp16-mixed", "growth_factor": 1.0}, r"growth_factor=1.0 must be greater than 1"),
        ({"precision": "fp16-mixed", "backoff_factor": 2.0}, r"backoff_factor=2.0 must be below 1"),
        ({"precision": "fp16-mixed", "growth_interval": 0}, r"growth_interval=0 must be a positive integer"),
        ({"precision": "fp16-mixed", "init_scale": -1.0}, r"init_scale=-1.0 must be a positive finite number"),
        (
            {"precision": "fp16-mixed", "nonfinite_grads": "raise"},
            r"nonfinite_grads='raise' with precision='fp16-mixed'",
        ),
        (
            {"precision": "bf16-mixed", "nonfinite_grads": "halt"},
            r"nonfinite_grads='halt' is not one of 'ignore', 'raise', 'skip'",
        ),
        ({"reduce_dtype": "int8"}, r"reduce_dtype='int8' is not one of 'bfloat16', 'float16', 'float32'"),
        ({"norm_type": 0}, r"norm_type=0 must be a positive number or inf"),
    ],
)
def test_bad_plugin_settings_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MixedPrecision(**kwargs)


def _single(precision: MixedPrecision, *, inject: bool = False, steps: int = 4) -> tuple[Watch, Trainer]:
    watch = Watch((0, "model.blocks.0.mlp.fc.weight") if inject else None)
    seed_everything(0, verbose=False)
    trainer = quiet_trainer(
        devices=1,
        strategy="hybrid",
        plugins=[precision],
        max_steps=steps,
        gradient_clip_val=1.0,
        callbacks=[GradNormMonitor(), watch],
    )
    trainer.fit(GPTLightningModule(CONFIG, warmup_steps=3), datamodule=TextDataModule(seq_len=16, global_batch_size=4))
    return watch, trainer


def test_bf16_non_finite_gradients_are_skipped_or_raised_on_request() -> None:
    watch, trainer = _single(MixedPrecision("bf16-mixed", nonfinite_grads="skip", log_nonfinite=True), inject=True)
    assert [s["skipped"] for s in watch.steps] == [False, False, True, False]
    assert watch.unchanged == {"params": True, "optimizer": True, "scheduler": True}
    assert trainer.callback_metrics["precision/skipped_steps"] == 1
    with pytest.raises(FloatingPointError, match=r"non-finite at global step 2.*nonfinite_grads='raise'"):
        _single(MixedPrecision("bf16-mixed", nonfinite_grads="raise"), inject=True)
    # The default: no check, and the step is taken (as plain Lightning would).
    watch, _ = _single(MixedPrecision("bf16-mixed"), inject=True)
    assert not any(s["skipped"] for s in watch.steps)


def test_non_finite_parameter_names_are_reported_on_request() -> None:
    with pytest.warns(
        RuntimeWarning, match=r"Non-finite gradients at global step 2 in 1 parameters: model.blocks.0.mlp.fc.weight"
    ):
        _single(_fp16(log_nonfinite=True), inject=True)


def test_fp16_logs_the_scale_and_the_skipped_steps() -> None:
    watch, trainer = _single(_fp16(), inject=True)
    assert float(trainer.callback_metrics["precision/loss_scale"]) == 2.0**9
    assert float(trainer.callback_metrics["precision/skipped_steps"]) == 1
    assert [s["collectives"] for s in watch.steps] == [0] * 4  # one process: nothing to reduce


class _LBFGSModule(GPTLightningModule):
    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=2)


def test_an_optimizer_that_re_evaluates_its_closure_is_refused_with_fp16_and_runs_with_bf16() -> None:
    data = TextDataModule(seq_len=16, global_batch_size=4)
    trainer = quiet_trainer(devices=1, strategy="hybrid", plugins=[_fp16()], max_steps=1)
    with pytest.raises(
        ValueError, match=r"LBFGS re-evaluates its closure inside step\(\).*precision='32-true' or 'bf16-mixed'"
    ):
        trainer.fit(_LBFGSModule(CONFIG), datamodule=data)
    trainer = quiet_trainer(
        devices=1, strategy="hybrid", precision="bf16-mixed", max_steps=1, callbacks=[GradNormMonitor()]
    )
    trainer.fit(_LBFGSModule(CONFIG), datamodule=data)
    assert trainer.global_step == 1


def test_bf16_true_keeps_weights_gradients_and_optimizer_state_in_bf16() -> None:
    class Dtypes(Callback):
        def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
            self.grads = {str(p.grad.dtype) for p in pl_module.parameters()}

    dtypes = Dtypes()
    seed_everything(0, verbose=False)
    trainer = quiet_trainer(devices=1, strategy="hybrid", precision="bf16-true", max_steps=2, callbacks=[dtypes])
    module = GPTLightningModule(CONFIG, warmup_steps=1)
    trainer.fit(module, datamodule=TextDataModule(seq_len=16, global_batch_size=4))
    state = [v for s in trainer.optimizers[0].state.values() for k, v in s.items() if k == "exp_avg"]
    assert {str(p.dtype) for p in module.parameters()} == {"torch.bfloat16"} == dtypes.grads
    assert {str(v.dtype) for v in state} == {"torch.bfloat16"}


class _ManualModule(GPTLightningModule):
    """Manual optimisation the usual way: backward, clip, step, then the scheduler by hand."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config, warmup_steps=1)
        self.automatic_optimization = False
        self.norms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = self._loss(batch)
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        self.norms.append(self.trainer.precision_plugin.gradient_stats(optimizer.optimizer).norm)
        optimizer.step()
        optimizer.zero_grad()
        if not self.trainer.precision_plugin.last_step_skipped:
            self.lr_schedulers().step()
        return loss


def test_manual_optimisation_scales_unscales_once_and_steps() -> None:
    norms = {}
    for precision in (_fp16(), MixedPrecision("32-true")):
        seed_everything(0, verbose=False)
        module = _ManualModule(CONFIG)
        trainer = quiet_trainer(devices=1, strategy="hybrid", plugins=[precision], max_steps=2)
        trainer.fit(module, datamodule=TextDataModule(seq_len=16, global_batch_size=4))
        norms[precision.precision] = module.norms
    # Clipped before step() and read again at the step: unscaled once, so fp16's norm is fp32's.
    torch.testing.assert_close(norms["16-mixed"], norms["32-true"], rtol=2e-2, atol=0)
    assert trainer.global_step == 2


def test_fp16_with_gradient_accumulation_scales_every_micro_batch_alike() -> None:
    results = {}
    for precision in (_fp16(), MixedPrecision("32-true")):
        seed_everything(0, verbose=False)
        watch = Watch()
        trainer = quiet_trainer(
            devices=1,
            strategy="hybrid",
            plugins=[precision],
            max_steps=3,
            accumulate_grad_batches=2,
            gradient_clip_val=1.0,
            callbacks=[GradNormMonitor(), watch],
        )
        trainer.fit(
            GPTLightningModule(CONFIG, warmup_steps=1), datamodule=TextDataModule(seq_len=16, global_batch_size=4)
        )
        results[precision.precision] = [s["grad_norm"] for s in watch.steps if s["grad_norm"] is not None]
        assert trainer.global_step == 3
    assert trainer.precision_plugin.state_dict()["skipped_steps"] == 0
    # The norm of a window's gradients, logged on its last micro-batch, matches fp32's.
    torch.testing.assert_close(results["16-mixed"], results["32-true"], rtol=2e-2, atol=0)
