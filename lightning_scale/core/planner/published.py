"""Published step-time measurements the planner is checked against. No Lightning.

:data:`NARAYANAN_2021`: Table 1 of Narayanan et al., "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM" (SC'21, https://arxiv.org/abs/2104.04473): GPT models of 1.7B to 1T
parameters on up to 3,072 A100 80GB GPUs of NVIDIA's Selene (DGX A100 nodes: 8 GPUs on NVLink 3,
8 HDR InfiniBand links per node), sequence length 2,048, vocabulary 51,200, mixed precision (fp16),
activation recomputation on; the achieved teraFLOP/s per GPU count the recomputation
(:func:`megatron_flops_per_step`, their equation 3).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_scale.core.planner.shape import ModelShape

__all__ = ["NARAYANAN_2021", "PublishedRun", "megatron_flops_per_step"]

SOURCE = "Narayanan et al. 2021, Table 1 (https://arxiv.org/abs/2104.04473)"


@dataclass(frozen=True)
class PublishedRun:
    billions: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    tflops_per_gpu: float
    """Achieved teraFLOP/s per GPU, recomputation counted."""
    seq_len: int = 2048
    vocab: int = 51200

    @property
    def shape(self) -> ModelShape:
        return ModelShape(
            n_layers=self.layers, d_model=self.hidden, n_heads=self.heads, n_kv_heads=self.heads,
            head_dim=self.hidden // self.heads, d_ff=4 * self.hidden, vocab_size=self.vocab, tied=True, bias=True,
            learned_positions=self.seq_len, layernorm=True, name=f"GPT-{self.billions}B",
        )  # fmt: skip

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


NARAYANAN_2021: tuple[PublishedRun, ...] = (
    PublishedRun(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    PublishedRun(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    PublishedRun(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    PublishedRun(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    PublishedRun(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    PublishedRun(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    PublishedRun(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    PublishedRun(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    PublishedRun(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    PublishedRun(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def megatron_flops_per_step(run: PublishedRun) -> float:
    """The paper's count: ``96 B s l h^2 (1 + s / (6 h) + V / (16 l h))`` per iteration, forward,
    backward and the recomputed forward."""
    b, s, l, h, v = run.global_batch, run.seq_len, run.layers, run.hidden, run.vocab
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
