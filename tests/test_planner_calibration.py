"""The planner on the run's own machine: the cluster a run sees, calibration from measured runs (and
nothing run or trusted from their files), and ``layout="auto"`` choosing and recording a layout."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.distributed import run_distributed
from helpers.plan_cli import plan_cli
from lightning.pytorch import LightningModule

from lightning_scale.core.planner import Candidate, Workload, cluster, model_shape
from lightning_scale.core.planner.calibration import (
    CPU_FITTED,
    FITTED,
    Observation,
    calibrated,
    calibration_key,
    cluster_from_record,
    default_fit,
    fit_efficiency,
    load_calibration,
    observation_from_record,
    planner_record,
    save_calibration,
)
from lightning_scale.core.planner.cluster import CPU_EFFICIENCY, Efficiency, cpu_cluster, local_cluster
from lightning_scale.core.planner.search import candidates
from lightning_scale.core.planner.step_time import estimate_time
from lightning_scale.models import PRESETS
from lightning_scale.strategies import HybridParallelStrategy
from lightning_scale.strategies.hybrid.planning import model_shape_of

TINY = model_shape(PRESETS["tiny"])
CPU = cpu_cluster(devices_per_node=4, peak_flops={"float32": 5e10})

# ------------------------------------------------------------------------------------ the run's cluster


def test_the_cluster_a_run_sees_is_its_chips_row_and_system() -> None:
    h100 = local_cluster(
        "cuda", devices_per_node=8, nodes=2, device_name="NVIDIA H100 80GB HBM3", device_memory=79.6 * 2**30
    )
    assert (h100.device.name, h100.intra.name, h100.inter.name, h100.world_size) == (
        "H100 SXM 80GB",
        "nvlink4",
        "ib-ndr",
        16,
    )
    # A chip sold in two sizes: the row nearest the memory torch reports, that memory kept.
    a100 = local_cluster("cuda", devices_per_node=8, device_name="NVIDIA A100-SXM4-40GB", device_memory=39.4 * 2**30)
    assert a100.device.name == "A100 SXM 40GB" and a100.efficiency == cluster("a100-sxm-40").efficiency
    l4 = local_cluster("cuda", devices_per_node=4, device_name="NVIDIA L4")
    assert (l4.intra.name, l4.inter.name) == ("pcie4", "ethernet-100g")
    with pytest.raises(ValueError, match=r"no device row for 'NVIDIA GeForce RTX 3090'.*cluster='h100-sxm'"):
        local_cluster("cuda", devices_per_node=1, device_name="NVIDIA GeForce RTX 3090")
    # This host: each process its share of the memory; 4 processes on fewer cores run slower in Python too.
    assert CPU.device.peak("float32") == 5e10 and CPU.device.memory == pytest.approx(
        cpu_cluster(devices_per_node=1, peak_flops={}).device.memory / 4
    )
    assert CPU.efficiency is CPU_EFFICIENCY and CPU.device.name.startswith("CPU (")


def test_the_search_never_offers_a_layout_the_strategy_refuses() -> None:
    # A V-shaped schedule puts the first and last stage on rank 0: a tied embedding and head there cannot
    # be wrapped apart by data parallelism (the strategy refuses it), so auto must never choose it.
    # (zbv is not ranked by default, its memory being unmeasured: asked for here.)
    workload, zbv = Workload(16, 128, "32-true"), (("zbv", 2),)
    tied = list(candidates(TINY, workload, CPU, schedules=zbv))
    assert TINY.tied and not [c for c in tied if c.schedule == "zbv" and c.dp > 1]
    assert [c for c in tied if c.schedule == "zbv" and c.dp == 1]  # without data parallelism it runs
    untied = list(candidates(dataclasses.replace(TINY, tied=False), workload, CPU, schedules=zbv))
    assert [c for c in untied if c.schedule == "zbv" and c.dp > 1]


def test_without_gradient_accumulation_a_replica_runs_its_whole_batch_at_once() -> None:
    found = list(candidates(TINY, Workload(16, 128, "32-true"), CPU, gradient_accumulation=False))
    assert {c.micro_batch for c in found if c.pp == 1} == {16 // c.dp for c in found if c.pp == 1}
    assert any(c.pp > 1 and c.micro_batch < 16 // c.dp for c in found)  # pipelines still split into micro-batches


# ------------------------------------------------------------------------------------ calibration


def _observations(truth: Efficiency) -> list[Observation]:
    workload = Workload(16, 128, "32-true")
    layouts = [
        Candidate(4, 1, 1, micro_batch=4),
        Candidate(1, 2, 2, micro_batch=4),
        Candidate(2, 2, 1, micro_batch=8),
        Candidate(2, 1, 2, micro_batch=2),
        Candidate(1, 4, 1, micro_batch=16, checkpointing="full"),
    ]
    return [
        Observation(TINY, workload, c, estimate_time(TINY, workload, c, CPU, truth).step_time, name=c.name)
        for c in layouts
    ]


def test_a_fit_keeps_each_factor_within_its_physical_range() -> None:
    # Step times only "explained" by collectives faster than the measured link: the fit stops at the floor
    # (framework_collectives >= 1) rather than at 0.2, where it would predict tensor parallelism 3x too fast.
    truth = dataclasses.replace(CPU_EFFICIENCY, framework_collectives=0.2)
    observations = _observations(truth)
    fitted = fit_efficiency(observations, CPU, fit=("framework_collectives",))
    assert fitted.framework_collectives == pytest.approx(1.0)
    truth = dataclasses.replace(CPU_EFFICIENCY, framework_collectives=1.6)  # inside the range: recovered
    assert fit_efficiency(_observations(truth), CPU, fit=("framework_collectives",)).framework_collectives == (
        pytest.approx(1.6, rel=0.01)
    )


def test_calibration_recovers_the_factors_that_made_the_step_times() -> None:
    truth = dataclasses.replace(CPU_EFFICIENCY, compute=0.31, overhead=2.2e-3, framework_collectives=3.4)
    observations = _observations(truth)
    fitted = fit_efficiency(observations[:3], CPU)  # three runs, three factors
    # On a CPU host the link is measured; what its frameworks' collectives cost beyond it is fitted.
    assert "calibrated on 3 measured run(s) of cpu (compute, overhead, framework_collectives fitted" in fitted.source
    for o in observations:  # the two it never saw too
        predicted = estimate_time(o.shape, o.workload, o.candidate, CPU, fitted).step_time
        assert predicted == pytest.approx(o.step_time, rel=0.01), o.name
    # A GPU system's default is the link's achieved share; any factors can be asked for by name.
    assert default_fit(CPU) == CPU_FITTED and default_fit(cluster("h100-sxm")) == FITTED == (
        "compute",
        "overhead",
        "intra_link",
    )
    truth = dataclasses.replace(CPU_EFFICIENCY, compute=0.31, overhead=2.2e-3, intra_link=0.17)
    fitted = fit_efficiency(_observations(truth)[:3], CPU, fit=FITTED)
    assert (fitted.compute, fitted.overhead, fitted.intra_link) == pytest.approx((0.31, 2.2e-3, 0.17), rel=0.01)
    # Without calibration the CPU defaults are far off (what calibration is for).
    default = estimate_time(TINY, observations[0].workload, observations[0].candidate, CPU).step_time
    assert abs(default / observations[0].step_time - 1) > 0.5
    with pytest.raises(ValueError, match=r"needs at least one measured run"):
        fit_efficiency([], CPU)
    with pytest.raises(ValueError, match=r"fit=\['flux'\] are not factors calibration fits"):
        fit_efficiency(observations, CPU, fit=["flux"])


def test_a_calibration_is_stored_per_system_and_later_plans_say_they_use_it(tmp_path: Path) -> None:
    store = tmp_path / "calibration.json"
    fitted = dataclasses.replace(CPU_EFFICIENCY, compute=0.5, source="calibrated on 3 measured run(s) of cpu")
    assert load_calibration(CPU, store) is None and calibrated(CPU, store) is CPU
    save_calibration(CPU, fitted, _observations(fitted)[:1], store)
    save_calibration(cluster("h100-sxm"), cluster("h100-sxm").efficiency, (), store)  # another system, kept apart
    assert load_calibration(CPU, store) == fitted and calibrated(CPU, store).efficiency.source.startswith(
        "calibrated on 3"
    )
    assert set(json.loads(store.read_text())) == {calibration_key(CPU), "H100 SXM 80GB|nvlink4|ib-ndr"}
    # A stored entry is checked field by field, never trusted.
    doc = json.loads(store.read_text())
    key = next(k for k in doc if k.startswith("CPU"))
    doc[key]["compute"] = "__import__('os').system('true')"
    store.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"calibration.json\[.*\]\.compute=\S*__import__.*is not a plain float"):
        load_calibration(CPU, store)
    store.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"does not hold an object of calibrations; remove it or recalibrate"):
        load_calibration(CPU, store)


def _record() -> dict[str, Any]:
    return planner_record(TINY, Workload(16, 128, "32-true"), Candidate(2, 1, 1, micro_batch=8), CPU, 5e10)


def test_a_runs_record_rebuilds_its_observation_and_cluster_exactly() -> None:
    record = json.loads(json.dumps(_record()))  # as results.json holds it
    o = observation_from_record(record, 0.25, "results.json", "dp2")
    assert (o.shape, o.candidate, o.step_time, o.peak) == (TINY, Candidate(2, 1, 1, micro_batch=8), 0.25, 5e10)
    rebuilt = cluster_from_record(record["cluster"], "results.json")
    assert (rebuilt.device, rebuilt.intra, rebuilt.inter, rebuilt.efficiency) == (
        CPU.device,
        CPU.intra,
        CPU.inter,
        CPU_EFFICIENCY,
    )


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        (("shape", "n_layers"), "4", r"shape\.n_layers='4' is not a plain int"),
        (("shape", "__class__"), "os.system", r"unknown field\(s\) \['__class__'\] for ModelShape"),
        (("candidate", "dp_mode"), "zero9", r"candidate: dp_mode='zero9'; valid:"),
        (("candidate", "tp"), True, r"candidate\.tp=True is not a plain int"),
        (("workload",), [16, 128], r"workload: expected an object, found list"),
        (("peak_flops",), -1, r"peak_flops=-1 is not a positive number"),
    ],
)
def test_a_crafted_record_is_refused_naming_the_file_and_field(path: tuple[str, ...], value: Any, match: str) -> None:
    record = copy.deepcopy(_record())
    target = record
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ValueError, match=match):
        observation_from_record(record, 0.25, "job/results.json")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        (("intra",), "warp-drive", r"cluster\.intra='warp-drive' is not a known link"),
        (("device", "memory"), "lots", r"device\.memory='lots' is not a plain float"),
        (("device", "flops"), {"float32": "fast"}, r"device\.flops is not a mapping of dtypes to numbers"),
    ],
)
def test_a_crafted_cluster_record_is_refused(field: tuple[str, ...], value: Any, match: str) -> None:
    record = copy.deepcopy(_record())["cluster"]
    target = record
    for key in field[:-1]:
        target = target[key]
    target[field[-1]] = value
    with pytest.raises(ValueError, match=match):
        cluster_from_record(record, "job/results.json")


# ------------------------------------------------------------------------------------ layout="auto"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"layout": "best"}, r"layout='best' must be 'manual' \(the sizes given\) or 'auto'"),
        ({"cluster": "h100-sxm"}, r"cluster='h100-sxm' is what layout='auto' plans for; set layout='auto'"),
    ],
)
def test_the_layout_option_and_a_cluster_without_auto_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HybridParallelStrategy(**kwargs)


def test_planned_options_set_beside_auto_are_its_constraints() -> None:
    assert HybridParallelStrategy(layout="auto").options.constraints() == {}
    options = HybridParallelStrategy(layout="auto", tensor_parallel=2, activation_checkpointing="full").options
    assert options.constraints() == {"tensor_parallel": 2, "activation_checkpointing": "full"}
    # Options the planner does not choose are not constraints, and a constraint is checked like any option.
    assert HybridParallelStrategy(layout="auto", sequence_parallel=False).options.constraints() == {}
    with pytest.raises(ValueError, match=r"activation_checkpointing='most'"):
        HybridParallelStrategy(layout="auto", activation_checkpointing="most")


def test_the_planner_reads_a_hugging_face_models_shape_off_the_module() -> None:
    transformers = pytest.importorskip("transformers")

    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )

    class Wrapper(LightningModule):  # the shape of examples/huggingface_llama.py: the model under `model`
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.LlamaForCausalLM(config)

    module = Wrapper()
    shape = model_shape_of(module)
    assert shape.parameters == sum(p.numel() for p in module.parameters())
    assert (shape.n_kv_heads, shape.gated_mlp, shape.tied, shape.layernorm) == (2, True, False, False)

    class NoConfig(LightningModule):
        pass

    with pytest.raises(ValueError, match=r"cannot read NoConfig's shape: give it a `config` attribute"):
        model_shape_of(NoConfig())


class _UserCausalLM(LightningModule):
    """A user's own model, not the package's: torch's encoder layers under a causal mask, built in
    ``__init__``, no ``config``, no tensor-parallel plan, no pipeline spec."""

    def __init__(self, vocab: int = 256, d: int = 64, layers: int = 2, heads: int = 4, seq: int = 32) -> None:
        super().__init__()
        self.emb, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(seq, d)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm, self.out = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab, bias=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        x = self.emb(tokens) + self.pos(torch.arange(tokens.shape[1]))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return torch.nn.functional.cross_entropy(self.out(self.norm(x)).flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _auto_fit(module: LightningModule, world: int, **options: Any) -> HybridParallelStrategy:
    from lightning.pytorch import Trainer

    from lightning_scale.data import TextDataModule

    strategy = HybridParallelStrategy(layout="auto", **options)
    trainer = Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule=TextDataModule(seq_len=32, global_batch_size=4))
    return strategy


def _auto_layouts(rank: int, world: int) -> dict[str, Any]:
    """A user's own model under auto; the package's GPT under auto with and without tensor_parallel=2 (a
    constraint); the user's model under that constraint, which it cannot run (the error each rank raised)."""
    from lightning_scale.models import GPTLightningModule

    user = _UserCausalLM()
    out: dict[str, Any] = {
        "user": dataclasses.asdict(_auto_fit(user, world).auto_layout.chosen.candidate),
        "read": model_shape_of(user).parameters,
        "counted": sum(p.numel() for p in user.parameters()),
    }
    for name, options in (("gpt", {}), ("gpt_tp2", {"tensor_parallel": 2})):
        out[name] = dataclasses.asdict(
            _auto_fit(GPTLightningModule(PRESETS["tiny"]), world, **options).auto_layout.chosen.candidate
        )
    try:
        _auto_fit(_UserCausalLM(), world, tensor_parallel=2)
    except ValueError as err:
        out["refused"] = str(err)
    return out


