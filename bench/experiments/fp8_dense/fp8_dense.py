"""FP8 dense layers (issue 18's optional item): q/k/v, o and lm_head held as float8 e4m3 with one
fp32 scale a row (absmax / 448), weight-only, quantized at load. Half of bf16's bytes a token at
batch 1 (MXFP4: ~0.27), far less error than MXFP4. Not in the engine: this measures whether it
pays before it goes in.

    python bench/experiments/fp8_dense/fp8_dense.py --quality            # CPU or GPU (tiny)
    python bench/experiments/fp8_dense/fp8_dense.py --bench --tokens 1,2,4,8   # GPU

--quality: logits of `tiny` with each set of layers FP8 (the weights replaced by their FP8
round trip, which is what a weight-only FP8 layer computes up to summation order) and with
MXFP4 (`mxfp4_layers`), against the checkpoint as shipped (bench/mxfp4_quality.py's measures).
--bench: the FP8 GEMV below against the engine's bf16 GEMV, cuBLAS and the MXFP4 GEMV at
gpt-oss-20b's dense shapes, us a call (CUDA-graph replays over 4 weight sets, so L2 does not
hold them) and GB/s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

FP8_MAX = 448.0  # float8 e4m3fn's largest finite value
SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096), "lm_head": (201088, 2880)}  # gpt-oss-20b


def quantize_fp8(w: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8 e4m3fn [N, K], fp32 scale [N]): each row over its largest magnitude
    times 448, rounded to nearest; an all-zero row gets scale 1. A few thousand rows at a time."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(n, dtype=torch.float32, device=w.device)
    for r in range(0, n, chunk):
        rows = w[r : r + chunk].float()
        s = rows.abs().amax(dim=1) / FP8_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))
        q[r : r + chunk] = (rows / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        scale[r : r + chunk] = s
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


@triton.jit
def _gemv_fp8(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, HAS_BIAS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              STAGES: tl.constexpr):
    """linear_triton._gemv on FP8 weights: the row scales multiply the sums once, after K."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    toks = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    tok_ok = toks < M
    cols = tl.arange(0, BLOCK_K)
    wp = w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
    xp = x_ptr + toks.to(tl.int64)[:, None] * K + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = tl.load(wp + k0, mask=row_ok[:, None] & (k0 + cols < K)[None, :], other=0.0)
        x = tl.load(xp + k0, mask=tok_ok[:, None] & (k0 + cols < K)[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, 2) * tl.load(s_ptr + rows, mask=row_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + toks.to(tl.int64)[:, None] * N + rows[None, :],
             y.to(out_ptr.dtype.element_ty), mask=tok_ok[:, None] & row_ok[None, :])


def fp8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
             bias: torch.Tensor | None = None, block_n: int = 8, block_k: int = 1024,
             warps: int = 4, stages: int = 4) -> torch.Tensor:
    """x [M, K] @ (q [N, K] * scale[:, None]).T (+ bias) -> [M, N] in x.dtype, fp32 sums."""
    m, k = x.shape
    n = q.shape[0]
    block_m = triton.next_power_of_2(max(m, 1))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_fp8[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x.contiguous(), q, scale, out if bias is None else bias, out, m, n, k,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=max(32, block_k // block_m), STAGES=stages, num_warps=warps, num_stages=stages)
    return out


LAYERS = {"qkv": ("qkv_proj",), "o": ("o_proj",), "lm_head": (), "all": ("qkv_proj", "o_proj")}


@torch.inference_mode()
def fp8_round_trip(llm, layers: str) -> None:
    """Replaces the named dense weights of `llm`'s model by their FP8 round trip, in place."""
    model = llm.engine.executor.model
    if layers in ("lm_head", "all") and model.config.tie_word_embeddings:
        raise ValueError("lm_head is tied to the input embeddings here: FP8 would change both")
    for layer in model.model.layers:
        for attr in LAYERS[layers]:
            lin = getattr(layer.self_attn, attr)
            lin.weight.copy_(dequantize_fp8(*quantize_fp8(lin.weight)).to(lin.weight.dtype))
    if layers in ("lm_head", "all"):
        w = model.lm_head.weight
        w.copy_(dequantize_fp8(*quantize_fp8(w)).to(w.dtype))


def quality(model: str = "tiny", num_prompts: int = 2, length: int = 64,
            **engine_options: object) -> list[dict]:
    """bench/mxfp4_quality.py's rows for FP8 (qkv, o, lm_head, all) and MXFP4 (all) layers,
    each against the checkpoint as shipped, on the same prompts."""
    from bench.mxfp4_quality import compare, prompt_logits, random_prompts
    from tinyoss import LLM

    prompts = random_prompts(num_prompts, length)
    options = {"kv_cache_tokens": 4 * length, "max_model_len": length + 1,
               "max_num_batched_tokens": num_prompts * length, "enforce_eager": True,
               "enable_prefix_caching": False, **engine_options}
    ref = prompt_logits(LLM(model, **options), prompts)
    rows = []
    for layers in ("qkv", "o", "lm_head", "all"):
        llm = LLM(model, **options)
        fp8_round_trip(llm, layers)
        rows.append({"layers": f"fp8 {layers}", **compare(ref, prompt_logits(llm, prompts))})
    mx = prompt_logits(LLM(model, mxfp4_layers="all", **options), prompts)
    rows.append({"layers": "mxfp4 all", **compare(ref, mx)})
    return rows


def bench(tokens: list[int]) -> None:
    """us a call and GB/s of the weights read, at gpt-oss-20b's dense shapes."""
    from bench.moe_kernels import timed
    from tinyoss.kernels.linear_mxfp4_triton import mxfp4_linear
    from tinyoss.kernels.linear_triton import linear_gemv
    from tinyoss.model.quant_linear import quantize_weight

    dev = torch.device("cuda")
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev).mul_(0.02).bfloat16() for _ in range(4)]
        q8 = [quantize_fp8(w) for w in ws]
        mx = [quantize_weight(w) for w in ws]
        for m in tokens:
            x = torch.randn(m, k, device=dev).bfloat16()
            ref = F.linear(x.float(), dequantize_fp8(*q8[0]))
            err = ((fp8_gemv(x, *q8[0]).float() - ref).norm() / ref.norm()).item()
            rows = [("cuBLAS bf16", lambda w=ws: [F.linear(x, wi) for wi in w], n * k * 2),
                    ("mxfp4 GEMV", lambda w=mx: [mxfp4_linear(x, b, s, None) for b, s in w],
                     n * (k // 2 + k // 32))]
            if m == 1:
                rows.insert(0, ("bf16 GEMV (engine)",
                                lambda w=ws: [linear_gemv(x, wi) for wi in w], n * k * 2))
            for bn, bk in ((8, 1024), (16, 512), (8, 2048), (4, 1024)):
                rows.append((f"fp8 GEMV {bn}x{bk}", lambda w=q8, bn=bn, bk=bk: [
                    fp8_gemv(x, qi, si, block_n=bn, block_k=bk) for qi, si in w], n * k + 4 * n))
            for label, fn, nbytes in rows:
                us = timed(fn, [()]) / len(ws)
                print(f"{name:<7} M={m} {label:<20} {us:8.1f} us {nbytes / us / 1e3:7.0f} GB/s",
                      flush=True)
            print(f"{name:<7} M={m} fp8 GEMV error against its fp32 reference {err:.1e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quality", action="store_true")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--model", default="tiny")
    args = p.parse_args()
    if args.quality:
        on_gpu = torch.cuda.is_available()
        for r in quality(args.model, device="cuda" if on_gpu else "cpu",
                         dtype="bfloat16" if on_gpu else "float32"):
            print(f"{r['layers']:<12} max|d| {r['max_abs']:8.4f} mean|d| {r['mean_abs']:8.5f} "
                  f"rel {r['rel']:8.5f} KL {r['kl']:8.2e} "
                  f"greedy {100 * r['greedy_agreement']:6.2f}%")
    if args.bench:
        bench([int(t) for t in args.tokens.split(",")])


if __name__ == "__main__":
    main()
