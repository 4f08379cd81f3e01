// A whole batch-1 MoE (gate_up, SwiGLU, down, routing weight) in one persistent launch: an
// experiment. Includes the product kernel's source for its helpers.
//
// One program an SM, NG gate_up warps (KS of them share a 16-row tile, each a part of K) and ND
// down warps. A down warp's 16 rows of down weights go into shared memory with cp.async at the
// start, so they stream in alongside gate_up; the warp then waits for its pair's gate_up tiles
// (a counter a pair, bumped after each tile's SwiGLU outputs are stored), copies the pair's
// activations into shared memory and does its MMAs from there. Programs are grouped by pair for
// down (gridDim.x / P programs a pair), so a program waits for one pair only. The last program
// to finish zeroes the counters for the next launch. Launched cooperatively (all programs
// resident: the waits need it).
#include "../../../tinyoss/kernels/moe_gemv_mma.cu"

namespace {

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

template <int NG, int KS, int ND, int U>
__global__ void __launch_bounds__((NG + ND) * 32, 1)
    token_moe(const __nv_bfloat16* __restrict__ x, const int* __restrict__ ids, int P,
              const uint8_t* __restrict__ gq, const uint8_t* __restrict__ gs,
              const __nv_bfloat16* __restrict__ gb, const uint8_t* __restrict__ dq,
              const uint8_t* __restrict__ ds, const __nv_bfloat16* __restrict__ db,
              const float* __restrict__ wts, __half* __restrict__ act, float* __restrict__ y,
              unsigned* __restrict__ sync, int N1, int H, int I, long gse, int gsq, long gss,
              long dse, int dsq, long dss, float alpha, float limit, int mode) {
  constexpr int THREADS = (NG + ND) * 32, GROUPS = NG / KS;
  constexpr int XWORDS = (KMAX / 8 + THREADS - 1) / THREADS;
  extern __shared__ uint4 smem[];
  __shared__ float xmax[NG + ND];
  __shared__ float red[NG][16];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int gblk = H / 32, dblk = I / 32, rowb = 16 * (dblk + 1);
  const int tile_bytes = 16 * rowb + 16 * dblk;
  uint4* xs = smem;                                   // x as fp16 pairs [H / 8]
  uint8_t* gsc = (uint8_t*)(xs + H / 8);              // gate_up groups' scales [GROUPS][16][gblk]
  uint4* as = (uint4*)(gsc + GROUPS * 16 * gblk);     // the pair's activations, hi then lo
  uint8_t* dt = (uint8_t*)(as + 2 * (I / 8));         // down tiles [ND]: rows, then scales
  const int gtiles = N1 / 16, dtiles = H / 16;
  const int cpp = gridDim.x / P, pd = blockIdx.x / cpp, local = blockIdx.x % cpp;
  const int d0 = local * dtiles / cpp, d1 = (local + 1) * dtiles / cpp;
  const bool is_down = warp >= NG;
  const bool do_gate = !(mode & 2), do_down = !(mode & 1);  // diagnostics: skip a part
  const int wd = warp - NG, dtile = d0 + wd;
  const long de = ids[pd];
  uint8_t* mytile = dt + wd * tile_bytes;
  if (do_down && is_down && dtile < d1) {  // this warp's down rows and scales, on their way now
    const uint8_t* src = dq + de * dse + (long)dtile * 16 * dsq;
    for (int i = lane; i < 16 * dblk; i += 32) {
      const int r = i / dblk, u = i % dblk;
      cp_async16(mytile + r * rowb + u * 16, src + (long)r * dsq + u * 16);
    }
    const uint8_t* ssrc = ds + de * dss + (long)dtile * 16 * dblk;
    for (int i = lane; i < dblk; i += 32) cp_async16(mytile + 16 * rowb + i * 16, ssrc + i * 16);
    cp_commit();
  }
  // gate_up: group grp of KS warps takes tiles grp * grid + program, ...; part takes K part
  const int grp = warp / KS, part = warp % KS, per = gblk / KS, first = part * per;
  const int jn = P * gtiles, jstep = GROUPS * gridDim.x;
  int j = do_gate ? grp * gridDim.x + blockIdx.x : jn;
  uint8_t* ss = gsc + grp * 16 * gblk;
  const int la = 2 * g, lb = la + 1;  // gate and up rows of one output
  uint32_t wa[U], wb[U];
  const uint32_t *qa = nullptr, *qb = nullptr;
  int pg = 0, row0 = 0;
  long e = 0;
#define TOKEN_BEGIN(jj)                                                                      \
  do {                                                                                       \
    pg = (jj) / gtiles;                                                                      \
    row0 = ((jj) % gtiles) * 16;                                                             \
    e = ids[pg];                                                                             \
    const uint8_t* base = gq + e * gse + (long)row0 * gsq;                                   \
    qa = reinterpret_cast<const uint32_t*>(base + (long)la * gsq) + t + 4 * first;           \
    qb = reinterpret_cast<const uint32_t*>(base + (long)lb * gsq) + t + 4 * first;           \
    _Pragma("unroll") for (int u = 0; u < U; ++u) {                                          \
      wa[u] = __ldg(qa + 4 * u);                                                             \
      wb[u] = __ldg(qb + 4 * u);                                                             \
    }                                                                                        \
    if (part == 0) {                                                                         \
      const uint8_t* sg = gs + e * gss + (long)row0 * gblk;                                  \
      for (int i = lane; i < gblk; i += 32) cp_async16(ss + i * 16, sg + i * 16);            \
    }                                                                                        \
    cp_commit();                                                                             \
  } while (0)
  if (!is_down && j < jn) TOKEN_BEGIN(j);
  const float pre = stage_x<false, XWORDS, NG + ND>(x, H, xs, nullptr, xmax);
  __syncthreads();
  if (!is_down) {
    for (bool fresh = false; j < jn; j += jstep, fresh = true) {
      if (fresh) TOKEN_BEGIN(j);
      cp_wait<0>();
      if (KS > 1) {
        asm volatile("bar.sync %0, %1;" ::"r"(2 + grp), "n"(KS * 32));  // scales landed
      } else {
        __syncwarp();
      }
      float acc_a = 0.f, acc_b = 0.f;
      for (int b0 = 0; b0 < per; b0 += U) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int b = first + b0 + u;
          float d[4] = {0.f, 0.f, 0.f, 0.f};
          block_mma<false>(d, wa[u], wb[u], xs[4 * b + t], uint4{});
          acc_a = fmaf(d[0], __uint_as_float((uint32_t)ss[la * gblk + b] << 23), acc_a);
          acc_b = fmaf(d[2], __uint_as_float((uint32_t)ss[lb * gblk + b] << 23), acc_b);
        }
        if (b0 + U < per) {
#pragma unroll
          for (int u = 0; u < U; ++u) {
            wa[u] = __ldg(qa + 4 * (b0 + U + u));
            wb[u] = __ldg(qb + 4 * (b0 + U + u));
          }
        }
      }
      if (KS > 1) {
        if (part > 0 && t == 0) {
          red[warp][g] = acc_a;
          red[warp][8 + g] = acc_b;
        }
        asm volatile("bar.sync %0, %1;" ::"r"(2 + grp), "n"(KS * 32));
        if (part == 0) {
#pragma unroll
          for (int p = 1; p < KS; ++p) {
            acc_a += red[warp + p][g];
            acc_b += red[warp + p][8 + g];
          }
        }
      }
      if (part == 0) {
        if (t == 0) {
          const float undo = 16384.f / pre;
          const float ha = acc_a * undo + __bfloat162float(gb[e * N1 + row0 + la]);
          const float hb = acc_b * undo + __bfloat162float(gb[e * N1 + row0 + lb]);
          const float gate = fminf(ha, limit);
          const float up = fminf(fmaxf(hb, -limit), limit);
          const float v = (up + 1.f) * gate / (1.f + expf(-alpha * gate));
          const int i = row0 / 2 + g, w = i >> 3, k = i & 7;  // stage_x's pair order
          const long pos = (long)pg * 2 * I + w * 8 + (k >> 1) + ((k & 1) << 2);
          const __half hi = __float2half_rn(v);
          act[pos] = hi;
          act[pos + I] = __float2half_rn(v - __half2float(hi));
          __threadfence();
        }
        __syncwarp();
        if (lane == 0) atomicAdd(&sync[pg], 1u);
      }
      if (KS > 1) asm volatile("bar.sync %0, %1;" ::"r"(2 + grp), "n"(KS * 32));  // red reused
      else __syncwarp();
    }
  } else {
    if (lane == 0 && do_gate) {
      while (ld_acquire(&sync[pd]) < (unsigned)gtiles) __nanosleep(32);
    }
    __syncwarp();
    __threadfence();
    const uint4* asrc = reinterpret_cast<const uint4*>(act + (long)pd * 2 * I);
    for (int i = wd * 32 + lane; i < 2 * (I / 8); i += ND * 32) cp_async16(as + i, asrc + i);
    cp_commit();
    cp_wait<0>();
    asm volatile("bar.sync 1, %0;" ::"n"(ND * 32));
    if (do_down && dtile < d1) {
      const uint8_t* ra = mytile + g * rowb + t * 4;
      const uint8_t* rb = ra + 8 * rowb;
      const uint8_t* sc = mytile + 16 * rowb;
      float acc_a = 0.f, acc_b = 0.f;
#pragma unroll 10
      for (int b = 0; b < dblk; ++b) {
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        block_mma<true>(d, *reinterpret_cast<const uint32_t*>(ra + b * 16),
                        *reinterpret_cast<const uint32_t*>(rb + b * 16), as[4 * b + t],
                        as[I / 8 + 4 * b + t]);
        acc_a = fmaf(d[0], __uint_as_float((uint32_t)sc[g * dblk + b] << 23), acc_a);
        acc_b = fmaf(d[2], __uint_as_float((uint32_t)sc[(g + 8) * dblk + b] << 23), acc_b);
      }
      if (t == 0) {
        store<false>(acc_a, acc_b, 1.f, dtile * 16 + g, dtile * 16 + g + 8, pd, de, db, wts, y,
                     H, alpha, limit);
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&sync[P], 1u) == gridDim.x - 1) {  // the last program: counters back to 0
      for (int p = 0; p < P; ++p) sync[p] = 0;
      sync[P] = 0;
      __threadfence();
    }
  }
}

