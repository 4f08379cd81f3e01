// The MoE GEMVs on Hopper's tensor cores: what moe_gemv_gluon computes (rows of one expert
// against one pair's activations; bias, clamped SwiGLU or routing weight fused), a pair a
// program for 1 to 8 tokens a step, and grouped by expert (up to 8 pairs of one expert a
// program, one a column of the MMA) for 9 to 64; the pair kernel also serves dense MXFP4 layers
// (one "pair" a row of x), and dense_gemv_mma bf16 / FP8 layers (below); dense_gemv_stream and
// fp8_gemv_stream are the CUDA-core kernels here, bf16 layers at 1-2 rows of x and FP8 ones at
// one. See moe_gemv_mma.py for when each runs and how the library is built.
//
// A warp takes 16 weight rows. In an mma.sync.m16n8k16, thread (g = lane / 4, t = lane % 4)
// holds rows g and g + 8 at four k positions; a dot product does not care which physical k a
// position stands for as long as x uses the same, so thread t loads word t (8 codes) of a
// 32-code scale block for its two rows, and one block is two MMAs: codes (0, 2), (4, 6), then
// (1, 3), (5, 7) as fp16 pairs in the pair kernels ((0, 4), (1, 5), then (2, 6), (3, 7) in the
// grouped ones: block_mma). Decoding is a bit copy: sign to bit 15, exponent and mantissa to
// bits 11..9, which is the code's value times 2**-14 (E2M1 subnormals land on fp16 subnormals,
// which the tensor cores take). The block's E8M0 scale multiplies the MMA's fp32 result, so an MMA
// never mixes blocks. x is staged once a program in shared memory as fp16
// pairs in that order: bf16 x times a power of two that puts its largest magnitude just under
// 2**15 (exact; values below 2**-24 of the largest round), fp32 x (the SwiGLU output) as fp16
// hi + lo, two more MMAs, ~22 bits. In the pair kernels every column of B holds the same x, so
// each column of D is the product; in the grouped ones column j holds pair j's x. pair_gemv_mma
// and group_gemv_mma load those words straight into registers; pair_gemv_stream (gate_up above
// 8 pairs) and group_gemv_stream (down above 16 tokens) first copy the rows into shared memory
// with cp.async and hand each thread the same words with ldmatrix.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int KMAX = 2880;  // K the launch takes at most (gpt-oss's hidden and intermediate)

// Codes (0, 2) and (4, 6) of q (EVEN; code 2i is the low nibble of byte i) or (1, 3) and (5, 7)
// as two fp16 pairs times 2**-14. A nibble moved to the top of its byte has its sign at bit 7
// and its exponent and mantissa, shifted to bits 3..1, where an fp16's high byte holds them;
// one byte permute then takes two of the four bytes. A word in 11 instructions, where building
// pairs (J, J + 4) one at a time took 16 (bench/results/2026-11-28_session34.md).
template <bool EVEN>
__device__ __forceinline__ void decode_half(uint32_t q, uint32_t& r0, uint32_t& r1) {
  const uint32_t n = EVEN ? ((q << 4) & 0x80808080u) | ((q << 1) & 0x0E0E0E0Eu)
                          : (q & 0x80808080u) | ((q >> 3) & 0x0E0E0E0Eu);
  r0 = __byte_perm(n, 0u, 0x1404);
  r1 = __byte_perm(n, 0u, 0x3424);
}

// Codes J (low half) and J + 4 (high half) of q as an fp16 pair times 2**-14, one pair at a
// time: the grouped kernels' decode (block_mma's STRIDED).
template <int J>
__device__ __forceinline__ uint32_t pair16(uint32_t q) {
  constexpr int A = 9 - 4 * J, B = 12 - 4 * J;
  const uint32_t em = A >= 0 ? (q << A) : (q >> -A);
  return (em & 0x0E000E00u) | ((q << B) & 0x80008000u);
}

__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// the low two e4m3 bytes of q as two fp16, one cvt (exact: e4m3 fits fp16)
__device__ __forceinline__ __half2_raw fp8x2_raw(uint32_t q) {
  return __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(q & 0xFFFFu), __NV_E4M3);
}

// ... as an fp16 pair's bits (an MMA operand)
__device__ __forceinline__ uint32_t fp8x2(uint32_t q) {
  const __half2_raw h = fp8x2_raw(q);
  return (uint32_t)h.x | ((uint32_t)h.y << 16);
}

// One scale block of rows g and g + 8: their words qa, qb (8 codes each) against x's fp16 pairs
// xv (and the fp32 remainder xl when SPLIT), summed into d (rows g, g + 8 x columns 2t, 2t + 1).
// The pair kernels take codes (0, 2), (4, 6), then (1, 3), (5, 7) (decode_half); the grouped
// ones (STRIDED) (0, 4), (1, 5), then (2, 6), (3, 7) (pair16): with decode_half their gate_up
// needs 62 registers where it had 56 (2 programs an SM, not 3), and batch 16 ran 2% slower,
// batch 64 0.7-3% (bench/results/2026-11-28_session34.md). x is staged in the same order.
template <bool SPLIT, bool STRIDED = false>
__device__ __forceinline__ void block_mma(float (&d)[4], uint32_t qa, uint32_t qb, uint4 xv,
                                          uint4 xl) {
  if constexpr (STRIDED) {
    const uint32_t a0 = pair16<0>(qa), a1 = pair16<0>(qb), a2 = pair16<1>(qa),
                   a3 = pair16<1>(qb);
    const uint32_t c0 = pair16<2>(qa), c1 = pair16<2>(qb), c2 = pair16<3>(qa),
                   c3 = pair16<3>(qb);
    mma(d, a0, a1, a2, a3, xv.x, xv.y);
    mma(d, c0, c1, c2, c3, xv.z, xv.w);
    if (SPLIT) {
      mma(d, a0, a1, a2, a3, xl.x, xl.y);
      mma(d, c0, c1, c2, c3, xl.z, xl.w);
    }
    return;
  }
  uint32_t a0, a1, b0, b1;
  decode_half<true>(qa, a0, a1);  // the even codes first, then the odd: fewer registers live
  decode_half<true>(qb, b0, b1);
  mma(d, a0, b0, a1, b1, xv.x, xv.y);  // x (0, 2), (4, 6)
  if (SPLIT) mma(d, a0, b0, a1, b1, xl.x, xl.y);
  decode_half<false>(qa, a0, a1);
  decode_half<false>(qb, b0, b1);
  mma(d, a0, b0, a1, b1, xv.z, xv.w);  // x (1, 3), (5, 7)
  if (SPLIT) mma(d, a0, b0, a1, b1, xl.z, xl.w);
}

__device__ __forceinline__ uint32_t pack(__half lo, __half hi) {
  return (uint32_t)__half_as_ushort(lo) | ((uint32_t)__half_as_ushort(hi) << 16);
}

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

// The power of two that puts a largest magnitude m just under 2**15 (1 for m = 0): x times it
// fits fp16 with the most bits (values below 2**-24 of m round).
__device__ __forceinline__ float stage_scale(float m) {
  int ex = 0;
  frexpf(m, &ex);  // m < 2**ex
  return m > 0.f ? ldexpf(1.f, 15 - max(ex, -100)) : 1.f;
}

// x [K] staged in shared memory as fp16 pairs in block_mma's order by every thread of the
// program (NWARPS warps, XWORDS words of 8 values each): bf16 x times the power of two `pre`
// (returned) that puts its largest magnitude just under 2**15, fp32 x (SPLIT) as hi + lo.
template <bool SPLIT, int XWORDS, int NWARPS, typename XT>
__device__ __forceinline__ float stage_x(const XT* __restrict__ xr, int K, uint4* xs, uint4* xl,
                                         float* xmax) {
  const int lane = threadIdx.x & 31;
  float v[XWORDS][8];  // x in registers first (one read), its largest magnitude, then staged
#pragma unroll
  for (int i = 0; i < XWORDS; ++i) {
    const int w = threadIdx.x + i * blockDim.x;
#pragma unroll
    for (int j = 0; j < 8; ++j) v[i][j] = w < K / 8 ? to_f(xr[8 * w + j]) : 0.f;
  }
  float pre = 1.f;
  if (!SPLIT) {
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < XWORDS; ++i) {
#pragma unroll
      for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(v[i][j]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) xmax[threadIdx.x >> 5] = m;
    __syncthreads();
    m = 0.f;
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) m = fmaxf(m, xmax[w]);
    pre = stage_scale(m);
  }
#pragma unroll
  for (int i = 0; i < XWORDS; ++i) {
    const int w = threadIdx.x + i * blockDim.x;
    if (w < K / 8) {
      __half h[8], l[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        h[j] = __float2half_rn(v[i][j] * pre);
        l[j] = __float2half_rn(v[i][j] * pre - __half2float(h[j]));
      }
      xs[w] = make_uint4(pack(h[0], h[2]), pack(h[4], h[6]), pack(h[1], h[3]), pack(h[5], h[7]));
      if (SPLIT) {
        xl[w] = make_uint4(pack(l[0], l[2]), pack(l[4], l[6]), pack(l[1], l[3]),
                           pack(l[5], l[7]));
      }
    }
  }
  return pre;
}

// Rows ra and rb of a pair's output from their sums: the decode's 2**-14 and x's staging factor
// undone, the bias added, then the clamped SwiGLU of the (gate ra, up rb) pair or each row times
// the routing weight.
__device__ __forceinline__ void put(float* p, float v) { *p = v; }
__device__ __forceinline__ void put(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }

template <bool SWIGLU, typename OT>
__device__ __forceinline__ void store(float acc_a, float acc_b, float pre, int ra, int rb,
                                      int pair, long e, const __nv_bfloat16* __restrict__ bias,
                                      const float* __restrict__ wts, OT* __restrict__ out,
                                      int N, float alpha, float limit) {
  const float undo = 16384.f / pre;
  const float ha = acc_a * undo + (bias ? __bfloat162float(bias[e * N + ra]) : 0.f);
  const float hb = acc_b * undo + (bias ? __bfloat162float(bias[e * N + rb]) : 0.f);
  if (SWIGLU) {
    const float gate = fminf(ha, limit);
    const float up = fminf(fmaxf(hb, -limit), limit);
    put(out + (long)pair * (N / 2) + ra / 2, (up + 1.f) * gate / (1.f + expf(-alpha * gate)));
  } else {
    const float wt = wts ? wts[pair] : 1.f;
    put(out + (long)pair * N + ra, ha * wt);
    put(out + (long)pair * N + rb, hb * wt);
  }
}

// cp.async (16 bytes, global to shared) and ldmatrix, for the streamed kernels. HINT: 0 none,
// 1 the L2 fetching the 128 bytes around a miss from DRAM, 2 the 256 bytes.
template <int HINT = 0>
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
  if (HINT == 1) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(d), "l"(src)
                 : "memory");
  } else if (HINT == 2) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(d), "l"(src)
                 : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
  }
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"((uint32_t)__cvta_generic_to_shared(p)));
}

// An mbarrier and the bulk copies (cp.async.bulk) that complete on it, for down_resident.
__device__ __forceinline__ uint32_t saddr(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(uint64_t* b) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(saddr(b)));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(b)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  uint32_t ok;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
        "selp.u32 %0, 1, 0, p; }"
        : "=r"(ok)
        : "r"(saddr(b)), "r"(parity)
        : "memory");
  } while (!ok);
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* b) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(saddr(dst)),
      "l"(src), "r"(bytes), "r"(saddr(b))
      : "memory");
}

// The KSPLIT warps of a 16-row tile (each a part of K) summing rows g and g + 8 into part 0's
// through red (shared memory no longer read, 16 * TILES * (KSPLIT - 1) floats); every thread of
// the program calls it. False for the other parts, which are done.
template <int TILES, int KSPLIT>
__device__ __forceinline__ bool sum_parts(float* red, int part, int tile, int g, int t,
                                          float& acc_a, float& acc_b) {
  if (KSPLIT == 1) return true;
  __syncthreads();
  if (part > 0 && t == 0) {
    red[((part - 1) * TILES + tile) * 16 + g] = acc_a;
    red[((part - 1) * TILES + tile) * 16 + 8 + g] = acc_b;
  }
  __syncthreads();
  if (part > 0) return false;
#pragma unroll
  for (int p = 1; p < KSPLIT; ++p) {
    acc_a += red[((p - 1) * TILES + tile) * 16 + g];
    acc_b += red[((p - 1) * TILES + tile) * 16 + 8 + g];
  }
  return true;
}

// SWIGLU: gate_up (x bf16, out [pairs, N / 2] after the clamped SwiGLU); else down (x fp32,
// out [pairs, N] times the routing weight) or a dense layer (x bf16, ids, bias and wts null:
// expert 0, no bias, weight 1). U: scale blocks a load group; KSPLIT: warps that
// share a row tile, each a contiguous part of K, summed through shared memory at the end;
// TILES: 16-row tiles a program; TAIL: K's blocks need not divide into KSPLIT parts of whole
// load groups (a tensor-parallel rank's down: 45, 23 or 12 blocks), the last group is cut.
// OT: the output's type (bf16 for a dense layer).
template <bool SWIGLU, int U, int KSPLIT, int TILES, typename XT, bool TAIL = false,
          typename OT = float, bool TRIG = false>
__global__ void __launch_bounds__(TILES * KSPLIT * 32)
    pair_gemv_mma(const XT* __restrict__ x, int x_div, const int* __restrict__ ids,
                  const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                  const __nv_bfloat16* __restrict__ bias, const float* __restrict__ wts,
                  OT* __restrict__ out, int N, int K, long stride_qe, int stride_q,
                  long stride_se, float alpha, float limit) {
  if (TRIG) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  constexpr bool SPLIT = std::is_same<XT, float>::value;  // fp32 x: hi + lo
  constexpr int ROWS = 16 * TILES, THREADS = TILES * KSPLIT * 32;
  constexpr int XWORDS = (KMAX / 8 + THREADS - 1) / THREADS;
  extern __shared__ uint4 smem[];
  __shared__ float xmax[TILES * KSPLIT];
  const int nblk = K / 32, per = TAIL ? (nblk + KSPLIT - 1) / KSPLIT : nblk / KSPLIT;
  uint4* xs = smem;                                           // [K / 8] fp16 pairs (hi)
  uint4* xl = smem + K / 8;                                   // [K / 8] (lo)
  uint8_t* ss = (uint8_t*)(smem + (SPLIT ? 2 : 1) * (K / 8));  // [ROWS][nblk] scales
  const int pair = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) % TILES;
  const int part = (threadIdx.x >> 5) / TILES, first = part * per;
  const int cnt = TAIL ? max(0, min(per, nblk - first)) : per;  // this part's blocks
  const int g = lane >> 2, t = lane & 3;
  const long e = ids ? ids[pair] : 0;
  if (e < 0) return;  // a pair another rank holds (expert parallelism): the combine skips it
  const int row0 = blockIdx.y * ROWS;
  // SwiGLU: row g is the gate and row g + 8 the up row of one output (2j and 2j + 1 in the
  // checkpoint); else 16 consecutive rows
  const int la = SWIGLU ? 2 * (warp * 8 + g) : warp * 16 + g;
  const int lb = SWIGLU ? la + 1 : la + 8;
  const uint32_t* qa = reinterpret_cast<const uint32_t*>(q + e * stride_qe +
                                                         (long)(row0 + la) * stride_q) + t + 4 * first;
  const uint32_t* qb = reinterpret_cast<const uint32_t*>(q + e * stride_qe +
                                                         (long)(row0 + lb) * stride_q) + t + 4 * first;
  uint32_t wa[U], wb[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {  // the first group's weights are on their way while x stages
    if (!TAIL || u < cnt) {
      wa[u] = __ldg(qa + 4 * u);
      wb[u] = __ldg(qb + 4 * u);
    }
  }
  const uint4* sg = reinterpret_cast<const uint4*>(s + e * stride_se + (long)row0 * nblk);
  for (int i = threadIdx.x; i < ROWS * nblk / 16; i += blockDim.x) {
    reinterpret_cast<uint4*>(ss)[i] = sg[i];
  }
  const float pre = stage_x<SPLIT, XWORDS, TILES * KSPLIT>(x + (long)(pair / x_div) * K, K, xs,
                                                            xl, xmax);
  __syncthreads();
  float acc_a = 0.f, acc_b = 0.f;
  for (int b0 = 0; b0 < cnt; b0 += U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (TAIL && b0 + u >= cnt) break;
      const int b = first + b0 + u;
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      block_mma<SPLIT>(d, wa[u], wb[u], xs[4 * b + t], SPLIT ? xl[4 * b + t] : uint4{});
      acc_a = fmaf(d[0], __uint_as_float((uint32_t)ss[la * nblk + b] << 23), acc_a);
      acc_b = fmaf(d[2], __uint_as_float((uint32_t)ss[lb * nblk + b] << 23), acc_b);
    }
    if (b0 + U < cnt) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (!TAIL || b0 + U + u < cnt) {
          wa[u] = __ldg(qa + 4 * (b0 + U + u));
          wb[u] = __ldg(qb + 4 * (b0 + U + u));
        }
      }
    }
  }
  // x is read no more: its shared memory takes the other parts' sums
  if (!sum_parts<TILES, KSPLIT>(reinterpret_cast<float*>(smem), part, warp, g, t, acc_a, acc_b)) {
    return;
  }
  if (t == 0) {
    store<SWIGLU>(acc_a, acc_b, pre, row0 + la, row0 + lb, pair, e, bias, wts, out, N, alpha,
                  limit);
  }
}

template <bool SWIGLU, int U, int KSPLIT, int TILES, typename XT, typename OT = float,
          bool TRIG = false>
int launch(const void* x, int x_div, const int* ids, int pairs, const uint8_t* q,
           const uint8_t* s, const void* bias, const float* wts, OT* out, int N, int K,
           long stride_qe, int stride_q, long stride_se, float alpha, float limit,
           cudaStream_t stream) {
  constexpr int ROWS = 16 * TILES;
  if (N % ROWS || K % 32 || K > KMAX) return (int)cudaErrorInvalidValue;
  const int smem = (std::is_same<XT, float>::value ? 2 : 1) * (K / 8) * 16 + ROWS * (K / 32);
  dim3 grid(pairs, N / ROWS);
  auto kernel = K % (32 * U * KSPLIT)
                    ? pair_gemv_mma<SWIGLU, U, KSPLIT, TILES, XT, true, OT, TRIG>
                    : pair_gemv_mma<SWIGLU, U, KSPLIT, TILES, XT, false, OT, TRIG>;
  kernel<<<grid, TILES * KSPLIT * 32, smem, stream>>>(
      static_cast<const XT*>(x), x_div, ids, q, s, static_cast<const __nv_bfloat16*>(bias), wts,
      out, N, K, stride_qe, stride_q, stride_se, alpha, limit);
  return (int)cudaGetLastError();
}

// The streamed kernels' weight path: a warp takes 16 rows over the whole K and copies them into
// its shared-memory ring with cp.async, C scale blocks (C * 16 bytes a row, contiguous, 16 bytes
// a copy) a stage, S stages in flight, rows laid out in MMA row order with C + 1 units a row
// (odd: ldmatrix reads 8 rows without bank conflicts); ldmatrix hands each thread the words
// block_mma takes. issue_stage copies stage st of the rows at src into slot st % S.
template <bool SWIGLU, int C, int S, int HINT = 0>
__device__ __forceinline__ void issue_stage(uint8_t* ring, const uint8_t* __restrict__ src,
                                            int stride_q, int st) {
  constexpr int RU = C + 1;  // 16-byte units a row of a stage
  uint8_t* dst = ring + (st % S) * 16 * RU * 16;
#pragma unroll
  for (int i = threadIdx.x & 31; i < 16 * C; i += 32) {
    const int r = i / C, u = i % C;
    const int m = SWIGLU ? (r & 1) * 8 + (r >> 1) : r;  // checkpoint row r -> MMA row m
    cp_async16<HINT>(dst + (m * RU + u) * 16, src + (long)r * stride_q + (st * C + u) * 16);
  }
}

