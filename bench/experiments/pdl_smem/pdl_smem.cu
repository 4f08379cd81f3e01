// The batch-1 MoE's down launched early (programmatic dependent launch) with every weight row of
// its program copied into shared memory before it waits for gate_up: the product's streamed pair
// kernel (pair_gemv_stream) with a trigger (gate_up lets the next kernel launch at its start) or
// a full prefetch then a wait (down: all S - 1 >= K / 32 / C stages issued, griddepcontrol.wait,
// then x). Built by bench.py beside the product's source, which it includes.
#include "../../../tinyoss/kernels/moe_gemv_mma.cu"
#include "../persistent_layer/ring.cuh"

namespace {

template <bool SWIGLU, int C, int S, int W, typename XT, int HINT, bool TRIG, bool WAIT>
__global__ void __launch_bounds__(W * 32)
    pdl_pair_stream(const XT* __restrict__ x, int x_div, const int* __restrict__ ids,
                    const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                    const __nv_bfloat16* __restrict__ bias, const float* __restrict__ wts,
                    float* __restrict__ out, int N, int K, long stride_qe, int stride_q,
                    long stride_se, float alpha, float limit) {
  if (TRIG) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  constexpr bool SPLIT = !SWIGLU;
  constexpr int XWORDS = (KMAX / 8 + W * 32 - 1) / (W * 32);
  constexpr int STAGE = 16 * (C + 1) * 16;
  extern __shared__ uint4 smem[];
  __shared__ float xmax[W];
  const int nblk = K / 32, nst = nblk / C;
  uint4* xs = smem;
  uint4* xl = smem + K / 8;
  uint8_t* base = (uint8_t*)(smem + (SPLIT ? 2 : 1) * (K / 8));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  uint8_t* ring = base + warp * (S * STAGE + 16 * nblk);
  uint8_t* ss = ring + S * STAGE;
  const int pair = blockIdx.x;
  const long e = ids[pair];  // written by the router, two launches back: complete
  if (e < 0) return;
  const int row0 = (blockIdx.y * W + warp) * 16;
  const uint8_t* src = q + e * stride_qe + (long)row0 * stride_q;
  const uint8_t* sg = s + e * stride_se + (long)row0 * nblk;
  for (int i = lane; i < nblk; i += 32) cp_async16(ss + i * 16, sg + i * 16);
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < nst) issue_stage<SWIGLU, C, S, HINT>(ring, src, stride_q, st);
    cp_commit();
  }
  if (WAIT) asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the kernel before's
  const float pre = stage_x<SPLIT, XWORDS, W>(x + (long)(pair / x_div) * K, K, xs, xl, xmax);
  __syncthreads();
  const int ca = SWIGLU ? 2 * g : g, cb = SWIGLU ? 2 * g + 1 : g + 8;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  stream_rows<SWIGLU, C, S, HINT>(ring, src, stride_q, nst, xs, xl, ss, nblk, ca, cb, acc);
  if (t == 0) {
    store<SWIGLU>(acc[0], acc[2], pre, row0 + ca, row0 + cb, pair, e, bias, wts, out, N, alpha,
                  limit);
  }
}

