"""Deferred (meta-device) initialisation: cut and shard first, then each rank materialises and
initialises only its part; the same seed gives the same parameters at every layout."""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.distributed import run_cases, run_distributed
from helpers.lightning import quiet_trainer
from helpers.parity import assert_parity, fit_gpt, full_parameters
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn
from torch.distributed.tensor import DTensor

import lightning_scale  # noqa: F401
from lightning_scale.core.parallel.deferred_init import DeferredInit
from lightning_scale.core.pipeline.block_costs import measure_costs
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPT, GPTConfig, GPTLightningModule
from lightning_scale.models.parallel import gpt_pipeline_spec
from lightning_scale.strategies import HybridParallelStrategy

CONFIG = GPTConfig(n_layers=4, n_heads=4, n_kv_heads=2, d_model=32, block_size=32, positional="rope")  # tied
# ~807 MB of fp32 parameters (201.7M): 16 blocks of 12.6M; the largest module (an MLP linear) is 16.8 MB.
BIG = GPTConfig(vocab_size=256, block_size=64, n_layers=16, n_heads=16, d_model=1024)


# ---------------------------------------------------------------- one process, no Trainer


def _meta_gpt(config: GPTConfig = CONFIG) -> nn.Module:
    with torch.device("meta"):
        return nn.ModuleDict({"model": GPT(config)})


def _materialised(seed: int) -> nn.Module:
    root = _meta_gpt()
    plan = DeferredInit.plan(root)
    assert plan is not None
    assert plan.materialize(root, torch.device("cpu"), seed) == []
    return root


def test_materialised_tensors_depend_on_the_seed_and_names_only_keep_ties_and_leave_the_random_state_alone() -> None:
    torch.manual_seed(5)
    before = torch.get_rng_state()
    first, again, other = _materialised(0), _materialised(0), _materialised(1)
    assert torch.equal(torch.get_rng_state(), before)  # training's random stream is untouched
    assert not any(t.is_meta for t in [*first.parameters(), *first.buffers()])
    assert first.model.head.weight is first.model.tok_emb.weight  # the tie survives allocation
    for (name, a), b, c in zip(first.state_dict().items(), again.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b), name
        assert a.numel() <= 32 or not torch.equal(a, c), name  # norms are ones at any seed
    # The model's own scheme: GPT-2's std, residual outputs scaled by 1/sqrt(2L); rotary tables computed.
    assert first.model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert first.model.blocks["0"].attn.wo.weight.std().item() == pytest.approx(0.02 / 8**0.5, rel=0.1)
    assert torch.equal(first.model.blocks["1"].attn_norm.weight, torch.ones(32))
    with torch.device("cpu"):
        eager = GPT(CONFIG)
    assert torch.equal(first.model.rope_cos, eager.rope_cos)


def test_tensors_not_on_the_meta_device_are_kept_as_they_are() -> None:
    real = nn.Linear(4, 4)
    kept = real.weight.detach().clone()
    with torch.device("meta"):
        root = nn.Sequential(real, nn.Linear(4, 4))
    root[0] = real  # built on a real device (loaded weights, say)
    plan = DeferredInit.plan(root)
    assert plan is not None and plan.num_tensors == 2  # the meta linear's weight and bias
    assert plan.materialize(root, torch.device("cpu"), 0) == []
    assert torch.equal(root[0].weight, kept) and root[0].weight is real.weight
    assert not root[1].weight.is_meta and torch.isfinite(root[1].weight).all()


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))


class _HalfInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.register_buffer("table", torch.arange(4.0))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)  # forgets the buffer, which __init__ computed


def test_a_meta_tensor_nobody_initialises_is_refused_before_any_work() -> None:
    with torch.device("meta"):
        root = nn.ModuleDict({"body": nn.Linear(2, 2), "custom": _Scale()})
    with pytest.raises(
        ValueError,
        match=r"nothing can initialise them: \['custom.scale \(_Scale\)'\].*reset_parameters\(\).*_init_weights\(self, module\)",
    ):
        DeferredInit.plan(root)


