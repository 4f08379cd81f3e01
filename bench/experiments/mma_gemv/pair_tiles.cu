// Tile variants of the product's tensor-core MoE GEMVs (tinyoss/kernels/moe_gemv_mma.cu), for
// sweep_pair.py: the pair kernel with other (U, KSPLIT, TILES) choices and the streamed one;
// with --grouped the grouped kernel with other (U, TILES) and group_gemv_wide (16 columns, not
// yet run). Built by nvcc into a library of its own, launched through ctypes like the product's.
#include <type_traits>

#include "../../../tinyoss/kernels/moe_gemv_mma.cu"

#define TINYOSS_VARIANTS(X)                                                                   \
  X(0, true, 9, 2, 4) X(1, true, 15, 3, 2) X(2, true, 9, 5, 1) X(3, true, 15, 2, 1)           \
  X(4, true, 45, 2, 2) X(5, true, 15, 3, 1) X(6, true, 9, 2, 2) X(7, true, 9, 1, 4)           \
  X(20, false, 15, 1, 4) X(21, false, 15, 3, 2) X(22, false, 15, 6, 1) X(23, false, 9, 5, 2)  \
  X(24, false, 18, 5, 1) X(25, false, 10, 3, 2) X(26, false, 9, 10, 1) X(27, false, 45, 2, 1) \
  X(28, false, 5, 3, 2) X(29, false, 9, 2, 2)

// streamed (pair_gemv_stream): (variant, swiglu, C blocks a stage, S stages, W warps)
#define TINYOSS_STREAMED(X)                                                                   \
  X(40, true, 10, 4, 4) X(41, true, 10, 3, 4) X(42, true, 18, 3, 4) X(43, true, 6, 6, 4)      \
  X(44, true, 10, 4, 2) X(45, true, 10, 6, 2)                                                 \
  X(50, false, 10, 4, 4) X(51, false, 10, 3, 4) X(52, false, 18, 3, 4) X(53, false, 6, 6, 4)  \
  X(54, false, 10, 4, 2) X(55, false, 10, 6, 2)

// gate_up (bf16 x) or down (fp32 x), as the name says; -1 for an unknown variant
extern "C" int tinyoss_pair_variant(int variant, const void* x, int x_div, const int* ids,
                                    int pairs, const uint8_t* q, const uint8_t* s,
                                    const void* bias, const float* wts, float* out, int N, int K,
                                    long stride_qe, int stride_q, long stride_se, float alpha,
                                    float limit, void* stream) {
  switch (variant) {
#define TINYOSS_CASE(V, SW, U, KS, TL)                                                    \
  case V:                                                                                     \
    return launch<SW, U, KS, TL, std::conditional_t<SW, __nv_bfloat16, float>>(           \
        x, x_div, ids, pairs, q, s, bias, wts, out, N, K, stride_qe, stride_q, stride_se,     \
        alpha, limit, static_cast<cudaStream_t>(stream));
    TINYOSS_VARIANTS(TINYOSS_CASE)
#define TINYOSS_SCASE(V, SW, C, S, W)                                                         \
  case V:                                                                                     \
    return launch_stream<SW, C, S, W, std::conditional_t<SW, __nv_bfloat16, float>>(          \
        x, x_div, ids, pairs, q, s, bias, wts, out, N, K, stride_qe, stride_q, stride_se,     \
        alpha, limit, static_cast<cudaStream_t>(stream));
    TINYOSS_STREAMED(TINYOSS_SCASE)
  }
  return -1;
}

extern "C" const char* tinyoss_pair_variant_name(int variant) {
  switch (variant) {
#define TINYOSS_NAME(V, SW, U, KS, TL) \
  case V:                              \
    return SW ? "gate_up U" #U " KSPLIT" #KS " TILES" #TL : "down U" #U " KSPLIT" #KS " TILES" #TL;
    TINYOSS_VARIANTS(TINYOSS_NAME)
#define TINYOSS_SNAME(V, SW, C, S, W) \
  case V:                             \
    return SW ? "gate_up streamed C" #C " S" #S " W" #W : "down streamed C" #C " S" #S " W" #W;
    TINYOSS_STREAMED(TINYOSS_SNAME)
  }
  return nullptr;
}

