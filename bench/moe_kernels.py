"""GPU micro-benchmark of the Triton MoE (tinyoss/kernels/moe_triton.py) at gpt-oss shapes.

One invocation sweeps a small grid of tile configs for the decode path (T = 1..64 tokens) and
the prefill path, and prints one compact table: per path and T, the default config's time and
the best config's, the expert bytes actually read (hit experts only: blocks, scales, biases),
the achieved GB/s and its share of a device-to-device copy's rate measured in the same run.
Every row of the sweep goes to a CSV ($OUT/moe_kernels.csv when $OUT is set).

Timing: `triton.testing.do_bench` (median; it also clears L2 before every call), rotating
over --sets independent weight and input sets so that no call finds its experts in the 50 MB
L2. Decode calls are replayed from CUDA graphs (one per set), as the engine will run them, so
the numbers carry no Python launch overhead and capture itself proves there is no host sync.

  python bench/moe_kernels.py --check      # check every config, then the sweep (~4-5 min)
  python bench/moe_kernels.py --decode-tokens 1 --decode-configs fma:n16/8:k256,fma:n32/16:w8

Config strings: mode:field:field..., fields t<block_t>, n<block_n1>/<block_n2> (prefill:
m<block_m> too), k<block_k1>/<block_k2> (prefill: k<block_k>), w<num_warps>, p<num_stages>,
x<split1>; fields left out keep the dataclass defaults.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinyoss.kernels import moe_triton as mt
from tinyoss.kernels.moe_torch import ExpertWeights, moe_torch

DECODE_CONFIGS = (
    "fma:t1:n32/8:k256:w4,fma:t1:n16/8:k256:w4,fma:t1:n32/16:k256:w4,fma:t1:n32/16:k512:w8,"
    "dot:n32/16:k256:w4,dot:n64/32:k256:w8,dot:n32/16:k128:w4,scaled:n32/16:k256:w4"
)
PREFILL_CONFIGS = (
    "dot:m64:n128/128:k128:w8,dot:m128:n128/128:k128:w8,dot:m64:n64/64:k128:w4,"
    "scaled:m64:n128/128:k128:w8"
)
TOL = 1e-2  # ||out - moe_torch|| / ||moe_torch|| for bf16 activations


def parse_config(text: str, base: mt.DecodeConfig | mt.PrefillConfig):
    """'dot:n32/16:k256:w4' -> replace(base, mode='dot', block_n1=32, block_n2=16, ...)."""
    mode, *parts = text.split(":")
    prefill = isinstance(base, mt.PrefillConfig)
    keys = {
        "t": ("block_t",),
        "m": ("block_m",),
        "w": ("num_warps",),
        "p": ("num_stages",),
        "x": ("split1",),
        "n": ("block_n1", "block_n2"),
        "k": ("block_k",) if prefill else ("block_k1", "block_k2"),
    }
    known = {f.name for f in fields(base)}
    changes: dict[str, object] = {"mode": mode}
    for part in parts:
        names, values = keys[part[0]], [int(v) for v in part[1:].split("/")]
        values = values * len(names) if len(values) == 1 else values
        changes.update({n: v for n, v in zip(names, values) if n in known})
    if not prefill and mode == "fma":
        changes.setdefault("block_t", 1)
    return replace(base, **changes)


def config_name(cfg) -> str:
    if isinstance(cfg, mt.PrefillConfig):
        return (
            f"{cfg.mode}:m{cfg.block_m}:n{cfg.block_n1}/{cfg.block_n2}:k{cfg.block_k}"
            f":w{cfg.num_warps}:p{cfg.num_stages}"
        )
    split = f":x{cfg.split1}" if cfg.split1 else ""
    return (
        f"{cfg.mode}:t{cfg.block_t}:n{cfg.block_n1}/{cfg.block_n2}:k{cfg.block_k1}/"
        f"{cfg.block_k2}:w{cfg.num_warps}:p{cfg.num_stages}{split}"
    )


def random_experts(e: int, h: int, i: int, gen: torch.Generator) -> ExpertWeights:
    """Uniform E2M1 codes with scales giving weights of ~0.1 (gate_up) and ~0.03 (down)."""

    def codes(shape: tuple[int, ...], std: float) -> tuple[torch.Tensor, torch.Tensor]:
        exponent = 127 + round(math.log2(std / 2.93))  # 2.93: rms of the E2M1 values
        blocks = torch.randint(0, 256, shape, generator=gen, device="cuda", dtype=torch.uint8)
        scales = torch.randint(
            exponent - 1, exponent + 2, shape[:-1], generator=gen, device="cuda", dtype=torch.int32
        ).to(torch.uint8)
        return blocks, scales

    gb, gs = codes((e, 2 * i, h // 32, 16), 0.1)
    db, ds = codes((e, h, i // 32, 16), 0.03)
    gbias = torch.randn(e, 2 * i, generator=gen, device="cuda").to(torch.bfloat16)
    dbias = torch.randn(e, h, generator=gen, device="cuda").to(torch.bfloat16)
    return ExpertWeights(gb, gs, gbias, db, ds, dbias)


@dataclass
class Case:
    x: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    w: ExpertWeights
    out: torch.Tensor

    def expert_bytes(self) -> int:
        """Bytes of the experts this case hits: blocks, scales and biases, gate_up and down."""
        per_expert = sum(
            t[0].numel() * t.element_size()
            for t in (
                self.w.gate_up_blocks,
                self.w.gate_up_scales,
                self.w.gate_up_bias,
                self.w.down_blocks,
                self.w.down_scales,
                self.w.down_bias,
            )
        )
        return per_expert * self.ids.unique().numel()


def make_cases(sets: list[ExpertWeights], t: int, top_k: int, gen: torch.Generator) -> list[Case]:
    cases = []
    for w in sets:
        e, h = w.down_bias.shape
        logits = torch.randn(t, e, generator=gen, device="cuda")
        top, ids = logits.topk(top_k, dim=-1)
        x = torch.randn(t, h, generator=gen, device="cuda").to(torch.bfloat16)
        out = torch.empty(t, h, device="cuda", dtype=torch.bfloat16)
        cases.append(Case(x, torch.softmax(top, dim=-1), ids, w, out))
    return cases


def rotating(calls: list[Callable[[], object]]) -> Callable[[], None]:
    """One call per invocation, cycling over the sets."""
    state = {"i": 0}

    def fn() -> None:
        calls[state["i"] % len(calls)]()
        state["i"] += 1

    return fn


def time_ms(fn: Callable[[], None]) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def copy_gbps() -> float:
    """Device-to-device copy rate of 1 GiB (bytes read + bytes written, per second)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    src.random_()
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def decode_calls(cases: list[Case], cfg: mt.DecodeConfig) -> list[Callable[[], object]]:
    """One CUDA graph per set, replayed: the engine's way of running decode."""
    graphs = []
    for c in cases:
        mt.moe_decode(c.x, c.weights, c.ids, c.w, cfg, out=c.out)  # compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            mt.moe_decode(c.x, c.weights, c.ids, c.w, cfg, out=c.out)
        graphs.append(graph.replay)
    return graphs


