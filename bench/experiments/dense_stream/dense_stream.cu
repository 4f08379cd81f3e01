// The bf16 decode GEMV at one row of x with every weight load of a warp issued at once: does a
// 24-30 MB layer (q/k/v, o) read closer to the copy bandwidth than the engine's Triton GEMV
// (shared-memory pipeline, ~1.7-1.8 TB/s on the H100 against ~3.0 for lm_head)?
//
//   gemv_rows<ROWS, VPL, HINT>  a warp takes ROWS rows; lane l loads 16-byte vectors
//                               l, l + 32, ... (VPL of them a row) of all ROWS rows before any
//                               math, x read as the same vectors (L1), fp32 sums, a warp
//                               reduction; HINT: ld.global.nc.L1::no_allocate.L2::256B
//   gemv_persist<ROWS, VPL>     a grid of resident warps, each looping over row groups with the
//                               next group's loads in flight during the current one's math
//   read_only<U>                the same bytes read and discarded: the ceiling at this size
//   gemv_rows<.., FENCE>        (variant 3) one value XORs every loaded word before the math,
//                               so that ptxas issues more loads ahead (SASS: 22 of q/k/v's 2-row
//                               loads before the first FMA against 18); not yet timed
//
// Built by bench.py with nvcc into a shared library (ctypes), launched on the caller's stream.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>

namespace {

template <bool HINT>
__device__ __forceinline__ uint4 load16(const uint4* p) {
  if constexpr (HINT) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
  } else {
    return __ldg(p);
  }
}

__device__ __forceinline__ float dot8(uint4 w, uint4 x, float acc) {
  const uint32_t ws[4] = {w.x, w.y, w.z, w.w}, xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc = fmaf(__uint_as_float(ws[i] << 16), __uint_as_float(xs[i] << 16), acc);
    acc = fmaf(__uint_as_float(ws[i] & 0xffff0000u), __uint_as_float(xs[i] & 0xffff0000u), acc);
  }
  return acc;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// W [N, K] bf16 row-major, K % 8 == 0, VPL = ceil(K / 256).
template <int ROWS, int VPL, bool HINT, bool FENCE = false>
__global__ void __launch_bounds__(256, 1) gemv_rows(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                          const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ out,
                          int N, int K) {
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * ROWS;
  if (row0 >= N) return;
  const int kv = K >> 3;  // 16-byte vectors a row
  uint4 wv[ROWS][VPL];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const uint4* wr = reinterpret_cast<const uint4*>(w + (long)min(row0 + r, N - 1) * K);
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      wv[r][i] = load16<HINT>(wr + min(lane + 32 * i, kv - 1));  // masked in the math
    }
  }
  if constexpr (FENCE) {  // one value needs every load: ptxas issues them all before it
    uint32_t all = 0;
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int i = 0; i < VPL; ++i) all ^= wv[r][i].x ^ wv[r][i].y ^ wv[r][i].z ^ wv[r][i].w;
    if (all == 0x9e3779b9u && N < 0) out[0] = __float2bfloat16(0.f);  // never: keeps `all`
  }
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int j = lane + 32 * i;
    const uint4 xi = j < kv ? __ldg(xv + j) : make_uint4(0, 0, 0, 0);  // zero past K
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = dot8(wv[r][i], xi, acc[r]);
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const float s = warp_sum(acc[r]);
    if (lane == 0 && row0 + r < N)
      out[row0 + r] = __float2bfloat16(s + (bias ? __bfloat162float(bias[row0 + r]) : 0.f));
  }
}

template <int ROWS, int VPL>
__device__ __forceinline__ void load_group(uint4 (&wv)[ROWS][VPL], const __nv_bfloat16* w,
                                           int row0, int N, int K, int lane) {
  const int kv = K >> 3;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const uint4* wr = reinterpret_cast<const uint4*>(w + (long)min(row0 + r, N - 1) * K);
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      wv[r][i] = load16<true>(wr + min(lane + 32 * i, kv - 1));  // masked in the math
    }
  }
}