template <int NG, int KS, int ND, int U>
int launch_token(const void* x, const int* ids, int P, const uint8_t* gq, const uint8_t* gs,
                 const void* gb, const uint8_t* dq, const uint8_t* ds, const void* db,
                 const float* wts, void* act, float* y, unsigned* sync, int N1, int H, int I,
                 long gse, int gsq, long gss, long dse, int dsq, long dss, float alpha,
                 float limit, int ctas, int mode, cudaStream_t stream) {
  const int dblk = I / 32, rowb = 16 * (dblk + 1);
  const int cpp = ctas / P;
  if (P < 1 || ctas % P || cpp < 1 || N1 % 16 || H % 16 || H > KMAX || I % 32 ||
      (H / 32) % KS || ((H / 32) / KS) % U || (H / 16 + cpp - 1) / cpp > ND)
    return (int)cudaErrorInvalidValue;
  // mode 8 (with 1, no down): without the down tiles' shared memory
  const int smem = (H / 8) * 16 + (NG / KS) * 16 * (H / 32) + 2 * (I / 8) * 16 +
                   ((mode & 8) ? 0 : ND * (16 * rowb + 16 * dblk));
  auto kernel = token_moe<NG, KS, ND, U>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return (int)err;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(ctas);
  cfg.blockDim = dim3((NG + ND) * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = (mode & 4) ? 0 : 1;
  err = cudaLaunchKernelEx(&cfg, kernel, static_cast<const __nv_bfloat16*>(x), ids, P, gq, gs,
                           static_cast<const __nv_bfloat16*>(gb), dq, ds,
                           static_cast<const __nv_bfloat16*>(db), wts,
                           static_cast<__half*>(act), y, sync, N1, H, I, gse, gsq, gss, dse, dsq,
                           dss, alpha, limit, mode);
  if (err != cudaSuccess) return (int)err;
  return (int)cudaGetLastError();
}

}  // namespace

