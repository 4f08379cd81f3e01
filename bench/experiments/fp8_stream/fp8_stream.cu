// FP8 (e4m3, an fp32 scale a row) dense layers at one row of x on the CUDA cores, written like
// the product's dense_gemv_stream (moe_gemv_mma.cu): a warp takes ROWS rows of W, lane l loads
// 16-byte vectors l, l + 32, ... of each (VPL of them a row, the last repeated past K, where x
// counts zero), every load written ahead of the math, with the L2 256-byte hint; each 16 FP8
// weights become fp16 pairs (one cvt a pair) and fp32 (two), fp32 FMAs with bf16 x read through
// L1, a warp reduction, the row's scale at the end. The aim: FP8's half of bf16's bytes at the
// bf16 streaming GEMV's bandwidth (the product's FP8 GEMV at one row is Triton's, ~1.1-1.3 TB/s).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cstdint>

namespace {

constexpr int WARPS = 4;

__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// the two e4m3 codes in the low (J = 0) or high (J = 1) half of a word, as two fp32
template <int J>
__device__ __forceinline__ float2 fp8x2_f32(uint32_t w) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>((w >> (16 * J)) & 0xFFFFu), __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

template <int VPL, int ROWS>
__global__ void __launch_bounds__(WARPS * 32, 1)
    fp8_gemv_stream(const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ w,
                    const float* __restrict__ scale, const __nv_bfloat16* __restrict__ bias,
                    __nv_bfloat16* __restrict__ out, int N, int K) {
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * ROWS;
  if (row0 >= N) return;
  const int kv = K >> 4;  // 16-byte vectors a row (16 weights each)
  uint4 wv[ROWS][VPL];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const uint4* wr = reinterpret_cast<const uint4*>(w + (long)min(row0 + r, N - 1) * K);
#pragma unroll
    for (int i = 0; i < VPL; ++i) wv[r][i] = ldg_stream(wr + min(lane + 32 * i, kv - 1));
  }
  float acc[ROWS] = {};
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
    for (int r = 0; r < ROWS; ++r) {
      const uint32_t ws[4] = {wv[r][i].x, wv[r][i].y, wv[r][i].z, wv[r][i].w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {  // word c: weights 4c .. 4c + 3
        const float2 lo = fp8x2_f32<0>(ws[c]), hi = fp8x2_f32<1>(ws[c]);
        acc[r] = fmaf(lo.x, xf[4 * c], acc[r]);
        acc[r] = fmaf(lo.y, xf[4 * c + 1], acc[r]);
        acc[r] = fmaf(hi.x, xf[4 * c + 2], acc[r]);
        acc[r] = fmaf(hi.y, xf[4 * c + 3], acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float v = acc[r];
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0 && row0 + r < N)
      out[row0 + r] = __float2bfloat16(v * scale[row0 + r] +
                                       (bias ? __bfloat162float(bias[row0 + r]) : 0.f));
  }
}

template <int VPL, int ROWS>
int launch(const void* x, const void* w, const float* scale, const void* bias, void* out, int N,
           int K, cudaStream_t stream) {
  const int rows = WARPS * ROWS;
  fp8_gemv_stream<VPL, ROWS><<<(N + rows - 1) / rows, WARPS * 32, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), static_cast<const uint8_t*>(w), scale,
      static_cast<const __nv_bfloat16*>(bias), static_cast<__nv_bfloat16*>(out), N, K);
  return (int)cudaGetLastError();
}

template <int ROWS>
int launch_k(const void* x, const void* w, const float* scale, const void* bias, void* out,
             int N, int K, cudaStream_t stream) {
  const int vpl = (K + 511) / 512;  // 16-byte vectors a lane
  auto run = vpl <= 2 ? launch<2, ROWS> : vpl <= 4 ? launch<4, ROWS>
             : vpl <= 6 ? launch<6, ROWS> : launch<8, ROWS>;
  return run(x, w, scale, bias, out, N, K, stream);
}
}  // namespace

// x [1, K] bf16, w [N, K] e4m3 (K in 16s up to 4096, both 16-byte aligned), scale [N] fp32,
// bias [N] bf16 or null -> out [1, N] bf16; rows: weight rows a warp (2, 4 or 8)
extern "C" int fp8_stream_gemv(int rows, const void* x, const void* w, const float* scale,
                               const void* bias, void* out, int N, int K, void* stream) {
  if (N < 1 || K < 16 || K % 16 || K > 4096) return (int)cudaErrorInvalidValue;
  auto run = rows == 2 ? launch_k<2> : rows == 4 ? launch_k<4> : launch_k<8>;
  return run(x, w, scale, bias, out, N, K, static_cast<cudaStream_t>(stream));
}