// The ring's nst stages against x's fp16 pairs (xs, and xl when SPLIT: a column's words in
// block_mma's order), after the first S - 1 stages were issued: sums of the warp's rows (g, g + 8
// in MMA order) times columns (2t, 2t + 1) into acc, each block times its rows' scales (ss, the
// tile's [16][nblk] in checkpoint row order: ca, cb the rows g and g + 8 stand for).
template <bool SWIGLU, int C, int S, int HINT = 0, bool STRIDED = false>
__device__ __forceinline__ void stream_rows(uint8_t* ring, const uint8_t* __restrict__ src,
                                            int stride_q, int nst, const uint4* xs,
                                            const uint4* xl, const uint8_t* ss, int nblk,
                                            int ca, int cb, float (&acc)[4]) {
  constexpr bool SPLIT = !SWIGLU;
  constexpr int RU = C + 1;
  const int lane = threadIdx.x & 31, t = lane & 3;
  // ldmatrix: lanes 0-7 MMA rows 0-7 of block b, 8-15 rows 8-15, 16-31 the same at b + 1
  const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8, lblk = lane >> 4;
  for (int st = 0; st < nst; ++st) {
    cp_wait<S - 2>();
    __syncwarp();  // stage st landed for every lane; every lane is done with stage st - 1's slot
    if (st + S - 1 < nst) issue_stage<SWIGLU, C, S, HINT>(ring, src, stride_q, st + S - 1);
    cp_commit();
    const uint8_t* w = ring + (st % S) * 16 * RU * 16 + (lrow * RU + lblk) * 16;
#pragma unroll
    for (int j = 0; j < C / 2; ++j) {
      uint32_t r[4];
      ldsm4(r, w + 32 * j);
      const int b = st * C + 2 * j;
      float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
      block_mma<SPLIT, STRIDED>(d0, r[0], r[1], xs[4 * b + t], SPLIT ? xl[4 * b + t] : uint4{});
      block_mma<SPLIT, STRIDED>(d1, r[2], r[3], xs[4 * b + 4 + t],
                                SPLIT ? xl[4 * b + 4 + t] : uint4{});
      const float sa0 = __uint_as_float((uint32_t)ss[ca * nblk + b] << 23);
      const float sb0 = __uint_as_float((uint32_t)ss[cb * nblk + b] << 23);
      const float sa1 = __uint_as_float((uint32_t)ss[ca * nblk + b + 1] << 23);
      const float sb1 = __uint_as_float((uint32_t)ss[cb * nblk + b + 1] << 23);
      acc[0] = fmaf(d1[0], sa1, fmaf(d0[0], sa0, acc[0]));
      acc[1] = fmaf(d1[1], sa1, fmaf(d0[1], sa0, acc[1]));
      acc[2] = fmaf(d1[2], sb1, fmaf(d0[2], sb0, acc[2]));
      acc[3] = fmaf(d1[3], sb1, fmaf(d0[3], sb0, acc[3]));
    }
  }
}

// The streamed pair kernel, for gate_up at more than 8 pairs and at one token (there with the
// L2 fetching 256 bytes a miss: HINT 2), and down at 8 and from 20 pairs: W warps a program share
// the pair's x, each streams its 16 rows; the tile's scales come with the first stage. TRIG
// (one token's gate_up): the next kernel, down_resident, may launch as soon as every program of
// this one has started, and load its weights while this one runs.
template <bool SWIGLU, int C, int S, int W, typename XT, int HINT = 0, bool TRIG = false>
__global__ void __launch_bounds__(W * 32)
    pair_gemv_stream(const XT* __restrict__ x, int x_div, const int* __restrict__ ids,
                     const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                     const __nv_bfloat16* __restrict__ bias, const float* __restrict__ wts,
                     float* __restrict__ out, int N, int K, long stride_qe, int stride_q,
                     long stride_se, float alpha, float limit) {
  if (TRIG) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  constexpr bool SPLIT = !SWIGLU;
  constexpr int XWORDS = (KMAX / 8 + W * 32 - 1) / (W * 32);
  constexpr int STAGE = 16 * (C + 1) * 16;  // bytes a stage
  extern __shared__ uint4 smem[];
  __shared__ float xmax[W];
  const int nblk = K / 32, nst = nblk / C;
  uint4* xs = smem;
  uint4* xl = smem + K / 8;
  uint8_t* base = (uint8_t*)(smem + (SPLIT ? 2 : 1) * (K / 8));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  uint8_t* ring = base + warp * (S * STAGE + 16 * nblk);  // this warp's stages, then its scales
  uint8_t* ss = ring + S * STAGE;
  const int pair = blockIdx.x;
  const long e = ids[pair];
  if (e < 0) return;  // a pair another rank holds (expert parallelism): the combine skips it
  const int row0 = (blockIdx.y * W + warp) * 16;
  const uint8_t* src = q + e * stride_qe + (long)row0 * stride_q;
  const uint8_t* sg = s + e * stride_se + (long)row0 * nblk;
  for (int i = lane; i < nblk; i += 32) cp_async16(ss + i * 16, sg + i * 16);  // 16 rows x nblk
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < nst) issue_stage<SWIGLU, C, S, HINT>(ring, src, stride_q, st);
    cp_commit();
  }
  const float pre = stage_x<SPLIT, XWORDS, W>(x + (long)(pair / x_div) * K, K, xs, xl, xmax);
  __syncthreads();
  const int ca = SWIGLU ? 2 * g : g, cb = SWIGLU ? 2 * g + 1 : g + 8;  // checkpoint rows
  float acc[4] = {0.f, 0.f, 0.f, 0.f};  // every column holds the same x: columns 0 and 1 agree
  stream_rows<SWIGLU, C, S, HINT>(ring, src, stride_q, nst, xs, xl, ss, nblk, ca, cb, acc);
  if (t == 0) {
    store<SWIGLU>(acc[0], acc[2], pre, row0 + ca, row0 + cb, pair, e, bias, wts, out, N, alpha,
                  limit);
  }
}

template <bool SWIGLU, int C, int S, int W, typename XT, int HINT = 0, bool TRIG = false>
int launch_stream(const void* x, int x_div, const int* ids, int pairs, const uint8_t* q,
                  const uint8_t* s, const void* bias, const float* wts, float* out, int N, int K,
                  long stride_qe, int stride_q, long stride_se, float alpha, float limit,
                  cudaStream_t stream) {
  if (N % (16 * W) || (K / 32) % C || K > KMAX) return (int)cudaErrorInvalidValue;
  const int smem = (SWIGLU ? 1 : 2) * (K / 8) * 16 + W * (S * 16 * (C + 1) * 16 + 16 * (K / 32));
  auto kernel = pair_gemv_stream<SWIGLU, C, S, W, XT, HINT, TRIG>;
  if (smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return (int)err;
  }
  kernel<<<dim3(pairs, N / (16 * W)), W * 32, smem, stream>>>(
      static_cast<const XT*>(x), x_div, ids, q, s, static_cast<const __nv_bfloat16*>(bias), wts,
      out, N, K, stride_qe, stride_q, stride_se, alpha, limit);
  return (int)cudaGetLastError();
}

// One token's down, launched early (programmatic dependent launch) behind gate_up's TRIG: each
// program copies its 16 * TILES rows (one bulk copy a row, into rows padded by 16 bytes: no bank
// conflicts) and their scales into shared memory, then waits for gate_up (griddepcontrol.wait),
// stages its x and multiplies; TILES x KSPLIT warps, a 16-row tile and a K part each. The
// programs that fit beside gate_up's load during it, the rest as gate_up's programs end; against
// Gluon's down after gate_up, the pair is ~10% faster at gpt-oss's shapes on one GPU and TP 2's
// share (bench/experiments/pdl_smem).
template <int TILES, int KSPLIT>
__global__ void __launch_bounds__(TILES * KSPLIT * 32)
    down_resident(const float* __restrict__ x, const int* __restrict__ ids,
                  const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                  const __nv_bfloat16* __restrict__ bias, const float* __restrict__ wts,
                  float* __restrict__ out, int N, int K, long stride_qe, int stride_q,
                  long stride_se) {
  constexpr int ROWS = 16 * TILES, THREADS = TILES * KSPLIT * 32;
  constexpr int XWORDS = (KMAX / 8 + THREADS - 1) / THREADS;
  extern __shared__ uint4 smem[];
  __shared__ float xmax[TILES * KSPLIT];
  __shared__ uint64_t bar;
  const int nblk = K / 32, rb = K / 2 + 16;  // bytes a row in shared memory
  uint8_t* wsm = (uint8_t*)smem;             // [ROWS][rb]
  uint8_t* ss = wsm + ROWS * rb;             // [ROWS][nblk]
  uint4* xs = (uint4*)(ss + ((ROWS * nblk + 15) & ~15));
  uint4* xl = xs + K / 8;
  const int pair = blockIdx.x, row0 = blockIdx.y * ROWS;
  const long e = ids[pair];  // the router's, complete before gate_up started
  if (e < 0) return;         // a pair another rank holds (expert parallelism)
  const uint8_t* src = q + e * stride_qe + (long)row0 * stride_q;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) mbar_init(&bar);
  __syncthreads();
  if (warp == 0) {
    if (lane == 0) {
      mbar_expect(&bar, ROWS * (K / 2) + ROWS * nblk);
      bulk_copy(ss, s + e * stride_se + (long)row0 * nblk, ROWS * nblk, &bar);
    }
    __syncwarp();  // the expected bytes are set before any row's copy can complete
    for (int r = lane; r < ROWS; r += 32) {
      bulk_copy(wsm + r * rb, src + (long)r * stride_q, K / 2, &bar);
    }
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");  // gate_up done, its output visible
  const float pre = stage_x<true, XWORDS, TILES * KSPLIT>(x + (long)pair * K, K, xs, xl, xmax);
  __syncthreads();
  mbar_wait(&bar, 0);
  const int tile = warp % TILES, part = warp / TILES;
  const int g = lane >> 2, t = lane & 3;
  const int la = tile * 16 + g, lb = la + 8;
  const int per = (nblk + KSPLIT - 1) / KSPLIT, first = part * per;
  const int last = min(nblk, first + per);
  const uint32_t* wa = reinterpret_cast<const uint32_t*>(wsm + la * rb) + t;
  const uint32_t* wb = reinterpret_cast<const uint32_t*>(wsm + lb * rb) + t;
  float acc_a = 0.f, acc_b = 0.f;
#pragma unroll 4
  for (int b = first; b < last; ++b) {
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    block_mma<true>(d, wa[4 * b], wb[4 * b], xs[4 * b + t], xl[4 * b + t]);
    acc_a = fmaf(d[0], __uint_as_float((uint32_t)ss[la * nblk + b] << 23), acc_a);
    acc_b = fmaf(d[2], __uint_as_float((uint32_t)ss[lb * nblk + b] << 23), acc_b);
  }
  // x is read no more: its shared memory takes the other parts' sums
  if (!sum_parts<TILES, KSPLIT>(reinterpret_cast<float*>(xs), part, tile, g, t, acc_a, acc_b)) {
    return;
  }
  if (t == 0) {
    store<false>(acc_a, acc_b, pre, row0 + la, row0 + lb, pair, e, bias, wts, out, N, 0.f, 0.f);
  }
}