def test_an_initialiser_that_leaves_a_tensor_unset_is_named() -> None:
    with torch.device("meta"):
        root = nn.ModuleDict({"part": _HalfInit()})
    plan = DeferredInit.plan(root)
    assert plan is not None
    problems = plan.materialize(root, torch.device("cpu"), 0)
    assert problems == [
        "part.table: _HalfInit.reset_parameters() left non-finite values (it does not initialise this tensor)"
    ]


def test_by_cost_times_a_meta_model_one_piece_at_a_time_and_leaves_it_on_meta() -> None:
    root = _meta_gpt().model
    head, emb = root.head.weight, root.tok_emb.weight
    tokens = torch.randint(0, 256, (4, 32))
    weights, first, last = measure_costs(root, gpt_pipeline_spec(root), (tokens, tokens), microbatches=2, repeats=1)
    # Real seconds of real tensors: a piece of this 32-wide model runs in milliseconds; 1 s leaves a
    # loaded machine a hundredfold, and still fails a cost given in milliseconds.
    assert len(weights) == CONFIG.n_layers and all(0 < t < 1.0 for t in [*weights, first, last]), (weights, first, last)
    assert all(t.is_meta for t in [*root.parameters(), *root.buffers()])
    assert root.head.weight is head is emb  # the very objects, tie intact


def test_the_strategys_init_context_gives_the_meta_device_unless_asked_not_to() -> None:
    trainer = quiet_trainer(devices=1, strategy=HybridParallelStrategy(data_parallel=1))
    with trainer.init_module():
        assert nn.Linear(2, 2).weight.is_meta
    with trainer.init_module(empty_init=False):
        assert nn.Linear(2, 2).weight.device == torch.device("cpu")


# ---------------------------------------------------------------- every layout, the same parameters


class _Initial(Callback):
    """The full parameters as set-up leaves them (before any step)."""

    def __init__(self, devices: int) -> None:
        self.devices = devices
        self.state: dict[str, torch.Tensor] = {}

    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.state = full_parameters(pl_module, self.devices)


class _DeferredLlama(LightningModule):
    """A plain wrapper that builds its transformers model in configure_model."""

    def __init__(self) -> None:
        super().__init__()
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            import transformers

            config = transformers.LlamaConfig(
                vocab_size=256,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
                tie_word_embeddings=True,
            )
            self.model = transformers.LlamaForCausalLM(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _gpt(world: int, **layout: Any) -> dict[str, Any]:
    initial = _Initial(world)
    result = fit_gpt(HybridParallelStrategy(**layout), world, CONFIG, callbacks=[initial], deferred_init=True)
    return result | {"initial": initial.state}


def _llama(world: int, **layout: Any) -> dict[str, Any]:
    seed_everything(0, verbose=False)
    initial = _Initial(world)
    trainer = quiet_trainer(devices=world, strategy=HybridParallelStrategy(**layout), max_steps=0, callbacks=[initial])
    trainer.fit(_DeferredLlama(), datamodule=TextDataModule(seq_len=16, global_batch_size=8))
    return {"initial": initial.state}


SINGLE = {"gpt": lambda w: _gpt(w, data_parallel=1), "llama": lambda w: _llama(w, data_parallel=1)}
LAYOUTS = {
    "gpt tp2": lambda w: _gpt(w, data_parallel=1, tensor_parallel=2),
    "gpt pp2": lambda w: _gpt(w, data_parallel=1, pipeline_parallel=2),
    "gpt pp2 by_cost": lambda w: _gpt(w, data_parallel=1, pipeline_parallel=2, partition="by_cost"),
    "gpt dp2 fsdp": lambda w: _gpt(w, data_parallel=2, data_parallel_mode="fsdp"),
    "llama tp2": lambda w: _llama(w, data_parallel=1, tensor_parallel=2),
    "llama pp2": lambda w: _llama(w, data_parallel=1, pipeline_parallel=2),
    "llama dp2 fsdp": lambda w: _llama(w, data_parallel=2, data_parallel_mode="fsdp"),
}


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    return run_distributed(run_cases, 1, __name__, "SINGLE", timeout=300)[0]


@pytest.fixture(scope="module")
def layouts() -> list[dict[str, Any]]:
    return run_distributed(run_cases, 2, __name__, "LAYOUTS", timeout=420)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_deferred_initialisation_gives_the_same_full_parameters_at_every_layout(
    single: dict[str, Any], layouts: list[dict[str, Any]], case: str
) -> None:
    reference = single[case.split()[0]]["initial"]
    assert len(reference) > 10
    for rank in layouts:
        got = rank[case]["initial"]
        assert got.keys() == reference.keys()
        for name, value in reference.items():
            assert torch.equal(got[name], value), name


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in LAYOUTS if c.startswith("gpt")])
def test_a_deferred_model_trains_like_one_process(
    single: dict[str, Any], layouts: list[dict[str, Any]], case: str
) -> None:
    assert_parity([rank[case] for rank in layouts], single["gpt"])


