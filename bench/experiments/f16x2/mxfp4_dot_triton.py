"""MXFP4 weights times activations on the CUDA cores, two fp16 products per instruction.

An experiment, out of the product (bench/experiments/README.md says why); the GEMVs built on it
are in `gemv_f16x2`.

At batch 1 a GEMV over MXFP4 weights is bound by the instructions that unpack the 4-bit codes,
not by memory: one fp32 multiply-add per weight plus three integer ops to unpack it reached 46 us
for a gpt-oss-20b MoE layer on the H100, against 18 us at the bandwidth floor. Here each 32-bit
word of eight codes becomes four fp16x2 registers with two integer ops a pair of codes (the
three E2M1 exponent/mantissa bits land on the low fp16 exponent and top mantissa bits, which is
the value times 2**-14, exactly; the sign bit flips the matching activation instead), and one
`fma.rn.f16x2` does two products.

The activations go in as fp16 pairs, packed once per token by `pack_pairs` (or written packed
by the kernel that makes them): for the word of codes k = 8w..8w+7 of a 32-value scale group,
pair j of word w holds x[8w + j] (low half) and x[8w + j + 4] (high half), the order in which a
word holds its codes. Each group of 32 activations is scaled by a power of two so that its
largest magnitude lies in [2**14, 2**15): products and the sum of a group's 32 products stay in
fp16 range, and the scaling is exact (bf16 activations have fewer mantissa bits than fp16). The
group's exponent byte `ebits` (the biased fp32 exponent of its largest magnitude) undoes it
together with the weights' UE8M0 scale in one fp32 multiply (`group_scale`).

A group's 32 products are summed in fp16 (16 a lane, then the two lanes in fp32): relative
rounding ~2**-11 a step, inside the bf16 tolerance the kernels are held to. Group factors below
2**-126 flush to zero (a weight scale times an activation group under ~1e-38).

The Triton interpreter cannot run PTX: there `ASM=False` computes the same products exactly in
fp32 from the same packed operands, so CPU tests cover the packing and the scaling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The biased exponent of the largest |x| of a group fixes its scale 2**(EXP_BIAS - ebits), which
# puts that magnitude in [2**14, 2**15). (constexpr: kernels read them; the host uses .value)
EXP_BIAS = tl.constexpr(141)
# SwiGLU outputs of gpt-oss are below 56 in magnitude ((up + 1) <= 8, gate <= 7), so the kernel
# that writes them packs them with the fixed factor 2**9, i.e. ebits 132 (as for max |x| 32..64).
ACT_EBITS = tl.constexpr(132)

_WORD = """
shl.b32 m, {q}, {em};
and.b32 m, m, 0x0E000E00;
{sign}
fma.rn.f16x2 {acc}, m, t, {acc};"""


def _word_asm(q: str, pairs: list[str], acc: str) -> str:
    """PTX for one word of eight codes against its four activation pairs, into `acc`."""
    out = []
    for j, p in enumerate(pairs):
        em = 9 - 4 * j  # shift that puts code j's exponent/mantissa bits at fp16 bits 9..11
        block = _WORD.format(
            q=q,
            em=em,
            acc=acc,
            sign=(
                f"shl.b32 s, {q}, {12 - 4 * j};\nlop3.b32 t, {p}, s, 0x80008000, 0x78;"
                if j < 3
                else f"lop3.b32 t, {p}, {q}, 0x80008000, 0x78;"  # sign already at bits 15, 31
            ),
        )
        if em < 0:
            block = block.replace(f"shl.b32 m, {q}, {em};", f"shr.b32 m, {q}, {-em};")
        out.append(block)
    return "".join(out)


def _group_asm() -> str:
    """$0 = fp32 sum of 32 products: words $1..$4, activation pairs $5..$20 (four a word).
    lop3 0x78 is a ^ (b & c): the code's sign bit flips the activation's."""
    body = "".join(
        _word_asm(f"${1 + w}", [f"${5 + 4 * w + j}" for j in range(4)], f"a{w % 2}")
        for w in range(4)
    )
    return (
        "{\n.reg .b32 m, s, t, a0, a1;\n.reg .b16 lo, hi;\n.reg .f32 flo, fhi;\n"
        "mov.b32 a0, 0;\nmov.b32 a1, 0;\n" + body + "\nadd.rn.f16x2 a0, a0, a1;\n"
        "mov.b32 {lo, hi}, a0;\ncvt.f32.f16 flo, lo;\ncvt.f32.f16 fhi, hi;\n"
        "add.f32 $0, flo, fhi;\n}"
    )


GROUP_ASM = tl.constexpr(_group_asm())
GROUP_CONSTRAINTS = tl.constexpr("=f" + ",r" * 20)  # fp32 out; 4 words, 16 pairs in


@triton.jit
def _split4(t):
    """t [..., 4] -> t[..., 0], t[..., 1], t[..., 2], t[..., 3] (a thread holds all four)."""
    a, b = tl.split(t.reshape(t.shape[0], t.shape[1], 2, 2))
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def _code_fp16(q, i: tl.constexpr):
    """Code i of each word as the fp16 magnitude bits the PTX makes (value * 2**-14), in fp32."""
    bits = ((q >> (4 * i)) & 7) << 9
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _half(p, hi: tl.constexpr):
    """Low or high fp16 half of packed pairs, in fp32."""
    bits = (p >> 16) if hi else p
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _pair_emulated(q, p, j: tl.constexpr):
    """Pair j of the PTX word block, exactly in fp32: codes j and j + 4 times p's halves."""
    lo = tl.where(((q >> (4 * j + 3)) & 1) != 0, -1.0, 1.0) * _code_fp16(q, j)
    hi = tl.where(((q >> (4 * j + 19)) & 1) != 0, -1.0, 1.0) * _code_fp16(q, j + 4)
    return lo * _half(p, False) + hi * _half(p, True)


