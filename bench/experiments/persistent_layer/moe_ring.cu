// The batch-1 MoE (gate_up then down of one token's 4 experts) as one persistent launch whose
// rows stream through a cp.async.bulk ring in shared memory, read by the product's tensor-core
// pair decode (block_mma, ldmatrix): can MXFP4 consumers keep up with the ring? Down's rows load
// while gate_up is computed (they are known from the same routing); the product's two launches
// cannot start down's loads before gate_up's launch ends.
//
// One program an SM: warp NW (the producer) copies this program's 16-row tiles (gate_up's, then
// down's), a tile a slot: 16 rows of 1,440 code bytes at a padded stride (ldmatrix without bank
// conflicts; gate_up's rows interleaved gate/up as the pair kernel's checkpoint->MMA order) and
// the tile's [16][90] scales. KS consumer warps take a tile together, each a part of its K, the
// first summing the others' partials (shared memory, a named barrier a group); group i of G
// takes the program's tiles k = i, i + G, ... (slot k % SLOTS, an mbarrier pair a slot, KS
// arrivals; G <= SLOTS, so that a warp waiting for a slot's fill finds the fill before it already
// done, which its parity wait needs). A gate_up tile ends with the clamped
// SwiGLU, written as fp32 (`act`, for checking) and as down's x staged in block_mma's order
// (fp16 hi + lo, global), then counts the pair's done tiles; a warp's first down tile of a pair
// waits for all 360 and copies that x into shared memory once a program. The counts are never
// reset: a launch waits for (launches done + 1) x 360, and the last program to end a launch
// counts it (`epoch`), so no memset runs between launches.
#include "../../../tinyoss/kernels/moe_gemv_mma.cu"
#include "ring.cuh"