# ---------------------------------------------------------------- memory: a ~800 MB model at tp=2 x pp=2


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise LookupError(field)


def _window_start() -> float:
    """Start a peak-memory window: the peak resident set size is reset to the current one.

    Not ``getrusage``'s ``ru_maxrss``: Linux carries it over ``execve``, so a spawned rank reports
    the parent's peak (pytest's, with the whole model built for the checkpoint) and would measure
    nothing. ``VmHWM`` is the same peak for this process alone, and ``clear_refs`` resets it."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mb("VmRSS")


def _peak_mb() -> float:
    return _status_mb("VmHWM")


def _set_up_big(rank: int, world: int, mode: str, partition: str, checkpoint: str | None) -> dict[str, Any]:
    seed_everything(0, verbose=False)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 0
    start = _window_start()
    layout = {"data_parallel": 1, "tensor_parallel": 2, "pipeline_parallel": 2, "partition": partition}
    trainer = quiet_trainer(
        devices=world, strategy=HybridParallelStrategy(**layout), max_steps=0, num_sanity_val_steps=0
    )
    module = GPTLightningModule(BIG, deferred_init=mode == "deferred")  # eager: built (whole) right here
    data = TextDataModule(seq_len=64, global_batch_size=4)
    trainer.fit(module, datamodule=data)
    result: dict[str, Any] = {"set_up": _peak_mb() - start}
    if checkpoint is not None:
        before = _window_start()
        quiet_trainer(devices=world, strategy=HybridParallelStrategy(**layout)).validate(
            module, datamodule=data, ckpt_path=checkpoint, verbose=False
        )
        result["load"] = _peak_mb() - before
        saved = torch.load(checkpoint, mmap=True, map_location="cpu")["state_dict"]
        for name, tensor in module.state_dict().items():
            if name.endswith("fc.weight"):  # one of this rank's blocks: a DTensor sharded over tp
                assert isinstance(tensor, DTensor)
                result["loaded_equal"] = torch.equal(tensor.full_tensor(), saved[name])
                break
        result.update(_sharded_save_and_load(trainer, module, data, layout, Path(checkpoint).parent / "sharded"))
    return result


def _local_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        local = state.to_local() if isinstance(state, DTensor) else state
        return local.numel() * local.element_size()
    if isinstance(state, dict):
        return sum(_local_bytes(v) for v in state.values())
    return 0


def _sharded_save_and_load(trainer: Any, module: Any, data: Any, layout: dict[str, Any], root: Path) -> dict[str, Any]:
    """Peak RSS growth of a sharded save (synchronous, then async) and load, against this rank's shard's bytes
    (model and AdamW state)."""
    from lightning_scale.plugins import ShardedCheckpointIO

    strategy = trainer.strategy
    optimizer_state = strategy.optimizer_state(trainer.optimizers[0])  # AdamW's moments created here, not in the window
    shard = _local_bytes(strategy.lightning_module_state_dict()) + _local_bytes(optimizer_state["state"])
    del optimizer_state
    out: dict[str, Any] = {"shard_mb": shard / 2**20}
    before = _window_start()
    trainer.save_checkpoint(root / "sync")
    out["sharded_save"] = _peak_mb() - before
    strategy.checkpoint_io = ShardedCheckpointIO(async_save=True)
    strategy.checkpoint_io.process_group = None
    before = _window_start()
    trainer.save_checkpoint(root / "async")  # the first: allocates the host buffers later saves reuse
    strategy.checkpoint_io.wait()
    out["async_first"] = _peak_mb() - before
    before = _window_start()
    trainer.save_checkpoint(root / "async-again")
    strategy.checkpoint_io.wait()
    out["async_save"] = _peak_mb() - before
    before = _window_start()
    quiet_trainer(devices=trainer.world_size, strategy=HybridParallelStrategy(**layout)).validate(
        module, datamodule=data, ckpt_path=str(root / "sync"), verbose=False
    )
    out["sharded_load"] = _peak_mb() - before
    return out


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A Lightning checkpoint of the whole BIG model (written whole, by this process)."""
    import lightning

    torch.manual_seed(1)
    model = GPT(BIG)
    bytes_ = sum(p.numel() * p.element_size() for p in model.parameters())
    path = tmp_path_factory.mktemp("big") / "big.ckpt"
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "pytorch-lightning_version": lightning.__version__}, path)
    return path, bytes_


