"""Hugging Face decoder models, unmodified, inside a LightningModule that just wraps them: parity with one
process at every layout, with no tensor_parallel_plan or pipeline_spec written here."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.distributed import run_cases, run_distributed
from helpers.lightning import quiet_trainer
from helpers.parity import RecordLoss, full_parameters
from lightning.pytorch import LightningModule, seed_everything
from torch.utils.data import DataLoader, Dataset

import lightning_scale  # noqa: F401
from lightning_scale.callbacks import GradNormMonitor
from lightning_scale.core.pipeline.spec import PipelineSpec
from lightning_scale.data import DataParallelSampler, data_parallel_coordinates
from lightning_scale.integrations.huggingface import hf_tensor_parallel_plan
from lightning_scale.strategies import HybridParallelStrategy

transformers = pytest.importorskip("transformers")  # the dev extra installs it

STEPS = 5
FAMILIES = ("llama", "qwen2")


def _model(family: str, **overrides: Any) -> torch.nn.Module:
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    shape = {
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    return model_cls(config_cls(**(shape | overrides)))


class _Tokens(Dataset):
    """Token windows as transformers batches, in the forms users feed a causal LM (``data``):

    - ``dict``: ``{"input_ids", "labels"}``, labels unshifted (transformers' convention);
    - ``packed``: several documents per row, ``position_ids`` restarting at each (packed sequences);
    - ``masked``: prompts of different lengths labelled -100 (instruction tuning);
    - ``shifted``: ``(inputs, targets)`` pairs, targets already shifted by one (the nanoGPT convention).
    """

    def __init__(self, data: str = "dict", n: int = 8 * STEPS, length: int = 16) -> None:
        generator = torch.Generator().manual_seed(0)
        self.data = data
        self.tokens = torch.randint(0, 256, (n, length + 1), generator=generator)
        starts = torch.randint(1, length - 1, (n, 2), generator=generator)
        self.positions = torch.stack([_restart_at(length, row.tolist()) for row in starts])
        self.prompts = torch.randint(0, length - 2, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> Any:
        tokens = self.tokens[i, :-1]
        if self.data == "shifted":
            return tokens, self.tokens[i, 1:]
        batch = {"input_ids": tokens, "labels": tokens}
        if self.data == "packed":
            batch["position_ids"] = self.positions[i]
        if self.data == "masked":
            batch["labels"] = torch.where(torch.arange(len(tokens)) < self.prompts[i], -100, tokens)
        return batch


def _restart_at(length: int, starts: list[int]) -> torch.Tensor:
    """Positions of a row holding documents that begin at 0 and at each of ``starts``."""
    positions, begin = torch.arange(length), torch.zeros(length, dtype=torch.long)
    for start in sorted(starts):
        begin[start:] = start
    return positions - begin


def _next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


class HFModule(LightningModule):
    """What a user writes around a transformers model: no hook of this package.

    ``own_loss``: the model's ``.loss``, which transformers computes in float32 whatever the model's
    precision; else the same next-token loss written out, which stays in float64 (with -100 ignored,
    as F.cross_entropy does). ``data``: the batches' form (:class:`_Tokens`)."""

    def __init__(self, family: str, own_loss: bool = False, data: str = "dict") -> None:
        super().__init__()
        self.model = _model(family)
        self.own_loss = own_loss
        self.data = data

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if isinstance(batch, (tuple, list)):  # shifted targets: every position against its target
            inputs, targets = batch
            loss = F.cross_entropy(self.model(input_ids=inputs).logits.flatten(0, 1), targets.flatten())
        elif self.own_loss:
            loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        else:
            logits = self.model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids")).logits
            loss = _next_token_loss(logits, batch["labels"])
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self) -> DataLoader:
        # The same global batches at every data-parallel size (so one process is the reference).
        data = _Tokens(self.data)
        rank, size = data_parallel_coordinates(self.trainer.strategy)
        sampler = DataParallelSampler(data, global_batch_size=8, dp_rank=rank, dp_size=size, shuffle=False)
        return DataLoader(data, batch_size=sampler.local_batch_size, sampler=sampler)