@pytest.mark.slow
def test_auto_plans_a_users_own_model_read_off_its_modules_within_what_it_can_run_and_keeps_constraints() -> None:
    results = run_distributed(_auto_layouts, 2, timeout=240)
    assert results[0] == results[1]  # every rank built the layouts rank 0 chose, and raised alike
    result = results[0]
    assert result["read"] == result["counted"]  # the planner planned this model, parameter for parameter
    # No tensor-parallel plan and no pipeline spec: only data-parallel layouts were candidates.
    sizes = {name: (c["dp"], c["tp"], c["pp"]) for name, c in result.items() if name in ("user", "gpt", "gpt_tp2")}
    assert sizes["user"] == (2, 1, 1), result
    # tensor_parallel=2 beside auto is a constraint: the fastest layout with it, not the unconstrained choice.
    assert sizes["gpt_tp2"] == (1, 2, 1) and sizes["gpt"] != sizes["gpt_tp2"], result
    assert re.search(
        r"layout='auto' keeps tensor_parallel=2, but no layout the planner can run has it: tensor_parallel "
        r"can be 1 here\. Change or remove it, or set layout='manual'",
        result.get("refused", ""),
    ), result


# ------------------------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_auto_picks_logs_and_records_a_layout_that_calibration_then_learns_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, store = tmp_path / "runs" / "auto", tmp_path / "calibration.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LIGHTNING_SCALE_CALIBRATION": str(store)}
    command = [
        sys.executable,
        "-m",
        "lightning_scale.cli.train",
        "strategy=auto",
        "trainer.max_steps=12",
        "trainer.log_every_n_steps=6",
        "trainer.limit_val_batches=0",
        "validate_before_fit=false",
        "validate_after_fit=false",
        "callbacks=[throughput,step_time]",
        "logger=csv",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    chosen = re.search(r"layout='auto': (\S+) for GPTLightningModule on 2 x CPU \(.*\) \(efficiency: CPU defaults", out)
    assert chosen, out[-4000:]
    results = json.loads((run_dir / "results.json").read_text())
    planner = results["planner"]
    assert planner["chosen_by"] == "auto" and planner["layout"] == chosen.group(1)
    sizes = results["layout_sizes"]  # the run's own record of what it built, from the strategy's log line
    c = planner["inputs"]["candidate"]
    assert f"HybridParallelStrategy: dp={c['dp']} x pp={c['pp']} x tp={c['tp']}" in out, sizes
    # Predicted beside measured: logged as plan/* next to the measured figures, and kept with their error.
    metrics = results["metrics"]
    assert metrics["plan/step_time"] == pytest.approx(planner["predicted"]["step_time_s"])
    assert metrics["train/step_time/total"] > 0 and planner["measured"]["step_time_s"] > 0
    assert planner["error"]["step_time_s"] == pytest.approx(
        planner["predicted"]["step_time_s"] / planner["measured"]["step_time_s"] - 1
    )
    assert "plan/tokens_per_sec" in (run_dir / "csv" / "metrics.csv").read_text().splitlines()[0]

    # The sweep report shows the prediction beside the measurement.
    from lightning_scale.cli.report import build_report

    report = build_report(tmp_path / "runs").markdown.read_text()
    assert "## Planner: predicted and measured" in report and f"| {chosen.group(1)} | auto |" in report, report

    # Calibration learns from the run; a later plan of this machine uses it and says so.
    status, text, err = plan_cli(monkeypatch, capsys, "calibrate", str(tmp_path / "runs"), "--store", str(store))
    assert status == 0, err
    assert re.search(r"CPU \(.*\)\|gloo-loopback\|ethernet-10g: 1 run\(s\); calibrated on 1 measured run", text), text
    monkeypatch.setenv("LIGHTNING_SCALE_CALIBRATION", str(store))
    status, text, err = plan_cli(monkeypatch, capsys, "cluster=cpu", "trainer.devices=2", f"plan.out={tmp_path}")
    assert status == 0 and "efficiency: calibrated on 1 measured run(s) of cpu" in text, text + err

    # A crafted results.json beside it is refused by file and field; nothing in it runs.
    crafted = tmp_path / "crafted" / "results.json"
    crafted.parent.mkdir()
    results["planner"]["inputs"]["shape"]["__reduce__"] = "os.system"
    crafted.write_text(json.dumps(results))
    status, _, err = plan_cli(monkeypatch, capsys, "calibrate", str(crafted.parent), "--store", str(store))
    assert status == 2 and re.search(
        r"crafted/results.json: planner.inputs.shape: unknown field\(s\) \['__reduce__'\]", err
    ), err
