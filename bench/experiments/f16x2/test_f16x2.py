"""The f16x2 experiment: the packed-fp16 MXFP4 dot core (`mxfp4_dot_triton`: activation packing,
the group dot and its scale, the PTX itself), and the GEMVs built on it against tinyoss's
references. On CPU `group_dot` runs its exact fp32 emulation in the Triton interpreter; on a GPU
the PTX (fp16 products summed in fp16) is held to the emulation within fp16 rounding. The PTX
also compiles for sm_90 without a GPU (`--sass`).

    python -m pytest bench/experiments/f16x2
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

from bench.experiments.f16x2 import gemv_f16x2 as gf
from bench.experiments.f16x2 import mxfp4_dot_triton as md
from tinyoss.kernels.linear_mxfp4_torch import mxfp4_linear_torch
from tinyoss.kernels.moe_torch import ExpertWeights, moe_torch
from tinyoss.model import mxfp4

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32
ROOT = Path(__file__).resolve().parents[3]


def unpack_halves(xp: torch.Tensor) -> torch.Tensor:
    """[M, K/2] int32 pairs -> [M, K] fp32 halves, in storage order."""
    return xp.view(torch.int16).view(torch.float16).float()


def test_pack_pairs_order_and_scale():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 160, generator=gen) * torch.logspace(-3, 3, 160)).to(torch.bfloat16)
    x[1, 32:64] = 0  # an all-zero group
    xp, xe = md.pack_pairs(x.to(DEVICE))
    halves, xe = unpack_halves(xp.cpu()), xe.cpu()
    k = torch.arange(160)
    pos = k - k % 8 + 2 * (k % 8 % 4) + k % 8 // 4
    factor = torch.pow(2.0, (md.EXP_BIAS.value - xe).float()).repeat_interleave(32, dim=1)
    assert torch.equal(halves[:, pos], x.float() * factor)  # exact: bf16 fits in fp16
    group_max = halves.abs().view(3, 5, 32).amax(-1)
    live = group_max > 0
    assert ((group_max[live] >= 2**14) & (group_max[live] < 2**15)).all()
    assert xe[1, 1] == 14 and (halves[1, 32:64] == 0).all()


@triton.jit
def _dot_kernel(q_ptr, xp_ptr, s_ptr, xe_ptr, out_ptr, R: tl.constexpr, G: tl.constexpr,
                NG, ASM: tl.constexpr):
    rows = tl.arange(0, R)
    g = tl.arange(0, G)
    g_ok = g < NG
    words = (rows[:, None, None] * NG + g[None, :, None]) * 4 + tl.arange(0, 4)[None, None, :]
    q = tl.load(q_ptr.to(tl.pointer_type(tl.int32)) + words, mask=g_ok[None, :, None], other=0)
    sc = tl.load(s_ptr + rows[:, None] * NG + g[None, :], mask=g_ok[None, :], other=0)
    ebits = tl.load(xe_ptr + g, mask=g_ok, other=0)[None, :]
    d = md.group_dot(q, xp_ptr, g, g_ok, ASM) * md.group_scale(sc, ebits)
    tl.store(out_ptr + rows, tl.sum(d, 1))


def dot(w_blocks, w_scales, x, asm: bool) -> torch.Tensor:
    r, ng = w_scales.shape
    xp, xe = md.pack_pairs(x[None])
    out = torch.empty(r, dtype=torch.float32, device=x.device)
    _dot_kernel[(1,)](w_blocks, xp, w_scales, xe, out, R=r, G=triton.next_power_of_2(ng), NG=ng,
                      ASM=asm)
    return out


def case(seed: int, r: int = 16, groups: int = 5, x_scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(r, 32 * groups, generator=gen) * torch.logspace(-2, 1, r)[:, None]
    blocks, scales = mxfp4.quantize(w)
    blocks[:, 0, 0] = 0x88  # the quantizer never writes -0
    x = (torch.randn(32 * groups, generator=gen) * x_scale).to(torch.bfloat16)
    ref = mxfp4.dequantize(blocks, scales) @ x.float()
    return blocks.to(DEVICE), scales.to(DEVICE), x.to(DEVICE), ref


@pytest.mark.parametrize("x_scale", [1.0, 1e-3, 300.0])
def test_group_dot_matches_decoded_weights(x_scale):
    """Every E2M1 code and sign, weights over three decades, activations tiny to large."""
    blocks, scales, x, ref = case(int(x_scale * 7) + 1, x_scale=x_scale)
    assert set(torch.cat([blocks.cpu().flatten() & 15, blocks.cpu().flatten() >> 4]).tolist()) \
        == set(range(16))
    out = dot(blocks, scales, x, asm=False).cpu()
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
    if CUDA:  # the PTX sums each lane's 16 products in fp16
        asm = dot(blocks, scales, x, asm=True).cpu()
        assert ((asm - ref).norm() / ref.norm()).item() < 2e-3


def test_group_scale_flushes_underflow_to_zero():
    """A weight scale of 2**-127 times a group of ~2**-100 is below fp32's normal range."""
    blocks, scales, x, _ = case(3, groups=1)
    scales = torch.zeros_like(scales)
    out = dot(blocks, scales, (x.float() * 2**-100).to(torch.bfloat16), asm=False)
    assert (out == 0).all()


