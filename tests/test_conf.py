"""The Hydra configs: every option composes, every `_target_` key is a real parameter, presets agree
with the Python table, other apps can compose our groups, and every experiment runs."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import MissingConfigException
from hydra.utils import _locate, instantiate
from omegaconf import OmegaConf

from lightning_scale.cli.job_config import instantiate as _instantiate
from lightning_scale.cli.run import run
from lightning_scale.models import PRESETS

CONF = Path(str(resources.files("lightning_scale") / "conf"))
GROUPS = ["trainer", "model", "data", "strategy", "precision", "callbacks", "logger", "experiment", "debug"]

# Targets whose **kwargs are forwarded to another callable: keys must be parameters of one of them.
_FORWARDS: dict[str, str] = {
    "lightning.pytorch.strategies.DDPStrategy": "torch.nn.parallel.DistributedDataParallel",
    "lightning.pytorch.loggers.WandbLogger": "wandb.init",
    "lightning_scale.strategies.deepspeed_strategy": "lightning.pytorch.strategies.DeepSpeedStrategy",
}


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _sweeps() -> list[str]:
    """The experiments that are sweeps (``hydra.mode: MULTIRUN``): tests/test_sweep.py expands them."""
    return [
        name
        for name in _options("experiment")
        if "mode: MULTIRUN" in (CONF / "experiment" / f"{name}.yaml").read_text()
    ]


def _compose(*overrides: str) -> Any:
    GlobalHydra.instance().clear()
    with initialize_config_module("lightning_scale.conf", version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _targets(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        if "_target_" in node:
            yield path, node
        for key, value in node.items():
            yield from _targets(value, f"{path}.{key}" if path else str(key))


def _parameters(target: str) -> tuple[set[str], bool]:
    obj = _locate(target)
    sig = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
    names = {n for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return names - {"self"}, any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


def test_every_group_exists_with_options() -> None:
    for group in GROUPS:
        assert _options(group), f"config group {group!r} has no options"


@pytest.mark.parametrize(("group", "option"), [(g, o) for g in GROUPS for o in _options(g)])
def test_every_target_key_is_a_parameter_of_its_target(group: str, option: str) -> None:
    cfg = OmegaConf.to_container(_compose(f"{group}={option}"), resolve=False)
    checked = 0
    for path, node in _targets(cfg):
        keys = {k for k in node if not k.startswith("_")}
        params, has_kwargs = _parameters(node["_target_"])
        if has_kwargs and node["_target_"] in _FORWARDS:
            params |= _parameters(_FORWARDS[node["_target_"]])[0]
        elif has_kwargs:
            pytest.fail(f"{path}: {node['_target_']} takes **kwargs; add where they go to _FORWARDS")
        unknown = sorted(keys - params)
        assert not unknown, f"{group}={option}: {path} sets {unknown}, not parameters of {node['_target_']}"
        checked += 1
    assert checked >= 4  # module, model, data, trainer, strategy at least


def test_the_signature_check_catches_a_misspelled_key() -> None:
    params, _ = _parameters("lightning_scale.data.TextDataModule")
    assert "global_batch_size" in params and "batch_size" not in params


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_model_configs_equal_the_python_presets(name: str) -> None:
    assert instantiate(_compose(f"model={name}").model) == PRESETS[name]


def test_model_configs_and_presets_are_the_same_set() -> None:
    assert set(_options("model")) == set(PRESETS)


def test_unknown_model_lists_the_available_ones() -> None:
    with pytest.raises(MissingConfigException, match=r"(?s)Could not find 'model/gpt5'.*tiny"):
        _compose("model=gpt5")


def test_another_hydra_app_composes_our_groups(tmp_path: Path) -> None:
    (tmp_path / "app.yaml").write_text("defaults:\n  - model: gpt2-124m\n  - data: shakespeare\n  - _self_\nseed: 7\n")
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(tmp_path), version_base="1.3"):
        cfg = compose("app")
    assert cfg.model.n_layers == 12 and cfg.data._target_ == "lightning_scale.data.TextDataModule"
    assert cfg.data.seed == 7


@pytest.mark.slow
@pytest.mark.parametrize("experiment", [None, *sorted(set(_options("experiment")) - set(_sweeps()))])
def test_every_experiment_runs_under_debug_fast(experiment: str | None, tmp_path: Path) -> None:
    # fp32: CPUs without native bfloat16 matmuls run bf16 autocast ~30x slower (28 s/step for
    # one GPT-2 layer here); bf16 itself is smoke-run on the tiny model below.
    overrides = ["debug=fast", f"run_dir={tmp_path}", "precision=fp32"]
    if experiment:
        overrides.append(f"experiment={experiment}")
    if experiment == "gpt2-124m":
        # debug=fast drops our checkpoint callback, so Lightning adds its own: for GPT-2 small it wrote
        # the weights and AdamW's moments (1.4 GB) after the validation at step 2, 10 of this test's
        # 23 s. What the test is for, the full-size model built, stepped and learning, needs no save.
        overrides.append("trainer.enable_checkpointing=false")
    summary = run(_compose(*overrides))
    assert summary["global_step"] == 2
    assert (tmp_path / "summary.json").is_file()
    if experiment == "gpt2-124m":  # GPT-2 small at full size (what `model=gpt2-124m` builds) takes a step
        assert abs(summary["num_parameters"] - 124e6) / 124e6 < 0.01
        assert summary["final_val_loss"] < summary["initial_val_loss"]
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("experiment", _options("experiment"))
def test_every_experiment_has_enough_data_for_its_batches(experiment: str) -> None:
    from lightning_scale.cli.job_config import planned_data_parallel_size

    cfg = _compose(f"experiment={experiment}")
    datamodule = instantiate(cfg.data)
    datamodule.check_data_parallel(planned_data_parallel_size(cfg))
    datamodule.setup("fit")  # raises if a split holds less than one global batch
    assert cfg.data.seq_len <= cfg.model.block_size


@pytest.mark.parametrize("precision", ["bf16", "fp16", "bf16_true"])
def test_half_precisions_run_on_the_tiny_model(tmp_path: Path, precision: str) -> None:
    summary = run(_compose("debug=fast", f"precision={precision}", f"run_dir={tmp_path}"))
    assert summary["global_step"] == 2 and summary["final_val_loss"] < summary["initial_val_loss"]
    if dist.is_initialized():
        dist.destroy_process_group()


def test_wandb_logger_writes_an_offline_run_and_finishes_it(tmp_path: Path) -> None:
    import wandb

    run(_compose("debug=fast", "logger=wandb", f"run_dir={tmp_path}"))
    assert wandb.run is None, "the job left its wandb run open"
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(("stage", "mode"), [(1, "fsdp_grad_op"), (2, "fsdp_grad_op"), (3, "fsdp")])
def test_deepspeed_presets_name_the_cpu_equivalent(stage: int, mode: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("the error is for machines without CUDA")
    with pytest.raises(
        ValueError,
        match=rf"deepspeed_zero{stage} uses Lightning's DeepSpeedStrategy, which needs CUDA GPUs.*strategy=hybrid strategy.data_parallel_mode={mode}",
    ):
        _instantiate(_compose(f"strategy=deepspeed_zero{stage}").strategy)  # as the CLI does, unwrapping Hydra's error


def test_3d_presets_build_their_layouts() -> None:
    for option in [o for o in _options("strategy") if o.startswith("3d_")]:
        strategy = instantiate(_compose(f"strategy={option}").strategy)
        assert strategy.options.data_parallel_mode in ("ddp", "fsdp", "fsdp_grad_op", "hsdp"), option
    assert instantiate(_compose("strategy=3d_dp2_tp2_pp2").strategy).options.pipeline_parallel == 2