@triton.jit
def _word_emulated(q, p0, p1, p2, p3):
    return (_pair_emulated(q, p0, 0) + _pair_emulated(q, p1, 1) + _pair_emulated(q, p2, 2)
            + _pair_emulated(q, p3, 3))


@triton.jit
def group_dot(q, xp_ptr, g, g_ok, ASM: tl.constexpr):
    """sum_k W[row, k] x[k] * 2**(127 - ebits) over scale group g of each (row, group) of q.

    q [R, G, 4] int32: the group's four words per row; xp_ptr + g * 16: the group's sixteen
    activation pairs (g [G] where g_ok, broadcast over rows). Unscaled by the weights' UE8M0
    scale."""
    q0, q1, q2, q3 = _split4(q)
    b = xp_ptr + g[None, :] * 16
    m = g_ok[None, :]
    p0, p1 = tl.load(b, mask=m, other=0), tl.load(b + 1, mask=m, other=0)
    p2, p3 = tl.load(b + 2, mask=m, other=0), tl.load(b + 3, mask=m, other=0)
    p4, p5 = tl.load(b + 4, mask=m, other=0), tl.load(b + 5, mask=m, other=0)
    p6, p7 = tl.load(b + 6, mask=m, other=0), tl.load(b + 7, mask=m, other=0)
    p8, p9 = tl.load(b + 8, mask=m, other=0), tl.load(b + 9, mask=m, other=0)
    p10, p11 = tl.load(b + 10, mask=m, other=0), tl.load(b + 11, mask=m, other=0)
    p12, p13 = tl.load(b + 12, mask=m, other=0), tl.load(b + 13, mask=m, other=0)
    p14, p15 = tl.load(b + 14, mask=m, other=0), tl.load(b + 15, mask=m, other=0)
    if ASM:
        return tl.inline_asm_elementwise(
            GROUP_ASM, GROUP_CONSTRAINTS,
            [q0, q1, q2, q3, p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14,
             p15],
            dtype=tl.float32, is_pure=True, pack=1)
    return (_word_emulated(q0, p0, p1, p2, p3) + _word_emulated(q1, p4, p5, p6, p7)
            + _word_emulated(q2, p8, p9, p10, p11) + _word_emulated(q3, p12, p13, p14, p15))


@triton.jit
def load_groups(qp, sp, row_ok, k0, K, BLOCK_K: tl.constexpr):
    """The scale groups of one K step for rows of MXFP4 weights (qp: each row's int32 words,
    sp: its scale bytes): (g, g_ok, words q [R, G, 4], scales [R, G]). A row's four words of a
    group are one 16-byte load."""
    g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    g_ok = g < K // 32
    ok = row_ok[:, None] & g_ok[None, :]
    q = tl.load(qp[:, :, None] + (4 * g)[None, :, None] + tl.arange(0, 4)[None, None, :],
                mask=ok[:, :, None], other=0)
    return g, g_ok, q, tl.load(sp + g[None, :], mask=ok, other=0)


@triton.jit
def group_scale(s, ebits):
    """2**(s - 127) * 2**(ebits - 127) as fp32 (s: UE8M0 weight scale bytes; ebits: the
    activation group's exponent): undoes `group_dot`'s scaling. Below 2**-126 -> 0."""
    e = s.to(tl.int32) + ebits - 127
    return (tl.minimum(tl.maximum(e, 0), 254) << 23).to(tl.float32, bitcast=True)


@triton.jit
def pair_position(k):
    """Where activation k goes among the packed fp16 halves: pair j of word w holds
    k = 8w + j (low) and 8w + j + 4 (high), stored as halves 8w + 2j and 8w + 2j + 1."""
    r = k % 8
    return k - r + 2 * (r % 4) + r // 4


@triton.jit
def _pack_pairs_kernel(x_ptr, xp_ptr, xe_ptr, K, GROUPS: tl.constexpr):
    """One row: per group of 32, ebits of its largest |x|, then x * 2**(EXP_BIAS - ebits) as
    fp16 halves in pair order."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    ok = g < K // 32
    k = g[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + row * K + k, mask=ok[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    ebits = tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 14)
    factor = ((ebits * -1 + (EXP_BIAS + 127)) << 23).to(tl.float32, bitcast=True)
    xh = (x * factor[:, None]).to(tl.float16)
    tl.store(xp_ptr.to(tl.pointer_type(tl.float16)) + row * K + pair_position(k), xh,
             mask=ok[:, None])
    tl.store(xe_ptr + row * (K // 32) + g, ebits, mask=ok)


def pack_pairs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32) -> (pairs [M, K/2] int32, ebits [M, K/32] int32)."""
    m, k = x.shape
    if k % 32:
        raise ValueError(f"K must be a multiple of 32, got {k}")
    xp = torch.empty(m, k // 2, dtype=torch.int32, device=x.device)
    xe = torch.empty(m, k // 32, dtype=torch.int32, device=x.device)
    if m:
        groups = 16
        _pack_pairs_kernel[(m, triton.cdiv(k // 32, groups))](
            x.contiguous(), xp, xe, k, GROUPS=groups
        )
    return xp, xe


def use_asm(x: torch.Tensor) -> bool:
    """The PTX path on a GPU; the exact emulation in the interpreter."""
    return x.is_cuda
