// Tile variants of the product's tensor-core pair GEMV (tinyoss/kernels/moe_gemv_mma.cu), for
// sweep_pair.py: the product's kernel with other (U, KSPLIT, TILES) choices, built by nvcc
// into a library of its own and launched through ctypes like the product's.
#include <type_traits>

#include "../../../tinyoss/kernels/moe_gemv_mma.cu"

namespace {
// The streamed variant: a warp takes 16 rows of one pair over the whole K and copies them into
// shared memory with cp.async, C scale blocks (C * 16 bytes a row, contiguous, 16 bytes a copy)
// a stage, S stages in flight, rows laid out in MMA row order with C + 1 units a row (odd:
// ldmatrix reads 8 rows without bank conflicts); ldmatrix hands each thread the words block_mma
// takes. The tile's scales come in the first stage's group. W warps a program share x.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                   (uint32_t)__cvta_generic_to_shared(dst)),
               "l"(src)
               : "memory");
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

template <bool SWIGLU, int C, int S, int W, typename XT>
__global__ void __launch_bounds__(W * 32)
    pair_gemv_stream(const XT* __restrict__ x, int x_div, const int* __restrict__ ids,
                     const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                     const __nv_bfloat16* __restrict__ bias, const float* __restrict__ wts,
                     float* __restrict__ out, int N, int K, long stride_qe, int stride_q,
                     long stride_se, float alpha, float limit) {
  constexpr bool SPLIT = !SWIGLU;
  constexpr int XWORDS = (KMAX / 8 + W * 32 - 1) / (W * 32);
  constexpr int RU = C + 1;             // 16-byte units a row of a stage
  constexpr int STAGE = 16 * RU * 16;   // bytes a stage
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
  const int row0 = (blockIdx.y * W + warp) * 16;
  const uint8_t* src = q + e * stride_qe + (long)row0 * stride_q;
  auto issue = [&](int st) {  // stage st: rows' blocks st * C .. + C into slot st % S
    uint8_t* dst = ring + (st % S) * STAGE;
#pragma unroll
    for (int i = lane; i < 16 * C; i += 32) {
      const int r = i / C, u = i % C;
      const int m = SWIGLU ? (r & 1) * 8 + (r >> 1) : r;  // checkpoint row r -> MMA row m
      cp_async16(dst + (m * RU + u) * 16, src + (long)r * stride_q + (st * C + u) * 16);
    }
  };
  const uint8_t* sg = s + e * stride_se + (long)row0 * nblk;
  for (int i = lane; i < nblk; i += 32) cp_async16(ss + i * 16, sg + i * 16);  // 16 rows x nblk
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < nst) issue(st);
    cp_commit();
  }
  const float pre = stage_x<SPLIT, XWORDS, W>(x + (long)(pair / x_div) * K, K, xs, xl, xmax);
  __syncthreads();
  // ldmatrix: lanes 0-7 MMA rows 0-7 of block b, 8-15 rows 8-15, 16-31 the same at b + 1
  const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8, lblk = lane >> 4;
  const int ca = SWIGLU ? 2 * g : g, cb = SWIGLU ? 2 * g + 1 : g + 8;  // checkpoint rows
  float acc_a = 0.f, acc_b = 0.f;
  for (int st = 0; st < nst; ++st) {
    cp_wait<S - 2>();
    __syncwarp();  // stage st landed for every lane; every lane is done with stage st - 1's slot
    if (st + S - 1 < nst) issue(st + S - 1);
    cp_commit();
    const uint8_t* w = ring + (st % S) * STAGE + (lrow * RU + lblk) * 16;
#pragma unroll
    for (int j = 0; j < C / 2; ++j) {
      uint32_t r[4];
      ldsm4(r, w + 32 * j);
      const int b = st * C + 2 * j;
      float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
      block_mma<SPLIT>(d0, r[0], r[1], xs[4 * b + t], SPLIT ? xl[4 * b + t] : uint4{});
      block_mma<SPLIT>(d1, r[2], r[3], xs[4 * b + 4 + t], SPLIT ? xl[4 * b + 4 + t] : uint4{});
      acc_a = fmaf(d0[0], __uint_as_float((uint32_t)ss[ca * nblk + b] << 23), acc_a);
      acc_b = fmaf(d0[2], __uint_as_float((uint32_t)ss[cb * nblk + b] << 23), acc_b);
      acc_a = fmaf(d1[0], __uint_as_float((uint32_t)ss[ca * nblk + b + 1] << 23), acc_a);
      acc_b = fmaf(d1[2], __uint_as_float((uint32_t)ss[cb * nblk + b + 1] << 23), acc_b);
    }
  }
  if (t == 0) {
    const int ra = row0 + ca, rb = row0 + cb;
    const float undo = 16384.f / pre;
    const float ha = acc_a * undo + __bfloat162float(bias[e * N + ra]);
    const float hb = acc_b * undo + __bfloat162float(bias[e * N + rb]);
    if (SWIGLU) {
      const float gate = fminf(ha, limit);
      const float up = fminf(fmaxf(hb, -limit), limit);
      out[(long)pair * (N / 2) + ra / 2] = (up + 1.f) * gate / (1.f + expf(-alpha * gate));
    } else {
      const float wt = wts[pair];
      out[(long)pair * N + ra] = ha * wt;
      out[(long)pair * N + rb] = hb * wt;
    }
  }
}

template <bool SWIGLU, int C, int S, int W, typename XT>
int launch_stream(const void* x, int x_div, const int* ids, int pairs, const uint8_t* q,
                  const uint8_t* s, const void* bias, const float* wts, float* out, int N, int K,
                  long stride_qe, int stride_q, long stride_se, float alpha, float limit,
                  cudaStream_t stream) {
  if (N % (16 * W) || (K / 32) % C || K > KMAX) return (int)cudaErrorInvalidValue;
  const int smem = (SWIGLU ? 1 : 2) * (K / 8) * 16 + W * (S * 16 * (C + 1) * 16 + 16 * (K / 32));
  auto kernel = pair_gemv_stream<SWIGLU, C, S, W, XT>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return (int)err;
  kernel<<<dim3(pairs, N / (16 * W)), W * 32, smem, stream>>>(
      static_cast<const XT*>(x), x_div, ids, q, s, static_cast<const __nv_bfloat16*>(bias), wts,
      out, N, K, stride_qe, stride_q, stride_se, alpha, limit);
  return (int)cudaGetLastError();
}
}  // namespace

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