// down_resident's shared memory for K, or 0 where it cannot take the shapes (rows in whole
// programs, the rows' and scales' copies 16-byte aligned and sized, x staged whole).
template <int TILES>
int resident_smem(const uint8_t* q, const uint8_t* s, int N, int K, long stride_qe, int stride_q,
                  long stride_se) {
  constexpr int ROWS = 16 * TILES;
  const int nblk = K / 32;
  const bool fits = N % ROWS == 0 && K % 32 == 0 && K <= KMAX && (K / 2) % 16 == 0 &&
                    (ROWS * nblk) % 16 == 0 && (uintptr_t)q % 16 == 0 &&
                    (uintptr_t)s % 16 == 0 && stride_q % 16 == 0 && stride_qe % 16 == 0 &&
                    stride_se % 16 == 0 && stride_se >= (long)N * nblk;
  const int smem = ROWS * (K / 2 + 16) + ((ROWS * nblk + 15) & ~15) + 2 * (K / 8) * 16;
  return fits ? smem : 0;
}

template <int TILES, int KSPLIT>
int launch_resident(const float* x, const int* ids, int pairs, const uint8_t* q, const uint8_t* s,
                    const void* bias, const float* wts, float* out, int N, int K,
                    long stride_qe, int stride_q, long stride_se, cudaStream_t stream) {
  const int smem = resident_smem<TILES>(q, s, N, K, stride_qe, stride_q, stride_se);
  if (!smem) return (int)cudaErrorInvalidValue;
  auto kernel = down_resident<TILES, KSPLIT>;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return (int)err;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(pairs, N / (16 * TILES));
  cfg.blockDim = dim3(TILES * KSPLIT * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return (int)cudaLaunchKernelEx(&cfg, kernel, x, ids, q, s,
                                 static_cast<const __nv_bfloat16*>(bias), wts, out, N, K,
                                 stride_qe, stride_q, stride_se);
}

// x of a group's `count` columns (pairs cols[0..count), rows cols[j] / x_div of x) staged in
// shared memory for the grouped kernels by a program of W warps, column j at xs[j * (K/8 + 1)]
// (padded against bank conflicts): fp32 x as fp16 hi + lo; bf16 x by warp j (no block barrier,
// no shared atomics) times the power of two cpre[j] that puts its largest magnitude just under
// 2**15, as stage_x does; in block_mma's STRIDED order.
template <bool SPLIT, int W, typename XT>
__device__ __forceinline__ void stage_group(const XT* __restrict__ x, int x_div,
                                            const int* __restrict__ cols, int count, int K,
                                            uint4* xs, uint4* xl, float* cpre) {
  const int KW = K / 8, KP = KW + 1, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if constexpr (SPLIT) {
    for (int i = threadIdx.x; i < count * KW; i += W * 32) {
      const int j = i / KW, w = i % KW;
      const float4* xr = reinterpret_cast<const float4*>(x + (long)(cols[j] / x_div) * K) + 2 * w;
      const float4 a = __ldg(xr), c = __ldg(xr + 1);
      const float v[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
      __half h[8], l[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        h[k] = __float2half_rn(v[k]);
        l[k] = __float2half_rn(v[k] - __half2float(h[k]));
      }
      xs[j * KP + w] = make_uint4(pack(h[0], h[4]), pack(h[1], h[5]), pack(h[2], h[6]),
                                  pack(h[3], h[7]));
      xl[j * KP + w] = make_uint4(pack(l[0], l[4]), pack(l[1], l[5]), pack(l[2], l[6]),
                                  pack(l[3], l[7]));
    }
  } else {
    for (int j = warp; j < count; j += W) {
      const uint4* xw = reinterpret_cast<const uint4*>(x + (long)(cols[j] / x_div) * K);
      uint32_t m = 0u;  // bf16 magnitudes compare as integers
      for (int w = lane; w < KW; w += 32) {
        const uint4 raw = __ldg(xw + w);
        const uint32_t r[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int c = 0; c < 4; ++c) m = max(m, max(r[c] & 0x7FFFu, (r[c] >> 16) & 0x7FFFu));
      }
      const float pre = stage_scale(__uint_as_float(__reduce_max_sync(0xffffffffu, m) << 16));
      if (lane == 0) cpre[j] = pre;
      for (int w = lane; w < KW; w += 32) {  // again, from L1
        const uint4 raw = __ldg(xw + w);
        const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&raw);
        __half h[8];
#pragma unroll
        for (int c = 0; c < 8; ++c) h[c] = __float2half_rn(__bfloat162float(b[c]) * pre);
        xs[j * KP + w] = make_uint4(pack(h[0], h[4]), pack(h[1], h[5]), pack(h[2], h[6]),
                                    pack(h[3], h[7]));
      }
    }
  }
}

// Grouped by expert, for steps of more tokens than the pair kernels take: the pairs sorted by
// expert on the device (`sorted_ids`, `order` the pairs' positions) and cut into groups of up to
// 8 pairs of one expert (`groups[g]` = start | count << 16, sorted positions start..; -1 past
// the last, whose programs return), one a column of B, so the expert's rows are read and decoded
// once for all of them. A program takes a group's ROWS rows; TILES 16-row tiles a program
// amortize staging its columns of x. TAIL: K's blocks need not divide into load groups of U (a
// tensor-parallel rank's down: 45, 23 or 12 blocks), the last group is cut.
template <bool SWIGLU, int U, int TILES, typename XT, bool TAIL = false>
__global__ void __launch_bounds__(TILES * 32)
    group_gemv_mma(const XT* __restrict__ x, int x_div, const int* __restrict__ groups,
                   const int* __restrict__ sorted_ids, const int* __restrict__ order,
                   const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                   const __nv_bfloat16* __restrict__ bias, const float* __restrict__ wts,
                   float* __restrict__ out, int N, int K, long stride_qe, int stride_q,
                   long stride_se, float alpha, float limit) {
  constexpr bool SPLIT = !SWIGLU;
  constexpr int ROWS = 16 * TILES, THREADS = TILES * 32;
  extern __shared__ uint4 smem[];
  __shared__ float cpre[8];
  const int gi = groups[blockIdx.x];
  if (gi < 0) return;
  const int start = gi & 0xFFFF, count = gi >> 16;
  const int e = sorted_ids[start];
  if (e < 0) return;  // pairs another rank holds (expert parallelism; they sort first)
  const int nblk = K / 32, KP = K / 8 + 1;
  uint4* xs = smem;                                 // [8][KP] fp16 pairs (hi)
  uint4* xl = smem + 8 * KP;                        // [8][KP] (lo), SPLIT only
  uint8_t* ss = (uint8_t*)(smem + (SPLIT ? 2 : 1) * 8 * KP);  // [ROWS][nblk] scales
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.y * ROWS;
  const int la = SWIGLU ? 2 * (warp * 8 + g) : warp * 16 + g;
  const int lb = SWIGLU ? la + 1 : la + 8;
  const uint32_t* qa = reinterpret_cast<const uint32_t*>(q + (long)e * stride_qe +
                                                         (long)(row0 + la) * stride_q) + t;
  const uint32_t* qb = reinterpret_cast<const uint32_t*>(q + (long)e * stride_qe +
                                                         (long)(row0 + lb) * stride_q) + t;
  uint32_t wa[U], wb[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {  // the first group's weights are on their way while x stages
    if (!TAIL || u < nblk) {
      wa[u] = __ldg(qa + 4 * u);
      wb[u] = __ldg(qb + 4 * u);
    }
  }
  const uint4* sg = reinterpret_cast<const uint4*>(s + (long)e * stride_se + (long)row0 * nblk);
  for (int i = threadIdx.x; i < ROWS * nblk / 16; i += THREADS) {
    reinterpret_cast<uint4*>(ss)[i] = sg[i];
  }
  // Only the group's count columns are staged: the others hold whatever shared memory held,
  // which reaches only MMA columns that are never stored (a column of D is its column of B's).
  stage_group<SPLIT, TILES>(x, x_div, order + start, count, K, xs, xl, cpre);
  __syncthreads();
  float acc[4] = {0.f, 0.f, 0.f, 0.f};  // rows g, g (columns 2t, 2t + 1), g + 8, g + 8
  for (int b0 = 0; b0 < nblk; b0 += U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int b = b0 + u;
      if (TAIL && b >= nblk) break;
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      block_mma<SPLIT, true>(d, wa[u], wb[u], xs[g * KP + 4 * b + t],
                             SPLIT ? xl[g * KP + 4 * b + t] : uint4{});
      const float sa = __uint_as_float((uint32_t)ss[la * nblk + b] << 23);
      const float sb = __uint_as_float((uint32_t)ss[lb * nblk + b] << 23);
      acc[0] = fmaf(d[0], sa, acc[0]);
      acc[1] = fmaf(d[1], sa, acc[1]);
      acc[2] = fmaf(d[2], sb, acc[2]);
      acc[3] = fmaf(d[3], sb, acc[3]);
    }
    if (b0 + U < nblk) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (!TAIL || b0 + U + u < nblk) {
          wa[u] = __ldg(qa + 4 * (b0 + U + u));
          wb[u] = __ldg(qb + 4 * (b0 + U + u));
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int c = 2 * t + i;
    if (c < count) {
      store<SWIGLU>(acc[i], acc[2 + i], SPLIT ? 1.f : cpre[c], row0 + la, row0 + lb,
                    order[start + c], e, bias, wts, out, N, alpha, limit);
    }
  }
}

// The grouped kernel with the streamed weight path (issue_stage, stream_rows), W warps a program
// sharing the group's staged x: down above 16 tokens, where it keeps more bytes in flight than
// group_gemv_mma's register loads. HINT: cp_async16's L2 fetch size.
template <bool SWIGLU, int C, int S, int W, typename XT, int HINT = 0>
__global__ void __launch_bounds__(W * 32)
    group_gemv_stream(const XT* __restrict__ x, int x_div, const int* __restrict__ groups,
                      const int* __restrict__ sorted_ids, const int* __restrict__ order,
                      const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                      const __nv_bfloat16* __restrict__ bias, const float* __restrict__ wts,
                      float* __restrict__ out, int N, int K, long stride_qe, int stride_q,
                      long stride_se, float alpha, float limit) {
  constexpr bool SPLIT = !SWIGLU;
  constexpr int STAGE = 16 * (C + 1) * 16;
  extern __shared__ uint4 smem[];
  __shared__ float cpre[8];
  const int gi = groups[blockIdx.x];
  if (gi < 0) return;
  const int start = gi & 0xFFFF, count = gi >> 16;
  const int e = sorted_ids[start];
  if (e < 0) return;  // pairs another rank holds (expert parallelism; they sort first)
  const int nblk = K / 32, nst = nblk / C, KP = K / 8 + 1;
  uint4* xs = smem;
  uint4* xl = smem + 8 * KP;
  uint8_t* base = (uint8_t*)(smem + (SPLIT ? 2 : 1) * 8 * KP);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  uint8_t* ring = base + warp * (S * STAGE + 16 * nblk);  // this warp's stages, then its scales
  uint8_t* ss = ring + S * STAGE;
  const int row0 = (blockIdx.y * W + warp) * 16;
  const uint8_t* src = q + (long)e * stride_qe + (long)row0 * stride_q;
  const uint8_t* sg = s + (long)e * stride_se + (long)row0 * nblk;
  for (int i = lane; i < nblk; i += 32) cp_async16(ss + i * 16, sg + i * 16);
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < nst) issue_stage<SWIGLU, C, S, HINT>(ring, src, stride_q, st);
    cp_commit();
  }
  stage_group<SPLIT, W>(x, x_div, order + start, count, K, xs, xl, cpre);
  __syncthreads();
  const int ca = SWIGLU ? 2 * g : g, cb = SWIGLU ? 2 * g + 1 : g + 8;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};  // thread column g's x: B's column g is pair g's
  stream_rows<SWIGLU, C, S, HINT, true>(ring, src, stride_q, nst, xs + g * KP, xl + g * KP, ss,
                                        nblk, ca, cb, acc);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int c = 2 * t + i;
    if (c < count) {
      store<SWIGLU>(acc[i], acc[2 + i], SPLIT ? 1.f : cpre[c], row0 + ca, row0 + cb,
                    order[start + c], e, bias, wts, out, N, alpha, limit);
    }
  }
}

