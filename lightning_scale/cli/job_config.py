"""A job's composed config, read and checked before any process starts: how many processes it has, its
layout (worked out here, once, for every caller), its fingerprint, its constructors' errors, and what the
model admits. May import from ``cli`` only ``environment`` and ``resume`` (see ``cli/__init__.py``)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_scale.cli.environment import launched_externally
from lightning_scale.cli.resume import check_checkpoint_path
from lightning_scale.core.checks import divisors
from lightning_scale.core.parallel.layout import Layout, resolve_layout
from lightning_scale.core.pipeline.partition import stages_per_rank
from lightning_scale.models import GPTConfig

__all__ = [
    "LayoutNotAdmitted",
    "check_fits",
    "config_fingerprint",
    "device_count",
    "devices_per_node",
    "instantiate",
    "job_info",
    "layout_of",
    "planned_data_parallel_size",
    "preflight",
    "world_size",
]

_VOLATILE = ("run_dir", "ckpt_path", "job", "sweep")  # differ between attempts of one job (sweep: how to run it)


def device_count(devices: Any, accelerator: str) -> int:
    """Processes per node that Lightning will start for ``trainer.devices``."""
    if OmegaConf.is_list(devices) or isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str):
        text = devices.strip()
        if "," in text:
            return len([d for d in text.split(",") if d.strip()])
        devices = int(text) if text.lstrip("-").isdigit() else text
    if devices in (-1, "auto"):
        if accelerator in ("gpu", "cuda", "auto"):
            import torch

            return max(torch.cuda.device_count(), 1)
        return 1
    if isinstance(devices, int) and devices > 0:
        return devices
    raise ValueError(f"trainer.devices={devices!r} is not a positive count, a list of device ids, -1 or 'auto'")


def devices_per_node(cfg: Mapping[str, Any]) -> int:
    """Processes per node (``trainer.devices``)."""
    trainer = cfg["trainer"]
    return device_count(trainer.get("devices", 1), str(trainer.get("accelerator", "cpu")))


def world_size(cfg: Mapping[str, Any]) -> int:
    """Processes of the whole run: per node times ``trainer.num_nodes``."""
    return devices_per_node(cfg) * int(cfg["trainer"].get("num_nodes", 1))


def _mesh_layout(cfg: Mapping[str, Any]) -> Layout:
    """The (dp, tp, pp) sizes ``strategy`` asks for, resolved against the run's processes. Raises
    ``ValueError`` when they do not fit."""
    strategy = cfg.get("strategy") or {}
    return resolve_layout(
        world_size(cfg),
        data_parallel=strategy.get("data_parallel", "auto"),
        tensor_parallel=strategy.get("tensor_parallel", 1),
        pipeline_parallel=strategy.get("pipeline_parallel", 1),
        devices_per_node=devices_per_node(cfg),
    )


def planned_data_parallel_size(cfg: DictConfig) -> int:
    """Data-parallel ranks the run will have, from the config alone (before any process starts)."""
    strategy = cfg.get("strategy") or {}
    if not any(k in strategy for k in ("data_parallel", "tensor_parallel", "pipeline_parallel")):
        return world_size(cfg)
    return _mesh_layout(cfg).dp


def layout_of(cfg: Mapping[str, Any], strategy_choice: str | None = None) -> dict[str, Any]:
    """The job's layout from its config alone: sizes, data-parallel mode and a short name
    (``dp2-tp1-pp1``; ``fsdp2-tp2-pp1``; ``ddp-x2`` for Lightning's own strategies). Raises
    ``ValueError`` when the sizes do not fit the processes."""
    world = world_size(cfg)
    strategy = cfg.get("strategy") or {}
    target = str(strategy.get("_target_", ""))
    if target.endswith("HybridParallelStrategy") and strategy.get("layout") == "auto":
        # Chosen when the run starts; results.json records the choice (cli.results.job_results).
        return {"name": f"auto-x{world}", "dp": world, "tp": 1, "pp": 1, "mode": "auto", "world_size": world}
    if target.endswith("HybridParallelStrategy"):
        layout = _mesh_layout(cfg)
        mode = str(strategy.get("data_parallel_mode", "ddp"))
        prefix = "dp" if mode == "ddp" else mode
        return {
            "name": f"{prefix}{layout.dp}-tp{layout.tp}-pp{layout.pp}",
            "dp": layout.dp,
            "tp": layout.tp,
            "pp": layout.pp,
            "mode": mode,
            "world_size": world,
        }
    name = strategy_choice or target.rsplit(".", 1)[-1].removesuffix("Strategy").lower() or "single"
    return {"name": f"{name}-x{world}", "dp": world, "tp": 1, "pp": 1, "mode": name, "world_size": world}


def config_fingerprint(cfg: Mapping[str, Any]) -> str:
    """A hash of a job's resolved config without what changes between attempts of the same job,
    and with its directory written as ``${run_dir}`` (a sweep directory may be moved)."""
    plain = {k: v for k, v in cfg.items() if k not in _VOLATILE}
    text = json.dumps(plain, sort_keys=True, default=str)
    if cfg.get("run_dir"):
        text = text.replace(str(cfg["run_dir"]), "${run_dir}")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def instantiate(node: Any, *args: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` that lets a constructor's ``ValueError``/``TypeError`` through.

    Hydra wraps every constructor error in ``InstantiationException``; our checks' messages name
    the value and the fix, so surface them as they are. Lists and dicts reach the constructors as
    plain ``list``/``dict`` (``_convert_="all"``), never OmegaConf containers: whatever a module keeps
    (``save_hyperparameters``) goes into checkpoints, which must load with ``weights_only=True``.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    kwargs.setdefault("_convert_", "all")
    try:
        return hydra_instantiate(node, *args, **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, (ValueError, TypeError)):
            raise err.__cause__ from None
        raise


def preflight(cfg: DictConfig) -> tuple[Any, Any]:
    """Check everything checkable from the config alone; returns (model config, datamodule).

    Raises ``ValueError`` for bad input before any process group or child process exists.
    """
    check_checkpoint_path(cfg)
    model_config = instantiate(cfg.model)
    datamodule = instantiate(cfg.data)
    if datamodule.seq_len > model_config.block_size:
        raise ValueError(
            f"data.seq_len={datamodule.seq_len} exceeds the model's context model.block_size="
            f"{model_config.block_size}. Set data.seq_len<={model_config.block_size} or raise model.block_size."
        )
    dp_size = planned_data_parallel_size(cfg)
    datamodule.check_data_parallel(dp_size)
    if datamodule.vocab_size > model_config.vocab_size:
        raise ValueError(
            f"The data has token ids up to {datamodule.vocab_size - 1} but model.vocab_size="
            f"{model_config.vocab_size}. Set model.vocab_size>={datamodule.vocab_size}."
        )
    strategy = cfg.get("strategy") or {}
    if str(strategy.get("_target_", "")).endswith("HybridParallelStrategy") and isinstance(model_config, GPTConfig):
        _check_gpt_layout(model_config, strategy)
    return model_config, datamodule


class LayoutNotAdmitted(ValueError):
    """The model cannot be cut this way (a sweep skips such a job rather than failing it)."""


def _check_gpt_layout(config: GPTConfig, strategy: Any) -> None:
    """The reference GPT's limits on the layout: whole heads per tensor-parallel rank, a block per stage."""
    tp, pp = strategy.get("tensor_parallel", 1), strategy.get("pipeline_parallel", 1)
    if isinstance(tp, int) and tp > 1:
        kv = config.n_kv_heads or config.n_heads
        if config.n_heads % tp or kv % tp:
            raise LayoutNotAdmitted(
                f"tensor_parallel={tp} does not divide the model's n_heads={config.n_heads} (n_kv_heads={kv}): each "
                f"tensor-parallel rank needs whole heads. Use tensor_parallel in {divisors(kv)}."
            )
    fragments = _sync_fragments(strategy)
    if fragments > config.n_layers:
        raise LayoutNotAdmitted(
            f"strategy.data_parallel_sync=streaming_diloco(fragments={fragments}) needs at least one block per "
            f"fragment but the model has n_layers={config.n_layers} blocks. Use fragments<={config.n_layers}."
        )
    if isinstance(pp, int) and pp > 1:
        stages = pp * stages_per_rank(str(strategy.get("schedule", "1f1b")), int(strategy.get("virtual_stages", 2)))
        if stages > config.n_layers:
            raise LayoutNotAdmitted(
                f"pipeline_parallel={pp} needs {stages} pipeline stages but the model has n_layers={config.n_layers} "
                f"blocks. Use pipeline_parallel<={config.n_layers} or a deeper model."
            )


def _sync_fragments(strategy: Any) -> int:
    """The fragments a streaming DiLoCo of the strategy config splits the blocks into (1 for other modes)."""
    from lightning_scale.core.parallel.sync_spec import sync_spec

    value = strategy.get("data_parallel_sync", "every_step")
    if not isinstance(value, DictConfig):
        return 1  # a mode name: one fragment (the strategy checks the rest when it is built)
    return sync_spec(OmegaConf.to_container(value, resolve=True), strategy.get("sync_every")).fragments


def check_fits(cfg: DictConfig) -> None:
    """``ValueError`` when the job's processes do not fit this machine or launcher (it is skipped)."""
    trainer = cfg.trainer
    accelerator = str(trainer.get("accelerator", "cpu"))
    if accelerator in ("gpu", "cuda"):
        import torch

        devices = devices_per_node(cfg)
        have = torch.cuda.device_count()
        if devices > have:
            raise ValueError(f"trainer.devices={devices} but this machine has {have} GPU(s).")
    if int(trainer.get("num_nodes", 1)) > 1 and not launched_externally():
        raise ValueError(
            f"trainer.num_nodes={trainer.num_nodes} needs that many machines: run the sweep with "
            "hydra/launcher=submitit_slurm (srun starts every rank)."
        )


def job_info(cfg: DictConfig) -> dict[str, Any]:
    """This run's place in its study: job number, its own overrides, the group choices (from Hydra's
    runtime config)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    choices = hydra_cfg.runtime.choices
    return {
        "study": cfg.get("study"),
        "num": hydra_cfg.job.get("num") if hydra_cfg.mode == RunMode.MULTIRUN else None,
        "multirun": hydra_cfg.mode == RunMode.MULTIRUN,
        "overrides": [o for o in hydra_cfg.overrides.task if not o.startswith(("hydra.", "hydra/"))],
        "strategy_choice": choices.get("strategy"),
        "precision_choice": choices.get("precision"),
        "experiment": choices.get("experiment"),
    }