namespace {

using namespace ring;

constexpr int KB = KMAX / 32;  // scale blocks a row: 90
constexpr int RU = KB + 1;     // 16-byte units a row in shared memory (one of padding)
constexpr int TILE_CODES = 16 * RU * 16, TILE_BYTES = TILE_CODES + 16 * KB;  // 24,736
constexpr int GU_N = 5760, DN_N = 2880, PAIRS = 4;
constexpr int GU_TILES = PAIRS * GU_N / 16, DN_TILES = PAIRS * DN_N / 16, XW = KMAX / 8;

struct MoeArgs {
  const __nv_bfloat16* x;  // [KMAX] the token
  const int* ids;          // [PAIRS] its experts
  const float* wts;        // [PAIRS] their routing weights
  const uint8_t *gq, *gs;  // gate_up [E, 5760, 90, 16] codes, [E, 5760, 90] scales
  const __nv_bfloat16* gb;  // [E, 5760]
  const uint8_t *dq, *ds;  // down [E, 2880, 90, 16], [E, 2880, 90]
  const __nv_bfloat16* db;  // [E, 2880]
  float* act;              // [PAIRS, 2880] after the SwiGLU
  uint4* hx;               // [PAIRS][2][XW] down's x: fp16 hi, then lo, block_mma's order
  float* y;                // [PAIRS, 2880] times the routing weight
  unsigned* count;         // [PAIRS] gate_up tiles done, over every launch so far (never reset)
  unsigned* epoch;         // [2] launches done, and this launch's programs done (a ticket)
  float alpha, limit;
};

template <int NW>
__device__ __forceinline__ void consumers_bar() {
  asm volatile("bar.sync 1, %0;" ::"r"(NW * 32) : "memory");
}

// this program's k-th tile: phase (0 gate_up, 1 down), pair, first row
struct Tile {
  int down, pair, row0;
};
__device__ __forceinline__ Tile tile_of(int k, int ga, int ng, int da) {
  if (k < ng) return {0, (ga + k) / (GU_N / 16), ((ga + k) % (GU_N / 16)) * 16};
  const int i = da + k - ng;
  return {1, i / (DN_N / 16), (i % (DN_N / 16)) * 16};
}

// TRACE: [program][warp][field] clock64 cycles a launch: 0 waiting for full slots, 1 computing
// tiles (from a full slot to its epilogue's end), 2 waiting for down's x (the pair's count and
// the staging), 3 tiles taken; warp NW (the producer) 0 waiting for free slots; [program][32]:
// 0/1 clock64 and 2/3 globaltimer at the program's start and end.
constexpr int T_PROGRAMS = 264, T_WARPS = 33, T_FIELDS = 4;
__device__ unsigned long long g_mtrace[T_PROGRAMS * T_WARPS * T_FIELDS];
__device__ __forceinline__ unsigned long long& mtr(int w, int f) {
  return g_mtrace[((long)blockIdx.x * T_WARPS + w) * T_FIELDS + f];
}
__device__ __forceinline__ unsigned long long gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

template <int G, int KS, int SLOTS, bool TRACE = false>
__global__ void __launch_bounds__((G * KS + 1) * 32, 1) moe_ring(MoeArgs a) {
  static_assert(G <= SLOTS, "a warp's parity wait needs the slot's previous fill done");
  static_assert(G + 2 <= 16, "a named barrier a group");
  constexpr int NW = G * KS;
  extern __shared__ __align__(128) uint8_t ring_smem[];
  uint8_t* smem = ring_smem;
  uint4* xg = reinterpret_cast<uint4*>(smem + SLOTS * TILE_BYTES);  // gate_up's x, staged
  uint4* xd = xg + XW;                                               // [PAIRS][2][XW] down's
  uint64_t* full = reinterpret_cast<uint64_t*>(xd + PAIRS * 2 * XW);
  uint64_t* empty = full + SLOTS;
  int* flag = reinterpret_cast<int*>(empty + SLOTS);  // [PAIRS] 0 none, 1 staging, 2 staged
  float* xmax = reinterpret_cast<float*>(flag + PAIRS);
  float* red = xmax + NW;  // [G][2 tiles][KS][16 rows] partial sums
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, P = gridDim.x, c = blockIdx.x;
  const int ga = (int)((long)c * GU_TILES / P), ng = (int)((long)(c + 1) * GU_TILES / P) - ga;
  const int da = (int)((long)c * DN_TILES / P), nd = (int)((long)(c + 1) * DN_TILES / P) - da;
  __shared__ unsigned launches;
  if (TRACE && threadIdx.x == 0) mtr(32, 0) = clock64(), mtr(32, 2) = gtime();
  if (threadIdx.x == 0) {
    launches = ld_acquire(a.epoch);  // stable: it moves only after every program has ended
    for (int s = 0; s < SLOTS; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], KS);
    for (int p = 0; p < PAIRS; ++p) flag[p] = 0;
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == NW) {  // the producer
    if (TRACE && lane == 0) mtr(NW, 0) = 0;
    for (int k = 0; k < ng + nd; ++k) {
      const int s = k % SLOTS, round = k / SLOTS;
      const Tile tl = tile_of(k, ga, ng, da);
      const long e = a.ids[tl.pair];
      const int n = tl.down ? DN_N : GU_N;
      const uint8_t* q = (tl.down ? a.dq : a.gq) + (e * n + tl.row0) * (long)(KB * 16);
      const uint8_t* sc = (tl.down ? a.ds : a.gs) + (e * n + tl.row0) * (long)KB;
      uint8_t* slot = smem + s * TILE_BYTES;
      if (lane == 0) {
        const long long t0 = TRACE ? clock64() : 0;
        if (round) mbar_wait(&empty[s], (round - 1) & 1);
        if (TRACE) mtr(NW, 0) += clock64() - t0;
        mbar_expect(&full[s], 17 * KB * 16);
      }
      __syncwarp();
      if (lane < 16) {  // checkpoint row r -> MMA row m (gate_up: gate rows first, then up)
        const int m = tl.down ? lane : (lane & 1) * 8 + (lane >> 1);
        bulk_copy(slot + m * RU * 16, q + (long)lane * KB * 16, KB * 16, &full[s]);
      } else if (lane == 16) {
        bulk_copy(slot + TILE_CODES, sc, 16 * KB, &full[s]);
      }
    }
    return;
  }
  // consumers: gate_up's x staged as the pair kernel stages bf16 x (stage_x's order and factor)
  float m = 0.f;
  for (int w = threadIdx.x; w < XW; w += NW * 32) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(a.x) + w);
    const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
    for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(__bfloat162float(b[j])));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) xmax[warp] = m;
  consumers_bar<NW>();
  m = 0.f;
  for (int w = 0; w < NW; ++w) m = fmaxf(m, xmax[w]);
  const float pre = stage_scale(m);
  for (int w = threadIdx.x; w < XW; w += NW * 32) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(a.x) + w);
    const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&raw);
    __half h[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) h[j] = __float2half_rn(__bfloat162float(b[j]) * pre);
    xg[w] = make_uint4(pack(h[0], h[2]), pack(h[4], h[6]), pack(h[1], h[3]), pack(h[5], h[7]));
  }
  consumers_bar<NW>();
  const int g = lane >> 2, t = lane & 3;
  const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8, lblk = lane >> 4;
  const int gi = warp / KS, part = warp % KS;
  const int j0 = part * (KB / 2) / KS, j1 = (part + 1) * (KB / 2) / KS;
  const bool tr0 = TRACE && lane == 0;
  if (tr0) mtr(warp, 0) = mtr(warp, 1) = mtr(warp, 2) = mtr(warp, 3) = 0;
  for (int k = gi; k < ng + nd; k += G) {
    const long long t_tile = TRACE ? clock64() : 0;
    const int s = k % SLOTS;
    const Tile tl = tile_of(k, ga, ng, da);
    const long e = a.ids[tl.pair];
    const uint4 *xs = xg, *xl = nullptr;
    if (tl.down) {  // the pair's x: every gate_up tile of it done, staged once a program
      xs = xd + tl.pair * 2 * XW;
      xl = xs + XW;
      int f = 0;
      if (lane == 0) f = atomicCAS(&flag[tl.pair], 0, 1);
      f = __shfl_sync(0xffffffffu, f, 0);
      if (f == 0) {
        if (lane == 0)
          while (ld_acquire(a.count + tl.pair) < (launches + 1) * (GU_N / 16)) {
          }
        __syncwarp();
        ld_acquire(a.count + tl.pair);  // every lane: the other programs' x is visible to it
        for (int w = lane; w < 2 * XW; w += 32)
          xd[tl.pair * 2 * XW + w] = __ldcg(a.hx + tl.pair * 2 * XW + w);
        __threadfence_block();
        __syncwarp();
        if (lane == 0) atomicExch(&flag[tl.pair], 2);
      } else {
        if (lane == 0)
          while (atomicAdd(&flag[tl.pair], 0) != 2) {
          }
        __syncwarp();
        __threadfence_block();
      }
    }
    const long long t_full = TRACE ? clock64() : 0;
    mbar_wait(&full[s], (k / SLOTS) & 1);
    const long long t_math = TRACE ? clock64() : 0;
    if (tr0) mtr(warp, 2) += t_full - t_tile, mtr(warp, 0) += t_math - t_full, mtr(warp, 3) += 1;
    const uint8_t* slot = smem + s * TILE_BYTES;
    const uint8_t* w = slot + (lrow * RU + lblk) * 16;
    const uint8_t* ss = slot + TILE_CODES;
    const int ca = tl.down ? g : 2 * g, cb = tl.down ? g + 8 : 2 * g + 1;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 3
    for (int j = j0; j < j1; ++j) {
      uint32_t r[4];
      ldsm4(r, w + 32 * j);
      const int b = 2 * j;
      float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
      if (tl.down) {
        block_mma<true>(d0, r[0], r[1], xs[4 * b + t], xl[4 * b + t]);
        block_mma<true>(d1, r[2], r[3], xs[4 * b + 4 + t], xl[4 * b + 4 + t]);
      } else {
        block_mma<false>(d0, r[0], r[1], xs[4 * b + t], uint4{});
        block_mma<false>(d1, r[2], r[3], xs[4 * b + 4 + t], uint4{});
      }
      const float sa0 = __uint_as_float((uint32_t)ss[ca * KB + b] << 23);
      const float sb0 = __uint_as_float((uint32_t)ss[cb * KB + b] << 23);
      const float sa1 = __uint_as_float((uint32_t)ss[ca * KB + b + 1] << 23);
      const float sb1 = __uint_as_float((uint32_t)ss[cb * KB + b + 1] << 23);
      acc[0] = fmaf(d1[0], sa1, fmaf(d0[0], sa0, acc[0]));
      acc[2] = fmaf(d1[2], sb1, fmaf(d0[2], sb0, acc[2]));
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);
    if (KS > 1) {  // the group's partials to its first warp
      float* r = red + (gi * 2 + (k / G) % 2) * KS * 16;
      if (t == 0 && part) r[part * 16 + g] = acc[0], r[part * 16 + 8 + g] = acc[2];
      asm volatile("bar.sync %0, %1;" ::"r"(2 + gi), "r"(KS * 32) : "memory");
      if (part) {
        if (tr0) mtr(warp, 1) += clock64() - t_math;
        continue;
      }
      if (t == 0)
        for (int q = 1; q < KS; ++q) acc[0] += r[q * 16 + g], acc[2] += r[q * 16 + 8 + g];
    }
    if (t == 0) {
      const int ra = tl.row0 + ca, rb = tl.row0 + cb;
      if (tl.down) {
        const float wt = a.wts[tl.pair];
        a.y[tl.pair * DN_N + ra] = (acc[0] * 16384.f + __bfloat162float(a.db[e * DN_N + ra])) * wt;
        a.y[tl.pair * DN_N + rb] = (acc[2] * 16384.f + __bfloat162float(a.db[e * DN_N + rb])) * wt;
      } else {  // store()'s SwiGLU, then down's x as stage_x's SPLIT words would hold it
        const float undo = 16384.f / pre;
        const float ha = acc[0] * undo + __bfloat162float(a.gb[e * GU_N + ra]);
        const float hb = acc[2] * undo + __bfloat162float(a.gb[e * GU_N + rb]);
        const float gate = fminf(ha, a.limit), up = fminf(fmaxf(hb, -a.limit), a.limit);
        const float v = (up + 1.f) * gate / (1.f + expf(-a.alpha * gate));
        const int kk = ra / 2, j = kk % 8;
        a.act[tl.pair * DN_N + kk] = v;
        const __half hi = __float2half_rn(v), lo = __float2half_rn(v - __half2float(hi));
        __half* hx = reinterpret_cast<__half*>(a.hx + tl.pair * 2 * XW);
        const int at = (kk / 8) * 8 + (j % 2) * 4 + j / 2;  // (0 2)(4 6)(1 3)(5 7)
        hx[at] = hi;
        hx[XW * 8 + at] = lo;
      }
    }
    if (!tl.down) {
      __syncwarp();
      if (lane == 0) {
        __threadfence();
        atomicAdd(a.count + tl.pair, 1u);
      }
    }
    if (tr0) mtr(warp, 1) += clock64() - t_math;
  }
  consumers_bar<NW>();  // this program is done (its producer's copies all landed)
  if (TRACE && threadIdx.x == 0) mtr(32, 1) = clock64(), mtr(32, 3) = gtime();
  if (threadIdx.x == 0 && atomicAdd(a.epoch + 1, 1u) == (unsigned)P - 1) {
    a.epoch[1] = 0;
    __threadfence();
    atomicAdd(a.epoch, 1u);
  }
}

