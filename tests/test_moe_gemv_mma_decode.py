"""The MXFP4 decode of the tensor-core MoE GEMVs (`moe_gemv_mma.cu`: `decode_word` and the
order `stage_x` and `stage_group` stage x in), its bit logic emulated on the host: every word's
8 E2M1 codes, decoded into fp16 pairs and multiplied by x in the staged order, give the dot
product of the codes' values and x. The kernels themselves run in test_moe_gemv_mma.py (GPU).
"""

from __future__ import annotations

import numpy as np

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def byte_perm(x: int, y: int, s: int) -> int:
    """CUDA's __byte_perm without the sign-replicate mode (the selectors here never set it)."""
    src = [(x >> 8 * i) & 0xFF for i in range(4)] + [(y >> 8 * i) & 0xFF for i in range(4)]
    return sum(src[(s >> 4 * n) & 7] << 8 * n for n in range(4))


def decode_half(q: int, even: bool) -> list[int]:
    """decode_half: codes (0, 2), (4, 6) (even) or (1, 3), (5, 7) as fp16 pairs times 2**-14."""
    if even:
        n = ((q << 4) & 0x80808080) | ((q << 1) & 0x0E0E0E0E)
    else:
        n = (q & 0x80808080) | ((q >> 3) & 0x0E0E0E0E)
    return [byte_perm(n, 0, 0x1404), byte_perm(n, 0, 0x3424)]


def fp16_pair(r: int) -> tuple[float, float]:
    lo, hi = np.array([r & 0xFFFF, r >> 16], dtype=np.uint16).view(np.float16)
    return float(lo), float(hi)


def staged(x: np.ndarray) -> list[tuple[float, float]]:
    """stage_x's four pairs of a word of x: (0, 2), (4, 6), (1, 3), (5, 7)."""
    return [(x[0], x[2]), (x[4], x[6]), (x[1], x[3]), (x[5], x[7])]


def test_decoded_pairs_times_staged_x_give_the_dot_product() -> None:
    rng = np.random.default_rng(0)
    words = [0, 0xFFFFFFFF, 0x88888888, 0x77777777] + [int(w) for w in
                                                       rng.integers(0, 2**32, 3000)]
    for q in words:
        codes = [(q >> 4 * j) & 0xF for j in range(8)]  # code 2i: byte i's lo nibble
        values = [-E2M1[c & 7] if c & 8 else E2M1[c & 7] for c in codes]
        x = rng.standard_normal(8)
        xs = staged(x)
        # block_mma: the even codes' two registers against xs[0], xs[1], the odd against xs[2:]
        regs = decode_half(q, True) + decode_half(q, False)
        got = 0.0
        for reg, (xa, xb) in zip(regs, xs):
            a, b = fp16_pair(reg)
            got += a * xa + b * xb
        want = float(np.dot(values, x))
        assert abs(got * 2.0**14 - want) <= 1e-9 * (1 + abs(want)), hex(q)
