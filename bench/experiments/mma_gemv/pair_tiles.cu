// Tile variants of the product's tensor-core MoE GEMVs (tinyoss/kernels/moe_gemv_mma.cu), for
// sweep_pair.py: the pair kernel with other (U, KSPLIT, TILES) choices and the streamed one;
// with --grouped the grouped kernels with other (U, TILES) and (C, S, W); at the end, the register
// kernels on weights shuffled into fragment order (shuffled.py). Built by nvcc into a library of
// its own, launched through ctypes like the product's.
#include <type_traits>

#include "../../../tinyoss/kernels/moe_gemv_mma.cu"

#define TINYOSS_VARIANTS(X)                                                                   \
  X(0, true, 9, 2, 4) X(1, true, 15, 3, 2) X(2, true, 9, 5, 1) X(3, true, 15, 2, 1)           \
  X(4, true, 45, 2, 2) X(5, true, 15, 3, 1) X(6, true, 9, 2, 2) X(7, true, 9, 1, 4)           \
  X(8, true, 9, 4, 2) X(9, true, 9, 3, 2) X(10, true, 9, 4, 1) X(11, true, 5, 3, 2)           \
  X(12, true, 9, 2, 1) X(13, true, 9, 3, 4)                                                   \
  X(20, false, 15, 1, 4) X(21, false, 15, 3, 2) X(22, false, 15, 6, 1) X(23, false, 9, 5, 2)  \
  X(24, false, 18, 5, 1) X(25, false, 10, 3, 2) X(26, false, 9, 10, 1) X(27, false, 45, 2, 1) \
  X(28, false, 5, 3, 2) X(29, false, 9, 2, 2)

// the streamed pair kernel with an L2 prefetch hint on its copies (HINT: 1 = L2::128B, 2 =
// L2::256B; the product's 1-token gate_up is 2): (variant, swiglu, C, S, W, HINT). The register
// kernel with the hint (ld.global.nc.L2::128B / 256B, and 256B without an L1 line) measured no
// faster at any shape (bench/results/2026-11-28_h100_pair_l2_hint.txt) and was not kept
#define TINYOSS_SHINTED(X) X(90, true, 10, 3, 4, 1) X(91, true, 10, 3, 4, 2)

// streamed (pair_gemv_stream): (variant, swiglu, C blocks a stage, S stages, W warps); 46-49 and
// 56-59 keep a whole 16-row tile (9 stages of 10 blocks, 5 of 18) or half of it in flight from
// the start: at 1 token every load is requested at once (one round trip, not 5-9), not yet run
#define TINYOSS_STREAMED(X)                                                                   \
  X(40, true, 10, 4, 4) X(41, true, 10, 3, 4) X(42, true, 18, 3, 4) X(43, true, 6, 6, 4)      \
  X(44, true, 10, 4, 2) X(45, true, 10, 6, 2)                                                 \
  X(46, true, 10, 9, 1) X(47, true, 10, 9, 2) X(48, true, 10, 5, 2) X(49, true, 18, 5, 1)     \
  X(50, false, 10, 4, 4) X(51, false, 10, 3, 4) X(52, false, 18, 3, 4) X(53, false, 6, 6, 4)  \
  X(54, false, 10, 4, 2) X(55, false, 10, 6, 2)                                               \
  X(56, false, 10, 9, 1) X(57, false, 10, 9, 2) X(58, false, 10, 9, 4) X(59, false, 18, 5, 2)

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
#define TINYOSS_SHCASE(V, SW, C, S, W, H)                                                     \
  case V:                                                                                     \
    return launch_stream<SW, C, S, W, std::conditional_t<SW, __nv_bfloat16, float>, H>(      \
        x, x_div, ids, pairs, q, s, bias, wts, out, N, K, stride_qe, stride_q, stride_se,     \
        alpha, limit, static_cast<cudaStream_t>(stream));
    TINYOSS_SHINTED(TINYOSS_SHCASE)
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
#define TINYOSS_SHNAME(V, SW, C, S, W, H) \
  case V:                                 \
    return SW ? "gate_up streamed C" #C " S" #S " W" #W " H" #H : "down streamed C" #C " H" #H;
    TINYOSS_SHINTED(TINYOSS_SHNAME)
  }
  return nullptr;
}

