"""The compute kernels the model calls, chosen once at start-up for the hardware at hand.

The model holds a `Kernels` and never branches on the device itself: swapping the reference
torch functions for GPU kernels happens here, in one place, and is logged.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from tinyoss.kernels.linear_fp8_torch import fp8_linear_torch
from tinyoss.kernels.linear_mxfp4_torch import mxfp4_linear_torch
from tinyoss.kernels.moe_torch import ExpertWeights, moe_torch

# (x, topk_weights, topk_ids, experts): experts is what `prepare_experts` made (else ExpertWeights)
MoEFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]
PrepareFn = Callable[[ExpertWeights], Any]
Pair = tuple[torch.Tensor, torch.Tensor]
NormFn = Callable[[torch.Tensor, torch.Tensor, float, "torch.Tensor | None"], Pair]
# (logits, k, held) -> (top-k weights, ids); held: `router_topk_torch`'s
RouterFn = Callable[[torch.Tensor, int, "tuple[int, int] | None"], Pair]
# (x [M, K], blocks [N, K/32, 16], scales [N, K/32], bias [N] | None) -> [M, N]
LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
# (x [M, K], weight [N, K], bias [N] | None) -> [M, N]: the bf16 dense layers
DenseFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
# (x, residual, norm weight, eps, router weight, router bias, k, held) -> (normed, residual,
# topk weights, topk ids): `Kernels.post_attention` in one fused call
NormRouteFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor, torch.Tensor, int,
     "tuple[int, int] | None"],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
]
# (x, topk weights, topk ids, experts, residual, norm weight, eps) -> (normed, residual):
# `Kernels.moe_then_norm` in one fused call
MoENormFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any, torch.Tensor, torch.Tensor,
                      float], Pair]


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual); the weight multiplies in float32 (as transformers)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * y).to(x.dtype), x


def router_topk_torch(logits: torch.Tensor, k: int, held: tuple[int, int] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest router logits (sorted) and a softmax over just those: (weights fp32, ids).
    With `held` = [first, end), the experts this rank holds (expert parallelism), an id inside
    it comes as id - first and any other as -1: a pair the MoE kernels skip (another rank
    adds it)."""
    top_logits, top_ids = torch.topk(logits, k, dim=-1, sorted=True)
    if held is not None:
        first, end = held
        top_ids = torch.where((top_ids >= first) & (top_ids < end), top_ids - first, -1)
    return torch.softmax(top_logits.float(), dim=-1), top_ids


def greedy_pick_torch(logits: torch.Tensor) -> torch.Tensor:
    """[2, B] int64: each row's argmax (the first largest; NaN never counts as largest) and
    whether the row holds no NaN or infinity (1) or does (0). `greedy_triton` in one pass."""
    x = logits.float()
    tokens = x.masked_fill(x.isnan(), float("-inf")).argmax(-1)
    return torch.stack([tokens, torch.isfinite(x).all(-1).long()])


@dataclass
class Kernels:
    moe: MoEFn = moe_torch
    # Runs once per layer after loading: the checkpoint's experts -> the layout `moe` reads
    # (None: `moe` reads `ExpertWeights` as they are).
    prepare_experts: PrepareFn | None = None
    # The context the MoE warm-up runs in (FlashInfer's autotuner profiles tactics inside it).
    moe_warmup: Callable[[], AbstractContextManager] = contextlib.nullcontext
    rms_norm: NormFn = rms_norm_torch
    router_topk: RouterFn = router_topk_torch
    mxfp4_linear: LinearFn = mxfp4_linear_torch  # dense layers quantized at load
    fp8_linear: LinearFn = fp8_linear_torch
    linear: DenseFn = F.linear  # q/k/v, o, router, lm_head
    # logits [B, V] -> [2, B] int64: argmax, finite (the sampler's greedy pick and NaN check)
    greedy_pick: Callable[[torch.Tensor], torch.Tensor] = greedy_pick_torch
    # The norm after attention, the router and its top-k fused (None: the kernels above in turn)
    norm_route: NormRouteFn | None = None
    # The experts, the residual add and the next RMSNorm fused (None: `moe`, then `rms_norm`)
    moe_norm: MoENormFn | None = None
    # Tensor parallelism: the sum over ranks (in place) and the gather of vocabulary columns
    # ([T, C] -> [T, ranks * C]); None on one GPU
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    # The all-reduce, the residual add and the RMSNorm after the experts, fused where the
    # group's fast all-reduce can: (y, residual, norm weight, eps) -> (normed, residual)
    all_reduce_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float],
                              tuple[torch.Tensor, torch.Tensor]] | None = None
    # The same from the experts' uncombined pair rows (their combine in the all-reduce's
    # launch), for steps of up to `pairs_max_tokens` tokens: `moe_pairs` gives the rows
    # ([T * K, H] fp32), `all_reduce_pairs_norm` (y, ids, residual, weight, eps) the rest
    moe_pairs: MoEFn | None = None
    all_reduce_pairs_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    pairs_max_tokens: int = 0
    names: dict[str, str] = field(default_factory=lambda: dict.fromkeys(
        ("moe", "norm", "router", "mxfp4_linear", "fp8_linear", "linear", "greedy"), "torch"))

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the tensor-parallel ranks (x itself on one)."""
        return x if self.all_reduce is None else self.all_reduce(x)

    def post_attention(
        self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
        router_weight: torch.Tensor, router_bias: torch.Tensor, k: int,
        held: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What sits between attention and the experts: (norm(x + residual), x + residual,
        the router's top-k weights and ids, the ids as this rank holds them: `held`, see
        `router_topk_torch`)."""
        if self.norm_route is not None:
            return self.norm_route(x, residual, norm_weight, eps, router_weight, router_bias, k,
                                   held)
        x, residual = self.rms_norm(x, norm_weight, eps, residual)
        weights, ids = self.router_topk(self.linear(x, router_weight, router_bias), k, held)
        return x, residual, weights, ids

    def moe_then_norm(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: Any,
        residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What ends a layer: the experts' output y, then (norm(y + residual), y + residual) with
        the next layer's input norm (or the final one)."""
        if self.all_reduce is not None:  # the partial sums meet before the norm
            if self.moe_pairs is not None and x.shape[0] <= self.pairs_max_tokens:
                return self.all_reduce_pairs_norm(self.moe_pairs(x, topk_weights, topk_ids,
                                                                 experts),
                                                  topk_ids, residual, norm_weight, eps)
            y = self.moe(x, topk_weights, topk_ids, experts)
            if self.all_reduce_norm is not None:
                return self.all_reduce_norm(y, residual, norm_weight, eps)
            return self.rms_norm(self.all_reduce(y), norm_weight, eps, residual)
        if self.moe_norm is not None:
            return self.moe_norm(x, topk_weights, topk_ids, experts, residual, norm_weight, eps)
        return self.rms_norm(self.moe(x, topk_weights, topk_ids, experts), norm_weight, eps,
                             residual)
