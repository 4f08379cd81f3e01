"""Why a decode-attention block size parts the tiny model from the CPU reference (session 17).

Runs tiny greedy on the GPU (eager) with BLOCK_KV 64 and 128; every decode-attention call is
checked against the fp32 torch reference over the cache the kernel just wrote (q rotated by
apply_rope). Prints the worst relative error per (BLOCK_KV, layer window) and the calls above
3e-2, and the greedy tokens of each run against the CPU reference's.
"""
import random
import sys

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from tinyoss.kernels import attention_decode_triton as adt  # noqa: E402
from tinyoss.kernels.attention import attend  # noqa: E402
from tinyoss.model.rope import apply_rope  # noqa: E402

orig = adt.DecodeAttention.__call__
worst: dict = {}
bad: list = []


def checked(self, q, k, v, k_cache, v_cache, slots, positions, rope_cache, tables, ranges, sinks,
            scale, window=0, stored=False):
    qc = q.clone()
    out = orig(self, q, k, v, k_cache, v_cache, slots, positions, rope_cache, tables, ranges,
               sinks, scale, window, stored)
    page = k_cache.shape[1]
    rq = qc.float() if stored else apply_rope(qc.float(), k.float(), positions, rope_cache)[0]
    for i in range(q.shape[0]):
        if int(slots[i]) < 0:
            continue
        lo, hi = int(ranges[i, 0]), int(ranges[i, 1])
        t = torch.arange(lo, hi, device=q.device)
        rows = tables[i, t // page].long() * page + t % page
        keys = k_cache.flatten(0, 1)[rows].float()
        vals = v_cache.flatten(0, 1)[rows].float()
        ref = attend(rq[i:i + 1], keys, vals, sinks, torch.tensor([hi - 1]), t.cpu(), 0, scale)[0]
        got = out[i].view_as(ref).float()
        err = ((got - ref).norm() / ref.norm()).item()
        key = (adt.BLOCK_KV, window, q.shape[0])
        worst[key] = max(worst.get(key, 0.0), err)
        if err > 3e-2 and len(bad) < 40:
            bad.append((adt.BLOCK_KV, window, q.shape[0], i, lo, hi, round(err, 4)))
    return out


adt.DecodeAttention.__call__ = checked

from tinyoss import LLM, SamplingParams  # noqa: E402
from tinyoss.tools.make_checkpoint import ensure_tiny  # noqa: E402

tmp = str(ensure_tiny())
rng = random.Random(0)
prompts = [[rng.randrange(199998) for _ in range(n)] for n in (7, 150, 400)]
sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
cpu = LLM(tmp, device="cpu", dtype="float32", kv_cache_tokens=8192)
want = [o.outputs[0].token_ids for o in cpu.generate(prompts, sp, use_tqdm=False)]
for bkv in (64, 128):
    adt.BLOCK_KV = bkv
    for eager in (True, False):
        if not eager:
            adt.DecodeAttention.__call__ = orig
        gpu = LLM(tmp, device="cuda", max_num_seqs=8, kv_cache_tokens=8192, enforce_eager=eager)
        got = [o.outputs[0].token_ids for o in gpu.generate(prompts, sp, use_tqdm=False)]
        parts = [next((j for j, (a, b) in enumerate(zip(w, g)) if a != b), None)
                 for w, g in zip(want, got)]
        print(f"BLOCK_KV {bkv} eager {eager}: first differing token per prompt {parts}")
        del gpu
        adt.DecodeAttention.__call__ = checked
for key, err in sorted(worst.items()):
    print("worst rel err (BLOCK_KV, window, batch):", key, f"{err:.2e}")
print("calls over 3e-2:", bad)
