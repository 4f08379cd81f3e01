// The product's tensor-core pair GEMV (tinyoss/kernels/moe_gemv_mma.cu, pair_gemv_mma) on the
// experts "word-interleaved" at load (interleave.py): within each row, every group of 4 scale
// blocks (64 bytes) is stored as its 4 x 4 words transposed, so that word t of blocks
// 4G..4G+3 lie together. Lane (g, t) then loads 16 contiguous bytes of row g (and of row g + 8)
// for four blocks, where the product loads 4 bytes a block: a warp's load is 8 rows x 64
// contiguous bytes. The MMAs, scales and x are the product's, unchanged; rows stay rows, so the
// prefill GEMMs keep their row loads (only which scale a word takes changes). A row's last
// group has nblk % 4 blocks when K / 32 is no multiple of 4 (2880: 90 blocks, 22 groups of 4
// and one of 2), its words likewise transposed.
#include <type_traits>

#include "../../../tinyoss/kernels/moe_gemv_mma.cu"

namespace {

// words t of group gi's blocks (gs of them: 4, or the last group's nblk % 4) of one row
__device__ __forceinline__ uint4 load_group(const uint8_t* row, int gi, int full, int rem, int t) {
  if (gi < full) return __ldg(reinterpret_cast<const uint4*>(row + 64 * gi) + t);
  const uint32_t* p = reinterpret_cast<const uint32_t*>(row + 64 * gi) + rem * t;
  uint4 v = make_uint4(__ldg(p), 0u, 0u, 0u);
  if (rem > 1) v.y = __ldg(p + 1);
  if (rem > 2) v.z = __ldg(p + 2);
  return v;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// UG: groups of 4 blocks a load group; KSPLIT: warps splitting K by whole groups; TILES: as the
// product's
template <bool SWIGLU, int UG, int KSPLIT, int TILES, typename XT>
__global__ void __launch_bounds__(TILES * KSPLIT * 32)
    pair_gemv_il(const XT* __restrict__ x, int x_div, const int* __restrict__ ids,
                 const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                 const __nv_bfloat16* __restrict__ bias, const float* __restrict__ wts,
                 float* __restrict__ out, int N, int K, long stride_qe, int stride_q,
                 long stride_se, float alpha, float limit) {
  constexpr bool SPLIT = std::is_same<XT, float>::value;
  constexpr int ROWS = 16 * TILES, THREADS = TILES * KSPLIT * 32;
  constexpr int XWORDS = (KMAX / 8 + THREADS - 1) / THREADS;
  extern __shared__ uint4 smem[];
  __shared__ float xmax[TILES * KSPLIT];
  const int nblk = K / 32, full = nblk / 4, rem = nblk % 4, ngrp = (nblk + 3) / 4;
  const int per = (ngrp + KSPLIT - 1) / KSPLIT;
  uint4* xs = smem;
  uint4* xl = smem + K / 8;
  uint8_t* ss = (uint8_t*)(smem + (SPLIT ? 2 : 1) * (K / 8));
  const int pair = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) % TILES;
  const int part = (threadIdx.x >> 5) / TILES, first = part * per;
  const int cnt = max(0, min(per, ngrp - first));
  const int g = lane >> 2, t = lane & 3;
  const long e = ids ? ids[pair] : 0;
  const int row0 = blockIdx.y * ROWS;
  const int la = SWIGLU ? 2 * (warp * 8 + g) : warp * 16 + g;
  const int lb = SWIGLU ? la + 1 : la + 8;
  const uint8_t* ra = q + e * stride_qe + (long)(row0 + la) * stride_q;
  const uint8_t* rb = q + e * stride_qe + (long)(row0 + lb) * stride_q;
  uint4 wa[UG], wb[UG];
#pragma unroll
  for (int u = 0; u < UG; ++u) {
    if (u < cnt) {
      wa[u] = load_group(ra, first + u, full, rem, t);
      wb[u] = load_group(rb, first + u, full, rem, t);
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
  for (int g0 = 0; g0 < cnt; g0 += UG) {
#pragma unroll
    for (int u = 0; u < UG; ++u) {
      if (g0 + u >= cnt) break;
      const int gi = first + g0 + u, gs = gi < full ? 4 : rem;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (j >= gs) break;
        const int b = 4 * gi + j;
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        block_mma<SPLIT>(d, word(wa[u], j), word(wb[u], j), xs[4 * b + t],
                         SPLIT ? xl[4 * b + t] : uint4{});
        acc_a = fmaf(d[0], __uint_as_float((uint32_t)ss[la * nblk + b] << 23), acc_a);
        acc_b = fmaf(d[2], __uint_as_float((uint32_t)ss[lb * nblk + b] << 23), acc_b);
      }
    }
    if (g0 + UG < cnt) {
#pragma unroll
      for (int u = 0; u < UG; ++u) {
        if (g0 + UG + u < cnt) {
          wa[u] = load_group(ra, first + g0 + UG + u, full, rem, t);
          wb[u] = load_group(rb, first + g0 + UG + u, full, rem, t);
        }
      }
    }
  }
  if (KSPLIT > 1) {
    float* red = reinterpret_cast<float*>(smem);
    __syncthreads();
    if (part > 0 && t == 0) {
      red[((part - 1) * TILES + warp) * 16 + g] = acc_a;
      red[((part - 1) * TILES + warp) * 16 + 8 + g] = acc_b;
    }
    __syncthreads();
    if (part > 0) return;
#pragma unroll
    for (int p = 1; p < KSPLIT; ++p) {
      acc_a += red[((p - 1) * TILES + warp) * 16 + g];
      acc_b += red[((p - 1) * TILES + warp) * 16 + 8 + g];
    }
  }
  if (t == 0) {
    store<SWIGLU>(acc_a, acc_b, pre, row0 + la, row0 + lb, pair, e, bias, wts, out, N, alpha,
                  limit);
  }
}

template <bool SWIGLU, int UG, int KSPLIT, int TILES>
int launch_il(const void* x, int x_div, const int* ids, int pairs, const uint8_t* q,
              const uint8_t* s, const void* bias, const float* wts, float* out, int N, int K,
              long stride_qe, int stride_q, long stride_se, float alpha, float limit,
              cudaStream_t stream) {
  using XT = std::conditional_t<SWIGLU, __nv_bfloat16, float>;
  constexpr int ROWS = 16 * TILES;
  if (N % ROWS || K % 32 || K > KMAX || stride_q % 16) return (int)cudaErrorInvalidValue;
  const int smem = (SWIGLU ? 1 : 2) * (K / 8) * 16 + ROWS * (K / 32);
  pair_gemv_il<SWIGLU, UG, KSPLIT, TILES, XT><<<dim3(pairs, N / ROWS), TILES * KSPLIT * 32,
                                                smem, stream>>>(
      static_cast<const XT*>(x), x_div, ids, q, s, static_cast<const __nv_bfloat16*>(bias), wts,
      out, N, K, stride_qe, stride_q, stride_se, alpha, limit);
  return (int)cudaGetLastError();
}

}  // namespace

// (variant, swiglu, UG, KSPLIT, TILES)
#define TINYOSS_IL_VARIANTS(X)                                                               \
  X(0, true, 2, 2, 4) X(1, true, 3, 2, 4) X(2, true, 2, 3, 4) X(3, true, 3, 1, 4)            \
  X(4, true, 4, 2, 4) X(5, true, 2, 1, 4) X(6, true, 2, 2, 2) X(7, true, 3, 3, 2)            \
  X(20, false, 2, 2, 2) X(21, false, 2, 3, 2) X(22, false, 3, 2, 2) X(23, false, 4, 1, 4)    \
  X(24, false, 3, 3, 2) X(25, false, 2, 1, 4) X(26, false, 4, 2, 2) X(27, false, 2, 4, 1)    \
  X(28, false, 3, 1, 4)

extern "C" int tinyoss_il_variant(int variant, const void* x, int x_div, const int* ids,
                                  int pairs, const uint8_t* q, const uint8_t* s,
                                  const void* bias, const float* wts, float* out, int N, int K,
                                  long stride_qe, int stride_q, long stride_se, float alpha,
                                  float limit, void* stream) {
  switch (variant) {
#define TINYOSS_IL_CASE(V, SW, UG, KS, TL)                                                     \
  case V:                                                                                      \
    return launch_il<SW, UG, KS, TL>(x, x_div, ids, pairs, q, s, bias, wts, out, N, K,         \
                                     stride_qe, stride_q, stride_se, alpha, limit,             \
                                     static_cast<cudaStream_t>(stream));
    TINYOSS_IL_VARIANTS(TINYOSS_IL_CASE)
#undef TINYOSS_IL_CASE
    default:
      return -1;
  }
}

extern "C" const char* tinyoss_il_variant_name(int variant) {
  switch (variant) {
#define TINYOSS_IL_NAME(V, SW, UG, KS, TL) \
  case V:                                  \
    return SW ? "il gate_up UG" #UG " KSPLIT" #KS " TILES" #TL : "il down UG" #UG " KSPLIT" #KS " TILES" #TL;
    TINYOSS_IL_VARIANTS(TINYOSS_IL_NAME)
#undef TINYOSS_IL_NAME
    default:
      return nullptr;
  }
}