template <bool SWIGLU, int C, int S, int W, typename XT, int HINT, bool TRIG, bool WAIT>
int launch_pdl(bool attr, const void* x, int x_div, const int* ids, int pairs, const uint8_t* q,
               const uint8_t* s, const void* bias, const float* wts, float* out, int N, int K,
               long stride_qe, int stride_q, long stride_se, float alpha, float limit,
               cudaStream_t stream) {
  if (N % (16 * W) || (K / 32) % C || K > KMAX) return (int)cudaErrorInvalidValue;
  if (WAIT && S - 1 < (K / 32) / C) return (int)cudaErrorInvalidValue;  // not a full prefetch
  const int smem = (SWIGLU ? 1 : 2) * (K / 8) * 16 + W * (S * 16 * (C + 1) * 16 + 16 * (K / 32));
  auto kernel = pdl_pair_stream<SWIGLU, C, S, W, XT, HINT, TRIG, WAIT>;
  if (smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return (int)err;
  }
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(pairs, N / (16 * W));
  cfg.blockDim = dim3(W * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = at;
  cfg.numAttrs = attr ? 1 : 0;
  return (int)cudaLaunchKernelEx(&cfg, kernel, static_cast<const XT*>(x), x_div, ids, q, s,
                                 static_cast<const __nv_bfloat16*>(bias), wts, out, N, K,
                                 stride_qe, stride_q, stride_se, alpha, limit);
}


// An MMA the compiler may reorder (the product's is asm volatile, which keeps every MMA in
// source order, so a block's chained MMAs and the next block's cannot interleave).
__device__ __forceinline__ void mma_nv(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                       uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// block_mma<true> with x's hi and lo parts in two accumulators (chains of two MMAs, not four):
// rows g and g + 8's sums for the block.
__device__ __forceinline__ void block_mma_ilp(float& ra, float& rb, uint32_t qa, uint32_t qb,
                                              uint4 xv, uint4 xl) {
  uint32_t a0, a1, b0, b1;
  float d[4] = {0.f, 0.f, 0.f, 0.f}, f[4] = {0.f, 0.f, 0.f, 0.f};
  decode_half<true>(qa, a0, a1);
  decode_half<true>(qb, b0, b1);
  mma_nv(d, a0, b0, a1, b1, xv.x, xv.y);
  mma_nv(f, a0, b0, a1, b1, xl.x, xl.y);
  decode_half<false>(qa, a0, a1);
  decode_half<false>(qb, b0, b1);
  mma_nv(d, a0, b0, a1, b1, xv.z, xv.w);
  mma_nv(f, a0, b0, a1, b1, xl.z, xl.w);
  ra = d[0] + f[0];
  rb = d[2] + f[2];
}

// down with each program's rows in one piece: one bulk copy of its 16 * TILES consecutive rows
// (PAD 0; ldmatrix-free 32-bit reads, two lanes a bank) or one copy a row into rows padded by 16
// bytes (PAD 1: no bank conflicts), its scales in one more, all completing on one mbarrier; then
// the wait, x, and TILES x KSPLIT warps (a 16-row tile, a K part each) reading the words block_mma
// takes straight from shared memory.
// MODE (what a run leaves out, to see what bounds it): 0 nothing, 1 the math, 2 the copies
template <int TILES, int KSPLIT, bool PAD, bool WAIT, bool ILP, int MODE = 0>
__global__ void __launch_bounds__(TILES * KSPLIT * 32)
    down_bulk(const float* __restrict__ x, int x_div, const int* __restrict__ ids,
              const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
              const __nv_bfloat16* __restrict__ bias, const float* __restrict__ wts,
              float* __restrict__ out, int N, int K, long stride_qe, int stride_q,
              long stride_se, float alpha, float limit) {
  constexpr int ROWS = 16 * TILES, THREADS = TILES * KSPLIT * 32;
  constexpr int XWORDS = (KMAX / 8 + THREADS - 1) / THREADS;
  extern __shared__ uint4 smem[];
  __shared__ float xmax[TILES * KSPLIT];
  __shared__ uint64_t bar;
  const int nblk = K / 32, rb = K / 2 + (PAD ? 16 : 0);  // bytes a row in shared memory
  uint8_t* wsm = (uint8_t*)smem;                          // [ROWS][rb]
  uint8_t* ss = wsm + ROWS * rb;                          // [ROWS][nblk]
  uint4* xs = (uint4*)(ss + ((ROWS * nblk + 15) & ~15));  // [K / 8] hi, then [K / 8] lo
  uint4* xl = xs + K / 8;
  const int pair = blockIdx.x, row0 = blockIdx.y * ROWS;
  const long e = ids[pair];  // written by the router, two launches back: complete
  if (e < 0) return;
  const uint8_t* src = q + e * stride_qe + (long)row0 * stride_q;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    ring::mbar_init(&bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == 0 && MODE != 2) {
    if (lane == 0) {
      ring::mbar_expect(&bar, ROWS * (K / 2) + ROWS * nblk);
      ring::bulk_copy(ss, s + e * stride_se + (long)row0 * nblk, ROWS * nblk, &bar);
      if (!PAD) ring::bulk_copy(wsm, src, ROWS * (K / 2), &bar);
    }
    if (PAD) {
      __syncwarp();  // the expect before any copy completes
      for (int r = lane; r < ROWS; r += 32) {
        ring::bulk_copy(wsm + r * rb, src + (long)r * stride_q, K / 2, &bar);
      }
    }
  }
  if (WAIT) asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the kernel before's
  const float pre = stage_x<true, XWORDS, TILES * KSPLIT>(x + (long)(pair / x_div) * K, K, xs,
                                                           xl, xmax);
  __syncthreads();
  if (MODE != 2) ring::mbar_wait(&bar, 0);
  const int tile = warp % TILES, part = warp / TILES;
  const int g = lane >> 2, t = lane & 3;
  const int la = tile * 16 + g, lb = la + 8;
  const int per = (nblk + KSPLIT - 1) / KSPLIT, first = part * per;
  const int last = MODE == 1 ? first : min(nblk, first + per);
  const uint32_t* wa = reinterpret_cast<const uint32_t*>(wsm + la * rb) + t;
  const uint32_t* wb = reinterpret_cast<const uint32_t*>(wsm + lb * rb) + t;
  float acc_a = 0.f, acc_b = 0.f;
#pragma unroll 4
  for (int b = first; b < last; ++b) {
    float da, db;
    if (ILP) {
      block_mma_ilp(da, db, wa[4 * b], wb[4 * b], xs[4 * b + t], xl[4 * b + t]);
    } else {
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      block_mma<true>(d, wa[4 * b], wb[4 * b], xs[4 * b + t], xl[4 * b + t]);
      da = d[0];
      db = d[2];
    }
    acc_a = fmaf(da, __uint_as_float((uint32_t)ss[la * nblk + b] << 23), acc_a);
    acc_b = fmaf(db, __uint_as_float((uint32_t)ss[lb * nblk + b] << 23), acc_b);
  }
  if (KSPLIT > 1) {
    float* red = reinterpret_cast<float*>(xs);  // x is read no more
    __syncthreads();
    if (part > 0 && t == 0) {
      red[((part - 1) * TILES + tile) * 16 + g] = acc_a;
      red[((part - 1) * TILES + tile) * 16 + 8 + g] = acc_b;
    }
    __syncthreads();
    if (part > 0) return;
#pragma unroll
    for (int p = 1; p < KSPLIT; ++p) {
      acc_a += red[((p - 1) * TILES + tile) * 16 + g];
      acc_b += red[((p - 1) * TILES + tile) * 16 + 8 + g];
    }
  }
  if (t == 0) {
    store<false>(acc_a, acc_b, pre, row0 + la, row0 + lb, pair, e, bias, wts, out, N, alpha,
                 limit);
  }
}

template <int TILES, int KSPLIT, bool PAD, bool WAIT, bool ILP = false, int MODE = 0>
int launch_bulk(bool attr, const void* x, int x_div, const int* ids, int pairs, const uint8_t* q,
                const uint8_t* s, const void* bias, const float* wts, float* out, int N, int K,
                long stride_qe, int stride_q, long stride_se, float alpha, float limit,
                cudaStream_t stream) {
  constexpr int ROWS = 16 * TILES;
  if (N % ROWS || K % 32 || K > KMAX || (!PAD && stride_q != K / 2) || (ROWS * (K / 32)) % 16)
    return (int)cudaErrorInvalidValue;
  const int smem = ROWS * (K / 2 + (PAD ? 16 : 0)) + ((ROWS * (K / 32) + 15) & ~15) + 2 * (K / 8) * 16;
  auto kernel = down_bulk<TILES, KSPLIT, PAD, WAIT, ILP, MODE>;
  if (smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return (int)err;
  }
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(pairs, N / ROWS);
  cfg.blockDim = dim3(TILES * KSPLIT * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = at;
  cfg.numAttrs = attr ? 1 : 0;
  return (int)cudaLaunchKernelEx(&cfg, kernel, static_cast<const float*>(x), x_div, ids, q, s,
                                 static_cast<const __nv_bfloat16*>(bias), wts, out, N, K,
                                 stride_qe, stride_q, stride_se, alpha, limit);
}

using LaunchFn = int (*)(bool, const void*, int, const int*, int, const uint8_t*, const uint8_t*,
                         const void*, const float*, float*, int, int, long, int, long, float,
                         float, cudaStream_t);

using B = __nv_bfloat16;
// gate_up: the product's one-token tiles (C 10, S 3, W 4, HINT 2), without and with the trigger;
// then S 2 (less shared memory left to down's early programs)
const LaunchFn kGateUp[] = {
    launch_pdl<true, 10, 3, 4, B, 2, false, false>,
    launch_pdl<true, 10, 3, 4, B, 2, true, false>,
    launch_pdl<true, 10, 2, 4, B, 2, true, false>,
};
// down, every row of a program in shared memory before the wait
const LaunchFn kDown[] = {
    launch_bulk<2, 4, true, true, true>,
    launch_bulk<2, 4, true, true, true, 1>,
    launch_bulk<2, 4, true, true, true, 2>,
    launch_bulk<2, 6, true, true, true>,
    launch_bulk<3, 4, true, true, true>,
    launch_bulk<3, 3, true, true, true>,
    launch_bulk<4, 2, true, true, true>,
    launch_bulk<4, 4, true, true, true>,
    launch_bulk<4, 4, true, true, true, 1>,
};
const char* kDownNames[] = {"ilp padded 32 x4", "32 x4 no math", "32 x4 no copies",
                            "ilp padded 32 x6", "ilp padded 48 x4", "ilp padded 48 x3",
                            "ilp padded 64 x2", "ilp padded 64 x4", "64 x4 no math"};

// A dense bf16 layer at one row of x (o behind attention): each program copies its ROWS weight
// rows (one bulk copy a row, rows padded by 16 bytes) into shared memory, then waits for the
// kernel before (griddepcontrol.wait), stages x and multiplies on the tensor cores with x as the
// first row of A (m16n8k16: eight weight rows a B tile), WARPS warps a K part each.
template <int ROWS, int WARPS>
__global__ void __launch_bounds__(WARPS * 32)
    dense_resident(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                   const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ out,
                   int N, int K) {
  extern __shared__ uint4 smem[];
  __shared__ uint64_t bar;
  __shared__ float red[WARPS][ROWS];
  const int rb = 2 * K + 16;
  uint8_t* ws = (uint8_t*)smem;
  uint4* xs = (uint4*)(ws + ROWS * rb);
  const int row0 = blockIdx.x * ROWS, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) mbar_init(&bar);
  __syncthreads();
  if (warp == 0) {
    if (lane == 0) mbar_expect(&bar, ROWS * 2 * K);
    __syncwarp();
    for (int r = lane; r < ROWS; r += 32) bulk_copy(ws + r * rb, w + (long)(row0 + r) * K, 2 * K, &bar);
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");
  for (int i = threadIdx.x; i < K / 8; i += WARPS * 32) xs[i] = reinterpret_cast<const uint4*>(x)[i];
  __syncthreads();
  mbar_wait(&bar, 0);
  const int g = lane >> 2, t = lane & 3;
  const int per = K / WARPS, k_lo = warp * per;
  const uint32_t* xw = reinterpret_cast<const uint32_t*>(xs);
  float acc[ROWS / 8][4] = {};
#pragma unroll 4
  for (int k0 = k_lo; k0 < k_lo + per; k0 += 16) {
    const uint32_t a0 = g == 0 ? xw[(k0 >> 1) + t] : 0u;
    const uint32_t a2 = g == 0 ? xw[(k0 >> 1) + 4 + t] : 0u;
#pragma unroll
    for (int j = 0; j < ROWS / 8; ++j) {
      const uint32_t* wr = reinterpret_cast<const uint32_t*>(ws + (j * 8 + g) * rb);
      mma_bf16(acc[j], a0, 0u, a2, 0u, wr[(k0 >> 1) + t], wr[(k0 >> 1) + 4 + t]);
    }
  }
  if (g == 0) {
#pragma unroll
    for (int j = 0; j < ROWS / 8; ++j) {
      red[warp][j * 8 + 2 * t] = acc[j][0];
      red[warp][j * 8 + 2 * t + 1] = acc[j][1];
    }
  }
  __syncthreads();
  if (threadIdx.x < ROWS) {
    float v = bias ? __bfloat162float(bias[row0 + threadIdx.x]) : 0.f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) v += red[i][threadIdx.x];
    out[row0 + threadIdx.x] = __float2bfloat16(v);
  }
}

template <int ROWS, int WARPS>
int launch_dense_resident(bool attr, const void* x, const void* w, const void* bias, void* out,
                          int N, int K, cudaStream_t stream) {
  if (N % ROWS || K % (16 * WARPS) || (uintptr_t)w % 16 || (uintptr_t)x % 16)
    return (int)cudaErrorInvalidValue;
  const int smem = ROWS * (2 * K + 16) + 2 * K;
  auto kernel = dense_resident<ROWS, WARPS>;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return (int)err;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(N / ROWS);
  cfg.blockDim = dim3(WARPS * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = at;
  cfg.numAttrs = attr ? 1 : 0;
  return (int)cudaLaunchKernelEx(&cfg, kernel, static_cast<const __nv_bfloat16*>(x),
                                 static_cast<const __nv_bfloat16*>(w),
                                 static_cast<const __nv_bfloat16*>(bias),
                                 static_cast<__nv_bfloat16*>(out), N, K);
}

using DenseFn = int (*)(bool, const void*, const void*, const void*, void*, int, int,
                        cudaStream_t);
const DenseFn kDense[] = {launch_dense_resident<8, 8>,  launch_dense_resident<16, 8>,
                          launch_dense_resident<24, 8>, launch_dense_resident<8, 16>,
                          launch_dense_resident<16, 16>, launch_dense_resident<24, 16>};
const char* kDenseNames[] = {"8 rows, 8 warps",  "16 rows, 8 warps",  "24 rows, 8 warps",
                             "8 rows, 16 warps", "16 rows, 16 warps", "24 rows, 16 warps"};

}  // namespace

extern "C" int pdl_variants(int down) {
  return down ? (int)(sizeof(kDown) / sizeof(kDown[0])) : (int)(sizeof(kGateUp) / sizeof(kGateUp[0]));
}
extern "C" const char* pdl_down_name(int v) { return kDownNames[v]; }

extern "C" int pdl_gate_up(int v, const void* x, int x_div, const int* ids, int pairs,
                           const uint8_t* q, const uint8_t* s, const void* bias, const float* wts,
                           float* out, int N, int K, long stride_qe, int stride_q, long stride_se,
                           float alpha, float limit, void* stream) {
  return kGateUp[v](false, x, x_div, ids, pairs, q, s, bias, wts, out, N, K, stride_qe, stride_q,
                    stride_se, alpha, limit, static_cast<cudaStream_t>(stream));
}

extern "C" int pdl_down(int v, int attr, const void* x, int x_div, const int* ids, int pairs,
                        const uint8_t* q, const uint8_t* s, const void* bias, const float* wts,
                        float* out, int N, int K, long stride_qe, int stride_q, long stride_se,
                        float alpha, float limit, void* stream) {
  return kDown[v](attr != 0, x, x_div, ids, pairs, q, s, bias, wts, out, N, K, stride_qe,
                  stride_q, stride_se, alpha, limit, static_cast<cudaStream_t>(stream));
}

extern "C" int pdl_dense_variants() { return (int)(sizeof(kDense) / sizeof(kDense[0])); }
extern "C" const char* pdl_dense_name(int v) { return kDenseNames[v]; }
extern "C" int pdl_dense(int v, int attr, const void* x, const void* w, const void* bias,
                         void* out, int N, int K, void* stream) {
  return kDense[v](attr != 0, x, w, bias, out, N, K, static_cast<cudaStream_t>(stream));
}