#define TOKEN_ARGS                                                                              \
  x, ids, P, gq, gs, gb, dq, ds, db, wts, act, y, sync, N1, H, I, gse, gsq, gss, dse, dsq, dss, \
      alpha, limit, ctas, mode, static_cast<cudaStream_t>(stream)

extern "C" int tinyoss_token_moe(int variant, const void* x, const int* ids, int P,
                                 const uint8_t* gq, const uint8_t* gs, const void* gb,
                                 const uint8_t* dq, const uint8_t* ds, const void* db,
                                 const float* wts, void* act, float* y, unsigned* sync, int N1,
                                 int H, int I, long gse, int gsq, long gss, long dse, int dsq,
                                 long dss, float alpha, float limit, int ctas, int mode,
                                 void* stream) {
  switch (variant) {
    case 0: return launch_token<11, 1, 6, 9>(TOKEN_ARGS);
    case 1: return launch_token<22, 2, 6, 9>(TOKEN_ARGS);
    case 2: return launch_token<22, 2, 6, 5>(TOKEN_ARGS);
    case 3: return launch_token<20, 2, 6, 9>(TOKEN_ARGS);
    case 4: return launch_token<12, 1, 6, 9>(TOKEN_ARGS);
    default: return -1;
  }
}

extern "C" const char* tinyoss_token_moe_name(int variant) {
  switch (variant) {
    case 0: return "NG11 KS1 ND6 U9";
    case 1: return "NG22 KS2 ND6 U9";
    case 2: return "NG22 KS2 ND6 U5";
    case 3: return "NG20 KS2 ND6 U9";
    case 4: return "NG12 KS1 ND6 U9";
    default: return nullptr;
  }
}