// The grouped kernel (group_gemv_mma) with other row tiles: (variant, swiglu, U, TILES)
#define TINYOSS_GROUPED(X)                                                                    \
  X(100, true, 9, 2) X(101, true, 9, 4) X(102, true, 9, 6) X(103, true, 9, 12)                \
  X(104, true, 9, 15) X(105, true, 9, 20) X(106, true, 15, 12) X(107, true, 5, 12)            \
  X(108, true, 6, 15)                                                                         \
  X(110, false, 9, 2) X(111, false, 9, 4) X(112, false, 9, 6) X(113, false, 9, 12)            \
  X(114, false, 9, 15) X(115, false, 9, 20) X(116, false, 15, 12) X(117, false, 5, 12)        \
  X(118, false, 6, 15)

// The streamed grouped kernel (group_gemv_stream): (variant, swiglu, C, S, W)
#define TINYOSS_GROUPED_STREAM(X)                                                             \
  X(170, true, 10, 3, 4) X(171, true, 10, 3, 6) X(172, true, 10, 4, 4) X(173, true, 6, 4, 6)  \
  X(174, true, 6, 3, 4) X(175, true, 10, 2, 6)                                                \
  X(180, false, 10, 3, 12) X(181, false, 6, 3, 12) X(182, false, 10, 2, 12)                   \
  X(183, false, 6, 4, 9) X(184, false, 10, 3, 6) X(185, false, 6, 3, 6)
// ... with the L2 fetching 128 (H1) or 256 bytes (H2) a miss: (variant, swiglu, C, S, W, HINT);
// measured at 16-64 tokens (bench/results/2026-11-28_h100_grouped_hint.txt): within 1-3 us of
// the same tile without the hint, never ahead of the product's tiles: not kept
#define TINYOSS_GROUPED_STREAM_HINTED(X)                                                      \
  X(176, true, 10, 3, 4, 2) X(177, true, 10, 3, 6, 2) X(178, true, 10, 3, 4, 1)               \
  X(186, false, 10, 2, 12, 2) X(187, false, 10, 3, 12, 2) X(188, false, 10, 2, 12, 1)

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
#define TINYOSS_GSHCASE(V, SW, C, S, W, H)                                                    \
  case V:                                                                                     \
    return launch_grouped_stream<SW, C, S, W, std::conditional_t<SW, __nv_bfloat16, float>,   \
                                 H>(x, x_div, groups, G, sorted_ids, order, q, s, bias, wts,  \
                                    out, N, K, stride_qe, stride_q, stride_se, alpha, limit,  \
                                    static_cast<cudaStream_t>(stream));
    TINYOSS_GROUPED_STREAM_HINTED(TINYOSS_GSHCASE)
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
#define TINYOSS_GSHNAME(V, SW, C, S, W, H)                                   \
  case V:                                                                    \
    return SW ? "grouped gate_up streamed C" #C " S" #S " W" #W " H" #H      \
              : "grouped down streamed C" #C " S" #S " W" #W " H" #H;
    TINYOSS_GROUPED_STREAM_HINTED(TINYOSS_GSHNAME)
  }
  return nullptr;
}

// ---- Pre-shuffled weights (not yet run) ----
// The checkpoint's rows hand each thread 4 bytes of 8 rows an instruction (a warp touches 8
// rows x 16 bytes). Shuffled at load (shuffled.py: `shuffle`), a 16-row tile holds, for each
// pair of scale blocks jb and each lane (g, t), the 16 bytes that lane's MMA fragments take:
// word t of blocks 2jb and 2jb + 1 of MMA rows g and g + 8 ([qa b, qb b, qa b+1, qb b+1]), so a
// warp's load is 512 contiguous bytes and a tile one contiguous 23 KB stream. Same bytes, same
// tile and row strides; only the order inside a tile changes. These are pair_gemv_mma and
// group_gemv_mma with that load (U even, each K part an even number of blocks).
template <int U>
__device__ __forceinline__ void load_shuf(const uint4* __restrict__ qw, int b0, uint32_t (&wa)[U],
                                          uint32_t (&wb)[U]) {
#pragma unroll
  for (int u = 0; u < U; u += 2) {
    const uint4 v = __ldg(qw + ((b0 + u) / 2) * 32);
    wa[u] = v.x, wb[u] = v.y, wa[u + 1] = v.z, wb[u + 1] = v.w;
  }
}

