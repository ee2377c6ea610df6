"""The planner's price of the data-parallel sync modes (Local SGD, DiLoCo, Streaming DiLoCo) against hand
computations, and where they win (:mod:`lightning_scale.core.planner.sync`)."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest

from lightning_scale.core.parallel.sync_exchange import QUANT_BLOCK
from lightning_scale.core.parallel.sync_spec import SyncSpec, diloco, local_sgd, streaming_diloco
from lightning_scale.core.planner import Candidate, Workload, cluster, estimate, model_shape
from lightning_scale.core.planner.cluster import Cluster, Device, Efficiency, Link
from lightning_scale.core.planner.sync import UPDATE_TRAFFIC, break_even, sync_time
from lightning_scale.models import PRESETS

GB = 1e9
ROUND = Efficiency(compute=1.0, intra_link=1.0, inter_link=1.0, latency=0.0, dp_overlap=0.5, memory=1.0)
"""Nominal rates, no latency: every figure below is bytes over bandwidth."""


def _round_cluster(nodes: int = 2, inter: float = 1 * GB) -> Cluster:
    """One device a node, 1 TFLOP/s, 1 TB/s of memory, nodes joined by one ``inter`` bytes/s NIC."""
    device = Device("round", "round", 64 * 2**30, 1e12, None, "test", flops=(("float32", 1e12),))
    return Cluster(
        device, 1, nodes, Link("intra", 100 * GB, 0.0, "test"), Link("inter", inter, 0.0, "test"), "round", ROUND
    )


def _round(nodes: int = 2, inter: float = 1 * GB):
    node = _round_cluster(nodes, inter)
    shape = model_shape(PRESETS["tiny"])
    return estimate(shape, Workload(2 * nodes, 128, "32-true"), Candidate(nodes, 1, 1), node), node, shape


def test_local_sgd_on_round_numbers_is_bytes_over_bandwidth_divided_by_h() -> None:
    """2 nodes of one device on a 1 GB/s link, fp32: the all-reduce of ``P`` parameters moves
    ``2 (2 - 1) / 2 x 4 P`` bytes per rank, ``4 P / 1e9`` seconds; every 4 steps a quarter of it per step,
    blocking, plus the flat buffer's copy in and out (4 bytes a parameter each way) at 1 TB/s."""
    e, node, shape = _round()
    params = e.time.inputs["parameters_per_rank"]
    assert params == shape.parameters  # tp=pp=1: every parameter on the rank
    exchange = 4 * params / GB
    # Every step: the same all-reduce of fp32 gradients, half of it hidden behind the last backward.
    backward = e.time.inputs["microbatch_s"] * 2 / 3
    assert e.time.inputs["dp_reduce_s"] == pytest.approx(exchange)
    assert e.time.terms["data_parallel"] == pytest.approx(max(exchange - 0.5 * backward, 0.5 * exchange))

    s = sync_time(e, node, local_sgd(4))
    assert s.exchange == pytest.approx(exchange)
    assert s.terms["data_parallel"] == pytest.approx(exchange / 4)
    assert s.terms["sync_update"] == pytest.approx(UPDATE_TRAFFIC["local_sgd"] * 4 * params / 4 / 1e12)
    rest = e.time.step_time - e.time.terms["data_parallel"]
    assert s.step_time == pytest.approx(rest + exchange / 4 + s.terms["sync_update"])
    assert s.every_step_time == e.time.step_time
    assert s.time_saved == pytest.approx(e.time.terms["data_parallel"] - exchange / 4 - s.terms["sync_update"])
    assert s.bytes_per_step == pytest.approx(4 * params / 4) and s.every_step_bytes_per_step == pytest.approx(
        4 * params
    )
    assert s.tokens_per_sec == pytest.approx(4 * 128 / s.step_time)
    assert s.extra_memory == 0.0
    # DiLoCo: the same bytes, a larger update, and the anchor and outer momentum held.
    d = sync_time(e, node, diloco(4))
    assert d.terms["data_parallel"] == s.terms["data_parallel"] and d.bytes_per_step == s.bytes_per_step
    assert d.terms["sync_update"] == pytest.approx(12 * 4 * params / 4 / 1e12)
    assert d.extra_memory == 2 * 4 * params


