"""Tensor parallelism's split of the checkpoint: which slice of each tensor one rank holds.

Rank r of N holds (Megatron's split, as vLLM and SGLang do for gpt-oss):
- attention by heads: q heads [r*64/N, ...) and KV heads [r*8/N, ...) (N divides the 8 KV
  heads), their sinks, and o_proj's matching input columns;
- each expert by its intermediate dimension, in whole MXFP4 blocks of 32 (2,880 = 90 blocks):
  gate_up's interleaved gate/up rows and down's input blocks. When N does not divide 90 (N = 4:
  22.5 blocks, N = 8: 11.25) every rank holds ceil(90/N) blocks and the last ranks pad with
  zero blocks: a padded unit has zero gate, up and bias, so SwiGLU gives 0 and its zero down
  column adds nothing;
- the embedding and lm_head by vocabulary rows (ceil(V/N) each, the last padded);
- norms, router and sinks' scalars whole; o_proj's and down's biases on rank 0 only (zero
  elsewhere), so that the all-reduce of the partial sums adds them once.

With expert parallelism (`experts=True`, vLLM's --enable-expert-parallel) the experts are not
cut but dealt out whole: rank r holds experts [r*E/N, (r+1)*E/N). The router's top-k gives the
pairs routed to other ranks the expert id -1 (`Kernels.post_attention`), which every MoE kernel
skips (no weights read, nothing added), so a rank spends its MoE time on its own pairs only.
Attention, vocabulary and biases split as above, except that each expert's down bias lives
with its expert.

Each rank reads only its slices (`Cut`) from the memory-mapped safetensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyoss.config import ModelConfig

MXFP4_BLOCK = 32


@dataclass(frozen=True)
class Cut:
    """Rows [start, stop) of dimension `dim`, zero-padded to `length` along it."""

    dim: int
    start: int
    stop: int
    length: int

    def index(self, ndim: int) -> tuple[slice, ...]:
        return tuple(slice(self.start, self.stop) if d == self.dim else slice(None)
                     for d in range(ndim))

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.length if d == self.dim else n for d, n in enumerate(full))

    def pad(self, part: torch.Tensor) -> torch.Tensor:
        """The slice read (`part`) padded with zeros to `length`."""
        missing = self.length - part.shape[self.dim]
        if missing == 0:
            return part
        shape = list(part.shape)
        shape[self.dim] = missing
        return torch.cat([part, part.new_zeros(shape)], dim=self.dim)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a whole tensor (random weights are made whole)."""
        return self.pad(full[self.index(full.dim())])


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of a tensor-parallel group of `size`."""

    rank: int = 0
    size: int = 1
    experts: bool = False  # expert parallelism: whole experts dealt out, not cut

    def check(self, c: ModelConfig) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} of a group of {self.size}")
        if self.experts and c.num_local_experts % self.size:
            fits = [n for n in range(1, c.num_key_value_heads + 1)
                    if c.num_local_experts % n == 0 and c.num_key_value_heads % n == 0]
            raise ValueError(
                f"expert parallelism over {self.size} ranks needs the model's "
                f"{c.num_local_experts} experts to split evenly: use a tensor_parallel_size of "
                f"{fits}, or drop enable_expert_parallel (the experts are then cut by their "
                "intermediate dimension, which any size takes)"
            )
        kv = c.num_key_value_heads
        if kv % self.size:
            raise ValueError(
                f"tensor_parallel_size {self.size} must divide the model's {kv} KV heads "
                f"(attention is split by heads): use one of "
                f"{[n for n in range(1, kv + 1) if kv % n == 0]}"
            )

    def local_config(self, c: ModelConfig) -> ModelConfig:
        """The shapes this rank's model holds: its heads and intermediate units (vocab_size
        stays the whole vocabulary: the logits are gathered)."""
        self.check(c)
        return c.with_(
            num_attention_heads=c.num_attention_heads // self.size,
            num_key_value_heads=c.num_key_value_heads // self.size,
            intermediate_size=self.expert_blocks(c) * MXFP4_BLOCK,
        )

    def expert_blocks(self, c: ModelConfig) -> int:
        """MXFP4 blocks of the intermediate dimension each rank holds (padded)."""
        if self.experts:
            return c.intermediate_size // MXFP4_BLOCK
        return -(-c.intermediate_size // MXFP4_BLOCK // self.size)

    def expert_range(self, c: ModelConfig) -> tuple[int, int]:
        """The experts this rank holds, [first, end) (all of them without expert parallelism)."""
        if not self.experts or self.size == 1:
            return 0, c.num_local_experts
        n = c.num_local_experts // self.size
        return self.rank * n, (self.rank + 1) * n

    def experts_held(self, c: ModelConfig) -> int:
        """Experts in this rank's tensors."""
        first, end = self.expert_range(c)
        return end - first

    def vocab_rows(self, c: ModelConfig) -> int:
        return -(-c.vocab_size // self.size)

    def vocab_start(self, c: ModelConfig) -> int:
        return self.rank * self.vocab_rows(c)

    def cut(self, name: str, shape: tuple[int, ...], c: ModelConfig) -> Cut | None:
        """The slice of checkpoint tensor `name` (whole shape `shape`) this rank holds; None:
        the whole tensor."""
        if self.size == 1:
            return None
        r, n = self.rank, self.size
        if self.experts and ".mlp.experts." in name:
            first, end = self.expert_range(c)
            return Cut(0, first, end, end - first)
        if name.endswith(("self_attn.o_proj.bias", "mlp.experts.down_proj_bias")):
            return None if r == 0 else Cut(0, 0, 0, shape[0])
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.sinks")):
            return _even(0, shape, r, n)
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias",
                          "self_attn.v_proj.weight", "self_attn.v_proj.bias")):
            return _even(0, shape, r, n)
        if name.endswith("self_attn.o_proj.weight"):
            return _even(1, shape, r, n)
        b = self.expert_blocks(c)
        if name.endswith(("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias")):
            rows = 2 * b * MXFP4_BLOCK  # interleaved gate/up rows of b blocks of units
            return _clipped(1, shape, r * rows, rows)
        if name.endswith(("down_proj_blocks", "down_proj_scales")):
            return _clipped(2, shape, r * b, b)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = self.vocab_rows(c)
            return _clipped(0, shape, r * rows, rows)
        return None


def _even(dim: int, shape: tuple[int, ...], rank: int, size: int) -> Cut:
    part = shape[dim] // size
    return Cut(dim, rank * part, (rank + 1) * part, part)


def _clipped(dim: int, shape: tuple[int, ...], start: int, length: int) -> Cut:
    start = min(start, shape[dim])
    return Cut(dim, start, min(start + length, shape[dim]), length)
