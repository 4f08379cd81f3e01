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

// The pair kernel that prefetches the pair's down weights into L2 (PF 1), and also loads its own
// weights first to evict (PF 2): (variant, swiglu, U, KSPLIT, TILES, PF); the down weights from
// tinyoss_set_prefetch.
#define TINYOSS_PREFETCH(X) \
  X(60, true, 9, 2, 4, 1) X(61, true, 9, 2, 4, 2) X(62, true, 9, 1, 4, 1) X(63, true, 9, 1, 4, 2)

static const uint8_t *pf_q = nullptr, *pf_s = nullptr;
static long pf_qe = 0, pf_se = 0;
extern "C" void tinyoss_set_prefetch(const uint8_t* q, long qe, const uint8_t* s, long se) {
  pf_q = q, pf_qe = qe, pf_s = s, pf_se = se;
}

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
#define TINYOSS_PCASE(V, SW, U, KS, TL, PF)                                                   \
  case V:                                                                                     \
    return launch<SW, U, KS, TL, __nv_bfloat16, PF>(                                          \
        x, x_div, ids, pairs, q, s, bias, wts, out, N, K, stride_qe, stride_q, stride_se,     \
        alpha, limit, static_cast<cudaStream_t>(stream), pf_q, pf_qe, pf_s, pf_se);
    TINYOSS_PREFETCH(TINYOSS_PCASE)
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
#define TINYOSS_PNAME(V, SW, U, KS, TL, PF) \
  case V:                                   \
    return "gate_up U" #U " KSPLIT" #KS " TILES" #TL " prefetch" #PF;
    TINYOSS_PREFETCH(TINYOSS_PNAME)
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

// The group table for group_gemv_db: groups[i] = start | count << 16 for the i-th group (up to
// NC pairs of one expert from sorted position start), -1 for i in [groups, G). One program of
// 256 threads; P <= 1024.
template <int NC>
__global__ void make_groups(const int* __restrict__ sid, int P, int* __restrict__ groups, int G) {
  __shared__ int s[1024];
  __shared__ int wsum[8];
  __shared__ int base;
  for (int i = threadIdx.x; i < P; i += blockDim.x) s[i] = sid[i];
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int c0 = 0; c0 < P; c0 += blockDim.x) {
    const int r = c0 + threadIdx.x;
    bool flag = false;
    if (r < P) {  // a group starts every NC positions from the first of its expert's run
      int lo = 0, hi = r;
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (s[mid] < s[r]) lo = mid + 1; else hi = mid;
      }
      flag = (r - lo) % NC == 0;
    }
    const unsigned b = __ballot_sync(0xffffffffu, flag);
    if (lane == 0) wsum[warp] = __popc(b);
    __syncthreads();
    int off = base;
    for (int w = 0; w < warp; ++w) off += wsum[w];
    if (flag) {
      int cnt = 1;
      while (cnt < NC && r + cnt < P && s[r + cnt] == s[r]) ++cnt;
      groups[off + __popc(b & ((1u << lane) - 1u))] = r | (cnt << 16);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int tot = 0;
      for (int w = 0; w < 8; ++w) tot += wsum[w];
      base += tot;
    }
    __syncthreads();
  }
  for (int i = base + threadIdx.x; i < G; i += blockDim.x) groups[i] = -1;
}

// table[1024] = the number of groups in table[0, G) (make_groups marks the rest -1)
__global__ void count_groups(int* table, int G) {
  int n = 0;
  for (int i = threadIdx.x; i < G; i += 32) n += table[i] >= 0;
  for (int o = 16; o > 0; o >>= 1) n += __shfl_xor_sync(0xffffffffu, n, o);
  if (threadIdx.x == 0) table[1024] = n;
}