def test_every_step_is_the_estimate_as_it_is() -> None:
    e, node, _ = _round()
    s = sync_time(e, node)
    assert s.step_time == e.time.step_time and s.time_saved == 0.0 and s.bytes_ratio == 1.0
    assert s.exchange == e.time.inputs["dp_reduce_s"]
    fsdp = estimate(model_shape(PRESETS["tiny"]), Workload(4, 128, "32-true"), Candidate(2, 1, 1, "fsdp"), node)
    assert sync_time(fsdp, node).step_time == fsdp.time.step_time


def test_h1_local_sgd_pays_at_least_every_steps_unhidden_communication() -> None:
    """An exchange every step blocks on the whole all-reduce: on round numbers (no latency) exactly DDP's
    reduction with none of it hidden; on real clusters more than the share DDP leaves unhidden, so slower."""
    e, node, _ = _round()
    s = sync_time(e, node, local_sgd(1))
    assert s.terms["data_parallel"] == pytest.approx(e.time.inputs["dp_reduce_s"])
    assert s.step_time >= e.time.step_time - e.time.terms["data_parallel"] + e.time.inputs["dp_reduce_s"]
    for nodes, name in ((2, "h100-sxm"), (4, "a100-sxm-80")):
        node = cluster(name, nodes=nodes)
        e = estimate(model_shape(PRESETS["1.3b"]), Workload(64, 2048), Candidate(8 * nodes, 1, 1), node)
        s = sync_time(e, node, local_sgd(1))
        assert s.terms["data_parallel"] > e.time.terms["data_parallel"]
        assert s.step_time > e.time.step_time and s.time_saved < 0


@pytest.mark.parametrize("every", [1, 2, 8, 500])
def test_bytes_per_step_are_one_over_h_and_less_compressed(every: int) -> None:
    node = cluster("h100-sxm", nodes=2)
    shape = model_shape(PRESETS["350m"])
    e = estimate(shape, Workload(32, 1024), Candidate(16, 1, 1), node)  # bf16-mixed: fp32 parameters
    ratios = {c: sync_time(e, node, diloco(every, compression=c)).bytes_ratio for c in ("none", "bf16", "int8", "int4")}
    assert ratios["none"] == pytest.approx(1 / every)
    assert ratios["bf16"] == pytest.approx(2 / 4 / every)
    assert ratios["int8"] == pytest.approx((1 + 4 / QUANT_BLOCK) / 4 / every)
    assert ratios["int4"] == pytest.approx((0.5 + 4 / QUANT_BLOCK) / 4 / every)
    # Under bf16 parameters, bf16 is what they are already.
    e16 = estimate(shape, Workload(32, 1024, "bf16-true"), Candidate(16, 1, 1), node)
    assert sync_time(e16, node, local_sgd(every, compression="bf16")).bytes_ratio == pytest.approx(1 / every)
    # Streaming: 1/F of the parameters every H/F steps, the same bytes per step.
    if every >= 4:
        assert sync_time(e, node, streaming_diloco(every, 4)).bytes_ratio == pytest.approx(1 / every)
    # DiLoCo holds its anchor and outer momentum (none at momentum 0); a compressed exchange an anchor and its
    # fp32 error feedback (each value's, and the rank's averaged 1/16).
    params = e.time.inputs["parameters_per_rank"]
    assert sync_time(e, node, diloco(every)).extra_memory == 2 * 4 * params
    assert sync_time(e, node, diloco(every, outer_momentum=0.0)).extra_memory == 4 * params
    assert sync_time(e, node, local_sgd(every)).extra_memory == 0.0
    compressed = sync_time(e, node, local_sgd(every, compression="int8")).extra_memory
    assert compressed == pytest.approx((4 + 4 * (1 + 1 / 16)) * params)
    # Under bf16 parameters DiLoCo's anchor, and the pseudo-gradient it exchanges, are fp32.
    assert sync_time(e16, node, diloco(every)).wire_bytes_per_parameter == 4
    assert sync_time(e16, node, local_sgd(every)).wire_bytes_per_parameter == 2


