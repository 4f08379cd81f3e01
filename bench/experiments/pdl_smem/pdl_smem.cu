// The batch-1 MoE's down launched early (programmatic dependent launch) with every weight row of
// its program copied into shared memory before it waits for gate_up: the product's streamed pair
// kernel (pair_gemv_stream) with a trigger (gate_up lets the next kernel launch at its start) or
// a full prefetch then a wait (down: all S - 1 >= K / 32 / C stages issued, griddepcontrol.wait,
// then x). Built by bench.py beside the product's source, which it includes.
#include "../../../tinyoss/kernels/moe_gemv_mma.cu"

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
// down, every stage prefetched: (C, W, HINT)
const LaunchFn kDown[] = {
    launch_pdl<false, 10, 10, 1, float, 0, false, true>,
    launch_pdl<false, 10, 10, 2, float, 0, false, true>,
    launch_pdl<false, 10, 10, 4, float, 0, false, true>,
    launch_pdl<false, 15, 7, 1, float, 0, false, true>,
    launch_pdl<false, 15, 7, 2, float, 0, false, true>,
    launch_pdl<false, 10, 10, 1, float, 2, false, true>,
    launch_pdl<false, 10, 10, 2, float, 2, false, true>,
};
const char* kDownNames[] = {"C10 W1", "C10 W2", "C10 W4", "C15 W1", "C15 W2", "C10 W1 L2:256",
                            "C10 W2 L2:256"};

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