// group_gemv_mma with a group table (no programs that scan back and exit), x staged a column a
// warp (no shared atomics, no block barrier between the passes), and with DB the weights
// double-buffered in registers: the loads of block group i + 1 are in flight while group i's
// MMAs run (group_gemv_mma loads group i + 1 only after group i's MMAs).
template <bool SWIGLU, int U, int TILES, bool DB, typename XT>
__global__ void __launch_bounds__(TILES * 32)
    group_gemv_db(const XT* __restrict__ x, int x_div, const int* __restrict__ groups,
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
  const int nblk = K / 32, KW = K / 8, KP = KW + 1;
  uint4* xs = smem;
  uint4* xl = smem + 8 * KP;
  uint8_t* ss = (uint8_t*)(smem + (SPLIT ? 2 : 1) * 8 * KP);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.y * ROWS;
  const int la = SWIGLU ? 2 * (warp * 8 + g) : warp * 16 + g;
  const int lb = SWIGLU ? la + 1 : la + 8;
  const uint32_t* qa = reinterpret_cast<const uint32_t*>(q + (long)e * stride_qe +
                                                         (long)(row0 + la) * stride_q) + t;
  const uint32_t* qb = reinterpret_cast<const uint32_t*>(q + (long)e * stride_qe +
                                                         (long)(row0 + lb) * stride_q) + t;
  uint32_t wa[2][U], wb[2][U];
  auto load = [&](uint32_t (&ra)[U], uint32_t (&rb)[U], int b0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      ra[u] = __ldg(qa + 4 * (b0 + u));
      rb[u] = __ldg(qb + 4 * (b0 + u));
    }
  };
  load(wa[0], wb[0], 0);
  if (DB && U < nblk) load(wa[1], wb[1], U);
  const uint4* sg = reinterpret_cast<const uint4*>(s + (long)e * stride_se + (long)row0 * nblk);
  for (int i = threadIdx.x; i < ROWS * nblk / 16; i += THREADS) {
    reinterpret_cast<uint4*>(ss)[i] = sg[i];
  }
  for (int j = warp; j < count; j += TILES) {  // column j by warp j
    const XT* xr = x + (long)(order[start + j] / x_div) * K;
    if (SPLIT) {
      for (int w = lane; w < KW; w += 32) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(xr) + 2 * w);
        const float4 c = __ldg(reinterpret_cast<const float4*>(xr) + 2 * w + 1);
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
      const uint4* xw = reinterpret_cast<const uint4*>(xr);
      uint32_t m = 0u;  // bf16 magnitudes compare as integers
      for (int w = lane; w < KW; w += 32) {
        const uint4 raw = __ldg(xw + w);
        const uint32_t r[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int c = 0; c < 4; ++c) m = max(m, max(r[c] & 0x7FFFu, (r[c] >> 16) & 0x7FFFu));
      }
      const float pre = stage_scale(__uint_as_float(__reduce_max_sync(0xffffffffu, m) << 16));
      if (lane == 0) cpre[j] = pre;
      for (int w = lane; w < KW; w += 32) {
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
  __syncthreads();
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  auto compute = [&](const uint32_t (&ra)[U], const uint32_t (&rb)[U], int b0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int b = b0 + u;
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      block_mma<SPLIT>(d, ra[u], rb[u], xs[g * KP + 4 * b + t],
                       SPLIT ? xl[g * KP + 4 * b + t] : uint4{});
      const float sa = __uint_as_float((uint32_t)ss[la * nblk + b] << 23);
      const float sb = __uint_as_float((uint32_t)ss[lb * nblk + b] << 23);
      acc[0] = fmaf(d[0], sa, acc[0]);
      acc[1] = fmaf(d[1], sa, acc[1]);
      acc[2] = fmaf(d[2], sb, acc[2]);
      acc[3] = fmaf(d[3], sb, acc[3]);
    }
  };
  if (DB) {
    for (int b0 = 0; b0 < nblk; b0 += 2 * U) {
      compute(wa[0], wb[0], b0);
      if (b0 + 2 * U < nblk) load(wa[0], wb[0], b0 + 2 * U);
      if (b0 + U < nblk) {
        compute(wa[1], wb[1], b0 + U);
        if (b0 + 3 * U < nblk) load(wa[1], wb[1], b0 + 3 * U);
      }
    }
  } else {
    for (int b0 = 0; b0 < nblk; b0 += U) {
      compute(wa[0], wb[0], b0);
      if (b0 + U < nblk) load(wa[0], wb[0], b0 + U);
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

template <bool SWIGLU, int U, int TILES, bool DB, typename XT>
int launch_db(const void* x, int x_div, const int* sorted_ids, const int* order, int pairs,
              const uint8_t* q, const uint8_t* s, const void* bias, const float* wts, float* out,
              int N, int K, long stride_qe, int stride_q, long stride_se, float alpha,
              float limit, cudaStream_t stream) {
  constexpr int ROWS = 16 * TILES;
  if (N % ROWS || K % (32 * U) || K > KMAX || pairs > 1024) return (int)cudaErrorInvalidValue;
  static int* table = nullptr;  // the experiment's own scratch, allocated before any capture
  if (!table && cudaMalloc(&table, 1024 * sizeof(int)) != cudaSuccess) return -2;
  const int G = min(pairs, pairs / 8 + 32);  // 32 experts (gpt-oss-20b): groups at most
  make_groups<8><<<1, 256, 0, stream>>>(sorted_ids, pairs, table, G);
  const int smem = (SWIGLU ? 1 : 2) * 8 * (K / 8 + 1) * 16 + ROWS * (K / 32);
  auto kernel = group_gemv_db<SWIGLU, U, TILES, DB, XT>;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return (int)err;
  kernel<<<dim3(G, N / ROWS), TILES * 32, smem, stream>>>(
      static_cast<const XT*>(x), x_div, table, sorted_ids, order, q, s,
      static_cast<const __nv_bfloat16*>(bias), wts, out, N, K, stride_qe, stride_q, stride_se,
      alpha, limit);
  return (int)cudaGetLastError();
}

// The grouped kernel with pair_gemv_stream's weight path: a warp's 16 rows copied into shared
// memory with 16-byte cp.async (C scale blocks a stage, S stages in flight) and handed out with
// ldmatrix, where group_gemv_mma loads 4 bytes a thread from 8 rows an instruction (ncu: long
// scoreboard stalls, DRAM at 36-62% of peak). Groups from the table (make_groups); x of the
// group's columns staged as group_gemv_db stages it; W warps a program share it.
template <bool SWIGLU, int C, int S, int W, typename XT>
__global__ void __launch_bounds__(W * 32)
    group_gemv_stream(const XT* __restrict__ x, int x_div, const int* __restrict__ groups,
                      const int* __restrict__ sorted_ids, const int* __restrict__ order,
                      const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                      const __nv_bfloat16* __restrict__ bias, const float* __restrict__ wts,
                      float* __restrict__ out, int N, int K, long stride_qe, int stride_q,
                      long stride_se, float alpha, float limit) {
  constexpr bool SPLIT = !SWIGLU;
  constexpr int RU = C + 1, STAGE = 16 * RU * 16;
  extern __shared__ uint4 smem[];
  __shared__ float cpre[8];
  const int gi = groups[blockIdx.x];
  if (gi < 0) return;
  const int start = gi & 0xFFFF, count = gi >> 16;
  const int e = sorted_ids[start];
  const int nblk = K / 32, nst = nblk / C, KW = K / 8, KP = KW + 1;
  uint4* xs = smem;
  uint4* xl = smem + 8 * KP;
  uint8_t* base = (uint8_t*)(smem + (SPLIT ? 2 : 1) * 8 * KP);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  uint8_t* ring = base + warp * (S * STAGE + 16 * nblk);
  uint8_t* ss = ring + S * STAGE;
  const int row0 = (blockIdx.y * W + warp) * 16;
  const uint8_t* src = q + (long)e * stride_qe + (long)row0 * stride_q;
  auto issue = [&](int st) {
    uint8_t* dst = ring + (st % S) * STAGE;
#pragma unroll
    for (int i = lane; i < 16 * C; i += 32) {
      const int r = i / C, u = i % C;
      const int m = SWIGLU ? (r & 1) * 8 + (r >> 1) : r;
      cp_async16(dst + (m * RU + u) * 16, src + (long)r * stride_q + (st * C + u) * 16);
    }
  };
  const uint8_t* sg = s + (long)e * stride_se + (long)row0 * nblk;
  for (int i = lane; i < nblk; i += 32) cp_async16(ss + i * 16, sg + i * 16);
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < nst) issue(st);
    cp_commit();
  }
  if (SPLIT) {  // fp32 x as hi + lo, every thread of the program
    for (int i = threadIdx.x; i < count * KW; i += W * 32) {
      const int j = i / KW, w = i % KW;
      const float4* xr = reinterpret_cast<const float4*>(x + (long)(order[start + j] / x_div) * K);
      const float4 a = __ldg(xr + 2 * w), c = __ldg(xr + 2 * w + 1);
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
  } else {  // bf16 x: column j by warp j (and j + W ...), times its power of two
    for (int j = warp; j < count; j += W) {
      const uint4* xw = reinterpret_cast<const uint4*>(x + (long)(order[start + j] / x_div) * K);
      uint32_t m = 0u;
      for (int w = lane; w < KW; w += 32) {
        const uint4 raw = __ldg(xw + w);
        const uint32_t r[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int c = 0; c < 4; ++c) m = max(m, max(r[c] & 0x7FFFu, (r[c] >> 16) & 0x7FFFu));
      }
      const float pre = stage_scale(__uint_as_float(__reduce_max_sync(0xffffffffu, m) << 16));
      if (lane == 0) cpre[j] = pre;
      for (int w = lane; w < KW; w += 32) {
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
  __syncthreads();
  const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8, lblk = lane >> 4;
  const int ca = SWIGLU ? 2 * g : g, cb = SWIGLU ? 2 * g + 1 : g + 8;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int st = 0; st < nst; ++st) {
    cp_wait<S - 2>();
    __syncwarp();
    if (st + S - 1 < nst) issue(st + S - 1);
    cp_commit();
    const uint8_t* w = ring + (st % S) * STAGE + (lrow * RU + lblk) * 16;
#pragma unroll
    for (int j = 0; j < C / 2; ++j) {
      uint32_t r[4];
      ldsm4(r, w + 32 * j);
      const int b = st * C + 2 * j;
      float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
      block_mma<SPLIT>(d0, r[0], r[1], xs[g * KP + 4 * b + t],
                       SPLIT ? xl[g * KP + 4 * b + t] : uint4{});
      block_mma<SPLIT>(d1, r[2], r[3], xs[g * KP + 4 * b + 4 + t],
                       SPLIT ? xl[g * KP + 4 * b + 4 + t] : uint4{});
      const float sa0 = __uint_as_float((uint32_t)ss[ca * nblk + b] << 23);
      const float sb0 = __uint_as_float((uint32_t)ss[cb * nblk + b] << 23);
      const float sa1 = __uint_as_float((uint32_t)ss[ca * nblk + b + 1] << 23);
      const float sb1 = __uint_as_float((uint32_t)ss[cb * nblk + b + 1] << 23);
      acc[0] = fmaf(d0[0], sa0, fmaf(d1[0], sa1, acc[0]));
      acc[1] = fmaf(d0[1], sa0, fmaf(d1[1], sa1, acc[1]));
      acc[2] = fmaf(d0[2], sb0, fmaf(d1[2], sb1, acc[2]));
      acc[3] = fmaf(d0[3], sb0, fmaf(d1[3], sb1, acc[3]));
    }
  }
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
int launch_gstream(const void* x, int x_div, const int* sorted_ids, const int* order, int pairs,
                   const uint8_t* q, const uint8_t* s, const void* bias, const float* wts,
                   float* out, int N, int K, long stride_qe, int stride_q, long stride_se,
                   float alpha, float limit, cudaStream_t stream) {
  if (N % (16 * W) || (K / 32) % C || K > KMAX || pairs > 1024) return (int)cudaErrorInvalidValue;
  static int* table = nullptr;
  if (!table && cudaMalloc(&table, 1024 * sizeof(int)) != cudaSuccess) return -2;
  const int G = min(pairs, pairs / 8 + 32);
  make_groups<8><<<1, 256, 0, stream>>>(sorted_ids, pairs, table, G);
  const int smem = (SWIGLU ? 1 : 2) * 8 * (K / 8 + 1) * 16 +
                   W * (S * 16 * (C + 1) * 16 + 16 * (K / 32));
  auto kernel = group_gemv_stream<SWIGLU, C, S, W, XT>;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return (int)err;
  kernel<<<dim3(G, N / (16 * W)), W * 32, smem, stream>>>(
      static_cast<const XT*>(x), x_div, table, sorted_ids, order, q, s,
      static_cast<const __nv_bfloat16*>(bias), wts, out, N, K, stride_qe, stride_q, stride_se,
      alpha, limit);
  return (int)cudaGetLastError();
}

// x converted once a step for group_gemv_flat: row r of x (bf16: times its power of two, pre[r];
// fp32: as fp16 hi + lo, pre 1) as fp16 pairs in block_mma's order, KW words a row.
template <typename XT>
__global__ void convert_rows(const XT* __restrict__ x, int K, uint4* __restrict__ xh,
                             uint4* __restrict__ xl, float* __restrict__ pre) {
  constexpr bool SPLIT = std::is_same<XT, float>::value;
  __shared__ float red[4];
  const int r = blockIdx.x, KW = K / 8, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const XT* xr = x + (long)r * K;
  float p = 1.f;
  if (!SPLIT) {
    float m = 0.f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) m = fmaxf(m, fabsf(to_f(xr[i])));
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    p = stage_scale(m);
  }
  if (threadIdx.x == 0) pre[r] = p;
  for (int w = threadIdx.x; w < KW; w += blockDim.x) {
    __half h[8], l[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const float v = to_f(xr[8 * w + c]) * p;
      h[c] = __float2half_rn(v);
      l[c] = __float2half_rn(v - __half2float(h[c]));
    }
    xh[(long)r * KW + w] = make_uint4(pack(h[0], h[4]), pack(h[1], h[5]), pack(h[2], h[6]),
                                      pack(h[3], h[7]));
    if (SPLIT) {
      xl[(long)r * KW + w] = make_uint4(pack(l[0], l[4]), pack(l[1], l[5]), pack(l[2], l[6]),
                                        pack(l[3], l[7]));
    }
  }
}

// The grouped MoE GEMV with no program boundaries in the weight stream: a persistent grid, each
// warp a contiguous run of the step's (group, 16-row tile) work, its rows streamed through its
// own cp.async ring across tile boundaries (the next tile's first stages load while this one
// finishes), x read as MMA B fragments straight from the converted rows (L1) instead of staged a
// program, so no barrier and no prologue a tile. Up to 8 pairs of one expert a group (table).
template <bool SWIGLU, int C, int S, int W>
__global__ void __launch_bounds__(W * 32)
    group_gemv_flat(const uint4* __restrict__ xh, const uint4* __restrict__ xl,
                    const float* __restrict__ pre, int x_div, const int* __restrict__ groups,
                    const int* __restrict__ sorted_ids, const int* __restrict__ order,
                    const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                    const __nv_bfloat16* __restrict__ bias, const float* __restrict__ wts,
                    float* __restrict__ out, int N, int K, long stride_qe, int stride_q,
                    long stride_se, float alpha, float limit) {
  constexpr bool SPLIT = !SWIGLU;
  constexpr int RU = C + 1, STAGE = 16 * RU * 16;
  extern __shared__ uint4 smem[];
  const int nblk = K / 32, nst = nblk / C, KW = K / 8, NT = N / 16;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  uint8_t* ring = (uint8_t*)smem + warp * (S * STAGE + 2 * 16 * nblk);
  uint8_t* sbuf = ring + S * STAGE;  // two tiles' scales
  const int total = groups[1024] * NT;
  const int wid = blockIdx.x * W + warp, nw = gridDim.x * W;
  const int t0 = (int)((long)total * wid / nw), t1 = (int)((long)total * (wid + 1) / nw);
  if (t0 >= t1) return;
  const int nstages = (t1 - t0) * nst;
  auto issue = [&](int L) {  // stage L of the run: tile t0 + L / nst, its stage L % nst
    const int tile = t0 + L / nst, st = L % nst;
    const int gi = groups[tile / NT];
    const int e = sorted_ids[gi & 0xFFFF];
    const int row0 = (tile % NT) * 16;
    const uint8_t* src = q + (long)e * stride_qe + (long)row0 * stride_q;
    uint8_t* dst = ring + (L % S) * STAGE;
#pragma unroll
    for (int i = lane; i < 16 * C; i += 32) {
      const int r = i / C, u = i % C;
      const int m = SWIGLU ? (r & 1) * 8 + (r >> 1) : r;
      cp_async16(dst + (m * RU + u) * 16, src + (long)r * stride_q + (st * C + u) * 16);
    }
    if (st == 0) {
      const uint8_t* sg = s + (long)e * stride_se + (long)row0 * nblk;
      uint8_t* sd = sbuf + ((L / nst) & 1) * 16 * nblk;
      for (int i = lane; i < nblk; i += 32) cp_async16(sd + i * 16, sg + i * 16);
    }
  };
#pragma unroll
  for (int L = 0; L < S - 1; ++L) {
    if (L < nstages) issue(L);
    cp_commit();
  }
  const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8, lblk = lane >> 4;
  const int ca = SWIGLU ? 2 * g : g, cb = SWIGLU ? 2 * g + 1 : g + 8;
  float acc[4];
  const uint4 *ph = nullptr, *pl = nullptr;
  const uint8_t* ss = sbuf;
  int start = 0, count = 0, e = 0, row0 = 0;
  for (int L = 0; L < nstages; ++L) {
    const int st = L % nst;
    if (st == 0) {  // a new tile: its group's columns, rows and scales
      const int tile = t0 + L / nst;
      const int gi = groups[tile / NT];
      start = gi & 0xFFFF;
      count = gi >> 16;
      e = sorted_ids[start];
      row0 = (tile % NT) * 16;
      const int col = order[start + min(g, count - 1)] / x_div;
      ph = xh + (long)col * KW + t;
      pl = SPLIT ? xl + (long)col * KW + t : nullptr;
      ss = sbuf + ((L / nst) & 1) * 16 * nblk;
      acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
    }
    cp_wait<S - 2>();
    __syncwarp();
    if (L + S - 1 < nstages) issue(L + S - 1);
    cp_commit();
    const uint8_t* w = ring + (L % S) * STAGE + (lrow * RU + lblk) * 16;
#pragma unroll
    for (int j = 0; j < C / 2; ++j) {
      uint32_t r[4];
      ldsm4(r, w + 32 * j);
      const int b = st * C + 2 * j;
      float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
      block_mma<SPLIT>(d0, r[0], r[1], __ldg(ph + 4 * b), SPLIT ? __ldg(pl + 4 * b) : uint4{});
      block_mma<SPLIT>(d1, r[2], r[3], __ldg(ph + 4 * b + 4),
                       SPLIT ? __ldg(pl + 4 * b + 4) : uint4{});
      const float sa0 = __uint_as_float((uint32_t)ss[ca * nblk + b] << 23);
      const float sb0 = __uint_as_float((uint32_t)ss[cb * nblk + b] << 23);
      const float sa1 = __uint_as_float((uint32_t)ss[ca * nblk + b + 1] << 23);
      const float sb1 = __uint_as_float((uint32_t)ss[cb * nblk + b + 1] << 23);
      acc[0] = fmaf(d0[0], sa0, fmaf(d1[0], sa1, acc[0]));
      acc[1] = fmaf(d0[1], sa0, fmaf(d1[1], sa1, acc[1]));
      acc[2] = fmaf(d0[2], sb0, fmaf(d1[2], sb1, acc[2]));
      acc[3] = fmaf(d0[3], sb0, fmaf(d1[3], sb1, acc[3]));
    }
    if (st == nst - 1) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int c = 2 * t + i;
        if (c < count) {
          const int pair = order[start + c];
          store<SWIGLU>(acc[i], acc[2 + i], SPLIT ? 1.f : pre[pair / x_div], row0 + ca,
                        row0 + cb, pair, e, bias, wts, out, N, alpha, limit);
        }
      }
    }
  }
}

template <bool SWIGLU, int C, int S, int W, typename XT>
int launch_flat(const void* x, int x_div, const int* sorted_ids, const int* order, int pairs,
                const uint8_t* q, const uint8_t* s, const void* bias, const float* wts,
                float* out, int N, int K, long stride_qe, int stride_q, long stride_se,
                float alpha, float limit, cudaStream_t stream) {
  if (N % 16 || (K / 32) % C || K > KMAX || pairs > 1024) return (int)cudaErrorInvalidValue;
  static int* table = nullptr;  // [1024] groups, [1024] their number
  static uint4 *xh = nullptr, *xl = nullptr;
  static float* pre = nullptr;
  if (!table) {
    if (cudaMalloc(&table, 1025 * sizeof(int)) || cudaMalloc(&xh, 1024L * KMAX * 2) ||
        cudaMalloc(&xl, 1024L * KMAX * 2) || cudaMalloc(&pre, 1024 * sizeof(float)))
      return -2;
  }
  const int G = min(pairs, pairs / 8 + 32);
  make_groups<8><<<1, 256, 0, stream>>>(sorted_ids, pairs, table, G);
  count_groups<<<1, 32, 0, stream>>>(table, G);
  convert_rows<XT><<<pairs / x_div, 128, 0, stream>>>(static_cast<const XT*>(x), K, xh, xl, pre);
  const int smem = W * (S * 16 * (C + 1) * 16 + 2 * 16 * (K / 32));
  auto kernel = group_gemv_flat<SWIGLU, C, S, W>;
  static int grid = 0;
  if (!grid) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           smem);
    if (err != cudaSuccess) return (int)err;
    int per_sm = 0, sms = 0, dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, W * 32, smem);
    if (err != cudaSuccess) return (int)err;
    grid = per_sm * sms;
  }
  kernel<<<grid, W * 32, smem, stream>>>(xh, xl, pre, x_div, table, sorted_ids, order, q, s,
                                         static_cast<const __nv_bfloat16*>(bias), wts, out, N, K,
                                         stride_qe, stride_q, stride_se, alpha, limit);
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