template <int ROWS, int VPL>
__global__ void __launch_bounds__(256, 1) gemv_persist(const __nv_bfloat16* __restrict__ x,
                             const __nv_bfloat16* __restrict__ w,
                             const __nv_bfloat16* __restrict__ bias,
                             __nv_bfloat16* __restrict__ out, int N, int K) {
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (blockDim.x >> 5);
  int g = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int groups = (N + ROWS - 1) / ROWS, kv = K >> 3;
  if (g >= groups) return;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  uint4 cur[ROWS][VPL], nxt[ROWS][VPL];
  load_group<ROWS, VPL>(cur, w, g * ROWS, N, K, lane);
  for (; g < groups; g += warps) {
    const bool more = g + warps < groups;
    if (more) load_group<ROWS, VPL>(nxt, w, (g + warps) * ROWS, N, K, lane);
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int j = lane + 32 * i;
      const uint4 xi = j < kv ? __ldg(xv + j) : make_uint4(0, 0, 0, 0);  // zero past K  // zero past K
#pragma unroll
      for (int r = 0; r < ROWS; ++r) acc[r] = dot8(cur[r][i], xi, acc[r]);
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int row = g * ROWS + r;
      const float s = warp_sum(acc[r]);
      if (lane == 0 && row < N)
        out[row] = __float2bfloat16(s + (bias ? __bfloat162float(bias[row]) : 0.f));
    }
    if (more) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int i = 0; i < VPL; ++i) cur[r][i] = nxt[r][i];
    }
  }
}

template <int U>
__global__ void read_only(const uint4* __restrict__ p, long n, unsigned* __restrict__ sink) {
  const long t = blockIdx.x * (long)blockDim.x + threadIdx.x, stride = (long)gridDim.x * blockDim.x;
  uint32_t acc = 0;
  uint4 v[U];
#pragma unroll
  for (int u = 0; u < U; ++u) v[u] = t + u * stride < n ? load16<true>(p + t + u * stride)
                                                          : make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int u = 0; u < U; ++u) acc += v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

template <int ROWS, int VPL, bool HINT, bool FENCE = false>
int launch_rows(int warps_per_block, const void* x, const void* w, const void* b, void* out,
                int N, int K, cudaStream_t st) {
  const int groups = (N + ROWS - 1) / ROWS;
  const int blocks = (groups + warps_per_block - 1) / warps_per_block;
  gemv_rows<ROWS, VPL, HINT, FENCE><<<blocks, warps_per_block * 32, 0, st>>>(
      (const __nv_bfloat16*)x, (const __nv_bfloat16*)w, (const __nv_bfloat16*)b,
      (__nv_bfloat16*)out, N, K);
  return (int)cudaGetLastError();
}

template <int ROWS, int VPL>
int launch_persist(int warps_per_block, int blocks, const void* x, const void* w, const void* b,
                   void* out, int N, int K, cudaStream_t st) {
  gemv_persist<ROWS, VPL><<<blocks, warps_per_block * 32, 0, st>>>(
      (const __nv_bfloat16*)x, (const __nv_bfloat16*)w, (const __nv_bfloat16*)b,
      (__nv_bfloat16*)out, N, K);
  return (int)cudaGetLastError();
}

}  // namespace

// variant: 0 rows (ROWS rows a warp, one pass), 1 rows without the L2 hint, 2 persistent
// (`blocks` programs). VPL from K: 12 (K <= 3072) or 16 (K <= 4096). Returns a cudaError_t, or
// -1 for a combination not built.
extern "C" int dense_stream_gemv(int variant, int rows, int warps_per_block, int blocks,
                                 const void* x, const void* w, const void* b, void* out, int N,
                                 int K, void* stream) {
  cudaStream_t st = (cudaStream_t)stream;
  const int vpl = (K + 255) / 256;
  if (K % 8 || vpl > 16) return -1;
#define ROWS_CASE(R, V)                                                                     \
  if (rows == R && (vpl <= V) && (vpl > V - 4)) {                                           \
    if (variant == 0) return launch_rows<R, V, true>(warps_per_block, x, w, b, out, N, K, st); \
    if (variant == 1) return launch_rows<R, V, false>(warps_per_block, x, w, b, out, N, K, st); \
    if (variant == 3)                                                                       \
      return launch_rows<R, V, true, true>(warps_per_block, x, w, b, out, N, K, st);       \
    if constexpr (R == 1)                                                                   \
      if (variant == 2)                                                                     \
        return launch_persist<R, V>(warps_per_block, blocks, x, w, b, out, N, K, st);      \
  }
  ROWS_CASE(1, 12)
  ROWS_CASE(2, 12)
  ROWS_CASE(1, 16)
  ROWS_CASE(2, 16)
#undef ROWS_CASE
  return -1;
}

extern "C" int dense_stream_read(int unroll, int blocks, const void* p, long bytes, void* sink,
                                 void* stream) {
  cudaStream_t st = (cudaStream_t)stream;
  const long n = bytes / 16;
  if (unroll == 4)
    read_only<4><<<blocks, 256, 0, st>>>((const uint4*)p, n, (unsigned*)sink);
  else if (unroll == 8)
    read_only<8><<<blocks, 256, 0, st>>>((const uint4*)p, n, (unsigned*)sink);
  else
    return -1;
  return (int)cudaGetLastError();
}