// The grouped kernel with NS sets of 8 MMA columns: up to 8 * NS pairs of an expert a program,
// each weight fragment decoded once for all sets (sets past the group's pairs skipped). At 64
// tokens an expert has ~8 pairs on average, so groups of 8 read many experts twice. Otherwise
// group_gemv_mma's code. NOT YET RUN: written in session 9 after the device time was spent.
template <bool SWIGLU, int U, int TILES, int NS, typename XT>
__global__ void __launch_bounds__(TILES * 32)
    group_gemv_wide(const XT* __restrict__ x, int x_div, const int* __restrict__ sorted_ids,
                    const int* __restrict__ order, int P, const uint8_t* __restrict__ q,
                    const uint8_t* __restrict__ s, const __nv_bfloat16* __restrict__ bias,
                    const float* __restrict__ wts, float* __restrict__ out, int N, int K,
                    long stride_qe, int stride_q, long stride_se, float alpha, float limit) {
  constexpr bool SPLIT = !SWIGLU;
  constexpr int ROWS = 16 * TILES, THREADS = TILES * 32, NC = 8 * NS;
  extern __shared__ uint4 smem[];
  __shared__ unsigned cmax[NC];
  const int start = blockIdx.x;
  const int e = sorted_ids[start];
  if (start > 0 && sorted_ids[start - 1] == e) {
    int r = start;
    while (r > 0 && sorted_ids[r - 1] == e) --r;
    if ((start - r) % NC) return;
  }
  int count = 1;
  while (count < NC && start + count < P && sorted_ids[start + count] == e) ++count;
  const int nblk = K / 32, KW = K / 8, KP = KW + 1;
  uint4* xs = smem;
  uint4* xl = smem + NC * KP;
  uint8_t* ss = (uint8_t*)(smem + (SPLIT ? 2 : 1) * NC * KP);
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
  for (int u = 0; u < U; ++u) {
    wa[u] = __ldg(qa + 4 * u);
    wb[u] = __ldg(qb + 4 * u);
  }
  const uint4* sg = reinterpret_cast<const uint4*>(s + (long)e * stride_se + (long)row0 * nblk);
  for (int i = threadIdx.x; i < ROWS * nblk / 16; i += THREADS) {
    reinterpret_cast<uint4*>(ss)[i] = sg[i];
  }
  if (threadIdx.x < NC) cmax[threadIdx.x] = 0u;
  if (SPLIT) {
    for (int i = threadIdx.x; i < count * KW; i += THREADS) {
      const int j = i / KW, w = i % KW;
      const XT* xr = x + (long)(order[start + j] / x_div) * K + 8 * w;
      __half h[8], l[8];
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const float v = to_f(xr[c]);
        h[c] = __float2half_rn(v);
        l[c] = __float2half_rn(v - __half2float(h[c]));
      }
      xs[j * KP + w] = make_uint4(pack(h[0], h[4]), pack(h[1], h[5]), pack(h[2], h[6]),
                                  pack(h[3], h[7]));
      xl[j * KP + w] = make_uint4(pack(l[0], l[4]), pack(l[1], l[5]), pack(l[2], l[6]),
                                  pack(l[3], l[7]));
    }
  } else {
    __syncthreads();
    for (int i = threadIdx.x; i < count * KW; i += THREADS) {
      const int j = i / KW, w = i % KW;
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(
          x + (long)(order[start + j] / x_div) * K + 8 * w));
      const uint32_t r[4] = {raw.x, raw.y, raw.z, raw.w};
      uint32_t m = 0u;
#pragma unroll
      for (int c = 0; c < 4; ++c) m = max(m, max(r[c] & 0x7FFFu, (r[c] >> 16) & 0x7FFFu));
      atomicMax(&cmax[j], m << 16);
      xs[j * KP + w] = raw;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < count * KW; i += THREADS) {
      const int j = i / KW, w = i % KW;
      const float pre = stage_scale(__uint_as_float(cmax[j]));
      const uint4 raw = xs[j * KP + w];
      const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&raw);
      __half h[8];