// group_gemv_db: (variant, swiglu, U, TILES, DB)
#define TINYOSS_DB(X)                                                                         \
  X(150, true, 9, 12, false) X(151, true, 5, 12, true) X(152, true, 6, 12, true)              \
  X(153, true, 9, 12, true) X(154, true, 5, 8, true) X(155, true, 9, 8, true)                 \
  X(156, true, 3, 12, true) X(157, true, 5, 20, true)                                         \
  X(160, false, 9, 20, false) X(161, false, 5, 20, true) X(162, false, 5, 12, true)           \
  X(163, false, 6, 12, true) X(164, false, 9, 12, true) X(165, false, 3, 12, true)            \
  X(166, false, 5, 10, true) X(167, false, 9, 20, true)

// group_gemv_stream: (variant, swiglu, C, S, W)
#define TINYOSS_GSTREAM(X)                                                                    \
  X(170, true, 10, 3, 4) X(171, true, 10, 3, 6) X(172, true, 10, 4, 4) X(173, true, 10, 3, 8)  \
  X(174, true, 6, 4, 6) X(175, true, 18, 3, 4) X(176, true, 6, 3, 4) X(177, true, 10, 2, 6)    \
  X(180, false, 10, 3, 12) X(181, false, 6, 3, 12) X(182, false, 10, 2, 12)                    \
  X(183, false, 6, 4, 9) X(184, false, 10, 3, 6) X(185, false, 6, 3, 6) X(186, false, 5, 3, 10)

