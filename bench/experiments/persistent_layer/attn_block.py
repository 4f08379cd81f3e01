"""gpt-oss's attention block at batch 1 as one persistent launch (`attn_block.cu`: RMSNorm,
q/k/v with bias on the tensor cores, rope, the new key and value into the paged cache, attention
with sinks, o with bias, the residual) against torch in fp32 and against the product's three
launches for the same work (streaming GEMV, Triton decode attention, streaming GEMV; the
product's norm and residual add live in other launches and are left out of its time).
Microseconds a block from CUDA graphs over 4 rotating weight sets, full (1k keys) and sliding
(128) layers.

    python bench/experiments/persistent_layer/attn_block.py [--context 1024] [--check-only]
"""

from __future__ import annotations

import argparse
import ctypes
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.moe_kernels import timed  # noqa: E402
from tinyoss.kernels.attention_decode_triton import DecodeAttention  # noqa: E402
from tinyoss.kernels.moe_gemv_mma import load  # noqa: E402

from dense_ring import tiled  # noqa: E402  (beside this file)
from ring_build import build_lib  # noqa: E402

HID, HQ, HK, D, PAGE, WINDOW = 2880, 64, 8, 64, 16, 128
QO, QKV = HQ * D, HQ * D + 2 * HK * D
CK_QKV, CK_O, MAX_SPLITS = 192, 256, 16
BLOCKS = 4096  # cache blocks of PAGE tokens


class Args(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in (
        "h", "norm_w", "w_qkv", "b_qkv", "w_o", "b_o", "rope", "sinks", "k_cache", "v_cache",
        "table")] + [("lo", ctypes.c_int), ("hi", ctypes.c_int), ("slot", ctypes.c_int),
                     ("scale", ctypes.c_float), ("eps", ctypes.c_float)] + [
        (n, ctypes.c_void_p) for n in ("qkv", "part", "attn", "out", "bar", "gacc", "gcnt",
                                       "gpart")] + [("two_part", ctypes.c_int),
                                                    ("trace", ctypes.c_void_p),
                                                    ("inflight", ctypes.c_int),
                                                    ("gate_o", ctypes.c_int),
                                                    ("cp_async", ctypes.c_int)]
POINTS = ("consumers start", "x staged", "q/k/v units done", "barrier 0 passed",
          "attention done", "merged, barrier 2 passed", "o's x staged", "end",
          "producer: q/k/v issued", "producer: all issued", "an item's q and new key in",
          "an item's output out", "an item's scores", "an item's softmax", "an item's p . v",
          "o's units done")


def rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x [..., D] fp32 rotated half-split by rope [D] (cos | sin), rounded to bf16."""
    c, s = rope[: D // 2], rope[D // 2:]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).bfloat16()


def reference(w: dict, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
              lo: int, hi: int, slot: int, eps: float) -> dict:
    """The block in fp32 with bf16 at the product's rounding points; writes the new key and
    value into (copies of) the caches."""
    hf = w["h"].float()
    xn = (w["norm_w"].float() * (hf * torch.rsqrt(hf.square().mean() + eps))).bfloat16()
    qkv = (w["w_qkv"].float() @ xn.float() + w["b_qkv"].float()).bfloat16()
    q = rotate(qkv[:QO].float().view(HQ, D), w["rope"])
    k_new = rotate(qkv[QO:QO + HK * D].float().view(HK, D), w["rope"])
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    k_cache.view(-1, HK, D)[slot] = k_new
    v_cache.view(-1, HK, D)[slot] = qkv[QO + HK * D:].view(HK, D)
    keys = torch.arange(lo, hi, device=q.device)
    rows = table[keys // PAGE].long() * PAGE + keys % PAGE
    kk = k_cache.view(-1, HK, D)[rows].float().repeat_interleave(HQ // HK, 1)  # [n, HQ, D]
    vv = v_cache.view(-1, HK, D)[rows].float().repeat_interleave(HQ // HK, 1)
    scores = torch.einsum("hd,nhd->hn", q.float(), kk) / math.sqrt(D)
    big = torch.maximum(scores.max(1).values, w["sinks"])
    e = torch.exp(scores - big[:, None])
    den = e.sum(1) + torch.exp(w["sinks"] - big)
    attn = (torch.einsum("hn,nhd->hd", e, vv) / den[:, None]).bfloat16().flatten()
    o = (w["w_o"].float() @ attn.float() + w["b_o"].float()).bfloat16()
    return {"qkv": qkv, "attn": attn, "out": (hf + o.float()).bfloat16(), "k": k_new,
            "k_cache": k_cache}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=1024, help="keys of a full layer")
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--variants", default="bulk:22:two:gate,bulk:8:two:gate",
                   help="the producer's copies (bulk: one a unit, cp: cp.async a lane), how "
                   "many units in flight at most (<= 22), ':two' the GEMVs' rows left in two "
                   "parts for their readers (':twoq' q/k/v's only), ':gate' o's units after "
                   "every program's q/k/v, "
                   "a list")
    args = p.parse_args()
    dev = torch.device("cuda")
    mma, why = load(torch.cuda.get_device_capability(dev))
    assert mma is not None, why
    lib = build_lib("attn_block.cu")
    lib.attn_block_launch.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=gen) * scale).bfloat16()

    def weights() -> dict:
        theta = 0.37 * torch.arange(D // 2, device=dev).float()
        return {"h": rnd(HID), "norm_w": (1 + 0.1 * torch.randn(HID, device=dev, generator=gen)
                                          ).bfloat16(),
                "w_qkv": rnd(QKV, HID, scale=HID**-0.5), "b_qkv": rnd(QKV, scale=0.1),
                "w_o": rnd(HID, QO, scale=QO**-0.5), "b_o": rnd(HID, scale=0.1),
                "rope": torch.cat((theta.cos(), theta.sin())),
                "sinks": torch.randn(HQ, device=dev, generator=gen)}

    sets = [weights() for _ in range(4)]
    for w in sets:
        w["w_qkv_t"], w["w_o_t"] = tiled(w["w_qkv"], CK_QKV), tiled(w["w_o"], CK_O)
    k_cache = rnd(BLOCKS, PAGE, HK, D)
    v_cache = rnd(BLOCKS, PAGE, HK, D)
    table = torch.randperm(BLOCKS, device=dev, generator=gen).int()
    scratch = {"qkv": torch.empty(QKV, device=dev, dtype=torch.bfloat16),
               "part": torch.empty(HK * MAX_SPLITS * 8 * (2 + D), device=dev),
               "attn": torch.empty(QO, device=dev, dtype=torch.bfloat16),
               "out": torch.empty(HID, device=dev, dtype=torch.bfloat16),
               "bar": torch.zeros(4, device=dev, dtype=torch.int32),  # a counter a mode
               "gpart": torch.zeros(2, QKV + HID, device=dev),
               "gacc": torch.zeros(QKV + HID, device=dev),
               "gcnt": torch.zeros((QKV + HID) // 16, device=dev, dtype=torch.int32)}
    eps, hi = 1e-5, args.context
    slot = int(table[(hi - 1) // PAGE]) * PAGE + (hi - 1) % PAGE  # the new token's
    print(f"{torch.cuda.get_device_name()} | {sms} SMs | shared memory a program "
          f"{lib.attn_block_smem()} B", flush=True)
    keep = []  # Args structs the graphs point at

    def block(w: dict, lo: int, trace: torch.Tensor | None = None,
              variant: tuple[int, int, int, int] = (4, 0, 0, 0)) -> None:
        a = Args(w["h"].data_ptr(), w["norm_w"].data_ptr(), w["w_qkv_t"].data_ptr(),
                 w["b_qkv"].data_ptr(), w["w_o_t"].data_ptr(), w["b_o"].data_ptr(),
                 w["rope"].data_ptr(), w["sinks"].data_ptr(), k_cache.data_ptr(),
                 v_cache.data_ptr(), table.data_ptr(), lo, hi, slot, 1 / math.sqrt(D), eps,
                 *(scratch[n].data_ptr() for n in ("qkv", "part", "attn", "out")),
                 scratch["bar"].data_ptr() + 4 * variant[2],
                 *(scratch[n].data_ptr() for n in ("gacc", "gcnt", "gpart")), variant[2],
                 None if trace is None else trace.data_ptr(), variant[0], variant[3], variant[1])
        keep.append(a)
        err = lib.attn_block_launch(ctypes.byref(a), sms, stream())
        assert not err, f"launch failed: {err}"

    for name, lo in (("full", 0), ("sliding", hi - WINDOW)):
        for i, w in enumerate(sets):
            want = reference(w, k_cache, v_cache, table, lo, hi, slot, eps)
            block(w, lo, None, (4, i % 2, (0, 0, 3, 1)[i], i // 2))  # cp.async: 1, 3
            torch.cuda.synchronize()
            errs = {"qkv": rel(scratch["qkv"], want["qkv"]),
                    "new key": rel(k_cache.view(-1, HK, D)[slot], want["k"]),
                    "attn": rel(scratch["attn"], want["attn"]),
                    "o (out - h)": rel(scratch["out"].float() - w["h"].float(),
                                       want["out"].float() - w["h"].float())}
            print(f"  {name}, set {i}: error against fp32 " +
                  ", ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)
            assert errs["qkv"] < 1e-2 and errs["new key"] < 1e-2, errs
            assert errs["attn"] < 3e-2 and errs["o (out - h)"] < 3e-2, errs
    if args.check_only:
        return
    variants = {v: (int(v.split(":")[1]), int(v.startswith("cp")),
                    3 if ":two:" in v + ":" else int(":twoq" in v), int(":gate" in v))
                for v in args.variants.split(",")}
    for name, lo in (("full", 0), ("sliding", hi - WINDOW)):  # where a launch's time goes
        for vname, variant in variants.items():
            trace = torch.zeros(sms, len(POINTS), device=dev, dtype=torch.int64)
            for w in sets * 2:  # warm, then the last launch traced
                block(w, lo, None, variant)
            block(sets[0], lo, trace, variant)
            torch.cuda.synchronize()
            t = (trace - trace[:, 0].min()).float() / 1e3
            print(f"  trace, {name} layer, producer {vname} (us from the first "
                  "program's start: min / median / max over programs that reached it):",
                  flush=True)
            for i, point in enumerate(POINTS):
                col = t[:, i][trace[:, i] > 0]
                if col.numel():
                    print(f"    {point:24s} {col.min():7.2f} {col.median():7.2f} "
                          f"{col.max():7.2f}")

    attention = DecodeAttention(1, hi + 64, HQ, HK, D, dev)
    rope_cache = torch.zeros(hi + 64, D, device=dev)
    positions = torch.tensor([hi - 1], device=dev, dtype=torch.int32)
    slots = torch.tensor([slot], device=dev, dtype=torch.int32)
    tables = table[None, :].contiguous()
    xn = rnd(1, HID)
    qkv_out = torch.empty(1, QKV, device=dev, dtype=torch.bfloat16)
    o_out = torch.empty(1, HID, device=dev, dtype=torch.bfloat16)

    ranges = {lo: torch.tensor([[lo, hi]], device=dev, dtype=torch.int32)
              for lo in (0, hi - WINDOW)}

    attn_out = torch.zeros(1, QO, device=dev, dtype=torch.bfloat16)

    def product(w: dict, lo: int, window: int, parts: str = "qao") -> None:
        """The product's launches for the block: q/k/v, attention, o (those in `parts`)."""
        if "q" in parts:
            err = mma.stream_fn(xn.data_ptr(), 1, w["w_qkv"].data_ptr(), w["b_qkv"].data_ptr(),
                                qkv_out.data_ptr(), QKV, HID, stream())
            assert not err, err
        if "a" in parts:
            q, k, v = qkv_out.split([QO, HK * D, HK * D], -1)
            attn_out.copy_(attention(q.view(1, HQ, D), k.view(1, HK, D), v.view(1, HK, D),
                                     k_cache, v_cache, slots, positions, rope_cache, tables,
                                     ranges[lo], w["sinks"], 1 / math.sqrt(D), window))
        if "o" in parts:
            err = mma.stream_fn(attn_out.data_ptr(), 1, w["w_o"].data_ptr(),
                                w["b_o"].data_ptr(), o_out.data_ptr(), HID, QO, stream())
            assert not err, err

    for name, lo, window in (("full", 0, 0), ("sliding", hi - WINDOW, WINDOW)):
        ours = {v: timed(lambda w, lo=lo, f=f: block(w, lo, None, f), [(w,) for w in sets])
                for v, f in variants.items()}
        theirs = {parts: timed(lambda w, lo=lo, window=window, parts=parts:
                               product(w, lo, window, parts), [(w,) for w in sets])
                  for parts in ("qao", "q", "a", "o")}
        best = min(ours.values())
        print(f"== {name} layer, {hi - lo} keys: persistent block " +
              ", ".join(f"{v:.2f} us ({f})" for f, v in ours.items()) +
              f" | the product's q/k/v + attention + o {theirs['qao']:6.2f} us (best "
              f"{(best / theirs['qao'] - 1) * 100:+.1f}%); alone: q/k/v {theirs['q']:.2f}, "
              f"attention {theirs['a']:.2f} (with a 12 KB copy), o {theirs['o']:.2f}",
              flush=True)


if __name__ == "__main__":
    with torch.cuda.stream(torch.cuda.Stream()):
        main()
