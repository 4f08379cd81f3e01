"""L2 prefetch from inside a kernel: `prefetch_share` pulls bytes that a later kernel will read
into the GPU's L2 cache and does not wait for them (Hopper's bulk prefetch,
`cp.async.bulk.prefetch.L2`, issued by the copy engine of the SM).

A kernel that takes part has `pf0_ptr, pf0_bytes, pf1_ptr, pf1_bytes` arguments and a
`PREFETCH: tl.constexpr` (how many of the two regions are real), filled by
`launch.prefetch_options`. Kept apart from `launch` so that choosing kernels needs no Triton.
"""

import triton
import triton.language as tl

PIECE = tl.constexpr(4096)  # bytes a bulk request at least: few requests a program, each many cache lines


@triton.jit
def prefetch_share(ptr, nbytes, part, parts, LANES: tl.constexpr, KIND: tl.constexpr):
    """Prefetches share `part` of `parts` (equal, 16-byte aligned) of the `nbytes` at `ptr` into
    L2. KIND 1: one bulk request of PIECE bytes or more per lane, on up to LANES lanes (LANES =
    the program's threads, so no lane repeats another's request); KIND 2: a
    `prefetch.global.L2` per 128-byte line, LANES lines at a time; KIND 3: the same with
    evict_last. A tail under 16 bytes is left out. `ptr` must be 16-byte aligned."""
    share = tl.cdiv(tl.cdiv(nbytes, parts), 16) * 16
    start = part.to(tl.int64) * share
    end = tl.minimum(start + share, nbytes)
    if KIND == 1:
        piece = tl.maximum(tl.cdiv(tl.cdiv(share, LANES), 16) * 16, PIECE)
        off = start + tl.arange(0, LANES).to(tl.int64) * piece
        size = (tl.minimum(tl.maximum(end - off, 0), piece) // 16 * 16).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptr + off, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        for line in range(start, end, 128 * LANES):
            off = line + tl.arange(0, LANES).to(tl.int64) * 128
            ok = (off < end).to(tl.int32)
            if KIND == 2:
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; "
                    "mov.u32 $0, 0; }", "=r,l,r", [ptr + off, ok], dtype=tl.int32,
                    is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2::evict_last "
                    "[$1]; mov.u32 $0, 0; }", "=r,l,r", [ptr + off, ok], dtype=tl.int32,
                    is_pure=False, pack=1)


@triton.jit
def prefetch_regions(pf0_ptr, pf0_bytes, pf1_ptr, pf1_bytes, part, parts,
                     PREFETCH: tl.constexpr, LANES: tl.constexpr, KIND: tl.constexpr):
    """This program's share of the (up to) two regions a kernel was given to prefetch."""
    if PREFETCH >= 1:
        prefetch_share(pf0_ptr, pf0_bytes, part, parts, LANES, KIND)
    if PREFETCH >= 2:
        prefetch_share(pf1_ptr, pf1_bytes, part, parts, LANES, KIND)