// The grouped kernels' order and groups: the P pairs' expert ids sorted, stably (ties keep their
// pair order), order[r] the pair at sorted position r, and groups[g] = start | count << 16 for
// the g-th run of up to 8 pairs of one expert (-1 for g in [groups, G)). One program of 256
// threads; a pair's rank counts the pairs before it, O(P**2) for the few hundred pairs of a step
// that groups (one launch where torch.sort takes several).
__global__ void sort_pairs(const int* __restrict__ ids, int P, int* __restrict__ sorted_ids,
                           int* __restrict__ order, int* __restrict__ groups, int G) {
  extern __shared__ int sid[];  // [P] ids, then [P] sorted
  int* srt = sid + P;
  __shared__ int wsum[8], base;
  for (int i = threadIdx.x; i < P; i += blockDim.x) sid[i] = ids[i];
  __syncthreads();
  for (int i = threadIdx.x; i < P; i += blockDim.x) {
    const int v = sid[i];
    int rank = 0;
    for (int j = 0; j < P; ++j) rank += sid[j] < v || (sid[j] == v && j < i);
    sorted_ids[rank] = v;
    order[rank] = i;
    srt[rank] = v;
  }
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int c0 = 0; c0 < P; c0 += blockDim.x) {  // groups start 0, 8, 16, .. into each run
    const int r = c0 + threadIdx.x;
    bool first = false;
    if (r < P) {
      int lo = 0, hi = r;  // the run's first position
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (srt[mid] < srt[r]) lo = mid + 1; else hi = mid;
      }
      first = (r - lo) % 8 == 0;
    }
    const unsigned mask = __ballot_sync(0xffffffffu, first);
    if (lane == 0) wsum[warp] = __popc(mask);
    __syncthreads();
    int g = base + __popc(mask & ((1u << lane) - 1u));
    for (int w = 0; w < warp; ++w) g += wsum[w];
    if (first && g < G) {
      int count = 1;
      while (count < 8 && r + count < P && srt[r + count] == srt[r]) ++count;
      groups[g] = r | (count << 16);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 0; w < 8; ++w) base += wsum[w];
    }
    __syncthreads();
  }
  for (int g = base + threadIdx.x; g < G; g += blockDim.x) groups[g] = -1;
}

template <bool SWIGLU, int U, int TILES, typename XT>
int launch_grouped(const void* x, int x_div, const int* groups, int G, const int* sorted_ids,
                   const int* order, const uint8_t* q, const uint8_t* s, const void* bias,
                   const float* wts, float* out, int N, int K, long stride_qe, int stride_q,
                   long stride_se, float alpha, float limit, cudaStream_t stream) {
  constexpr int ROWS = 16 * TILES;
  if (N % ROWS || K % 32 || K > KMAX) return (int)cudaErrorInvalidValue;
  const int smem = (SWIGLU ? 1 : 2) * 8 * (K / 8 + 1) * 16 + ROWS * (K / 32);
  auto kernel = K % (32 * U) ? group_gemv_mma<SWIGLU, U, TILES, XT, true>
                             : group_gemv_mma<SWIGLU, U, TILES, XT, false>;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return (int)err;
  kernel<<<dim3(G, N / ROWS), TILES * 32, smem, stream>>>(
      static_cast<const XT*>(x), x_div, groups, sorted_ids, order, q, s,
      static_cast<const __nv_bfloat16*>(bias), wts, out, N, K, stride_qe, stride_q, stride_se,
      alpha, limit);
  return (int)cudaGetLastError();
}