def test_streaming_overlap_hides_the_exchange_behind_one_step_at_most() -> None:
    """Without overlap F fragments cost what one whole exchange does (no latency here); with it each hides
    behind the next step's work, at most ``dp_overlap`` of it."""
    e, node, _ = _round(inter=0.01 * GB)  # a slow link: an exchange longer than a step
    whole = sync_time(e, node, diloco(8))
    blocking = sync_time(e, node, streaming_diloco(8, 4, overlap=False))
    overlapped = sync_time(e, node, streaming_diloco(8, 4, overlap=True))
    assert blocking.exchange == pytest.approx(whole.exchange / 4)
    assert blocking.terms["data_parallel"] == pytest.approx(whole.terms["data_parallel"])
    window = e.time.step_time - e.time.terms["data_parallel"] - e.time.terms["optimizer"]
    assert blocking.exchange > window  # longer than the step it hides behind: half the window hides
    assert overlapped.terms["data_parallel"] == pytest.approx(4 / 8 * (blocking.exchange - 0.5 * window))


def test_one_replica_exchanges_nothing() -> None:
    e, node, _ = _round(nodes=1)
    s = sync_time(e, node, diloco(4))
    assert s.step_time == pytest.approx(e.time.step_time) and s.bytes_per_step == 0.0


def test_break_even_is_where_the_times_to_the_tokens_cross_and_rises_with_h() -> None:
    """DiLoCo needing 1.5 times the tokens (a caller's measurement): at high bandwidth every step wins, at low
    bandwidth DiLoCo; the crossing rises with H, toward the bandwidth where 1.5 x the compute alone equals
    every step's time."""
    shape, workload = model_shape(PRESETS["1.3b"]), Workload(64, 2048)
    node, candidate = cluster("h100-sxm", nodes=2), Candidate(16, 1, 1, micro_batch=4)
    e = estimate(shape, workload, candidate, node)
    crossings = [break_even(e, node, diloco(h), penalty=1.5) for h in (2, 4, 16, 64, 500)]
    assert all(0 < c < node.inter.bandwidth for c in crossings)
    assert crossings == sorted(crossings) and len(set(crossings)) == len(crossings)
    # At the crossing, re-estimated on a cluster with that link, the two times to the tokens are equal.
    for h, bandwidth in ((4, crossings[1]), (64, crossings[3])):
        there = dataclasses.replace(node, inter=dataclasses.replace(node.inter, bandwidth=bandwidth))
        s = sync_time(estimate(shape, workload, candidate, there), there, diloco(h))
        assert 1.5 * s.step_time == pytest.approx(s.every_step_time, rel=1e-6)
    # Compression and fragments with overlap win up to faster links.
    assert break_even(e, node, diloco(16, compression="int8"), penalty=1.5) > crossings[2]
    assert break_even(e, node, streaming_diloco(16, 4, overlap=True), penalty=1.5) > crossings[2]
    # Equal tokens: at H=1 the blocking exchange never wins; at H=500 it wins on any link.
    assert break_even(e, node, local_sgd(1)) == 0.0
    assert break_even(e, node, diloco(500)) == math.inf