class OwnSpecModule(HFModule):
    """A user's own cut of the transformers model (no stage forward of theirs) and their own loss."""

    def pipeline_spec(self) -> tuple[str, PipelineSpec]:
        layers = [f"model.layers.{i}" for i in range(len(self.model.model.layers))]
        spec = PipelineSpec(
            blocks=layers,
            first=["model.embed_tokens"],
            last=["model.norm", "lm_head"],
            loss_fn=_next_token_loss,
            loss_tokens=lambda labels: (labels[:, 1:] != -100).sum(),
        )
        return "model", spec

    def pipeline_batch(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return batch["input_ids"], batch["labels"]


def _fit(
    strategy: Any, devices: int, family: str, own_loss: bool = False, data: str = "dict", module_cls: type = HFModule
) -> dict[str, Any]:
    seed_everything(0, verbose=False)
    record = RecordLoss()
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy,
        precision="64-true",
        max_steps=STEPS,
        gradient_clip_val=0.5,
        callbacks=[GradNormMonitor(), record],
        use_distributed_sampler=False,
    )
    module = module_cls(family, own_loss, data)
    trainer.fit(module)
    return {"losses": record.losses, "grad_norms": record.grad_norms, "state": full_parameters(module, devices)}


def _hybrid(
    world: int, family: str, own_loss: bool = False, data: str = "dict", module_cls: type = HFModule, **kwargs: Any
) -> dict[str, Any]:
    return _fit(HybridParallelStrategy(microbatches=2, **kwargs), world, family, own_loss, data, module_cls)


LAYOUTS_2 = {
    "dp2": {"data_parallel": 2},
    "tp2": {"data_parallel": 1, "tensor_parallel": 2},
    "pp2-1f1b": {"data_parallel": 1, "pipeline_parallel": 2, "schedule": "1f1b"},
    "pp2-interleaved": {"data_parallel": 1, "pipeline_parallel": 2, "schedule": "interleaved_1f1b"},
}
LAYOUTS_4 = {
    "pp2-tp2": {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 2},
    "dp2-pp2-fsdp": {"data_parallel": 2, "pipeline_parallel": 2, "data_parallel_mode": "fsdp"},
}
CASES_2 = {f"{f}/{name}": lambda w, f=f, k=k: _hybrid(w, f, **k) for f in FAMILIES for name, k in LAYOUTS_2.items()}
# The model's own `.loss` in the user's step (float32 inside transformers) against the pipeline's.
CASES_2["llama/pp2-own-loss"] = lambda w: _hybrid(w, "llama", own_loss=True, **LAYOUTS_2["pp2-1f1b"])
# The batches users bring (one process's semantics, not the package's conventions), at pp=2 with no hook.
BATCHES = ("packed", "masked", "shifted")
CASES_2 |= {
    f"llama-{data}/pp2": lambda w, d=data: _hybrid(w, "llama", data=d, **LAYOUTS_2["pp2-1f1b"]) for data in BATCHES
}
# A user's own pipeline_spec for the model, with their own loss, on masked prompts.
CASES_2["llama-masked/pp2-own-spec"] = lambda w: _hybrid(
    w, "llama", data="masked", module_cls=OwnSpecModule, **LAYOUTS_2["pp2-1f1b"]
)
CASES_4 = {f"{f}/{name}": lambda w, f=f, k=k: _hybrid(w, f, **k) for f in FAMILIES for name, k in LAYOUTS_4.items()}
CASES_4["llama-packed/pp2-tp2"] = lambda w: _hybrid(w, "llama", data="packed", **LAYOUTS_4["pp2-tp2"])


@pytest.fixture(scope="module")
def single() -> dict[str, dict[str, Any]]:
    return {family: _fit("auto", 1, family) for family in FAMILIES} | {
        f"llama-{data}": _fit("auto", 1, "llama", data=data) for data in BATCHES
    }


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return run_distributed(run_cases, 2, __name__, "CASES_2", timeout=420)


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_distributed(run_cases, 4, __name__, "CASES_4", timeout=420)