@pytest.mark.slow
def test_set_up_of_a_deferred_model_holds_its_shard_not_the_model(big_checkpoint: tuple[Path, int]) -> None:
    path, model_bytes = big_checkpoint
    model_mb = model_bytes / 2**20
    assert 750 < model_mb < 850
    deferred = run_distributed(_set_up_big, 4, "deferred", "by_layers", str(path), timeout=300)
    by_cost = run_distributed(_set_up_big, 4, "deferred", "by_cost", None, timeout=300)
    eager = run_distributed(_set_up_big, 4, "eager", "by_layers", None, timeout=300)
    report = {
        name: [round(r["set_up"]) for r in runs]
        for name, runs in (("deferred", deferred), ("deferred by_cost", by_cost), ("eager", eager))
    }
    report["checkpoint load"] = [round(r["load"]) for r in deferred]
    for key in ("shard_mb", "sharded_save", "async_first", "async_save", "sharded_load"):
        report[key] = [round(r[key]) for r in deferred]
    print(f"peak RSS growth per rank (MB) at tp=2 x pp=2, model {model_mb:.0f} MB: {report}")
    bound = 0.5 * model_mb
    assert max(report["deferred"]) <= bound and max(report["deferred by_cost"]) <= bound, report
    assert min(report["eager"]) > bound, report  # the bound means something: eager holds the whole model
    # Loading the whole-model checkpoint (memory-mapped) reads only each rank's part.
    assert max(report["checkpoint load"]) <= bound, report
    assert all(r["loaded_equal"] for r in deferred)
    # A sharded save (synchronous or async) and load grow each rank's peak by at most 1.5x its own shard
    # (model and optimizer state), however big the model. The first async save allocates the host buffers
    # (1x the shard) that the next ones reuse.
    for r in deferred:
        assert r["sharded_save"] <= 1.5 * r["shard_mb"] and r["sharded_load"] <= 1.5 * r["shard_mb"], report
        assert r["async_save"] <= 1.5 * r["shard_mb"] and r["async_first"] <= 2.0 * r["shard_mb"], report
