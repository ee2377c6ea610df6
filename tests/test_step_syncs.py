"""The default job adds no collective or host sync to a step between logging steps beyond what
training needs: the gradient reduction and one agreement on a preemption signal (which takes the place
of Lightning's own per-batch SIGTERM broadcast, not an addition to it). The clipping norm needs none
under plain DDP: every rank holds the same reduced gradients and takes the norm and the overflow
decision from its own."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.distributed import run_distributed
from helpers.syncs import OPTIMIZER, SCALAR_READ, CountSyncs
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

LOG_EVERY = 4
STEPS = 9

NEEDED = {
    # DDP's bucketed gradient all-reduce, started by autograd hooks inside backward.
    ("c10d.allreduce_", "lightning/pytorch/core/module.py:backward"),
    # The preemption agreement, once per optimizer step.
    ("c10d.allreduce_", "core/resilience/preemption.py:anyone_signalled"),
    (SCALAR_READ, "core/resilience/preemption.py:anyone_signalled"),
    (SCALAR_READ, OPTIMIZER),
}


def _default_job(rank: int, world_size: int, run_dir: str) -> dict[int, dict[tuple[str, str], int]]:
    from lightning_scale.cli.resolvers import register_resolvers
    from lightning_scale.cli.run import build

    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_module("lightning_scale.conf", version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                f"run_dir={run_dir}",
                f"trainer.max_steps={STEPS}",
                "trainer.limit_val_batches=0",
                f"trainer.log_every_n_steps={LOG_EVERY}",
                f"callbacks.console.every_n_steps={LOG_EVERY}",
                "data.global_batch_size=4",
                "data.seq_len=32",
            ],
        )
    module, datamodule, trainer, _ = build(cfg)
    counter = CountSyncs()
    trainer.callbacks.append(counter)
    trainer.fit(module, datamodule=datamodule)
    return {step: dict(counts) for step, counts in counter.steps.items()}


@pytest.fixture(scope="module")
def default_job_syncs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[int, dict[tuple[str, str], int]]]:
    return run_distributed(_default_job, 2, str(tmp_path_factory.mktemp("syncs")), timeout=300)


def test_steps_between_logging_steps_run_only_the_collectives_and_syncs_training_needs(default_job_syncs: Any) -> None:
    for rank, steps in enumerate(default_job_syncs):
        assert sorted(steps) == list(range(1, STEPS + 1))
        # Step 1 holds the fit's start; in step 2 DDP rebuilds its buckets, once (two broadcasts of their
        # order); a step after a logging step holds Lightning's end of that logging step.
        quiet = [s for s in steps if s % LOG_EVERY not in (0, 1) and s != STEPS and s > 2]
        assert quiet
        for step in quiet:
            extra = {site: n for site, n in steps[step].items() if site not in NEEDED}
            assert not extra, f"rank {rank}, step {step}: {extra}"
            ours = steps[step]
            assert ours[("c10d.allreduce_", "core/resilience/preemption.py:anyone_signalled")] == 1
            assert ("c10d.allreduce_", "core/precision/grad_norm.py:gradient_stats") not in ours


def test_lightnings_own_sigterm_broadcast_is_replaced_not_doubled(default_job_syncs: Any) -> None:
    for steps in default_job_syncs:
        for counts in steps.values():
            assert not [site for site in counts if "_broadcast_sigterm_tensor" in site[1]]


def test_the_telemetry_callbacks_share_one_all_reduce_at_logging_steps(default_job_syncs: Any) -> None:
    # The counter is not blind: the logged loss's all-reduce is seen there, and the telemetry callbacks'
    # (throughput, memory, cost, step time, stragglers, goodput) one shared all-reduce, read once.
    for steps in default_job_syncs:
        for step in (LOG_EVERY, 2 * LOG_EVERY):
            logging = steps[step]
            assert logging[("c10d.allreduce_", "strategies/hybrid/collectives.py:reduce")] >= 1
            # (The console, printing at these steps, reads the figures it prints: those published, host numbers;
            # the command line's run record reads the logged loss for its curve, as it did from cli/.)
            ours = {
                site: n
                for site, n in logging.items()
                if site[1].startswith("callbacks/")
                and not site[1].startswith(("callbacks/console.py", "callbacks/run_record.py"))
            }
            assert ours == {("c10d.allreduce_", "callbacks/_telemetry.py:_all_reduce"): 1}, (step, ours)
