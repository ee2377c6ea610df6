"""The user's own training_step under pipeline parallelism (pp=2, GPipe, 1F1B, interleaved), against one
process in fp64: each variant of a step built from the pieces users write (a second loss term, label
smoothing, -100 labels, a weight following the schedule, an auxiliary loss carried in the output or
kept on the blocks, dict/dataclass/named-tuple stage outputs, a Hugging Face ModelOutput, self.log of
each term) trains the same parameters and logs the same values to 1e-9 (and its validation_step logs
the same value), or is refused before the first optimizer step on every rank, naming the rule. None
is silently different."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from helpers.distributed import run_distributed
from helpers.lightning import quiet_trainer
from helpers.parity import full_parameters
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_scale  # noqa: F401
from lightning_scale.core.pipeline.spec import PipelineSpec, labelled_tokens
from lightning_scale.strategies import HybridParallelStrategy

VOCAB, WIDTH, LENGTH, BLOCKS = 16, 8, 6, 4
STEPS, BATCH = 3, 8
SCHEDULES = {"gpipe": ("gpipe", 4), "1f1b": ("1f1b", 4), "interleaved": ("interleaved_1f1b", 4)}


@dataclasses.dataclass
class Carry:
    hidden: torch.Tensor
    aux: torch.Tensor


class CarryTuple(NamedTuple):
    hidden: torch.Tensor
    aux: torch.Tensor


def _pack(kind: str, hidden: torch.Tensor, aux: torch.Tensor) -> Any:
    if kind == "tuple":
        return hidden, aux
    if kind == "dict":
        return {"hidden": hidden, "aux": aux, "note": "kept"}
    if kind == "dataclass":
        return Carry(hidden, aux)
    if kind == "namedtuple":
        return CarryTuple(hidden, aux)
    return hidden


def _unpack(kind: str, value: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if kind in ("tuple", "namedtuple"):
        return value[0], value[1]
    if kind == "dict":
        assert value["note"] == "kept"
        return value["hidden"], value["aux"]
    if kind == "dataclass":
        return value.hidden, value.aux
    return value, None


class Block(nn.Module):
    def __init__(self, carry: str) -> None:
        super().__init__()
        self.linear, self.carry = nn.Linear(WIDTH, WIDTH), carry
        self.aux: torch.Tensor | None = None

    def forward(self, value: Any) -> Any:
        hidden, aux = _unpack(self.carry, value)
        hidden = hidden + torch.tanh(self.linear(hidden))
        self.aux = (self.linear.weight**2).mean() * hidden.abs().mean()  # a router-style loss kept on the block
        if aux is None:
            return hidden
        return _pack(self.carry, hidden, aux + (hidden**2).mean(-1).mean(-1))


class Net(nn.Module):
    def __init__(self, carry: str, output: str) -> None:
        super().__init__()
        self.carry, self.output = carry, output
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(carry) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: Any, *rest: torch.Tensor) -> Any:
        if rest:  # a later stage: torch passes a tuple of tensors as positional arguments
            x = (x, *rest)
        if self.embed is not None:
            hidden = self.embed(x)
            x = _pack(self.carry, hidden, hidden.new_zeros(hidden.size(0)))
        for block in self.blocks:
            x = block(x)
        if self.head is None:
            return x
        hidden, aux = _unpack(self.carry, x)
        logits = self.head(hidden)
        if self.output == "model_output":
            from transformers.modeling_outputs import CausalLMOutput

            return CausalLMOutput(logits=logits, hidden_states=(hidden,))
        return logits if aux is None else (logits, aux)


def _ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    terms: tuple[str, ...] = ("ce",)
    carry: str = "tensor"
    output: str = "tensor"
    masked: bool = False
    schedule_weight: bool = False
    router: bool = False
    twice: bool = False
    altered_inputs: bool = False
    refused: str | None = None


class UserModule(LightningModule):
    def __init__(self, variant: Variant) -> None:
        super().__init__()
        self.variant = variant
        self.net = Net(variant.carry, variant.output)

    def pipeline_spec(self) -> tuple[str, PipelineSpec]:
        blocks = [f"blocks.{i}" for i in range(BLOCKS)]
        return "net", PipelineSpec(blocks, ["embed"], ["head"], loss_fn=_ce, loss_tokens=labelled_tokens)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        v = self.variant
        x, y = batch
        out = self.net(x.flip(0) if v.altered_inputs else x)
        if v.twice:
            out = self.net(x)
        aux = None
        if v.output == "model_output":
            logits = out.logits
        elif isinstance(out, tuple):
            logits, aux = out
        else:
            logits = out
        smoothing = 0.1 if "smooth" in v.terms else 0.0
        ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), label_smoothing=smoothing)
        loss, logged = ce, {"ce": ce}
        z = torch.logsumexp(logits, dim=-1) ** 2
        if "z_all" in v.terms:  # averaged over every position
            logged["z"] = z.mean()
            loss = loss + 1e-2 * logged["z"]
        if "z_labelled" in v.terms:  # averaged over the labelled positions, as the cross entropy
            logged["z"] = z[y != -100].mean()
            loss = loss + 1e-2 * logged["z"]
        if aux is not None and "aux" in v.terms:  # averaged over the samples
            logged["aux"] = aux.mean()
            loss = loss + 1e-2 * logged["aux"]
        if v.router:
            loss = loss + 1e-2 * sum(block.aux for block in self.net.blocks)
        if v.schedule_weight:
            loss = loss * (1.0 + 0.5 * self.global_step)
        self.log_dict({f"user/{k}": t for k, t in logged.items()})
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        out = self.net(x)
        logits = out.logits if self.variant.output == "model_output" else out[0] if isinstance(out, tuple) else out
        self.log("user/val_ce", F.cross_entropy(logits.flatten(0, 1), y.flatten()), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


VARIANTS = [
    Variant("cross entropy"),
    Variant("the issue's weighted sum: ce + 1e-2 z-loss", ("ce", "z_all")),
    Variant("two terms over the labelled positions, -100 labels", ("ce", "z_labelled"), masked=True),
    Variant("label smoothing with -100 labels", ("smooth",), masked=True),
    Variant("a weight that follows the schedule", ("ce", "z_all"), schedule_weight=True),
    Variant("an auxiliary loss carried in the output (a tuple)", ("ce", "aux"), carry="tuple"),
    Variant("dict stage outputs", ("ce", "z_all", "aux"), carry="dict"),
    Variant("dataclass stage outputs", ("ce", "aux"), carry="dataclass"),
    Variant("named-tuple stage outputs with -100 labels", ("smooth", "z_labelled"), carry="namedtuple", masked=True),
    Variant("a Hugging Face ModelOutput from the last stage", ("ce", "z_all"), output="model_output"),
    Variant(
        "a term over every position beside one over the labelled ones",
        ("ce", "z_all"),
        masked=True,
        refused="not the weighted sum of theirs",
    ),
    Variant("a router loss kept on the blocks", router=True, refused="other than through the model's output"),
    Variant(
        "a carried auxiliary loss averaged over samples, with -100 labels",
        ("ce", "aux"),
        carry="dataclass",
        masked=True,
        refused="logged 'user/aux' of two micro-batches together",
    ),
    Variant("two forwards in one step", twice=True, refused="more than once"),
    Variant("inputs other than pipeline_batch's", altered_inputs=True, refused="other tensors than the pipeline"),
]


def _data(masked: bool) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (BATCH * STEPS, LENGTH), generator=generator)
    y = torch.randint(0, VOCAB, (BATCH * STEPS, LENGTH), generator=generator)
    if masked:  # prompts of different lengths: micro-batches hold different numbers of labelled positions
        for row in range(len(y)):
            y[row, : (row * 5) % LENGTH] = -100
    return TensorDataset(x, y)


class RecordLogged(Callback):
    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("user/")}
        self.metrics.append(logged | {"loss": float(outputs["loss"])})


def _fit(variant: Variant, strategy: Any, devices: int) -> dict[str, Any]:
    seed_everything(0, verbose=False)
    module = UserModule(variant)
    record = RecordLogged()
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy,
        precision="64-true",
        max_steps=STEPS,
        callbacks=[record],
        use_distributed_sampler=False,
        limit_val_batches=2,
        num_sanity_val_steps=0,
    )
    before = full_parameters(module, 1) if devices > 1 else None
    data = DataLoader(_data(variant.masked), batch_size=BATCH)
    try:
        trainer.fit(module, data, data)  # validation at the end of the (one) epoch, on 2 batches
    except ValueError as err:
        unchanged = all(torch.equal(v, before[k]) for k, v in full_parameters(module, devices).items() if k in before)
        return {"error": str(err), "steps": len(record.metrics), "unchanged": unchanged}
    val = float(trainer.callback_metrics["user/val_ce"])
    return {"metrics": record.metrics, "val": val, "params": full_parameters(module, devices)}


def _pipelined(rank: int, world: int, cases: list[tuple[int, str]]) -> list[dict[str, Any]]:
    out = []
    for index, schedule in cases:
        name, microbatches = SCHEDULES[schedule]
        strategy = HybridParallelStrategy(
            data_parallel=1, pipeline_parallel=world, schedule=name, microbatches=microbatches
        )
        result = _fit(VARIANTS[index], strategy, world)
        result.pop("params", None) if rank else None
        out.append(result)
    return out


def _cases() -> list[tuple[int, str]]:
    """Every variant under every schedule (one spawn: a few seconds in all)."""
    return [(i, s) for i in range(len(VARIANTS)) for s in SCHEDULES]


def test_at_least_ten_variants_of_a_users_training_step_are_exact_or_refused_at_pp2_under_every_schedule() -> None:
    cases = _cases()
    assert len(VARIANTS) >= 10 and len(cases) == len(VARIANTS) * len(SCHEDULES)
    references = {i: _fit(v, "auto", 1) for i, v in enumerate(VARIANTS) if v.refused is None}
    results = run_distributed(_pipelined, 2, cases, timeout=600)
    for rank, by_case in enumerate(results):
        for (index, schedule), got in zip(cases, by_case, strict=True):
            variant, where = VARIANTS[index], f"{VARIANTS[index].name} ({schedule}, rank {rank})"
            if variant.refused is not None:
                assert "error" in got, f"{where}: trained on instead of refusing"
                assert re.search(variant.refused, got["error"]), f"{where}: {got['error']}"
                assert got["steps"] == 0 and got["unchanged"], f"{where}: refused after a step"
                continue
            assert "error" not in got, f"{where}: {got.get('error')}"
            expected = references[index]
            assert len(got["metrics"]) == len(expected["metrics"]) == STEPS
            for step, (mine, theirs) in enumerate(zip(got["metrics"], expected["metrics"], strict=True)):
                assert set(mine) == set(theirs), f"{where} step {step}: logged {sorted(mine)} vs {sorted(theirs)}"
                for key, value in theirs.items():
                    assert mine[key] == pytest.approx(value, rel=1e-9, abs=1e-12), f"{where} step {step} {key}"
            assert got["val"] == pytest.approx(expected["val"], rel=1e-9), f"{where}: validation_step's logged value"
            if rank == 0:
                for key, value in expected["params"].items():
                    torch.testing.assert_close(got["params"][key], value, rtol=1e-9, atol=1e-12, msg=where)


# ---------------------------------------------------------------- structures across a cut, without a process group


def test_stage_outputs_of_any_structure_round_trip_through_their_tensors_and_a_json_description() -> None:
    import json

    from transformers.modeling_outputs import CausalLMOutput

    from lightning_scale.core.pipeline.structure import flatten, is_plain, rebuild

    h, a = torch.randn(2, 3), torch.randn(2)
    for value in (
        {"hidden": h, "aux": a, "note": "kept", "none": None, "scale": 0.5},
        Carry(h, a),
        CarryTuple(h, a),
        [h, (a, {"inner": h})],
        CausalLMOutput(logits=h, hidden_states=(a,)),
    ):
        leaves, description = flatten(value)
        assert not is_plain(value) and all(isinstance(t, torch.Tensor) for t in leaves)
        back = rebuild([t.clone() for t in leaves], json.loads(json.dumps(description)))  # as it travels
        assert type(back) is type(value)
        assert flatten(back)[1] == description and all(
            torch.equal(x, y) for x, y in zip(flatten(back)[0], leaves, strict=True)
        )
    assert is_plain(h) and is_plain((h, a))


def test_a_stage_output_that_cannot_travel_is_refused_naming_where_it_is_and_a_class_no_module_imported_is_refused() -> (
    None
):
    from lightning_scale.core.pipeline.structure import flatten, rebuild

    with pytest.raises(TypeError, match=r"holds output\['mask'\] of type set, which cannot be sent to the next stage"):
        flatten({"hidden": torch.zeros(1), "mask": {1, 2}})
    forged = {"dc": "not_imported_anywhere:Evil", "k": ["x"], "v": ["T"]}
    with pytest.raises(ValueError, match="not defined in any module this rank has imported"):
        rebuild([torch.zeros(1)], forged)