template <bool SWIGLU, int U, int KSPLIT, int TILES, typename XT>
__global__ void __launch_bounds__(TILES * KSPLIT * 32)
    pair_gemv_shuf(const XT* __restrict__ x, int x_div, const int* __restrict__ ids,
                   const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                   const __nv_bfloat16* __restrict__ bias, const float* __restrict__ wts,
                   float* __restrict__ out, int N, int K, long stride_qe, int stride_q,
                   long stride_se, float alpha, float limit) {
  constexpr bool SPLIT = !SWIGLU;
  constexpr int ROWS = 16 * TILES, THREADS = TILES * KSPLIT * 32;
  constexpr int XWORDS = (KMAX / 8 + THREADS - 1) / THREADS;
  extern __shared__ uint4 smem[];
  __shared__ float xmax[TILES * KSPLIT];
  const int nblk = K / 32, per = nblk / KSPLIT;
  uint4* xs = smem;
  uint4* xl = smem + K / 8;
  uint8_t* ss = (uint8_t*)(smem + (SPLIT ? 2 : 1) * (K / 8));
  const int pair = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) % TILES;
  const int part = (threadIdx.x >> 5) / TILES, first = part * per;
  const int g = lane >> 2, t = lane & 3;
  const long e = ids[pair];
  const int row0 = blockIdx.y * ROWS;
  const int la = SWIGLU ? 2 * (warp * 8 + g) : warp * 16 + g;
  const int lb = SWIGLU ? la + 1 : la + 8;
  const uint4* qw = reinterpret_cast<const uint4*>(q + e * stride_qe +
                                                   (long)(row0 + 16 * warp) * stride_q) + lane;
  uint32_t wa[U], wb[U];
  load_shuf<U>(qw, first, wa, wb);
  const uint4* sg = reinterpret_cast<const uint4*>(s + e * stride_se + (long)row0 * nblk);
  for (int i = threadIdx.x; i < ROWS * nblk / 16; i += blockDim.x) {
    reinterpret_cast<uint4*>(ss)[i] = sg[i];
  }
  const float pre = stage_x<SPLIT, XWORDS, TILES * KSPLIT>(x + (long)(pair / x_div) * K, K, xs,
                                                            xl, xmax);
  __syncthreads();
  float acc_a = 0.f, acc_b = 0.f;
  for (int b0 = 0; b0 < per; b0 += U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int b = first + b0 + u;
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      block_mma<SPLIT>(d, wa[u], wb[u], xs[4 * b + t], SPLIT ? xl[4 * b + t] : uint4{});
      acc_a = fmaf(d[0], __uint_as_float((uint32_t)ss[la * nblk + b] << 23), acc_a);
      acc_b = fmaf(d[2], __uint_as_float((uint32_t)ss[lb * nblk + b] << 23), acc_b);
    }
    if (b0 + U < per) load_shuf<U>(qw, first + b0 + U, wa, wb);
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