def test_break_even_inside_one_node_does_not_depend_on_the_inter_node_link() -> None:
    node = cluster("h100-sxm")
    e = estimate(model_shape(PRESETS["1.3b"]), Workload(64, 2048), Candidate(8, 1, 1, micro_batch=8), node)
    assert break_even(e, node, diloco(100)) == math.inf  # faster on NVLink too, at equal tokens
    assert break_even(e, node, diloco(100), penalty=1.5) == 0.0


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"mode": "diloco", "every": 0}, r"every=0 must be a positive integer.*It is H, the optimizer steps"),
        ({"mode": "local_sgd", "every": -3}, r"every=-3 must be a positive integer"),
        ({"mode": "diloco", "every": 2.5}, r"every=2.5 must be a positive integer"),
        (
            {"mode": "streaming_diloco", "every": 8, "fragments": 0},
            r"fragments=0 must be a positive integer.*fragments of blocks",
        ),
        ({"mode": "diloco", "every": 4, "compression": "fp8"}, r"compression='fp8' is not one of 'bf16', 'int4'"),
        ({"mode": "gossip", "every": 4}, r"mode 'gossip' is not one of.*'diloco'"),
        ({"mode": "diloco", "every": 4, "fragments": 2}, r"fragments=2 and overlap=False are streaming_diloco's"),
        ({"mode": "streaming_diloco", "every": 2, "fragments": 4}, r"fragments=4 > every=2.*Use fragments <= every"),
        ("diloco", r"data_parallel_sync='diloco' needs H.*every=50"),
    ],
)
def test_a_spec_the_strategy_refuses_is_refused_naming_the_value_and_the_fix(spec: object, match: str) -> None:
    e, node, _ = _round()
    with pytest.raises(ValueError, match=match):
        sync_time(e, node, spec)  # type: ignore[arg-type]


def test_a_sharded_layout_another_clusters_estimate_and_a_bad_penalty_are_refused() -> None:
    e, node, shape = _round()
    fsdp = estimate(shape, Workload(4, 128, "32-true"), Candidate(2, 1, 1, "fsdp"), node)
    with pytest.raises(ValueError, match=r"local_sgd\(every=4\) needs replicas: .*dp_mode='fsdp'.*dp_mode='ddp'"):
        sync_time(fsdp, node, local_sgd(4))
    with pytest.raises(ValueError, match=r"not made on this cluster.*Pass the cluster and efficiency="):
        sync_time(e, _round_cluster(inter=2 * GB), local_sgd(4))
    for penalty in (0, -1.0, math.nan):
        with pytest.raises(ValueError, match=r"penalty=.* must be a positive.*tokens per every-step token"):
            break_even(e, node, diloco(4), penalty=penalty)
    with pytest.raises(ValueError, match=r"'every_step' is what break_even compares against.*Pass a local mode"):
        break_even(e, node, SyncSpec())


def test_the_plan_command_prices_a_periodic_mode_on_the_best_replica_layout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    from helpers.plan_cli import plan_cli

    run = ("experiment=gpt2-124m", "cluster=h100-sxm", "cluster.nodes=4", f"plan.out={tmp_path}")
    status, out, _ = plan_cli(
        monkeypatch, capsys, *run, "plan.sync=diloco", "plan.sync_every=50", "plan.sync_penalty=1.2"
    )
    assert status == 0
    line = next(x for x in out.splitlines() if "data_parallel_sync diloco(every=50" in x)
    assert "-fp8" not in line and "-cp" not in line  # a layout the strategy trains
    assert "0.02x the bytes" in line and "wins below" in line and "1.2x the tokens" in line
    doc = json.loads((tmp_path / "plan.json").read_text())["data_parallel_sync"]
    assert doc["bytes_ratio"] == pytest.approx(1 / 50, rel=1e-6) and doc["penalty"] == 1.2
    assert 0 < doc["break_even_bytes_per_s_per_nic"] < 50e9
    # every_step (the default strategy's) prints nothing of the kind
    status, out, _ = plan_cli(monkeypatch, capsys, *run)
    assert status == 0 and "data_parallel_sync" not in out