// group_gemv_flat: (variant, swiglu, C, S, W)
#define TINYOSS_FLAT(X)                                                                       \
  X(190, true, 10, 4, 8) X(191, true, 10, 6, 8) X(192, true, 10, 3, 8) X(193, true, 10, 4, 4)  \
  X(194, true, 6, 6, 8) X(195, true, 10, 4, 12)                                               \
  X(196, false, 10, 4, 8) X(197, false, 10, 6, 8) X(198, false, 10, 3, 8)                      \
  X(199, false, 10, 4, 4) X(189, false, 6, 6, 8) X(188, false, 10, 4, 12)

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
#define TINYOSS_DCASE(V, SW, U, TL, DB)                                                       \
  case V:                                                                                     \
    return launch_db<SW, U, TL, DB, std::conditional_t<SW, __nv_bfloat16, float>>(           \
        x, x_div, sorted_ids, order, pairs, q, s, bias, wts, out, N, K, stride_qe, stride_q,  \
        stride_se, alpha, limit, static_cast<cudaStream_t>(stream));
    TINYOSS_DB(TINYOSS_DCASE)
#define TINYOSS_SGCASE(V, SW, C, S, W)                                                        \
  case V:                                                                                     \
    return launch_gstream<SW, C, S, W, std::conditional_t<SW, __nv_bfloat16, float>>(         \
        x, x_div, sorted_ids, order, pairs, q, s, bias, wts, out, N, K, stride_qe, stride_q,  \
        stride_se, alpha, limit, static_cast<cudaStream_t>(stream));
    TINYOSS_GSTREAM(TINYOSS_SGCASE)
