"""Times the Triton decode attention (tinyoss.kernels.attention_decode_triton) as a decode step
runs it: 24 layers of gpt-oss shapes (64 query and 8 KV heads of 64), sliding-window (128) and
full layers alternating, in one CUDA graph, on one GPU. Prints microseconds a layer and the
KV bytes a layer reads over that time.

    python bench/attention_decode.py --batch 1,8 --context 1024,8192,32768 \
        --configs 128/64/512,128/16/512,2048/64/99999

Each config is MIN_SPLIT/MAX_SPLITS/TARGET_PROGRAMS of the module (keys a program at least,
splits a sequence at most, programs a launch aimed at); 2048/64/99999 is how a workspace for
131,072 tokens split every sequence before each sequence's splits came from its own length.
`--compare FILE ...` times other copies of the module beside it in the same run, e.g. one from
`git show REV:tinyoss/kernels/attention_decode_triton.py > FILE`.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.dense_gemv import graph_time  # noqa: E402
from tinyoss.kernels import attention_decode_triton as adt  # noqa: E402

HQ, HK, D, PAGE, LAYERS, WINDOW = 64, 8, 64, 16, 24, 128


def module_from(path: Path) -> ModuleType:
    """A copy of the decode-attention module, loaded from its own file (Triton reads a kernel's
    source from there)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def layer_us(mod: ModuleType, batch: int, context: int, max_len: int) -> tuple[float, float]:
    """(us a layer, KV GB/s) of LAYERS decode-attention calls in one graph, each on its own
    cache, every sequence `context` keys long with its blocks scattered over the cache."""
    dev = torch.device("cuda")
    blocks = batch * -(-context // PAGE) + 1
    caches = [(torch.randn(blocks, PAGE, HK, D, device=dev, dtype=torch.bfloat16),
               torch.randn(blocks, PAGE, HK, D, device=dev, dtype=torch.bfloat16))
              for _ in range(LAYERS)]
    tables = torch.randperm(blocks - 1, device=dev)[:batch * -(-context // PAGE)]
    tables = tables.view(batch, -1).int()
    ends = torch.full((batch,), context, dtype=torch.int32, device=dev)
    full = torch.stack([torch.zeros_like(ends), ends], 1)
    sliding = torch.stack([(ends - WINDOW).clamp(min=0), ends], 1)
    slots = (tables[:, (context - 1) // PAGE].long() * PAGE + (context - 1) % PAGE)
    positions = ends.long() - 1
    rope = torch.randn(max_len, D, device=dev)
    qkv = torch.randn(batch, (HQ + 2 * HK) * D, device=dev, dtype=torch.bfloat16)
    q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
    q, k, v = q.view(batch, HQ, D), k.view(batch, HK, D), v.view(batch, HK, D)
    sinks = torch.randn(HQ, device=dev)
    attention = mod.DecodeAttention(batch, max_len, HQ, HK, D, dev)

    def step() -> None:
        for i, (kc, vc) in enumerate(caches):
            window = WINDOW if i % 2 == 0 else 0
            attention(q, k, v, kc, vc, slots, positions, rope, tables,
                      sliding if window else full, sinks, D ** -0.5, window)

    us = graph_time(step, LAYERS)
    keys = (min(context, WINDOW) + context) / 2  # a layer's keys, on average
    return us, batch * keys * HK * D * 2 * 2 / us / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,8")
    p.add_argument("--context", default="1024,8192,32768")
    p.add_argument("--max-len", type=int, default=131072, help="the workspace's max_len")
    p.add_argument("--configs", default=f"{adt.MIN_SPLIT}/{adt.MAX_SPLITS}/{adt.TARGET_PROGRAMS}",
                   help="min_split/max_splits/target_programs, comma-separated")
    p.add_argument("--compare", type=Path, nargs="+", default=[],
                   help="also time these copies of the module")
    args = p.parse_args()
    modules = [("", adt)] + [(f"{path.stem} ", module_from(path)) for path in args.compare]
    print(f"{torch.cuda.get_device_name()}; max_len {args.max_len}; us a layer (KV GB/s)")
    for batch in map(int, args.batch.split(",")):
        for context in map(int, args.context.split(",")):
            row = [f"batch {batch:3d} context {context:6d}"]
            for config in args.configs.split(","):
                for name, mod in modules:
                    mod.MIN_SPLIT, mod.MAX_SPLITS, mod.TARGET_PROGRAMS = map(int,
                                                                             config.split("/"))
                    us, gbs = layer_us(mod, batch, context, args.max_len)
                    row.append(f"{name}{config}: {us:6.2f} us ({gbs:5.0f})")
            print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