#pragma unroll
      for (int c = 0; c < 8; ++c) h[c] = __float2half_rn(__bfloat162float(b[c]) * pre);
      xs[j * KP + w] = make_uint4(pack(h[0], h[4]), pack(h[1], h[5]), pack(h[2], h[6]),
                                  pack(h[3], h[7]));
    }
  }
  __syncthreads();
  const int sets = (count + 7) / 8;  // the same in every thread
  float acc[NS][4] = {};
  for (int b0 = 0; b0 < nblk; b0 += U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int b = b0 + u;
      const uint32_t a0 = pair16<0>(wa[u]), a1 = pair16<0>(wb[u]);
      const uint32_t a2 = pair16<1>(wa[u]), a3 = pair16<1>(wb[u]);
      const uint32_t c0 = pair16<2>(wa[u]), c1 = pair16<2>(wb[u]);
      const uint32_t c2 = pair16<3>(wa[u]), c3 = pair16<3>(wb[u]);
      const float sa = __uint_as_float((uint32_t)ss[la * nblk + b] << 23);
      const float sb = __uint_as_float((uint32_t)ss[lb * nblk + b] << 23);
#pragma unroll
      for (int k = 0; k < NS; ++k) {
        if (k < sets) {
          const uint4 xv = xs[(8 * k + g) * KP + 4 * b + t];
          float d[4] = {0.f, 0.f, 0.f, 0.f};
          mma(d, a0, a1, a2, a3, xv.x, xv.y);
          mma(d, c0, c1, c2, c3, xv.z, xv.w);
          if (SPLIT) {
            const uint4 xw = xl[(8 * k + g) * KP + 4 * b + t];
            mma(d, a0, a1, a2, a3, xw.x, xw.y);
            mma(d, c0, c1, c2, c3, xw.z, xw.w);
          }
          acc[k][0] = fmaf(d[0], sa, acc[k][0]);
          acc[k][1] = fmaf(d[1], sa, acc[k][1]);
          acc[k][2] = fmaf(d[2], sb, acc[k][2]);
          acc[k][3] = fmaf(d[3], sb, acc[k][3]);
        }
      }
    }
    if (b0 + U < nblk) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        wa[u] = __ldg(qa + 4 * (b0 + U + u));
        wb[u] = __ldg(qb + 4 * (b0 + U + u));
      }
    }
  }
#pragma unroll
  for (int k = 0; k < NS; ++k) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int c = 8 * k + 2 * t + i;
      if (c < count) {
        store<SWIGLU>(acc[k][i], acc[k][2 + i],
                      SPLIT ? 1.f : stage_scale(__uint_as_float(cmax[c])), row0 + la,
                      row0 + lb, order[start + c], e, bias, wts, out, N, alpha, limit);
      }
    }
  }
}

