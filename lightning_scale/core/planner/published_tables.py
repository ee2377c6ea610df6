"""The published tables :mod:`~lightning_scale.core.planner.published` builds its records from, each row
copied as published (the docstring under each says from where, and what the planner assumes where the
source is silent). Plain data: no imports.
"""

KORTHIKANTI = (  # label, heads, hidden, layers, tp, pp, GPUs, global batch, micro-batch, schedule, seconds (full, present)
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 4, ("1f1b", 1), 1.42, 1.10),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 1, ("interleaved_1f1b", 3), 18.13, 13.75),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 1, ("interleaved_1f1b", 3), 49.05, 37.83),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, ("1f1b", 1), 94.42, 71.49),
)
"""Table 3's layouts (sequence 2,048, vocabulary 51,200; the 175B and 530B runs interleaved, 3 stages a
rank) and Table 5's iteration times: full recomputation, and "present work" (sequence parallelism with
selective recomputation, which recomputes only attention's softmax and products: the planner has no such
mode, so it is planned with no checkpointing). Tokens/s per GPU = batch x 2,048 / time / GPUs."""

MCORE = (  # params, heads, hidden, layers, tp, pp, GPUs, global batch, TFLOP/s per GPU
    ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
    ("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1),
    ("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
    ("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7),
    ("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
)
"""Sequence 4,096, vocabulary 131,072, data parallel 48 in every row; micro-batch, schedule and
recomputation are not published (the planner's fastest; Megatron interleaves any number of stages a rank
that divides its blocks). Megatron-Core's distributed optimizer
reduce-scatters the gradients and all-gathers the parameters once a step, as ``fsdp_grad_op`` does
under a pipeline (its memory differs: only the optimizer state is sharded). The TFLOP/s count ``6 N + 12 L H Q T`` per token
(Megatron-Core's ``num_floating_point_operations``, the planner's own count), so tokens/s per GPU =
TFLOP/s / that count."""

FOUNDRY_FP8 = 7
"""The last rows of :data:`FOUNDRY`: the FP8 table."""
FOUNDRY_SHAPES = {  # layers, hidden, heads (vocabulary 50,368; learned positions as long as the sequence)
    "mpt-760m": (24, 1536, 12),
    "mpt-1b": (24, 2048, 16),
    "mpt-3b": (32, 2560, 20),
    "mpt-7b": (32, 4096, 32),
    "mpt-13b": (40, 5120, 40),
    "mpt-30b": (48, 7168, 56),
    "mpt-70b": (80, 8192, 64),
}
FOUNDRY = (  # model, sequence, GPUs, micro-batch, accumulation, checkpointing, FSDP mode, tokens/s per GPU, MFU %
    ("mpt-70b", 2048, 512, 8, 1, "full", "fsdp", 1007, 41.25),  # large
    ("mpt-70b", 2048, 256, 8, 1, "full", "fsdp", 1035, 42.42),  # large
    ("mpt-70b", 2048, 128, 8, 1, "full", "fsdp", 1058, 43.36),  # large
    ("mpt-30b", 2048, 512, 8, 1, "full", "fsdp", 2115, 40.27),  # large
    ("mpt-30b", 2048, 256, 8, 1, "full", "fsdp", 2148, 40.89),  # large
    ("mpt-30b", 2048, 128, 8, 1, "full", "fsdp", 2199, 41.85),  # large
    ("mpt-13b", 2048, 512, 16, 1, "full", "fsdp", 4952, 41.12),  # large
    ("mpt-13b", 2048, 256, 16, 1, "full", "fsdp", 4989, 41.42),  # large
    ("mpt-13b", 2048, 128, 16, 1, "full", "fsdp", 5080, 42.18),  # large
    ("mpt-7b", 2048, 512, 6, 1, "none", "fsdp", 9670, 42.2),  # large
    ("mpt-7b", 2048, 256, 6, 1, "none", "fsdp", 10119, 44.15),  # large
    ("mpt-7b", 2048, 128, 6, 1, "none", "fsdp", 10475, 45.71),  # large
    ("mpt-3b", 2048, 512, 8, 1, "none", "fsdp_grad_op", 21664, 39.24),  # large
    ("mpt-3b", 2048, 256, 8, 1, "none", "fsdp_grad_op", 22772, 41.25),  # large
    ("mpt-3b", 2048, 128, 8, 1, "none", "fsdp_grad_op", 23422, 42.43),  # large
    ("mpt-1b", 2048, 512, 12, 1, "none", "fsdp_grad_op", 39837, 36.65),  # large
    ("mpt-1b", 2048, 256, 12, 1, "none", "fsdp_grad_op", 42555, 39.15),  # large
    ("mpt-1b", 2048, 128, 12, 1, "none", "fsdp_grad_op", 44123, 40.6),  # large
    ("mpt-70b", 2048, 64, 8, 4, "full", "fsdp", 1039, 42.57),  # bf16
    ("mpt-70b", 2048, 32, 2, 16, "full", "fsdp", 882, 36.15),  # bf16
    ("mpt-30b", 8192, 8, 1, 21, "full", "fsdp", 1384, 29.92),  # bf16
    ("mpt-30b", 4096, 8, 1, 21, "full", "fsdp", 1802, 35.86),  # bf16
    ("mpt-30b", 2048, 32, 14, 3, "full", "fsdp", 2308, 43.92),  # bf16
    ("mpt-30b", 2048, 16, 10, 3, "full", "fsdp", 2263, 43.07),  # bf16
    ("mpt-30b", 2048, 8, 3, 21, "full", "fsdp", 2002, 38.11),  # bf16
    ("mpt-30b", 1024, 8, 6, 21, "full", "fsdp", 2084, 38.76),  # bf16
    ("mpt-13b", 32768, 8, 1, 3, "full", "fsdp", 1976, 31.68),  # bf16
    ("mpt-13b", 16384, 8, 3, 3, "full", "fsdp", 2985, 35.55),  # bf16
    ("mpt-13b", 4096, 8, 10, 3, "full", "fsdp", 4717, 41.6),  # bf16
    ("mpt-13b", 2048, 64, 2, 1, "none", "fsdp", 4800, 39.86),  # bf16
    ("mpt-13b", 2048, 32, 2, 1, "none", "fsdp", 4811, 39.95),  # bf16
    ("mpt-13b", 2048, 16, 2, 1, "none", "fsdp", 4767, 39.58),  # bf16
    ("mpt-13b", 2048, 8, 2, 1, "none", "fsdp", 4792, 39.79),  # bf16
    ("mpt-13b", 1024, 8, 40, 3, "full", "fsdp", 5502, 44.27),  # bf16
    ("mpt-7b", 65536, 8, 1, 2, "full", "fsdp", 1956, 28.59),  # bf16
    ("mpt-7b", 32768, 8, 2, 2, "full", "fsdp", 3318, 30.94),  # bf16
    ("mpt-7b", 8192, 8, 8, 2, "full", "fsdp", 6935, 37.14),  # bf16
    ("mpt-7b", 4096, 8, 16, 2, "full", "fsdp", 8611, 40.42),  # bf16
    ("mpt-7b", 2048, 8, 6, 1, "none", "fsdp", 10643, 46.44),  # bf16
    ("mpt-7b", 1024, 8, 64, 2, "full", "fsdp", 10203, 42.83),  # bf16
    ("mpt-3b", 65536, 8, 1, 2, "full", "fsdp", 3262, 26.81),  # bf16
    ("mpt-3b", 32768, 8, 3, 6, "full", "fsdp", 5873, 28.84),  # bf16
    ("mpt-3b", 16384, 8, 1, 6, "none", "fsdp", 11152, 36.34),  # bf16
    ("mpt-3b", 8192, 8, 3, 6, "none", "fsdp", 16578, 40.31),  # bf16
    ("mpt-3b", 4096, 8, 5, 6, "none", "fsdp", 20964, 42.31),  # bf16
    ("mpt-3b", 2048, 64, 6, 3, "none", "fsdp", 22525, 40.8),  # bf16
    ("mpt-3b", 2048, 32, 6, 3, "none", "fsdp", 23021, 41.7),  # bf16
    ("mpt-3b", 2048, 16, 10, 3, "none", "fsdp", 24142, 43.73),  # bf16
    ("mpt-3b", 1024, 8, 20, 6, "none", "fsdp", 27046, 46.2),  # bf16
    ("mpt-3b", 512, 8, 40, 6, "none", "fsdp", 27965, 46.32),  # bf16
    ("mpt-1b", 65536, 8, 1, 2, "full", "fsdp", 5506, 26.34),  # bf16
    ("mpt-1b", 32768, 8, 1, 4, "none", "fsdp", 12025, 33.54),  # bf16
    ("mpt-1b", 16384, 8, 2, 4, "none", "fsdp", 19649, 35.22),  # bf16
    ("mpt-1b", 8192, 8, 3, 4, "none", "fsdp", 29157, 37.73),  # bf16
    ("mpt-1b", 4096, 8, 7, 4, "none", "fsdp", 38535, 40.26),  # bf16
    ("mpt-1b", 2048, 64, 20, 1, "none", "fsdp", 44402, 40.85),  # bf16
    ("mpt-1b", 2048, 32, 20, 1, "none", "fsdp", 45130, 41.52),  # bf16
    ("mpt-1b", 2048, 16, 20, 1, "none", "fsdp", 46037, 42.36),  # bf16
    ("mpt-1b", 2048, 8, 14, 1, "none", "fsdp", 45455, 41.82),  # bf16
    ("mpt-1b", 1024, 8, 18, 4, "none", "fsdp", 48910, 41.95),  # bf16
    ("mpt-1b", 512, 8, 56, 4, "none", "fsdp", 52275, 43.21),  # bf16
    ("mpt-760m", 32768, 8, 1, 2, "none", "fsdp", 16291, 31.84),  # bf16
    ("mpt-760m", 16384, 8, 3, 2, "none", "fsdp", 27815, 33.57),  # bf16
    ("mpt-760m", 8192, 8, 6, 2, "none", "fsdp", 41825, 34.84),  # bf16
    ("mpt-760m", 4096, 8, 12, 2, "none", "fsdp", 55459, 35.83),  # bf16
    ("mpt-760m", 2048, 32, 24, 1, "none", "fsdp", 67971, 37.57),  # bf16
    ("mpt-760m", 2048, 16, 24, 1, "none", "fsdp", 68551, 37.89),  # bf16
    ("mpt-760m", 2048, 8, 24, 2, "none", "fsdp", 63147, 34.9),  # bf16
    ("mpt-760m", 1024, 8, 48, 2, "none", "fsdp", 78581, 39.76),  # bf16
    ("mpt-760m", 512, 8, 96, 2, "none", "fsdp", 83749, 40.42),  # bf16
    ("mpt-3b", 32768, 8, 3, 6, "full", "fsdp", 5856, 14.38),  # fp8
    ("mpt-3b", 8192, 8, 3, 6, "none", "fsdp", 19146, 23.28),  # fp8
    ("mpt-3b", 2048, 8, 10, 6, "none", "fsdp", 30586, 27.7),  # fp8
    ("mpt-3b", 512, 8, 40, 6, "none", "fsdp", 36527, 30.25),  # fp8
    ("mpt-1b", 32768, 8, 1, 4, "none", "fsdp", 12580, 17.55),  # fp8
    ("mpt-1b", 8192, 8, 2, 4, "none", "fsdp", 32010, 20.71),  # fp8
    ("mpt-1b", 512, 8, 56, 4, "none", "fsdp", 70315, 29.06),  # fp8
)
"""Every row of the three H100 80GB tables, BF16 (``amp_bf16``, FSDP mixed precision ``DEFAULT``: fp32
parameters gathered, bf16 autocast) and FP8 (``amp_fp8``: Transformer Engine's float8 linears); FULL_SHARD
is ``fsdp``, SHARD_GRAD_OP ``fsdp_grad_op``; activation checkpointing is full. Tokens/s per GPU as
published (the tables' MFU of the FP8 rows is against the float8 peak)."""


LLAMA3 = {  # layers, hidden, heads, key/value heads, MLP width (vocabulary 128,256, untied, RMSNorm, rotary)
    "8B": (32, 4096, 32, 8, 14336),
    "70B": (80, 8192, 64, 8, 28672),
    "405B": (126, 16384, 128, 8, 53248),
}
TORCHTITAN = (  # model, GPUs, FSDP, tp, pp, cp, local batch, sequence, compile, float8, AC, async TP, schedule, tokens/s per GPU, table
    ("8B", 8, 8, 1, 1, 1, 2, 8192, False, False, "selective", False, None, 5762, 1),
    ("8B", 8, 8, 1, 1, 1, 2, 8192, True, False, "selective", False, None, 6667, 1),
    ("8B", 8, 8, 1, 1, 1, 2, 8192, True, True, "selective", False, None, 8532, 1),
    ("8B", 128, 128, 1, 1, 1, 2, 8192, False, False, "selective", False, None, 5605, 3),
    ("8B", 128, 128, 1, 1, 1, 2, 8192, True, False, "selective", False, None, 6514, 3),
    ("8B", 128, 128, 1, 1, 1, 2, 8192, True, True, "selective", False, None, 8380, 3),
    ("8B", 8, 8, 1, 1, 1, 1, 32768, True, True, "full", False, None, 3890, 2),
    ("8B", 8, 4, 1, 1, 2, 1, 65536, True, True, "full", False, None, 2540, 2),
    ("8B", 8, 2, 1, 1, 4, 1, 131072, True, True, "full", False, None, 1071, 2),
    ("8B", 8, 1, 1, 1, 8, 1, 262144, True, True, "full", False, None, 548, 2),
    ("70B", 256, 32, 8, 1, 1, 16, 8192, True, True, "full", False, None, 829, 4),
    ("70B", 256, 32, 8, 1, 1, 16, 8192, True, True, "full", True, None, 876, 4),
    ("405B", 512, 8, 8, 8, 1, 32, 8192, True, True, "full", True, ("1f1b", 1), 100, 5),
    ("405B", 512, 8, 8, 8, 1, 8, 32768, True, True, "full", True, ("1f1b", 1), 76, 6),
    ("405B", 512, 4, 8, 8, 2, 8, 65536, True, True, "full", True, ("1f1b", 1), 47, 6),
    ("405B", 512, 2, 8, 8, 4, 8, 131072, True, True, "full", True, ("1f1b", 1), 31, 6),
    ("405B", 512, 1, 8, 8, 8, 8, 262144, True, True, "full", True, ("1f1b", 1), 16, 6),
)
"""Every row of Tables 1-6 but one (the 8B sequence of Tables 1 and 3 is the config's 8,192); a global
batch of local batch x FSDP ranks; a pipeline splits the local batch into as many micro-batches as it
has stages (torchtitan's default for ``pipeline_parallel_microbatches``; not stated in the tables).
torchtitan's selective activation checkpointing ("op": it saves every compute op's output "except every
second mm") recomputes half of the forward's matmuls, as the planner's ``selective`` (every second block)
does. Left out: Table 5's interleaved 1F1B row (128 tokens/s), whose 126 blocks torchtitan splits unevenly
over 16 stages; the planner's interleaved schedule needs them to divide."""