template <bool SWIGLU, int C, int S, int W, typename XT, int HINT = 0>
int launch_grouped_stream(const void* x, int x_div, const int* groups, int G,
                          const int* sorted_ids, const int* order, const uint8_t* q,
                          const uint8_t* s, const void* bias, const float* wts, float* out,
                          int N, int K, long stride_qe, int stride_q, long stride_se,
                          float alpha, float limit, cudaStream_t stream) {
  if (N % (16 * W) || (K / 32) % C || K > KMAX) return (int)cudaErrorInvalidValue;
  const int smem = (SWIGLU ? 1 : 2) * 8 * (K / 8 + 1) * 16 +
                   W * (S * 16 * (C + 1) * 16 + 16 * (K / 32));
  auto kernel = group_gemv_stream<SWIGLU, C, S, W, XT, HINT>;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return (int)err;
  kernel<<<dim3(G, N / (16 * W)), W * 32, smem, stream>>>(
      static_cast<const XT*>(x), x_div, groups, sorted_ids, order, q, s,
      static_cast<const __nv_bfloat16*>(bias), wts, out, N, K, stride_qe, stride_q, stride_se,
      alpha, limit);
  return (int)cudaGetLastError();
}
// Dense layers with bf16 or FP8 (e4m3, a scale a row) weights W [N, K] for up to 8 rows of x
// [M, K] bf16, one row of x a column of the MMA (the weights read once for all of them). A lane
// (g, t) loads 16 bytes of rows g and g + 8 of its warp's 16-row tile a chunk (64 bytes of a
// row: 32 bf16 or 64 FP8 weights); as in block_mma, which physical k an MMA slot stands for is
// free as long as x uses the same, so the lane's weights meet x at the same k's, staged in shared
// memory: bf16 x as it is (bf16 MMAs), or for FP8 (converted to fp16 pairs with one cvt for two)
// as fp16 times a power of two a column (stage_scale). KSPLIT warps share a row tile, each a
// contiguous part of the chunks; TILES row tiles a program.
template <bool FP8, int U, int KSPLIT, int TILES>
__global__ void __launch_bounds__(TILES * KSPLIT * 32)
    dense_gemv_mma(const __nv_bfloat16* __restrict__ x, int M, const uint8_t* __restrict__ w,
                   const float* __restrict__ scale, const __nv_bfloat16* __restrict__ bias,
                   __nv_bfloat16* __restrict__ out, int N, int K) {
  constexpr int W = TILES * KSPLIT;
  extern __shared__ uint4 smem[];
  __shared__ float cpre[8];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tile = warp % TILES, part = warp / TILES;
  const int g = lane >> 2, t = lane & 3;
  const int KP = K + 8;  // a column's elements in shared memory (padded against bank conflicts)
  const int kb = FP8 ? K : 2 * K, nch = kb / 64;  // a row's bytes, its chunks of 64
  const int first = part * nch / KSPLIT, last = (part + 1) * nch / KSPLIT;
  const int row0 = (blockIdx.x * TILES + tile) * 16;
  const uint4* wa = reinterpret_cast<const uint4*>(w + (long)(row0 + g) * kb) + t;
  const uint4* wb = reinterpret_cast<const uint4*>(w + (long)(row0 + g + 8) * kb) + t;
  uint4 ra[U], rb[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {  // the first chunks are on their way while x stages
    if (first + u < last) ra[u] = __ldg(wa + 4 * (first + u)), rb[u] = __ldg(wb + 4 * (first + u));
  }
  __half* xh = reinterpret_cast<__half*>(smem);  // [M][KP]: FP8's x
  __nv_bfloat16* xb = reinterpret_cast<__nv_bfloat16*>(smem);  // [M][KP]: bf16's x
  for (int j = warp; j < M; j += W) {  // column j by warp j
    const uint4* xr = reinterpret_cast<const uint4*>(x + (long)j * K);
    float pre = 1.f;
    if (FP8) {
      uint32_t m = 0u;  // bf16 magnitudes compare as integers
      for (int i = lane; i < K / 8; i += 32) {
        const uint4 raw = __ldg(xr + i);
        const uint32_t r[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int c = 0; c < 4; ++c) m = max(m, max(r[c] & 0x7FFFu, (r[c] >> 16) & 0x7FFFu));
      }
      pre = stage_scale(__uint_as_float(__reduce_max_sync(0xffffffffu, m) << 16));
      if (lane == 0) cpre[j] = pre;
    }
    for (int i = lane; i < K / 8; i += 32) {
      const uint4 raw = __ldg(xr + i);
      if (FP8) {
        const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&raw);
        __half h[8];
#pragma unroll
        for (int c = 0; c < 8; ++c) h[c] = __float2half_rn(__bfloat162float(b[c]) * pre);
        *reinterpret_cast<uint4*>(xh + j * KP + 8 * i) =
            make_uint4(pack(h[0], h[1]), pack(h[2], h[3]), pack(h[4], h[5]), pack(h[6], h[7]));
      } else {
        *reinterpret_cast<uint4*>(xb + j * KP + 8 * i) = raw;
      }
    }
  }
  __syncthreads();
  const int col = min(g, M - 1);  // columns past M read a real one; they are never stored
  const uint32_t* xc = reinterpret_cast<const uint32_t*>(smem) + col * (KP / 2);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int c0 = first; c0 < last; c0 += U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u;
      if (c < last) {
        const uint32_t qa[4] = {ra[u].x, ra[u].y, ra[u].z, ra[u].w};
        const uint32_t qb[4] = {rb[u].x, rb[u].y, rb[u].z, rb[u].w};
        if (FP8) {  // 16 weights: k = 64c + 16t + 4i + (0..3) in MMA i
          const uint4 x0 = *reinterpret_cast<const uint4*>(xc + 32 * c + 8 * t);
          const uint4 x1 = *reinterpret_cast<const uint4*>(xc + 32 * c + 8 * t + 4);
          const uint32_t xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            mma(acc, fp8x2(qa[i]), fp8x2(qb[i]), fp8x2(qa[i] >> 16), fp8x2(qb[i] >> 16),
                xv[2 * i], xv[2 * i + 1]);
          }
        } else {  // 8 weights: k = 32c + 8t + 4i + (0..3) in MMA i
          const uint4 xv = *reinterpret_cast<const uint4*>(xc + 16 * c + 4 * t);
          mma_bf16(acc, qa[0], qb[0], qa[1], qb[1], xv.x, xv.y);
          mma_bf16(acc, qa[2], qb[2], qa[3], qb[3], xv.z, xv.w);
        }
      }
    }
    if (c0 + U < last) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + U + u;
        if (c < last) ra[u] = __ldg(wa + 4 * c), rb[u] = __ldg(wb + 4 * c);
      }
    }
  }
  if (KSPLIT > 1) {  // the other parts' sums into part 0's
    float* red = reinterpret_cast<float*>(smem);  // x is read no more
    __syncthreads();
    if (part > 0) {
#pragma unroll
      for (int i = 0; i < 4; ++i) red[(((part - 1) * TILES + tile) * 32 + lane) * 4 + i] = acc[i];
    }
    __syncthreads();
    if (part > 0) return;
#pragma unroll
    for (int p = 1; p < KSPLIT; ++p) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] += red[(((p - 1) * TILES + tile) * 32 + lane) * 4 + i];
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // rows g (i < 2) and g + 8, columns 2t, 2t + 1
    const int n = 2 * t + (i & 1), r = row0 + g + (i >> 1) * 8;
    if (n < M) {
      float v = acc[i];
      if (FP8) v *= scale[r] / cpre[n];
      if (bias) v += __bfloat162float(bias[r]);
      out[(long)n * N + r] = __float2bfloat16(v);
    }
  }
}

template <bool FP8, int U, int KSPLIT, int TILES>
int launch_dense(const void* x, int M, const uint8_t* w, const float* scale, const void* bias,
                 void* out, int N, int K, cudaStream_t stream) {
  constexpr int ROWS = 16 * TILES;
  if (M < 1 || M > 8 || N % ROWS || K % 64 || (FP8 ? K : 2 * K) / 64 < KSPLIT) {
    return (int)cudaErrorInvalidValue;
  }
  const int smem = max(M * (K + 8) * 2, (KSPLIT - 1) * TILES * 32 * 4 * 4);
  auto kernel = dense_gemv_mma<FP8, U, KSPLIT, TILES>;
  if (smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return (int)err;
  }
  kernel<<<N / ROWS, TILES * KSPLIT * 32, smem, stream>>>(
      static_cast<const __nv_bfloat16*>(x), M, w, scale, static_cast<const __nv_bfloat16*>(bias),
      static_cast<__nv_bfloat16*>(out), N, K);
  return (int)cudaGetLastError();
}

// Dense bf16 layers at 1-2 rows of x on the CUDA cores: a warp takes STREAM_ROWS rows of W, and
// lane l loads 16-byte vectors l, l + 32, ... of each (VPL of them a row, the last one repeated
// past K, where x counts zero), all written ahead of the math, with an L2 256-byte prefetch
// hint; each weight then meets the m <= MAXM rows of x (read through L1, which the weights
// bypass), fp32 sums, a warp reduction. A 24-30 MB layer (q/k/v, o) reads closer to the copy
// bandwidth this way than through a shared-memory pipeline or cuBLAS
// (bench/experiments/dense_stream); from 4 rows of x on the math no longer hides behind the
// loads (bench/results/2026-11-26_session18.md). ptxas still moves math in among the loads of
// the wide rows: at q/k/v's and o's K, 10-12 of a lane's 24-32 loads are issued before its
// first FMA (sm_90a, nvcc 13.0); without __launch_bounds__(.., 1) it kept only 2.
constexpr int STREAM_ROWS = 2, STREAM_WARPS = 4;

__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// A warp's STREAM_ROWS rows from row0 (rows past N repeat the last), row_bytes each: lane l's
// 16-byte vectors l, l + 32, ... (VPL of them a row; past the row the last one repeats, where
// x counts zero), every load issued before any math. W's rows are bf16 or FP8: bytes here.
template <int VPL>
__device__ __forceinline__ void load_stream_rows(const uint8_t* w, long row_bytes, int row0,
                                                 int N, int lane,
                                                 uint4 (&wv)[STREAM_ROWS][VPL]) {
  const int kv = (int)(row_bytes >> 4);
#pragma unroll
  for (int r = 0; r < STREAM_ROWS; ++r) {
    const uint4* wr = reinterpret_cast<const uint4*>(w + (long)min(row0 + r, N - 1) * row_bytes);
#pragma unroll
    for (int i = 0; i < VPL; ++i) wv[r][i] = ldg_stream(wr + min(lane + 32 * i, kv - 1));
  }
}

template <int VPL, int MAXM>
__global__ void __launch_bounds__(STREAM_WARPS * 32, 1)
    dense_gemv_stream(const __nv_bfloat16* __restrict__ x, int m,
                      const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ bias,
                      __nv_bfloat16* __restrict__ out, int N, int K) {
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * STREAM_WARPS + (threadIdx.x >> 5)) * STREAM_ROWS;
  if (row0 >= N) return;
  const int kv = K >> 3;  // 16-byte vectors a row
  uint4 wv[STREAM_ROWS][VPL];
  load_stream_rows(reinterpret_cast<const uint8_t*>(w), 2L * K, row0, N, lane, wv);
  float acc[MAXM][STREAM_ROWS] = {};
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int j = lane + 32 * i;
    float wf[STREAM_ROWS][8];  // a word holds two bf16: the low one, then the high one
#pragma unroll
    for (int r = 0; r < STREAM_ROWS; ++r) {
      const uint32_t ws[4] = {wv[r][i].x, wv[r][i].y, wv[r][i].z, wv[r][i].w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        wf[r][2 * c] = __uint_as_float(ws[c] << 16);
        wf[r][2 * c + 1] = __uint_as_float(ws[c] & 0xffff0000u);
      }
    }