def _assert_parity(results: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    for result in results:
        assert len(result["losses"]) == len(result["grad_norms"]) == STEPS
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-9, atol=0)
        torch.testing.assert_close(result["grad_norms"], reference["grad_norms"], rtol=1e-9, atol=0)
        assert result["state"].keys() == reference["state"].keys()  # the model's own names at every layout
        for name, value in reference["state"].items():
            torch.testing.assert_close(result["state"][name], value, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", list(LAYOUTS_2))
def test_hf_model_matches_one_process_on_two_processes(
    two: list[dict[str, Any]], single: dict[str, Any], family: str, layout: str
) -> None:
    _assert_parity([r[f"{family}/{layout}"] for r in two], single[family])


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", list(LAYOUTS_4))
def test_hf_model_matches_one_process_on_four_processes(
    four: list[dict[str, Any]], single: dict[str, Any], family: str, layout: str
) -> None:
    _assert_parity([r[f"{family}/{layout}"] for r in four], single[family])


@pytest.mark.slow
@pytest.mark.parametrize("data", BATCHES)
def test_batches_as_users_bring_them_train_at_pp2_as_one_process(
    two: list[dict[str, Any]], single: dict[str, Any], data: str
) -> None:
    """Packed sequences' position_ids reach every stage; -100 labels weigh micro-batches by their labelled
    tokens; already-shifted (inputs, targets) pairs are scored as they are, not shifted again."""
    _assert_parity([r[f"llama-{data}/pp2"] for r in two], single[f"llama-{data}"])


@pytest.mark.slow
def test_packed_position_ids_reach_every_stage_at_pp2_tp2(four: list[dict[str, Any]], single: dict[str, Any]) -> None:
    _assert_parity([r["llama-packed/pp2-tp2"] for r in four], single["llama-packed"])


@pytest.mark.slow
def test_a_users_own_pipeline_spec_on_an_hf_model_trains_as_one_process(
    two: list[dict[str, Any]], single: dict[str, Any]
) -> None:
    """The user's cut has no stage forward: the family's runs it (the model's own forward would call the
    final norm the first stage no longer has)."""
    _assert_parity([r["llama-masked/pp2-own-spec"] for r in two], single["llama-masked"])


@pytest.mark.slow
def test_a_module_using_the_models_own_float32_loss_matches_to_float32_rounding(two: list[dict[str, Any]]) -> None:
    reference = _fit("auto", 1, "llama", own_loss=True)
    for result in (r["llama/pp2-own-loss"] for r in two):
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-6, atol=0)
        torch.testing.assert_close(result["grad_norms"], reference["grad_norms"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_every_supported_familys_stages_chained_equal_the_whole_model(family: str) -> None:
    import copy

    from lightning_scale.core.pipeline.spec import StageForward, prune_to_stage
    from lightning_scale.strategies.hybrid.pipeline_hooks import pipeline_spec_of

    torch.manual_seed(0)
    module = LightningModule()
    module.model = _model(family).double()
    root, spec = pipeline_spec_of(module)  # found with no hook: the registered family
    assert root == "model" and list(spec.blocks) == [f"model.layers.{i}" for i in range(4)]
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        whole = module.model(input_ids=tokens).logits
        first, second = copy.deepcopy(module.model), copy.deepcopy(module.model)
        prune_to_stage(first, spec, [0, 1], is_first=True, is_last=False)
        prune_to_stage(second, spec, [2, 3], is_first=False, is_last=True)
        chained = StageForward(second, spec.stage_forward)(StageForward(first, spec.stage_forward)(tokens))
    torch.testing.assert_close(chained, whole, rtol=0, atol=0)
    assert {n for n, _ in first.named_parameters()} | {n for n, _ in second.named_parameters()} == {
        n for n, _ in module.model.named_parameters()
    }
    # The pipeline's loss is the model's own `.loss` (in the logits' precision).
    own = module.model(input_ids=tokens, labels=tokens).loss.double()
    torch.testing.assert_close(spec.loss_fn(whole, tokens), own, rtol=1e-6, atol=0)


# ---------------------------------------------------------------- what cannot work, refused with the fix


def test_an_hf_family_without_pipeline_stages_names_the_supported_ones_and_the_hook() -> None:
    from lightning_scale.strategies.hybrid.pipeline_hooks import pipeline_spec_of

    module = LightningModule()
    module.model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256, bos_token_id=0, eos_token_id=0)
    )
    with pytest.raises(
        ValueError,
        match=r"model is a Hugging Face GPT2LMHeadModel \(model_type='gpt2'\); pipeline stages are registered for the \*ForCausalLM models of the llama, mistral, qwen2, qwen3 families.*define `pipeline_spec\(self\)",
    ):
        pipeline_spec_of(module)


def test_an_hf_plan_style_without_a_dtensor_equivalent_is_refused_with_the_supported_ones() -> None:
    qwen3 = _model("qwen3", head_dim=8)  # q_norm/k_norm: "replicated_with_grad_allreduce"
    with pytest.raises(
        ValueError,
        match=r"uses style\(s\) \['replicated_with_grad_allreduce'\].*Supported transformers styles: 'colwise', 'colwise_gather_output', 'embedding_rowwise', 'rowwise'",
    ):
        hf_tensor_parallel_plan(qwen3, 2)


def test_kv_heads_that_tensor_parallelism_does_not_divide_name_the_divisors() -> None:
    llama = _model("llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(
        ValueError,
        match=re.escape("num_key_value_heads=3, which tensor_parallel=2 does not divide")
        + r".*tensor_parallel in \[1, 3\]",
    ):
        hf_tensor_parallel_plan(llama, 2)