def prefill_calls(cases: list[Case], cfg: mt.PrefillConfig) -> list[Callable[[], object]]:
    return [lambda c=c: mt.moe_prefill(c.x, c.weights, c.ids, c.w, cfg, out=c.out) for c in cases]


def check(case: Case, run: Callable[[Case], torch.Tensor], label: str) -> float:
    out = run(case)
    ref = moe_torch(case.x, case.weights, case.ids, case.w)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    bad = not math.isfinite(err) or err > TOL
    print(f"check {label:58s} rel_err={err:.2e}{'  FAILED' if bad else ''}", flush=True)
    return err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=32, help="32: gpt-oss-20b, 128: 120b")
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--intermediate", type=int, default=2880)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--sets", type=int, default=4, help="weight/input sets rotated per call")
    ap.add_argument("--decode-tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--prefill-tokens", default="16,64,512,2048")
    ap.add_argument("--decode-configs", default=DECODE_CONFIGS)
    ap.add_argument("--prefill-configs", default=PREFILL_CONFIGS)
    ap.add_argument(
        "--fma-max-tokens",
        type=int,
        default=4,
        help="'fma' decodes a tile once per token: skip it above this many tokens",
    )
    ap.add_argument("--check", action="store_true", help="compare with moe_torch first")
    ap.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "moe_kernels.csv")
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = [
        random_experts(args.experts, args.hidden, args.intermediate, gen) for _ in range(args.sets)
    ]
    decode_tokens = [int(t) for t in args.decode_tokens.split(",") if t]
    prefill_tokens = [int(t) for t in args.prefill_tokens.split(",") if t]
    decode_cfgs = [parse_config(c, mt.DecodeConfig()) for c in args.decode_configs.split(",") if c]
    prefill_cfgs = [
        parse_config(c, mt.PrefillConfig()) for c in args.prefill_configs.split(",") if c
    ]
    print(
        f"{torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__};"
        f" E={args.experts} H={args.hidden} I={args.intermediate} top-{args.top_k}",
        flush=True,
    )

    if args.check:
        c8 = make_cases(sets[:1], 8, args.top_k, gen)[0]
        c512 = make_cases(sets[:1], 512, args.top_k, gen)[0]
        for cfg in decode_cfgs:
            check(
                c8,
                lambda c, cfg=cfg: mt.moe_decode(c.x, c.weights, c.ids, c.w, cfg),
                f"decode T=8 {config_name(cfg)}",
            )
        for cfg in prefill_cfgs:
            check(
                c512,
                lambda c, cfg=cfg: mt.moe_prefill(c.x, c.weights, c.ids, c.w, cfg),
                f"prefill T=512 {config_name(cfg)}",
            )
        for t in sorted(set(decode_tokens + prefill_tokens)):
            case = make_cases(sets[:1], t, args.top_k, gen)[0]
            check(
                case,
                lambda c: mt.moe_triton(c.x, c.weights, c.ids, c.w),
                f"moe_triton T={t} (default path and config)",
            )

    copy = copy_gbps()
    print(f"device-to-device copy: {copy:.0f} GB/s (read + write)", flush=True)
    rows = []
    plan = [
        ("decode", t, cfg)
        for t in decode_tokens
        for cfg in [mt.decode_config(t)] + decode_cfgs
        if cfg.mode != "fma" or t <= args.fma_max_tokens
    ]
    plan += [
        ("prefill", t, cfg) for t in prefill_tokens for cfg in [mt.PrefillConfig()] + prefill_cfgs
    ]
    cases_by_t: dict[int, list[Case]] = {}
    for path, t, cfg in plan:
        cases = cases_by_t.setdefault(t, make_cases(sets, t, args.top_k, gen))
        name = config_name(cfg)
        default = cfg == (mt.decode_config(t) if path == "decode" else mt.PrefillConfig())
        if any(r["path"] == path and r["T"] == t and r["config"] == name for r in rows):
            continue  # a default config that is also in the sweep
        try:
            calls = (decode_calls if path == "decode" else prefill_calls)(cases, cfg)
            ms = time_ms(rotating(calls))
        except Exception as exc:  # noqa: BLE001  (a config that fails to compile: report it)
            print(
                f"{path} T={t} {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}",
                flush=True,
            )
            continue
        nbytes = sum(c.expert_bytes() for c in cases) / len(cases)
        gbps = nbytes / ms / 1e6
        rows.append(
            {
                "path": path,
                "T": t,
                "config": name,
                "default": default,
                "us": ms * 1e3,
                "expert_MB": nbytes / 1e6,
                "GBps": gbps,
                "pct_copy": 100 * gbps / copy,
            }
        )
        print(f"{path:7s} T={t:<5d} {name:44s} {ms * 1e3:9.1f} us {gbps:7.0f} GB/s", flush=True)

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nall rows: {args.out}; copy {copy:.0f} GB/s\n")
    print(
        f"{'path':7s} {'T':>5s} {'default us':>10s} {'best us':>8s} {'MB':>7s} {'GB/s':>6s} "
        f"{'%copy':>5s}  best config"
    )
    for path, t in dict.fromkeys((r["path"], r["T"]) for r in rows):
        group = [r for r in rows if r["path"] == path and r["T"] == t]
        best = min(group, key=lambda r: r["us"])
        dflt = next((r["us"] for r in group if r["default"]), float("nan"))
        print(
            f"{path:7s} {t:5d} {dflt:10.1f} {best['us']:8.1f} {best['expert_MB']:7.1f} "
            f"{best['GBps']:6.0f} {best['pct_copy']:5.0f}  {best['config']}"
        )


if __name__ == "__main__":
    main()
