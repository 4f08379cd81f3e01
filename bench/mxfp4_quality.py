"""What quantizing gpt-oss's dense layers at load (`--mxfp4-layers`, `--fp8-layers`) does to its
logits.

    python bench/mxfp4_quality.py --model tiny                               # CPU or GPU
    python bench/mxfp4_quality.py --model gpt-oss-20b --load-format dummy   # GPU

A variant names the layers in MXFP4 (`qkv`, `all`, ...) or, prefixed `fp8:`, in FP8 (`fp8:all`).
Each variant is a fresh engine with those layers quantized; its logits at every position of a
batch of random prompts are compared with those of `moe` (the checkpoint as shipped): max and
mean absolute difference, relative difference ||diff|| / ||ref||, mean KL(ref || variant), and
how often the greedy next token agrees. The `moe` row is a fresh `moe` engine: exactly zero
shows that the comparison itself is deterministic.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tinyoss import LLM  # noqa: E402
from tinyoss.engine.kv_cache import CacheLayout, allocate_kv_tensors  # noqa: E402
from tinyoss.kernels.attention import (  # noqa: E402
    AttentionMetadata,
    GroupMetadata,
    TorchAttention,
)

VARIANTS = ("moe", "qkv", "o", "lm_head", "all", "fp8:qkv", "fp8:o", "fp8:lm_head", "fp8:all")
BLOCK = 16  # tokens per KV block
CHUNK = 256  # logit rows compared at a time (bounds the temporaries)
NUM_REGULAR_TOKENS = 199998  # below harmony's special ids


def random_prompts(num: int, length: int, seed: int = 0) -> torch.Tensor:
    """[num, length] token ids, uniform over the regular (non-special) vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, NUM_REGULAR_TOKENS, (num, length), generator=gen)


@torch.inference_mode()
def prompt_logits(llm: LLM, prompts: torch.Tensor) -> torch.Tensor:
    """Float32 logits [P * L, V] at every position of every prompt, all in one forward pass
    through the engine's model (and its kernels), over a paged cache of our own."""
    model = llm.engine.executor.model
    config, device = model.config, llm.engine.executor.device
    dtype = model.model.embed_tokens.weight.dtype
    num, length = prompts.shape
    per_seq = -(-length // BLOCK)
    layout = CacheLayout.for_model(config)
    caches = allocate_kv_tensors(layout, num * per_seq, BLOCK, config, dtype, device)
    tables = [list(range(p * per_seq, (p + 1) * per_seq)) for p in range(num)]
    slots = torch.arange(num * per_seq * BLOCK).view(num, -1)[:, :length].reshape(-1)
    group = GroupMetadata(tables, [0] * num, slots.to(device))
    windows = [layout.windows[g] for g in layout.layer_group]
    attn = TorchAttention(caches, layout.layer_group, windows, config.head_dim**-0.5)
    attn.plan(AttentionMetadata([length] * num, [length] * num, [group] * len(layout.windows)))
    positions = torch.arange(length).repeat(num)
    hidden = model(prompts.reshape(-1).to(device), positions.to(device), attn)
    return model.compute_logits(hidden).float()


def compare(ref: torch.Tensor, logits: torch.Tensor) -> dict[str, float]:
    """Differences of `logits` from `ref` ([rows, V] float32), a chunk of rows at a time."""
    max_abs = abs_sum = sq_diff = sq_ref = kl = agree = 0.0
    for r in range(0, ref.shape[0], CHUNK):
        a, b = ref[r : r + CHUNK], logits[r : r + CHUNK]
        d = b - a
        max_abs = max(max_abs, d.abs().max().item())
        abs_sum += d.abs().sum().item()
        sq_diff += d.square().sum().item()
        sq_ref += a.square().sum().item()
        la, lb = a.log_softmax(-1), b.log_softmax(-1)
        kl += (la.exp() * (la - lb)).sum().item()
        agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
    rows = ref.shape[0]
    return {
        "max_abs": max_abs,
        "mean_abs": abs_sum / ref.numel(),
        "rel": (sq_diff / sq_ref) ** 0.5,
        "kl": kl / rows,
        "greedy_agreement": agree / rows,
    }


def quality(
    model: str,
    variants: tuple[str, ...] = VARIANTS,
    num_prompts: int = 8,
    length: int = 256,
    **engine_options: object,
) -> list[dict]:
    """One row per variant: its `compare` against `moe`, on `num_prompts` random prompts of
    `length` tokens. `engine_options` go to `LLM` (device, dtype, load_format, ...)."""
    prompts = random_prompts(num_prompts, length)
    options = {
        "kv_cache_tokens": 4 * length,  # the engine's own cache: unused, kept small
        "max_model_len": length + 1,
        "max_num_batched_tokens": num_prompts * length,
        "enforce_eager": True,
        "enable_prefix_caching": False,
        **engine_options,
    }
    ref = None
    rows = []
    for variant in ("moe", *variants):
        fp8 = variant.removeprefix("fp8:") if variant.startswith("fp8:") else "none"
        llm = LLM(model, mxfp4_layers="moe" if fp8 != "none" else variant, fp8_layers=fp8,
                  **options)
        logits = prompt_logits(llm, prompts)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        if ref is None:
            ref = logits
            continue
        rows.append({"layers": variant, **compare(ref, logits)})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'layers':<12} {'max|d|':>9} {'mean|d|':>9} {'rel':>9} {'KL':>9} {'greedy':>8}"]
    for r in rows:
        lines.append(
            f"{r['layers']:<12} {r['max_abs']:9.4f} {r['mean_abs']:9.5f} {r['rel']:9.5f} "
            f"{r['kl']:9.2e} {100 * r['greedy_agreement']:7.2f}%"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="tiny", help="tiny, a preset with --load-format dummy, ...")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of variants")
    p.add_argument("--json", default=None, help="write the table and settings to this file")
    args = p.parse_args()
    variants = tuple(v.strip() for v in args.variants.split(","))
    options = {"load_format": args.load_format, "device": args.device, "dtype": args.dtype}
    rows = quality(args.model, variants, args.prompts, args.length, **options)
    print(f"{args.model} | {args.prompts} prompts x {args.length} tokens | vs moe")
    print(table(rows))
    if args.json:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        record = {"model": args.model, "gpu": gpu, "prompts": args.prompts,
                  "length": args.length, **options, "rows": rows}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
