// Tile variants of the product's tensor-core MoE GEMVs (tinyoss/kernels/moe_gemv_mma.cu, on
// experts shuffled into fragment order), for sweep_pair.py: the pair kernel with other (U,
// KSPLIT, TILES) choices and a variant that streams its tiles through shared memory with
// cp.async; with --grouped the grouped kernel with other (U, TILES) and streamed (C, S, W).
// Built by nvcc into a library of its own, launched through ctypes like the product's.
#include <type_traits>

#include "../../../tinyoss/kernels/moe_gemv_mma.cu"
#include "cp_async.cuh"

namespace {
// The streamed kernels on shuffled weights: a stage (C blocks, C even) is C * 256 contiguous
// bytes of the tile, copied 16 bytes a lane; each lane then reads its own 16 bytes of each block
// pair from shared memory (no ldmatrix, no padding: lanes read consecutive 16-byte units).
template <int C, int S>
__device__ __forceinline__ void issue_stage(uint8_t* ring, const uint8_t* __restrict__ tile,
                                                 int st) {
  uint8_t* dst = ring + (st % S) * C * 256;
  const uint8_t* src = tile + (long)st * C * 256;
#pragma unroll
  for (int i = threadIdx.x & 31; i < C * 16; i += 32) cp_async16(dst + i * 16, src + i * 16);
}

template <bool SWIGLU, int C, int S>
__device__ __forceinline__ void stream_rows(uint8_t* ring, const uint8_t* __restrict__ tile,
                                                 int nst, const uint4* xs, const uint4* xl,
                                                 const uint8_t* ss, int nblk, int ca, int cb,
                                                 float (&acc)[4]) {
  constexpr bool SPLIT = !SWIGLU;
  const int lane = threadIdx.x & 31, t = lane & 3;
  for (int st = 0; st < nst; ++st) {
    cp_wait<S - 2>();
    __syncwarp();
    if (st + S - 1 < nst) issue_stage<C, S>(ring, tile, st + S - 1);
    cp_commit();
    const uint4* w = reinterpret_cast<const uint4*>(ring + (st % S) * C * 256) + lane;
#pragma unroll
    for (int j = 0; j < C / 2; ++j) {
      const uint4 v = w[32 * j];
      const int b = st * C + 2 * j;
      float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
      block_mma<SPLIT>(d0, v.x, v.z, xs[4 * b + t], SPLIT ? xl[4 * b + t] : uint4{});
      block_mma<SPLIT>(d1, v.y, v.w, xs[4 * b + 4 + t], SPLIT ? xl[4 * b + 4 + t] : uint4{});
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

template <bool SWIGLU, int C, int S, int W, typename XT>
__global__ void __launch_bounds__(W * 32)
    pair_gemv_stream(const XT* __restrict__ x, int x_div, const int* __restrict__ ids,
                          const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                          const __nv_bfloat16* __restrict__ bias, const float* __restrict__ wts,
                          float* __restrict__ out, int N, int K, long stride_qe, int stride_q,
                          long stride_se, float alpha, float limit) {
  constexpr bool SPLIT = !SWIGLU;
  constexpr int XWORDS = (KMAX / 8 + W * 32 - 1) / (W * 32);
  extern __shared__ uint4 smem[];
  __shared__ float xmax[W];
  const int nblk = K / 32, nst = nblk / C;
  uint4* xs = smem;
  uint4* xl = smem + K / 8;
  uint8_t* base = (uint8_t*)(smem + (SPLIT ? 2 : 1) * (K / 8));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  uint8_t* ring = base + warp * (S * C * 256 + 16 * nblk);
  uint8_t* ss = ring + S * C * 256;
  const int pair = blockIdx.x;
  const long e = ids[pair];
  const int row0 = (blockIdx.y * W + warp) * 16;
  const uint8_t* tile = q + e * stride_qe + (long)row0 * stride_q;
  const uint8_t* sg = s + e * stride_se + (long)row0 * nblk;
  for (int i = lane; i < nblk; i += 32) cp_async16(ss + i * 16, sg + i * 16);
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < nst) issue_stage<C, S>(ring, tile, st);
    cp_commit();
  }
  const float pre = stage_x<SPLIT, XWORDS, W>(x + (long)(pair / x_div) * K, K, xs, xl, xmax);
  __syncthreads();
  const int ca = SWIGLU ? 2 * g : g, cb = SWIGLU ? 2 * g + 1 : g + 8;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  stream_rows<SWIGLU, C, S>(ring, tile, nst, xs, xl, ss, nblk, ca, cb, acc);
  if (t == 0) {
    store<SWIGLU>(acc[0], acc[2], pre, row0 + ca, row0 + cb, pair, e, bias, wts, out, N, alpha,
                  limit);
  }
}

template <bool SWIGLU, int C, int S, int W, typename XT>
__global__ void __launch_bounds__(W * 32)
    group_gemv_stream(const XT* __restrict__ x, int x_div, const int* __restrict__ groups,
                           const int* __restrict__ sorted_ids, const int* __restrict__ order,
                           const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                           const __nv_bfloat16* __restrict__ bias, const float* __restrict__ wts,
                           float* __restrict__ out, int N, int K, long stride_qe, int stride_q,
                           long stride_se, float alpha, float limit) {
  constexpr bool SPLIT = !SWIGLU;
  extern __shared__ uint4 smem[];
  __shared__ float cpre[8];
  const int gi = groups[blockIdx.x];
  if (gi < 0) return;
  const int start = gi & 0xFFFF, count = gi >> 16;
  const int e = sorted_ids[start];
  const int nblk = K / 32, nst = nblk / C, KP = K / 8 + 1;
  uint4* xs = smem;
  uint4* xl = smem + 8 * KP;
  uint8_t* base = (uint8_t*)(smem + (SPLIT ? 2 : 1) * 8 * KP);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  uint8_t* ring = base + warp * (S * C * 256 + 16 * nblk);
  uint8_t* ss = ring + S * C * 256;
  const int row0 = (blockIdx.y * W + warp) * 16;
  const uint8_t* tile = q + (long)e * stride_qe + (long)row0 * stride_q;
  const uint8_t* sg = s + (long)e * stride_se + (long)row0 * nblk;
  for (int i = lane; i < nblk; i += 32) cp_async16(ss + i * 16, sg + i * 16);
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < nst) issue_stage<C, S>(ring, tile, st);
    cp_commit();
  }
  stage_group<SPLIT, W>(x, x_div, order + start, count, K, xs, xl, cpre);
  __syncthreads();
  const int ca = SWIGLU ? 2 * g : g, cb = SWIGLU ? 2 * g + 1 : g + 8;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  stream_rows<SWIGLU, C, S>(ring, tile, nst, xs + g * KP, xl + g * KP, ss, nblk, ca, cb,
                                 acc);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int c = 2 * t + i;
    if (c < count) {
      store<SWIGLU>(acc[i], acc[2 + i], SPLIT ? 1.f : cpre[c], row0 + ca, row0 + cb,
                    order[start + c], e, bias, wts, out, N, alpha, limit);
    }
  }
}