#define TINYOSS_FCASE(V, SW, C, S, W)                                                         \
  case V:                                                                                     \
    return launch_flat<SW, C, S, W, std::conditional_t<SW, __nv_bfloat16, float>>(           \
        x, x_div, sorted_ids, order, pairs, q, s, bias, wts, out, N, K, stride_qe, stride_q,  \
        stride_se, alpha, limit, static_cast<cudaStream_t>(stream));
    TINYOSS_FLAT(TINYOSS_FCASE)
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
#define TINYOSS_DNAME(V, SW, U, TL, DB) \
  case V:                               \
    return SW ? "db gate_up U" #U " TILES" #TL " DB" #DB : "db down U" #U " TILES" #TL " DB" #DB;
    TINYOSS_DB(TINYOSS_DNAME)
#define TINYOSS_SGNAME(V, SW, C, S, W) \
  case V:                              \
    return SW ? "gstream gate_up C" #C " S" #S " W" #W : "gstream down C" #C " S" #S " W" #W;
    TINYOSS_GSTREAM(TINYOSS_SGNAME)
#define TINYOSS_FNAME(V, SW, C, S, W) \
  case V:                             \
    return SW ? "flat gate_up C" #C " S" #S " W" #W : "flat down C" #C " S" #S " W" #W;
    TINYOSS_FLAT(TINYOSS_FNAME)
  }
  return nullptr;
}