template <int G, int KS, int SLOTS, bool TRACE = false>
int launch_ring(const MoeArgs& a, int grid, cudaStream_t stream) {
  constexpr int NW = G * KS;
  const int bytes = SLOTS * TILE_BYTES + (1 + 2 * PAIRS) * XW * 16 + 2 * SLOTS * 8 + PAIRS * 4 +
                    NW * 4 + G * 2 * KS * 16 * 4;
  auto k = moe_ring<G, KS, SLOTS, TRACE>;
  cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e) return (int)e;
  k<<<grid, (NW + 1) * 32, bytes, stream>>>(a);
  return (int)cudaGetLastError();
}

}  // namespace

extern "C" int moe_ring_args_bytes() { return (int)sizeof(MoeArgs); }

// variant: tiles at once (G) x 1000 + warps a tile (KS) x 100 + slots (+ 10000: traced)
extern "C" int moe_ring_launch(const void* args, int variant, int grid, cudaStream_t stream) {
  const MoeArgs& a = *static_cast<const MoeArgs*>(args);
  switch (variant) {
    case 4107: return launch_ring<4, 1, 7>(a, grid, stream);
    case 7107: return launch_ring<7, 1, 7>(a, grid, stream);
    case 7207: return launch_ring<7, 2, 7>(a, grid, stream);
    case 6307: return launch_ring<6, 3, 7>(a, grid, stream);
    case 7307: return launch_ring<7, 3, 7>(a, grid, stream);
    case 17107: return launch_ring<7, 1, 7, true>(a, grid, stream);  // traced
    case 17207: return launch_ring<7, 2, 7, true>(a, grid, stream);
    case 16307: return launch_ring<6, 3, 7, true>(a, grid, stream);
    default: return -1;
  }
}

// TRACE's record of the last traced launch, [T_PROGRAMS][T_WARPS][T_FIELDS] uint64, into `host`
extern "C" int moe_ring_trace(void* host) {
  return (int)cudaMemcpyFromSymbol(host, g_mtrace, sizeof(g_mtrace));
}