def test_act_ebits_covers_swiglu_range():
    """SwiGLU outputs (|y| < 56) packed with ACT_EBITS stay below fp16's largest finite value."""
    assert 56 * 2.0 ** (md.EXP_BIAS.value - md.ACT_EBITS.value) < 65504
    assert 2.0 ** (md.ACT_EBITS.value - 126) > 56  # ebits of a group whose max |y| is below 64


# -- The PTX itself, run by a small interpreter of the instructions it uses --------------------


def _run_ptx(asm: str, args: list[int]) -> float:
    """Executes `GROUP_ASM`'s instruction subset: 32-bit integer ops on ints, f16x2 math through
    numpy float16 (fma rounds once: the product and sum are exact in float64 here)."""
    import numpy as np

    regs: dict[str, object] = {f"${i + 1}": a & 0xFFFFFFFF for i, a in enumerate(args)}

    def val(tok: str) -> int:
        tok = tok.strip()
        return int(tok, 0) if tok[0].isdigit() else regs[tok]

    def halves(v: int) -> tuple[np.float16, np.float16]:
        return tuple(np.array([v & 0xFFFF, v >> 16], np.uint16).view(np.float16))

    def pack(lo: float, hi: float) -> int:
        u = np.array([lo, hi], np.float16).view(np.uint16)
        return int(u[0]) | int(u[1]) << 16

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith("//"):
            continue
        op, rest = line.split(None, 1)
        ops = [t.strip() for t in rest.split(",")]
        if op == "mov.b32" and ops[0].startswith("{"):  # {lo, hi} <- b32
            lo, hi = rest.split("}")[0].strip("{ ").split(",")
            v = val(rest.split("}")[1].strip(" ,"))
            regs[lo.strip()], regs[hi.strip()] = halves(v)
            continue
        d, srcs = ops[0], ops[1:]
        if op == "mov.b32":
            regs[d] = val(srcs[0])
        elif op == "shl.b32":
            regs[d] = (val(srcs[0]) << val(srcs[1])) & 0xFFFFFFFF
        elif op == "shr.b32":
            regs[d] = val(srcs[0]) >> val(srcs[1])
        elif op == "and.b32":
            regs[d] = val(srcs[0]) & val(srcs[1])
        elif op == "lop3.b32":
            a, b, c, lut = (val(s) for s in srcs)
            regs[d] = sum(((lut >> ((((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1)))
                           & 1) << i for i in range(32))
        elif op in ("fma.rn.f16x2", "add.rn.f16x2"):
            x = [np.float64(h) for h in halves(val(srcs[0]))]
            y = [np.float64(h) for h in halves(val(srcs[1]))]
            if op == "fma.rn.f16x2":
                z = [np.float64(h) for h in halves(val(srcs[2]))]
                regs[d] = pack(x[0] * y[0] + z[0], x[1] * y[1] + z[1])
            else:
                regs[d] = pack(x[0] + y[0], x[1] + y[1])
        elif op == "cvt.f32.f16":
            regs[d] = np.float32(regs[srcs[0]])
        elif op == "add.f32":
            regs[d] = np.float32(regs[srcs[0]]) + np.float32(regs[srcs[1]])
        else:
            raise AssertionError(f"instruction not modelled: {line}")
    return float(regs["$0"])


def test_group_asm_computes_the_group_dot():
    """The PTX string on random codes (every code and sign, -0 and the subnormal 0.5 included)
    and activation pairs scaled as `pack_pairs` scales them: equal to the exact dot product
    times 2**-14 within fp16 accumulation."""
    gen = torch.Generator().manual_seed(11)
    e2m1 = torch.tensor(mxfp4.FP4_VALUES)
    seen = set()
    for _ in range(60):
        codes = torch.randint(0, 16, (32,), generator=gen)
        seen |= set(codes.tolist())
        x = torch.randn(32, generator=gen).to(torch.bfloat16).float()
        x = x * 2.0 ** (14 - torch.floor(torch.log2(x.abs().max())))  # max |x| in [2**14, 2**15)
        words = [sum(int(codes[8 * w + i]) << (4 * i) for i in range(8)) for w in range(4)]
        bits = x.to(torch.float16).view(torch.int16).int() & 0xFFFF
        pairs = [int(bits[8 * w + j]) | int(bits[8 * w + j + 4]) << 16
                 for w in range(4) for j in range(4)]
        got = _run_ptx(md.GROUP_ASM.value, words + pairs)
        want = float((e2m1[codes].double() * x.double()).sum()) * 2.0**-14
        assert abs(got - want) <= 2e-3 * (e2m1[codes].abs().double() @ x.abs().double()) * 2**-14
    assert seen == set(range(16))


# -- The GEMVs against tinyoss's references -----------------------------------------------------


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "unwritten or NaN output"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Workspaces and outputs start as NaN (both fp16 halves of an int32 pair too)."""
    def full(shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else 0x7E007E00
        return torch.full(shape, fill, dtype=dtype, device=device)

    monkeypatch.setattr(gf, "_empty", full)


def experts(seed: int, e: int = 8, h: int = 96, i: int = 64) -> ExpertWeights:
    """Float experts quantized to MXFP4, biases of the same spread; H = 96 leaves K tiles of 64
    ragged."""
    gen = torch.Generator().manual_seed(seed)
    gb, gs = mxfp4.quantize(torch.randn(e, 2 * i, h, generator=gen) * 0.4)
    db, ds = mxfp4.quantize(torch.randn(e, h, i, generator=gen) * 0.2)
    return ExpertWeights(*(t.to(DEVICE) for t in (
        gb, gs, torch.randn(e, 2 * i, generator=gen), db, ds, torch.randn(e, h, generator=gen))))


@pytest.mark.parametrize("t", [1, 3])
def test_pair_gemv_f16x2_matches_moe_torch(t):
    """fp16 activations and SwiGLU outputs: 2**-11 relative rounding each."""
    w = experts(200 + t)
    gen = torch.Generator().manual_seed(t)
    x = (torch.randn(t, 96, generator=gen) * 2).to(DEVICE, DTYPE)
    ids = torch.stack([torch.randperm(8, generator=gen)[:4] for _ in range(t)]).to(DEVICE)
    wts = torch.softmax(torch.randn(t, 4, generator=gen), -1).to(DEVICE)
    cfg = gf.TILES if CUDA else gf.mt.GemvConfig(block_n1=16, block_n2=16, block_k=64)
    out = gf.moe_gemv_f16x2(x, wts, ids, w, cfg)
    assert rel(out, moe_torch(x, wts, ids, w)) < (1e-2 if CUDA else 2e-3)


@pytest.mark.parametrize("m", [1, 3])
def test_linear_gemv_f16x2_matches_reference(m):
    gen = torch.Generator().manual_seed(m)
    blocks, scales = mxfp4.quantize(torch.randn(40, 160, generator=gen) * 0.05)
    bias = torch.randn(40, generator=gen)
    x = 300 * torch.randn(m, 160, generator=gen)  # large activations keep full precision
    cfg = gf.lt.GemvConfig(block_m=4, block_n=16, block_k=128)
    ref = mxfp4_linear_torch(x, blocks, scales, bias)
    dev = [t.to(DEVICE) for t in (x, blocks, scales, bias)]
    if CUDA:
        dev[0], dev[3] = dev[0].to(torch.bfloat16), dev[3].to(torch.bfloat16)
    out = gf.linear_gemv_f16x2(*dev, config=cfg)
    assert out.shape == (m, 40) and rel(out.cpu(), ref) < (1e-2 if CUDA else 1e-3)


def test_kernels_compile_for_sm90():
    """Triton's ptxas takes the PTX and the kernels compile for the H100, no GPU needed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for real
    out = subprocess.run([sys.executable, "-m", "bench.experiments.f16x2.gemv_f16x2", "--sass"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pair_gemv_f16x2: " in out.stdout and "linear_mxfp4_f16x2: " in out.stdout
    assert "LOCAL:0" in out.stdout, out.stdout  # no spills