#pragma unroll
    for (int mi = 0; mi < MAXM; ++mi) {
      const uint4 xv = j < kv && mi < m ? __ldg(reinterpret_cast<const uint4*>(x) + mi * kv + j)
                                        : uint4{0, 0, 0, 0};
      const uint32_t xs[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float lo = __uint_as_float(xs[c] << 16), hi = __uint_as_float(xs[c] & 0xffff0000u);
#pragma unroll
        for (int r = 0; r < STREAM_ROWS; ++r)
          acc[mi][r] = fmaf(wf[r][2 * c + 1], hi, fmaf(wf[r][2 * c], lo, acc[mi][r]));
      }
    }
  }
#pragma unroll
  for (int mi = 0; mi < MAXM; ++mi) {
#pragma unroll
    for (int r = 0; r < STREAM_ROWS; ++r) {
      float v = acc[mi][r];
#pragma unroll
      for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0 && mi < m && row0 + r < N)
        out[(long)mi * N + row0 + r] =
            __float2bfloat16(v + (bias ? __bfloat162float(bias[row0 + r]) : 0.f));
    }
  }
}

template <int VPL, int MAXM>
int launch_dense_stream(const void* x, int m, const void* w, const void* bias, void* out, int N,
                        int K, cudaStream_t stream) {
  const int rows = STREAM_WARPS * STREAM_ROWS;
  dense_gemv_stream<VPL, MAXM><<<(N + rows - 1) / rows, STREAM_WARPS * 32, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), m, static_cast<const __nv_bfloat16*>(w),
      static_cast<const __nv_bfloat16*>(bias), static_cast<__nv_bfloat16*>(out), N, K);
  return (int)cudaGetLastError();
}

template <int MAXM>
int launch_dense_stream_k(const void* x, int m, const void* w, const void* bias, void* out, int N,
                          int K, cudaStream_t stream) {
  const int vpl = (K + 255) / 256;
  auto run = vpl <= 4    ? launch_dense_stream<4, MAXM>
             : vpl <= 8  ? launch_dense_stream<8, MAXM>
             : vpl <= 12 ? launch_dense_stream<12, MAXM>
                         : launch_dense_stream<16, MAXM>;
  return run(x, m, w, bias, out, N, K, stream);
}

// Dense FP8 layers (e4m3, an fp32 scale a row) at one row of x, as dense_gemv_stream: a warp
// takes STREAM_ROWS rows, lane l loads 16-byte vectors l, l + 32, ... of each (VPL of them a
// row, 16 weights each; the last one repeated past K, where x counts zero), all written ahead
// of the math. Two codes become two fp16 with one cvt (fp8x2_raw, exact), then fp32; fp32 FMAs
// with bf16 x, a warp reduction, the row's scale once at the end. It reads q/k/v and o faster
// than the Triton GEMV and lm_head as fast (2 rows a warp; 4 and 8 were slower:
// bench/results/2026-11-27_h100_fp8_stream.md). As in dense_gemv_stream ptxas moves math in
// among the loads: 6 of a lane's 12 (K 2880) or 16 (K 4096) are issued before its first FMA
// (sm_90a, nvcc 13.0).
template <int VPL>
__global__ void __launch_bounds__(STREAM_WARPS * 32, 1)
    fp8_gemv_stream(const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ w,
                    const float* __restrict__ scale, const __nv_bfloat16* __restrict__ bias,
                    __nv_bfloat16* __restrict__ out, int N, int K) {
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * STREAM_WARPS + (threadIdx.x >> 5)) * STREAM_ROWS;
  if (row0 >= N) return;
  const int kv = K >> 4;  // 16-byte vectors a row
  uint4 wv[STREAM_ROWS][VPL];
  load_stream_rows(w, K, row0, N, lane, wv);
  float acc[STREAM_ROWS] = {};
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int j = lane + 32 * i;  // weights 16j .. 16j + 15: x's 16-byte vectors 2j, 2j + 1
    uint4 xa = {0, 0, 0, 0}, xb = xa;
    if (j < kv) {
      xa = __ldg(reinterpret_cast<const uint4*>(x) + 2 * j);
      xb = __ldg(reinterpret_cast<const uint4*>(x) + 2 * j + 1);
    }
    const uint32_t xs[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    float xf[16];
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      xf[2 * c] = __uint_as_float(xs[c] << 16);
      xf[2 * c + 1] = __uint_as_float(xs[c] & 0xffff0000u);
    }
#pragma unroll
    for (int r = 0; r < STREAM_ROWS; ++r) {
      const uint32_t ws[4] = {wv[r][i].x, wv[r][i].y, wv[r][i].z, wv[r][i].w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {  // word c: weights 4c .. 4c + 3
        const float2 a = __half22float2(__half2(fp8x2_raw(ws[c])));
        const float2 b = __half22float2(__half2(fp8x2_raw(ws[c] >> 16)));
        acc[r] = fmaf(a.x, xf[4 * c], acc[r]);
        acc[r] = fmaf(a.y, xf[4 * c + 1], acc[r]);
        acc[r] = fmaf(b.x, xf[4 * c + 2], acc[r]);
        acc[r] = fmaf(b.y, xf[4 * c + 3], acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < STREAM_ROWS; ++r) {
    float v = acc[r];
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0 && row0 + r < N)
      out[row0 + r] = __float2bfloat16(v * scale[row0 + r] +
                                       (bias ? __bfloat162float(bias[row0 + r]) : 0.f));
  }
}

template <int VPL>
int launch_fp8_stream(const void* x, const uint8_t* w, const float* scale, const void* bias,
                      void* out, int N, int K, cudaStream_t stream) {
  const int rows = STREAM_WARPS * STREAM_ROWS;
  fp8_gemv_stream<VPL><<<(N + rows - 1) / rows, STREAM_WARPS * 32, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), w, scale, static_cast<const __nv_bfloat16*>(bias),
      static_cast<__nv_bfloat16*>(out), N, K);
  return (int)cudaGetLastError();
}
}  // namespace

// The tiles: the best of a sweep at gpt-oss-20b shapes (bench/experiments/mma_gemv), by the
// pairs a step has (4 a token): gate_up streamed through shared memory above 8 pairs, with one
// warp a row tile at 5-8; down with two-tile programs up to 8 pairs. At one token down runs here
// on one GPU's K and TP 2's share (down_resident behind gate_up's trigger); narrower shares take
// Gluon's.
// one token on one GPU's rows: streamed, the L2 fetching 256 bytes a miss
// (bench/results/2026-11-28_session33.md), letting down_resident launch at its start
#define TINYOSS_GATE_UP_ONE true, 10, 3, 4, __nv_bfloat16, 2, true
#define TINYOSS_GATE_UP_FEW true, 9, 1, 4, __nv_bfloat16
#define TINYOSS_GATE_UP_STREAM true, 10, 3, 4, __nv_bfloat16
// a tensor-parallel rank's share of gate_up's rows (fewer than one GPU's 5760): one 16-row tile
// a program, so that the fewer rows still spread over every SM; K in 5 parts below 2880 rows
// (sweep_pair.py --intermediate, bench/results/2026-11-28_h100_pair_tiles_tp_share.txt)
#define TINYOSS_GATE_UP_SHARE true, 15, 2, 1, __nv_bfloat16, float, true  // lets down_resident launch
#define TINYOSS_GATE_UP_SHARE_NARROW true, 9, 5, 1, __nv_bfloat16
#define TINYOSS_GATE_UP_SHARE_FEW true, 9, 2, 1, __nv_bfloat16
#define TINYOSS_GATE_UP_SHARE_BELOW 5760
#define TINYOSS_DOWN false, 15, 1, 4, float
#define TINYOSS_DOWN_FEW false, 9, 2, 2, float
// down streamed through shared memory at 8 pairs (2 tokens) and from 20 (5 tokens), where it
// measured faster than the register tiles (bench/results/2026-11-28_session33.md), K in whole
// stages only (one GPU's 2880)
#define TINYOSS_DOWN_STREAM false, 10, 3, 4, float
// one token: down_resident, 48-row programs of 12 warps (K in 4 parts), launched behind gate_up
// (bench/experiments/pdl_smem: on one GPU's K as fast as 32 rows, on TP 2's share faster)
#define TINYOSS_DOWN_RESIDENT_TILES 3
#define TINYOSS_DOWN_RESIDENT TINYOSS_DOWN_RESIDENT_TILES, 4
// grouped by expert: 192 gate_up and 320 down rows a program, down streamed (192 rows a program)
// above 64 pairs (sweep_pair.py --grouped)
#define TINYOSS_GATE_UP_GROUPED true, 9, 12, __nv_bfloat16
#define TINYOSS_DOWN_GROUPED false, 9, 20, float
#define TINYOSS_DOWN_GROUPED_STREAM false, 10, 2, 12, float
// A tensor-parallel rank's shares: gate_up rows not in 192s (1472 at TP 4) take 64-row programs;
// down's K in no whole stages of the streamed kernel (45 and 23 blocks at TP 2 and 4) takes the
// register kernel, its last load group cut
#define TINYOSS_GATE_UP_GROUPED_NARROW true, 9, 4, __nv_bfloat16
#define TINYOSS_GATE_UP_GROUPED_ROWS (16 * 12)
#define TINYOSS_DOWN_STREAM_BLOCKS 10

extern "C" int tinyoss_gate_up_mma(const void* x, int x_div, const int* ids, int pairs,
                                   const uint8_t* q, const uint8_t* s, const void* bias,
                                   const float* wts, float* out, int N, int K, long stride_qe,
                                   int stride_q, long stride_se, float alpha, float limit,
                                   void* stream) {
  const bool share = N < TINYOSS_GATE_UP_SHARE_BELOW;
  auto run = pairs > 8             ? launch_stream<TINYOSS_GATE_UP_STREAM>
             : pairs > 4 && share  ? launch<TINYOSS_GATE_UP_SHARE_FEW>
             : pairs > 4           ? launch<TINYOSS_GATE_UP_FEW>
             : !share              ? launch_stream<TINYOSS_GATE_UP_ONE>
             : N >= 2880           ? launch<TINYOSS_GATE_UP_SHARE>
                                   : launch<TINYOSS_GATE_UP_SHARE_NARROW>;
  return run(x, x_div, ids, pairs, q, s, bias, wts, out, N, K, stride_qe, stride_q, stride_se,
             alpha, limit, static_cast<cudaStream_t>(stream));
}