template <bool SWIGLU, int C, int S, int W, typename XT>
int launch_stream(const void* x, int x_div, const int* ids, int pairs, const uint8_t* q,
                       const uint8_t* s, const void* bias, const float* wts, float* out, int N,
                       int K, long stride_qe, int stride_q, long stride_se, float alpha,
                       float limit, cudaStream_t stream) {
  if (N % (16 * W) || (K / 32) % C || C % 2 || K > KMAX) return (int)cudaErrorInvalidValue;
  const int smem = (SWIGLU ? 1 : 2) * (K / 8) * 16 + W * (S * C * 256 + 16 * (K / 32));
  auto kernel = pair_gemv_stream<SWIGLU, C, S, W, XT>;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return (int)err;
  kernel<<<dim3(pairs, N / (16 * W)), W * 32, smem, stream>>>(
      static_cast<const XT*>(x), x_div, ids, q, s, static_cast<const __nv_bfloat16*>(bias), wts,
      out, N, K, stride_qe, stride_q, stride_se, alpha, limit);
  return (int)cudaGetLastError();
}

template <bool SWIGLU, int C, int S, int W, typename XT>
int launch_grouped_stream(const void* x, int x_div, const int* groups, int G,
                               const int* sorted_ids, const int* order, const uint8_t* q,
                               const uint8_t* s, const void* bias, const float* wts, float* out,
                               int N, int K, long stride_qe, int stride_q, long stride_se,
                               float alpha, float limit, cudaStream_t stream) {
  if (N % (16 * W) || (K / 32) % C || C % 2 || K > KMAX) return (int)cudaErrorInvalidValue;
  const int smem = (SWIGLU ? 1 : 2) * 8 * (K / 8 + 1) * 16 + W * (S * C * 256 + 16 * (K / 32));
  auto kernel = group_gemv_stream<SWIGLU, C, S, W, XT>;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return (int)err;
  kernel<<<dim3(G, N / (16 * W)), W * 32, smem, stream>>>(
      static_cast<const XT*>(x), x_div, groups, sorted_ids, order, q, s,
      static_cast<const __nv_bfloat16*>(bias), wts, out, N, K, stride_qe, stride_q, stride_se,
      alpha, limit);
  return (int)cudaGetLastError();
}

}  // namespace

