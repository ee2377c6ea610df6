"""The resolvers ``lightning_scale/conf`` uses, registered by :func:`register_resolvers` (when the config
package is imported, and when ``train.py`` is). May import from ``cli`` ``environment`` and ``sweep_dirs``
(see ``cli/__init__.py``)."""

from __future__ import annotations

from omegaconf import OmegaConf

from lightning_scale.cli.environment import launched_externally, log_suffix, run_name, study_name, wandb_offline
from lightning_scale.cli.sweep_dirs import job_dir_for
from lightning_scale.core.resilience.elastic import launched_sizes

__all__ = ["launched", "register_resolvers"]


def _multiply(*values: float) -> float:
    product: float = 1
    for value in values:
        product *= value
    return product


_LAUNCHED = ("num_nodes", "devices")


def launched(name: str, default: int | str) -> int | str:
    """``${ls_launched:num_nodes,1}``, ``${ls_launched:devices,2}``: this torchrun attempt's number of nodes
    (agents in the rendezvous) or processes per node, which change between restarts of an elastic launch
    (``--nnodes=MIN:MAX``); ``default`` when torchrun did not start this process."""
    if name not in _LAUNCHED:
        raise ValueError(f"${{ls_launched:{name},...}}: the first argument must be one of {', '.join(_LAUNCHED)}.")
    sizes = launched_sizes() if launched_externally() else None
    return default if sizes is None else sizes[name]


def register_resolvers() -> None:
    """Register the config's resolvers (idempotent): ``${ls_run_name:}``, ``${ls_log_suffix:}``,
    ``${ls_study:}`` (``environment.study_name``), ``${ls_wandb_offline:}``, ``${ls_mul:a,b}`` and
    ``${ls_job_dir:num}`` (``sweep_dirs.job_dir_for``) and ``${ls_launched:name,default}`` (:func:`launched`)."""
    resolvers = {
        "ls_run_name": (run_name, False),
        "ls_log_suffix": (log_suffix, False),
        "ls_study": (study_name, True),  # cached: every job of a sweep gets the sweep's name
        "ls_wandb_offline": (wandb_offline, False),
        "ls_mul": (_multiply, False),
        "ls_job_dir": (job_dir_for, False),  # a sweep job's directory, chosen by its config
        "ls_launched": (launched, False),  # torchrun's nodes and processes per node of this attempt
    }
    for name, (function, cached) in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, function, use_cache=cached)