extern "C" int tinyoss_down_mma(const void* x, int x_div, const int* ids, int pairs,
                                const uint8_t* q, const uint8_t* s, const void* bias,
                                const float* wts, float* out, int N, int K, long stride_qe,
                                int stride_q, long stride_se, float alpha, float limit,
                                void* stream) {
  if (pairs <= 4 && resident_smem<TINYOSS_DOWN_RESIDENT_TILES>(q, s, N, K, stride_qe, stride_q,
                                                                stride_se)) {
    return launch_resident<TINYOSS_DOWN_RESIDENT>(static_cast<const float*>(x), ids, pairs, q, s,
                                                  bias, wts, out, N, K, stride_qe, stride_q,
                                                  stride_se, static_cast<cudaStream_t>(stream));
  }
  const bool streamed = (K / 32) % 10 == 0 && (pairs == 8 || pairs >= 20);
  auto run = streamed    ? launch_stream<TINYOSS_DOWN_STREAM>
             : pairs > 8 ? launch<TINYOSS_DOWN>
                         : launch<TINYOSS_DOWN_FEW>;
  return run(x, x_div, ids, pairs, q, s, bias, wts, out, N, K, stride_qe, stride_q, stride_se,
             alpha, limit, static_cast<cudaStream_t>(stream));
}

// A dense MXFP4 layer (`--mxfp4-layers`; K 2880: q/k/v and lm_head), M rows of x [M, K] bf16,
// bf16 out (no conversion launch after it): 16-row programs in K thirds for layers of few rows,
// so that they still fill the GPU; 64-row programs for lm_head's 201088. (o, K 4096, ran slower
// here than on the Triton GEMV: bench/results/2026-11-26_session19.md.)
#define TINYOSS_DENSE false, 10, 3, 1, __nv_bfloat16
#define TINYOSS_DENSE_WIDE false, 9, 2, 4, __nv_bfloat16

extern "C" int tinyoss_dense_mma(const void* x, int rows, const uint8_t* q, const uint8_t* s,
                                 const void* bias, void* out, int N, int K, int stride_q,
                                 void* stream) {
  using B = __nv_bfloat16;
  auto run = N >= 16384 ? launch<TINYOSS_DENSE_WIDE, B> : launch<TINYOSS_DENSE, B>;
  return run(x, 1, nullptr, rows, q, s, bias, nullptr, static_cast<B*>(out), N, K, 0, stride_q,
             0, 0.f, 0.f, static_cast<cudaStream_t>(stream));
}

// Dense bf16 / FP8 layers at 1-8 rows: 16-row tiles in K thirds for layers of few rows, 64-row
// tiles for lm_head.
extern "C" int tinyoss_dense_gemv_mma(int fp8, const void* x, int M, const uint8_t* w,
                                      const float* scale, const void* bias, void* out, int N,
                                      int K, void* stream) {
  const bool wide = N >= 16384;
  auto run = fp8 ? (wide ? launch_dense<true, 4, 1, 4> : launch_dense<true, 4, 3, 1>)
                 : (wide ? launch_dense<false, 8, 1, 4> : launch_dense<false, 8, 3, 1>);
  return run(x, M, w, scale, bias, out, N, K, static_cast<cudaStream_t>(stream));
}

// A dense bf16 layer at 1-2 rows of x [m, K] (x and W 16-byte aligned, K in 8s up to 4096):
// q/k/v, o and lm_head at batch 1, q/k/v and o at 2, and a tensor-parallel rank's shares.
extern "C" int tinyoss_dense_gemv_stream(const void* x, int m, const void* w, const void* bias,
                                         void* out, int N, int K, void* stream) {
  if (N < 1 || m < 1 || m > 2 || K < 8 || K % 8 || K > 4096) return (int)cudaErrorInvalidValue;
  auto run = m == 1 ? launch_dense_stream_k<1> : launch_dense_stream_k<2>;
  return run(x, m, w, bias, out, N, K, static_cast<cudaStream_t>(stream));
}

// A dense FP8 layer (e4m3, scale [N] fp32) at one row of x [1, K] (x and W 16-byte aligned, K in
// 16s up to 4096): q/k/v, o and lm_head at batch 1 under --fp8-layers, and a tensor-parallel
// rank's shares.
extern "C" int tinyoss_fp8_gemv_stream(const void* x, const uint8_t* w, const float* scale,
                                       const void* bias, void* out, int N, int K, void* stream) {
  if (N < 1 || K < 16 || K % 16 || K > 4096) return (int)cudaErrorInvalidValue;
  const int vpl = (K + 511) / 512;  // 16-byte vectors a lane
  auto run = vpl <= 2   ? launch_fp8_stream<2>
             : vpl <= 4 ? launch_fp8_stream<4>
             : vpl <= 6 ? launch_fp8_stream<6>
                        : launch_fp8_stream<8>;
  return run(x, w, scale, bias, out, N, K, static_cast<cudaStream_t>(stream));
}

extern "C" int tinyoss_grouped_mma(int swiglu, const void* x, int x_div, const int* groups,
                                   int G, const int* sorted_ids, const int* order, int pairs,
                                   const uint8_t* q, const uint8_t* s, const void* bias,
                                   const float* wts, float* out, int N, int K, long stride_qe,
                                   int stride_q, long stride_se, float alpha, float limit,
                                   void* stream) {
  const bool narrow = N % TINYOSS_GATE_UP_GROUPED_ROWS != 0;
  const bool streamed = pairs > 64 && (K / 32) % TINYOSS_DOWN_STREAM_BLOCKS == 0;
  auto run = swiglu     ? (narrow ? launch_grouped<TINYOSS_GATE_UP_GROUPED_NARROW>
                                  : launch_grouped<TINYOSS_GATE_UP_GROUPED>)
             : streamed ? launch_grouped_stream<TINYOSS_DOWN_GROUPED_STREAM>
                        : launch_grouped<TINYOSS_DOWN_GROUPED>;
  return run(x, x_div, groups, G, sorted_ids, order, q, s, bias, wts, out, N, K, stride_qe,
             stride_q, stride_se, alpha, limit, static_cast<cudaStream_t>(stream));
}

// groups: room for G groups (at least P / 8 + the experts the ids name, at most P)
extern "C" int tinyoss_sort_pairs(const int* ids, int pairs, int* sorted_ids, int* order,
                                  int* groups, int G, void* stream) {
  if (pairs < 1 || pairs > 4096 || G < 1) return (int)cudaErrorInvalidValue;  // 2P ints of smem
  sort_pairs<<<1, 256, 2 * pairs * sizeof(int), static_cast<cudaStream_t>(stream)>>>(
      ids, pairs, sorted_ids, order, groups, G);
  return (int)cudaGetLastError();
}

// 0 when the kernels load on this GPU and driver (a toolkit newer than the driver, say, fails
// here rather than at the first launch), else the CUDA error.
extern "C" int tinyoss_mma_ready(void) {
  const void* kernels[] = {(const void*)pair_gemv_stream<TINYOSS_GATE_UP_ONE>,
                           (const void*)pair_gemv_mma<TINYOSS_GATE_UP_FEW>,
                           (const void*)pair_gemv_stream<TINYOSS_GATE_UP_STREAM>,
                           (const void*)pair_gemv_stream<TINYOSS_DOWN_STREAM>,
                           (const void*)pair_gemv_mma<TINYOSS_DOWN>,
                           (const void*)down_resident<TINYOSS_DOWN_RESIDENT>,
                           (const void*)pair_gemv_mma<TINYOSS_DOWN_FEW>,
                           (const void*)pair_gemv_mma<TINYOSS_DOWN, true>,
                           (const void*)pair_gemv_mma<TINYOSS_DOWN_FEW, true>,
                           (const void*)pair_gemv_mma<TINYOSS_DENSE, false, __nv_bfloat16>,
                           (const void*)pair_gemv_mma<TINYOSS_DENSE_WIDE, false, __nv_bfloat16>,
                           (const void*)group_gemv_mma<TINYOSS_GATE_UP_GROUPED>,
                           (const void*)group_gemv_mma<TINYOSS_GATE_UP_GROUPED_NARROW>,
                           (const void*)group_gemv_mma<TINYOSS_DOWN_GROUPED>,
                           (const void*)group_gemv_mma<TINYOSS_DOWN_GROUPED, true>,
                           (const void*)group_gemv_stream<TINYOSS_DOWN_GROUPED_STREAM>,
                           (const void*)dense_gemv_mma<true, 4, 1, 4>,
                           (const void*)dense_gemv_mma<true, 4, 3, 1>,
                           (const void*)dense_gemv_mma<false, 8, 1, 4>,
                           (const void*)dense_gemv_mma<false, 8, 3, 1>,
                           (const void*)dense_gemv_stream<4, 1>,
                           (const void*)dense_gemv_stream<8, 1>,
                           (const void*)dense_gemv_stream<12, 1>,
                           (const void*)dense_gemv_stream<16, 1>,
                           (const void*)dense_gemv_stream<4, 2>,
                           (const void*)dense_gemv_stream<8, 2>,
                           (const void*)dense_gemv_stream<12, 2>,
                           (const void*)dense_gemv_stream<16, 2>,
                           (const void*)fp8_gemv_stream<2>,
                           (const void*)fp8_gemv_stream<4>,
                           (const void*)fp8_gemv_stream<6>,
                           (const void*)fp8_gemv_stream<8>,
                           (const void*)sort_pairs};
  for (const void* k : kernels) {
    cudaFuncAttributes attr;
    const cudaError_t err = cudaFuncGetAttributes(&attr, k);
    if (err != cudaSuccess) return (int)err;
  }
  return 0;
}

extern "C" const char* tinyoss_mma_error(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}