template <bool SWIGLU, int U, int TILES, int NS, typename XT>
int launch_wide(const void* x, int x_div, const int* sorted_ids, const int* order, int pairs,
                const uint8_t* q, const uint8_t* s, const void* bias, const float* wts,
                float* out, int N, int K, long stride_qe, int stride_q, long stride_se,
                float alpha, float limit, cudaStream_t stream) {
  constexpr int ROWS = 16 * TILES;
  if (N % ROWS || K % (32 * U) || K > KMAX) return (int)cudaErrorInvalidValue;
  const int smem = (SWIGLU ? 1 : 2) * 8 * NS * (K / 8 + 1) * 16 + ROWS * (K / 32);
  auto kernel = group_gemv_wide<SWIGLU, U, TILES, NS, XT>;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return (int)err;
  kernel<<<dim3(pairs, N / ROWS), TILES * 32, smem, stream>>>(
      static_cast<const XT*>(x), x_div, sorted_ids, order, pairs, q, s,
      static_cast<const __nv_bfloat16*>(bias), wts, out, N, K, stride_qe, stride_q, stride_se,
      alpha, limit);
  return (int)cudaGetLastError();
}

// The grouped kernel (group_gemv_mma) with other row tiles: (variant, swiglu, U, TILES)
#define TINYOSS_GROUPED(X)                                                                    \
  X(100, true, 9, 2) X(101, true, 9, 4) X(102, true, 9, 6) X(103, true, 9, 12)                \
  X(104, true, 9, 15) X(105, true, 9, 20) X(106, true, 15, 12) X(107, true, 5, 12)            \
  X(108, true, 6, 15)                                                                         \
  X(110, false, 9, 2) X(111, false, 9, 4) X(112, false, 9, 6) X(113, false, 9, 12)            \
  X(114, false, 9, 15) X(115, false, 9, 20) X(116, false, 15, 12) X(117, false, 5, 12)        \
  X(118, false, 6, 15)

// group_gemv_wide: (variant, swiglu, U, TILES, NS); NS 1 should time as group_gemv_mma
#define TINYOSS_WIDE(X)                                                                       \
  X(130, true, 9, 12, 2) X(131, true, 9, 12, 1) X(140, false, 9, 20, 2) X(141, false, 9, 20, 1) \
  X(142, false, 9, 12, 2)

extern "C" int tinyoss_grouped_variant(int variant, const void* x, int x_div,
                                       const int* sorted_ids, const int* order, int pairs,
                                       const uint8_t* q, const uint8_t* s, const void* bias,
                                       const float* wts, float* out, int N, int K,
                                       long stride_qe, int stride_q, long stride_se, float alpha,
                                       float limit, void* stream) {
  switch (variant) {
#define TINYOSS_GCASE(V, SW, U, TL)                                                           \
  case V:                                                                                     \
    return launch_grouped<SW, U, TL, std::conditional_t<SW, __nv_bfloat16, float>>(           \
        x, x_div, sorted_ids, order, pairs, q, s, bias, wts, out, N, K, stride_qe, stride_q,  \
        stride_se, alpha, limit, static_cast<cudaStream_t>(stream));
    TINYOSS_GROUPED(TINYOSS_GCASE)
#define TINYOSS_WCASE(V, SW, U, TL, NS)                                                       \
  case V:                                                                                     \
    return launch_wide<SW, U, TL, NS, std::conditional_t<SW, __nv_bfloat16, float>>(         \
        x, x_div, sorted_ids, order, pairs, q, s, bias, wts, out, N, K, stride_qe, stride_q,  \
        stride_se, alpha, limit, static_cast<cudaStream_t>(stream));
    TINYOSS_WIDE(TINYOSS_WCASE)
  }
  return -1;
}

extern "C" const char* tinyoss_grouped_variant_name(int variant) {
  switch (variant) {
#define TINYOSS_GNAME(V, SW, U, TL) \
  case V:                           \
    return SW ? "grouped gate_up U" #U " TILES" #TL : "grouped down U" #U " TILES" #TL;
    TINYOSS_GROUPED(TINYOSS_GNAME)
#define TINYOSS_WNAME(V, SW, U, TL, NS) \
  case V:                               \
    return SW ? "wide gate_up U" #U " TILES" #TL " NS" #NS                                 \
              : "wide down U" #U " TILES" #TL " NS" #NS;
    TINYOSS_WIDE(TINYOSS_WNAME)
  }
  return nullptr;
}