template <bool SWIGLU, int U, int TILES, typename XT>
__global__ void __launch_bounds__(TILES * 32)
    group_gemv_shuf(const XT* __restrict__ x, int x_div, const int* __restrict__ groups,
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
  const int nblk = K / 32, KP = K / 8 + 1;
  uint4* xs = smem;
  uint4* xl = smem + 8 * KP;
  uint8_t* ss = (uint8_t*)(smem + (SPLIT ? 2 : 1) * 8 * KP);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.y * ROWS;
  const int la = SWIGLU ? 2 * (warp * 8 + g) : warp * 16 + g;
  const int lb = SWIGLU ? la + 1 : la + 8;
  const uint4* qw = reinterpret_cast<const uint4*>(q + (long)e * stride_qe +
                                                   (long)(row0 + 16 * warp) * stride_q) + lane;
  uint32_t wa[U], wb[U];
  load_shuf<U>(qw, 0, wa, wb);
  const uint4* sg = reinterpret_cast<const uint4*>(s + (long)e * stride_se + (long)row0 * nblk);
  for (int i = threadIdx.x; i < ROWS * nblk / 16; i += THREADS) {
    reinterpret_cast<uint4*>(ss)[i] = sg[i];
  }
  stage_group<SPLIT, TILES>(x, x_div, order + start, count, K, xs, xl, cpre);
  __syncthreads();
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int b0 = 0; b0 < nblk; b0 += U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int b = b0 + u;
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      block_mma<SPLIT>(d, wa[u], wb[u], xs[g * KP + 4 * b + t],
                       SPLIT ? xl[g * KP + 4 * b + t] : uint4{});
      const float sa = __uint_as_float((uint32_t)ss[la * nblk + b] << 23);
      const float sb = __uint_as_float((uint32_t)ss[lb * nblk + b] << 23);
      acc[0] = fmaf(d[0], sa, acc[0]);
      acc[1] = fmaf(d[1], sa, acc[1]);
      acc[2] = fmaf(d[2], sb, acc[2]);
      acc[3] = fmaf(d[3], sb, acc[3]);
    }
    if (b0 + U < nblk) load_shuf<U>(qw, b0 + U, wa, wb);
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

// The streamed kernels on shuffled weights: a stage (C blocks, C even) is C * 256 contiguous
// bytes of the tile, copied 16 bytes a lane; each lane then reads its own 16 bytes of each block
// pair from shared memory (no ldmatrix, no padding: lanes read consecutive 16-byte units).
template <int C, int S>
__device__ __forceinline__ void issue_stage_shuf(uint8_t* ring, const uint8_t* __restrict__ tile,
                                                 int st) {
  uint8_t* dst = ring + (st % S) * C * 256;
  const uint8_t* src = tile + (long)st * C * 256;
#pragma unroll
  for (int i = threadIdx.x & 31; i < C * 16; i += 32) cp_async16(dst + i * 16, src + i * 16);
}