// (variant, swiglu, U, KSPLIT, TILES): the product's pair kernel (U even, dividing K / 32 / KSPLIT)
#define TINYOSS_VARIANTS(X)                                                                   \
  X(0, true, 10, 3, 4) X(1, true, 18, 1, 4) X(2, true, 10, 1, 4) X(3, true, 6, 3, 2)          \
  X(4, true, 10, 1, 2) X(5, true, 30, 3, 1) X(6, true, 6, 1, 4)                               \
  X(20, false, 6, 3, 2) X(21, false, 10, 3, 2) X(22, false, 10, 1, 4) X(23, false, 18, 1, 2)  \
  X(24, false, 6, 5, 1) X(25, false, 18, 5, 1) X(26, false, 10, 3, 4)

// streamed (pair_gemv_stream): (variant, swiglu, C blocks a stage, S stages, W warps)
#define TINYOSS_STREAMED(X)                                                                   \
  X(40, true, 10, 3, 4) X(41, true, 10, 4, 4) X(42, true, 18, 3, 4) X(43, true, 10, 9, 2)     \
  X(50, false, 10, 3, 4) X(51, false, 10, 9, 2) X(52, false, 18, 5, 2)

// gate_up (bf16 x) or down (fp32 x), as the name says; -1 for an unknown variant
extern "C" int tinyoss_pair_variant(int variant, const void* x, int x_div, const int* ids,
                                    int pairs, const uint8_t* q, const uint8_t* s,
                                    const void* bias, const float* wts, float* out, int N, int K,
                                    long stride_qe, int stride_q, long stride_se, float alpha,
                                    float limit, void* stream) {
  switch (variant) {
#define TINYOSS_CASE(V, SW, U, KS, TL)                                                        \
  case V:                                                                                     \
    return launch<SW, U, KS, TL, std::conditional_t<SW, __nv_bfloat16, float>>(               \
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

// The grouped kernel (group_gemv_mma) with other row tiles: (variant, swiglu, U, TILES)
#define TINYOSS_GROUPED(X)                                                                    \
  X(100, true, 6, 12) X(101, true, 10, 12) X(102, true, 18, 12) X(103, true, 10, 8)           \
  X(104, true, 6, 15)                                                                         \
  X(110, false, 10, 20) X(111, false, 6, 20) X(112, false, 10, 12) X(113, false, 18, 12)      \
  X(114, false, 6, 15)

// The streamed grouped kernel (group_gemv_stream): (variant, swiglu, C, S, W)
#define TINYOSS_GROUPED_STREAM(X)                                                             \
  X(170, true, 6, 4, 6) X(171, true, 10, 3, 6) X(172, true, 10, 4, 4)                         \
  X(180, false, 10, 2, 12) X(181, false, 10, 3, 12) X(182, false, 6, 3, 12)

extern "C" int tinyoss_grouped_variant(int variant, const void* x, int x_div, const int* groups,
                                       int G, const int* sorted_ids, const int* order, int pairs,
                                       const uint8_t* q, const uint8_t* s, const void* bias,
                                       const float* wts, float* out, int N, int K,
                                       long stride_qe, int stride_q, long stride_se, float alpha,
                                       float limit, void* stream) {
  (void)pairs;
  switch (variant) {
#define TINYOSS_GCASE(V, SW, U, TL)                                                           \
  case V:                                                                                     \
    return launch_grouped<SW, U, TL, std::conditional_t<SW, __nv_bfloat16, float>>(           \
        x, x_div, groups, G, sorted_ids, order, q, s, bias, wts, out, N, K, stride_qe,        \
        stride_q, stride_se, alpha, limit, static_cast<cudaStream_t>(stream));
    TINYOSS_GROUPED(TINYOSS_GCASE)
#define TINYOSS_GSCASE(V, SW, C, S, W)                                                        \
  case V:                                                                                     \
    return launch_grouped_stream<SW, C, S, W, std::conditional_t<SW, __nv_bfloat16, float>>(  \
        x, x_div, groups, G, sorted_ids, order, q, s, bias, wts, out, N, K, stride_qe,        \
        stride_q, stride_se, alpha, limit, static_cast<cudaStream_t>(stream));
    TINYOSS_GROUPED_STREAM(TINYOSS_GSCASE)
  }
  return -1;
}

extern "C" const char* tinyoss_grouped_variant_name(int variant) {
  switch (variant) {
#define TINYOSS_GNAME(V, SW, U, TL) \
  case V:                           \
    return SW ? "grouped gate_up U" #U " TILES" #TL : "grouped down U" #U " TILES" #TL;
    TINYOSS_GROUPED(TINYOSS_GNAME)
#define TINYOSS_GSNAME(V, SW, C, S, W)                                 \
  case V:                                                              \
    return SW ? "grouped gate_up streamed C" #C " S" #S " W" #W        \
              : "grouped down streamed C" #C " S" #S " W" #W;
    TINYOSS_GROUPED_STREAM(TINYOSS_GSNAME)
  }
  return nullptr;
}