template <bool SWIGLU, int C, int S>
__device__ __forceinline__ void stream_rows_shuf(uint8_t* ring, const uint8_t* __restrict__ tile,
                                                 int nst, const uint4* xs, const uint4* xl,
                                                 const uint8_t* ss, int nblk, int ca, int cb,
                                                 float (&acc)[4]) {
  constexpr bool SPLIT = !SWIGLU;
  const int lane = threadIdx.x & 31, t = lane & 3;
  for (int st = 0; st < nst; ++st) {
    cp_wait<S - 2>();
    __syncwarp();
    if (st + S - 1 < nst) issue_stage_shuf<C, S>(ring, tile, st + S - 1);
    cp_commit();
    const uint4* w = reinterpret_cast<const uint4*>(ring + (st % S) * C * 256) + lane;
#pragma unroll
    for (int j = 0; j < C / 2; ++j) {
      const uint4 v = w[32 * j];
      const int b = st * C + 2 * j;
      float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
      block_mma<SPLIT>(d0, v.x, v.y, xs[4 * b + t], SPLIT ? xl[4 * b + t] : uint4{});
      block_mma<SPLIT>(d1, v.z, v.w, xs[4 * b + 4 + t], SPLIT ? xl[4 * b + 4 + t] : uint4{});
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
    pair_gemv_stream_shuf(const XT* __restrict__ x, int x_div, const int* __restrict__ ids,
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
    if (st < nst) issue_stage_shuf<C, S>(ring, tile, st);
    cp_commit();
  }
  const float pre = stage_x<SPLIT, XWORDS, W>(x + (long)(pair / x_div) * K, K, xs, xl, xmax);
  __syncthreads();
  const int ca = SWIGLU ? 2 * g : g, cb = SWIGLU ? 2 * g + 1 : g + 8;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  stream_rows_shuf<SWIGLU, C, S>(ring, tile, nst, xs, xl, ss, nblk, ca, cb, acc);
  if (t == 0) {
    store<SWIGLU>(acc[0], acc[2], pre, row0 + ca, row0 + cb, pair, e, bias, wts, out, N, alpha,
                  limit);
  }
}

template <bool SWIGLU, int C, int S, int W, typename XT>
__global__ void __launch_bounds__(W * 32)
    group_gemv_stream_shuf(const XT* __restrict__ x, int x_div, const int* __restrict__ groups,
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
    if (st < nst) issue_stage_shuf<C, S>(ring, tile, st);
    cp_commit();
  }
  stage_group<SPLIT, W>(x, x_div, order + start, count, K, xs, xl, cpre);
  __syncthreads();
  const int ca = SWIGLU ? 2 * g : g, cb = SWIGLU ? 2 * g + 1 : g + 8;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  stream_rows_shuf<SWIGLU, C, S>(ring, tile, nst, xs + g * KP, xl + g * KP, ss, nblk, ca, cb,
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
int launch_stream_shuf(const void* x, int x_div, const int* ids, int pairs, const uint8_t* q,
                       const uint8_t* s, const void* bias, const float* wts, float* out, int N,
                       int K, long stride_qe, int stride_q, long stride_se, float alpha,
                       float limit, cudaStream_t stream) {
  if (N % (16 * W) || (K / 32) % C || C % 2 || K > KMAX) return (int)cudaErrorInvalidValue;
  const int smem = (SWIGLU ? 1 : 2) * (K / 8) * 16 + W * (S * C * 256 + 16 * (K / 32));
  auto kernel = pair_gemv_stream_shuf<SWIGLU, C, S, W, XT>;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return (int)err;
  kernel<<<dim3(pairs, N / (16 * W)), W * 32, smem, stream>>>(
      static_cast<const XT*>(x), x_div, ids, q, s, static_cast<const __nv_bfloat16*>(bias), wts,
      out, N, K, stride_qe, stride_q, stride_se, alpha, limit);
  return (int)cudaGetLastError();
}

template <bool SWIGLU, int C, int S, int W, typename XT>
int launch_grouped_stream_shuf(const void* x, int x_div, const int* groups, int G,
                               const int* sorted_ids, const int* order, const uint8_t* q,
                               const uint8_t* s, const void* bias, const float* wts, float* out,
                               int N, int K, long stride_qe, int stride_q, long stride_se,
                               float alpha, float limit, cudaStream_t stream) {
  if (N % (16 * W) || (K / 32) % C || C % 2 || K > KMAX) return (int)cudaErrorInvalidValue;
  const int smem = (SWIGLU ? 1 : 2) * 8 * (K / 8 + 1) * 16 + W * (S * C * 256 + 16 * (K / 32));
  auto kernel = group_gemv_stream_shuf<SWIGLU, C, S, W, XT>;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return (int)err;
  kernel<<<dim3(G, N / (16 * W)), W * 32, smem, stream>>>(
      static_cast<const XT*>(x), x_div, groups, sorted_ids, order, q, s,
      static_cast<const __nv_bfloat16*>(bias), wts, out, N, K, stride_qe, stride_q, stride_se,
      alpha, limit);
  return (int)cudaGetLastError();
}

// streamed on shuffled weights: (variant, swiglu, C, S, W); pair 240-249, grouped 250-259
#define TINYOSS_SHUF_STREAM_PAIR(X)                                                           \
  X(240, true, 10, 3, 4) X(241, true, 10, 4, 4) X(242, true, 18, 3, 4) X(243, true, 10, 9, 2)  \
  X(245, false, 10, 3, 4) X(246, false, 10, 9, 2) X(247, false, 18, 5, 2)
#define TINYOSS_SHUF_STREAM_GROUPED(X)                                                        \
  X(250, true, 6, 4, 6) X(251, true, 10, 3, 6) X(252, true, 10, 4, 4)                         \
  X(255, false, 10, 2, 12) X(256, false, 10, 3, 12) X(257, false, 6, 3, 12)

// (variant, swiglu, U, KSPLIT, TILES) for the pair kernel; (variant, swiglu, U, TILES) grouped
#define TINYOSS_SHUF_PAIR(X)                                                                  \
  X(200, true, 10, 1, 4) X(201, true, 6, 3, 2) X(202, true, 18, 1, 4) X(203, true, 10, 1, 2)  \
  X(204, true, 6, 1, 4) X(205, true, 30, 3, 1) X(206, true, 10, 3, 4)                        \
  X(210, false, 10, 1, 4) X(211, false, 6, 3, 2) X(212, false, 18, 1, 2) X(213, false, 6, 5, 1) \
  X(214, false, 10, 3, 2) X(215, false, 18, 5, 1)
#define TINYOSS_SHUF_GROUPED(X)                                                               \
  X(220, true, 10, 12) X(221, true, 6, 12) X(222, true, 18, 12) X(223, true, 10, 8)           \
  X(230, false, 10, 20) X(231, false, 6, 20) X(232, false, 10, 12) X(233, false, 18, 12)

template <bool SWIGLU, int U, int KSPLIT, int TILES, typename XT>
int launch_shuf(const void* x, int x_div, const int* ids, int pairs, const uint8_t* q,
                const uint8_t* s, const void* bias, const float* wts, float* out, int N, int K,
                long stride_qe, int stride_q, long stride_se, float alpha, float limit,
                cudaStream_t stream) {
  constexpr int ROWS = 16 * TILES;
  if (N % ROWS || (K / 32 / KSPLIT) % U || U % 2 || K > KMAX) return (int)cudaErrorInvalidValue;
  const int smem = (SWIGLU ? 1 : 2) * (K / 8) * 16 + ROWS * (K / 32);
  pair_gemv_shuf<SWIGLU, U, KSPLIT, TILES, XT>
      <<<dim3(pairs, N / ROWS), TILES * KSPLIT * 32, smem, stream>>>(
          static_cast<const XT*>(x), x_div, ids, q, s, static_cast<const __nv_bfloat16*>(bias),
          wts, out, N, K, stride_qe, stride_q, stride_se, alpha, limit);
  return (int)cudaGetLastError();
}

template <bool SWIGLU, int U, int TILES, typename XT>
int launch_shuf_grouped(const void* x, int x_div, const int* groups, int G,
                        const int* sorted_ids, const int* order, const uint8_t* q,
                        const uint8_t* s, const void* bias, const float* wts, float* out, int N,
                        int K, long stride_qe, int stride_q, long stride_se, float alpha,
                        float limit, cudaStream_t stream) {
  constexpr int ROWS = 16 * TILES;
  if (N % ROWS || (K / 32) % U || U % 2 || K > KMAX) return (int)cudaErrorInvalidValue;
  const int smem = (SWIGLU ? 1 : 2) * 8 * (K / 8 + 1) * 16 + ROWS * (K / 32);
  auto kernel = group_gemv_shuf<SWIGLU, U, TILES, XT>;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return (int)err;
  kernel<<<dim3(G, N / ROWS), TILES * 32, smem, stream>>>(
      static_cast<const XT*>(x), x_div, groups, sorted_ids, order, q, s,
      static_cast<const __nv_bfloat16*>(bias), wts, out, N, K, stride_qe, stride_q, stride_se,
      alpha, limit);
  return (int)cudaGetLastError();
}

// the pair kernels' arguments (tinyoss_pair_variant's) on shuffled weights; -1: unknown variant
extern "C" int tinyoss_shuf_variant(int variant, const void* x, int x_div, const int* ids,
                                    int pairs, const uint8_t* q, const uint8_t* s,
                                    const void* bias, const float* wts, float* out, int N, int K,
                                    long stride_qe, int stride_q, long stride_se, float alpha,
                                    float limit, void* stream) {
  switch (variant) {
#define TINYOSS_SPCASE(V, SW, U, KS, TL)                                                      \
  case V:                                                                                     \
    return launch_shuf<SW, U, KS, TL, std::conditional_t<SW, __nv_bfloat16, float>>(         \
        x, x_div, ids, pairs, q, s, bias, wts, out, N, K, stride_qe, stride_q, stride_se,     \
        alpha, limit, static_cast<cudaStream_t>(stream));
    TINYOSS_SHUF_PAIR(TINYOSS_SPCASE)
#define TINYOSS_SSPCASE(V, SW, C, S, W)                                                       \
  case V:                                                                                     \
    return launch_stream_shuf<SW, C, S, W, std::conditional_t<SW, __nv_bfloat16, float>>(    \
        x, x_div, ids, pairs, q, s, bias, wts, out, N, K, stride_qe, stride_q, stride_se,     \
        alpha, limit, static_cast<cudaStream_t>(stream));
    TINYOSS_SHUF_STREAM_PAIR(TINYOSS_SSPCASE)
  }
  return -1;
}

// the grouped kernels' arguments (tinyoss_grouped_variant's) on shuffled weights
extern "C" int tinyoss_shuf_grouped_variant(int variant, const void* x, int x_div,
                                            const int* groups, int G, const int* sorted_ids,
                                            const int* order, int pairs, const uint8_t* q,
                                            const uint8_t* s, const void* bias, const float* wts,
                                            float* out, int N, int K, long stride_qe,
                                            int stride_q, long stride_se, float alpha,
                                            float limit, void* stream) {
  (void)pairs;
  switch (variant) {
#define TINYOSS_SGCASE(V, SW, U, TL)                                                          \
  case V:                                                                                     \
    return launch_shuf_grouped<SW, U, TL, std::conditional_t<SW, __nv_bfloat16, float>>(     \
        x, x_div, groups, G, sorted_ids, order, q, s, bias, wts, out, N, K, stride_qe,        \
        stride_q, stride_se, alpha, limit, static_cast<cudaStream_t>(stream));
    TINYOSS_SHUF_GROUPED(TINYOSS_SGCASE)
#define TINYOSS_SSGCASE(V, SW, C, S, W)                                                       \
  case V:                                                                                     \
    return launch_grouped_stream_shuf<SW, C, S, W,                                            \
                                      std::conditional_t<SW, __nv_bfloat16, float>>(          \
        x, x_div, groups, G, sorted_ids, order, q, s, bias, wts, out, N, K, stride_qe,        \
        stride_q, stride_se, alpha, limit, static_cast<cudaStream_t>(stream));
    TINYOSS_SHUF_STREAM_GROUPED(TINYOSS_SSGCASE)
  }
  return -1;
}

extern "C" const char* tinyoss_shuf_variant_name(int variant) {
  switch (variant) {
#define TINYOSS_SPNAME(V, SW, U, KS, TL) \
  case V:                                \
    return SW ? "shuffled gate_up U" #U " KSPLIT" #KS " TILES" #TL                           \
              : "shuffled down U" #U " KSPLIT" #KS " TILES" #TL;
    TINYOSS_SHUF_PAIR(TINYOSS_SPNAME)
#define TINYOSS_SGNAME(V, SW, U, TL) \
  case V:                            \
    return SW ? "shuffled grouped gate_up U" #U " TILES" #TL                                 \
              : "shuffled grouped down U" #U " TILES" #TL;
    TINYOSS_SHUF_GROUPED(TINYOSS_SGNAME)
#define TINYOSS_SSPNAME(V, SW, C, S, W) \
  case V:                               \
    return SW ? "shuffled streamed gate_up C" #C " S" #S " W" #W                             \
              : "shuffled streamed down C" #C " S" #S " W" #W;
    TINYOSS_SHUF_STREAM_PAIR(TINYOSS_SSPNAME)
#define TINYOSS_SSGNAME(V, SW, C, S, W) \
  case V:                               \
    return SW ? "shuffled streamed grouped gate_up C" #C " S" #S " W" #W                     \
              : "shuffled streamed grouped down C" #C " S" #S " W" #W;
    TINYOSS_SHUF_STREAM_GROUPED(TINYOSS_SSGNAME)
  }
  return nullptr;
}
