// A real gpt-oss attention block at batch 1 as one persistent launch (issue 18's persistent
// layer, first piece with the real math): RMSNorm, q/k/v (bf16, bias) on the tensor cores,
// rope, the new key and value into the paged cache, attention with sinks over the key range
// (full or sliding), o (bias) and the residual add. chain.cu measured the structure on stand-ins;
// dense_ring.cu the consumers. What it should show: against the product's three launches
// (streaming GEMV, Triton decode attention, streaming GEMV), o's rows load while attention runs
// and the launches' ramps and tails are paid once.
//
// One program an SM: warp NW (one thread) streams this program's q/k/v units, then its o units,
// through SLOTS bulk-copy slots (weights tiled as dense_ring.cu's TILED: a unit, 16 rows x a K
// chunk, one contiguous copy, swizzled for ldmatrix); NW consumer warps take unit k from slot
// k % SLOTS (NW == SLOTS: a warp owns its slot), add their partial sums into shared memory, and
// the warp adding a tile's last chunk writes its 16 outputs. Between phases the consumers of
// every program meet at a grid barrier (a counter never reset: a launch reads its generation
// from its first arrival). Attention: work item (KV head, split of 128 keys) a program; the last
// split of a head to finish (a ticket it resets) merges the partial softmaxes with the sink.
#include "../../../tinyoss/kernels/moe_gemv_mma.cu"
#include "ring.cuh"

namespace {

using namespace ring;

constexpr int HID = 2880, HQ = 64, HK = 8, D = 64, GROUP = HQ / HK, PAGE = 16;
constexpr int QO = HQ * D, QKV = QO + 2 * HK * D;  // 4096, 5120
constexpr int NW = 16, SLOTS = 16;                  // consumer warps, ring slots
constexpr int CK_QKV = 320, CK_O = 256;             // K chunks: 10 KB and 8 KB units
constexpr int SLOT = 16 * CK_QKV * 2;               // bytes a slot (the larger unit)
constexpr int SPLIT = 128, MAX_SPLITS = 32;         // keys a split; splits a head at most
constexpr int MAX_TILES = 8;                        // a program's 16-row tiles a GEMV at most
constexpr int BARRIERS = 2;                         // grid barriers a launch
constexpr int THREADS = NW * 32;

struct Args {
  const __nv_bfloat16* h;       // [HID] the block's input, also the residual
  const __nv_bfloat16* norm_w;  // [HID]
  const __nv_bfloat16* w_qkv;   // [QKV, HID] tiled by (16, CK_QKV)
  const __nv_bfloat16* b_qkv;   // [QKV]
  const __nv_bfloat16* w_o;     // [HID, QO] tiled by (16, CK_O)
  const __nv_bfloat16* b_o;     // [HID]
  const float* rope;            // [D] at the new token's position: cos (D / 2) | sin (D / 2)
  const float* sinks;           // [HQ]
  __nv_bfloat16* k_cache;       // [blocks, PAGE, HK, D]
  __nv_bfloat16* v_cache;
  const int* table;             // the sequence's blocks
  int lo, hi;                   // key range [lo, hi); key hi - 1 is the new token's
  int slot;                     // its cache slot
  float scale, eps;
  __nv_bfloat16* qkv;           // [QKV] scratch
  float* part;                  // [HK][MAX_SPLITS][GROUP][2 + D]: m, l, acc
  unsigned* tickets;            // [HK] zero; the merging program resets its own
  __nv_bfloat16* attn;          // [QO] scratch
  __nv_bfloat16* out;           // [HID] h + o
  unsigned* bar;                // grid barrier counter, never reset
  unsigned long long* trace;    // [programs][TRACE_POINTS] globaltimer ns, or null
  int inflight;                 // the producer's copies in flight at most (<= SLOTS)
};

// trace points: consumers' start, x of q/k/v staged, q/k/v's units done, barrier 0 passed,
// attention done, barrier 1 passed, o's x staged, end; the producer's q/k/v units issued, all;
// an attention item's keys and values loaded, its partials out
constexpr int TRACE_POINTS = 12;
__device__ __forceinline__ void mark(const Args& a, int point) {
  if (a.trace) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    a.trace[blockIdx.x * TRACE_POINTS + point] = t;
  }
}

struct Smem {
  uint8_t ring[SLOTS * SLOT];
  uint32_t xs[QO / 2];  // a GEMV's x as bf16 pairs
  float acc[MAX_TILES * 16];
  int done[MAX_TILES];
  uint64_t full[SLOTS], empty[SLOTS];
  __nv_bfloat16 k[SPLIT * D], v[SPLIT * D];
  float q[GROUP * D], p[GROUP * SPLIT], m[GROUP], l[GROUP], red[NW];
  int flag;
};

__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory");
}

// every program's consumers at barrier `j` of this launch; `gen` from the first arrival
__device__ void grid_sync(unsigned* bar, int j, unsigned& gen) {
  consumers_sync();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned old = atomicAdd(bar, 1u), per = BARRIERS * gridDim.x;
    if (j == 0) gen = old / per;
    const unsigned target = gen * per + (j + 1) * gridDim.x;
    while ((int)(ld_acquire(bar) - target) < 0) {
    }
  }
  consumers_sync();
}

__device__ __forceinline__ float bf(float v) { return __bfloat162float(__float2bfloat16(v)); }

// One GEMV phase's consumer side: units [u0, u0 + nt * nc) of the ring, tiles t0.. of 16 rows,
// x in s.xs; the warp adding a tile's last chunk hands its 16 sums to `put(row, sum)`.
template <int CK, typename Put>
__device__ void gemv_phase(Smem& s, int u0, int t0, int nt, int nc, Put put) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int lrow = lane & 15, lcol = (lane >> 4) * 8;
  for (int i = threadIdx.x; i < nt * 16; i += THREADS) s.acc[i] = 0.f;
  for (int i = threadIdx.x; i < nt; i += THREADS) s.done[i] = 0;
  consumers_sync();
  const int units = nt * nc;
  for (int j = (warp - u0 % SLOTS + SLOTS) % SLOTS; j < units; j += SLOTS) {
    const int k = u0 + j, sl = k % SLOTS, tl = j / nc, ch = j % nc;  // sl == warp
    mbar_wait(&s.full[sl], (k / SLOTS) & 1);
    const uint8_t* unit = s.ring + sl * SLOT + lrow * (CK * 2);
    const uint32_t* xb = s.xs + ch * CK / 2 + t;
    float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
    for (int kk = 0; kk < CK; kk += 16) {
      const int ci = (kk + lcol) >> 3;
      uint32_t r[4];
      ldsm4(r, unit + 16 * ((ci & ~7) | ((ci & 7) ^ (lrow & 7))));
      mma_bf16(d, r[0], r[1], r[2], r[3], xb[kk / 2], xb[kk / 2 + 4]);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&s.empty[sl]);
    if (t == 0) atomicAdd(&s.acc[tl * 16 + g], d[0]), atomicAdd(&s.acc[tl * 16 + 8 + g], d[2]);
    __syncwarp();
    int last = 0;
    if (lane == 0) {
      __threadfence_block();
      last = atomicAdd(&s.done[tl], 1) == nc - 1;
    }
    if (__shfl_sync(0xffffffffu, last, 0)) {
      __threadfence_block();
      if (lane < 16) put((t0 + tl) * 16 + lane, atomicAdd(&s.acc[tl * 16 + lane], 0.f));
    }
  }
}

// A head group's queries (rotated, rounded to bf16) or the new key: row x of D, rotated
// half-split as the product's rope does, in fp32.
__device__ __forceinline__ float rotated(const __nv_bfloat16* x, int d, const float* rope) {
  const float a = __bfloat162float(__ldcg(x + d));
  const float b = __bfloat162float(__ldcg(x + (d + D / 2) % D));
  const float c = rope[d % (D / 2)], sn = rope[D / 2 + d % (D / 2)];
  return bf(a * c + (d < D / 2 ? -b : b) * sn);
}

// Attention item (KV head h, split sp of n): the split's partial softmax over its keys, or the
// output itself when the range is one split; the last split of a head merges.
__device__ void attention_item(Smem& s, const Args& a, int h, int sp, int n) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int k0 = a.lo + sp * SPLIT, k1 = min(a.hi, k0 + SPLIT), nk = k1 - k0;
  const __nv_bfloat16* qkv = a.qkv;
  consumers_sync();  // the previous item's readers of shared memory are done
  for (int i = tid; i < GROUP * D; i += THREADS)  // this head group's 8 queries
    s.q[i] = rotated(qkv + (h * GROUP + i / D) * D, i % D, a.rope);
  if (k1 == a.hi && tid < D) {  // the new key and value, into the cache
    const long at = ((long)a.slot * HK + h) * D + tid;
    a.k_cache[at] = __float2bfloat16(rotated(qkv + QO + h * D, tid, a.rope));
    a.v_cache[at] = __ldcg(qkv + QO + HK * D + h * D + tid);
  }
  __threadfence();  // read back below past L1
  consumers_sync();
  for (int i = tid; i < SPLIT * D / 8; i += THREADS) {  // the split's keys and values, 16 B each
    const int r = i / (D / 8), c = i % (D / 8), key = k0 + r;
    uint4 kv = make_uint4(0, 0, 0, 0), vv = kv;
    if (r < nk) {
      const long row = ((long)a.table[key / PAGE] * PAGE + key % PAGE) * HK + h;
      kv = __ldcg(reinterpret_cast<const uint4*>(a.k_cache + row * D) + c);
      vv = __ldcg(reinterpret_cast<const uint4*>(a.v_cache + row * D) + c);
    }
    reinterpret_cast<uint4*>(s.k)[i] = kv;
    reinterpret_cast<uint4*>(s.v)[i] = vv;
  }
  consumers_sync();
  if (tid == 0) mark(a, 10);
  for (int i = tid; i < GROUP * SPLIT; i += THREADS) {  // scores: query i / SPLIT, key i % SPLIT
    const int qi = i / SPLIT, r = i % SPLIT;
    float acc = 0.f;
#pragma unroll
    for (int cc = 0; cc < D / 8; ++cc) {  // 16 bytes of the key a step, rotated by the key's row
      const int c = (cc + r) % (D / 8);  // so a warp's loads spread over the banks
      const uint4 kv = reinterpret_cast<const uint4*>(s.k)[r * (D / 8) + c];
      const __nv_bfloat16* kb = reinterpret_cast<const __nv_bfloat16*>(&kv);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc = fmaf(s.q[qi * D + c * 8 + e], __bfloat162float(kb[e]), acc);
    }
    s.p[i] = r < nk ? acc * a.scale : -INFINITY;
  }
  consumers_sync();
  if (warp < GROUP) {  // warp qi: the row's max, its exponentials, their sum
    float mx = -INFINITY;
    for (int r = lane; r < SPLIT; r += 32) mx = fmaxf(mx, s.p[warp * SPLIT + r]);
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    for (int r = lane; r < SPLIT; r += 32) {
      const float e = r < nk ? __expf(s.p[warp * SPLIT + r] - mx) : 0.f;
      s.p[warp * SPLIT + r] = e;
      sum += e;
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) s.m[warp] = mx, s.l[warp] = sum;
  }
  consumers_sync();
  const bool one = a.hi - a.lo <= SPLIT;
  float* part = a.part + ((long)h * MAX_SPLITS + sp) * GROUP * (2 + D);
  for (int i = tid; i < GROUP * D; i += THREADS) {  // p . v: query i / D, dim i % D
    const int qi = i / D, d = i % D;
    float acc = 0.f;
    for (int r = 0; r < nk; ++r)
      acc = fmaf(bf(s.p[qi * SPLIT + r]), __bfloat162float(s.v[r * D + d]), acc);
    if (one) {
      const float sink = a.sinks[h * GROUP + qi], big = fmaxf(s.m[qi], sink);
      const float w = __expf(s.m[qi] - big);
      a.attn[(h * GROUP + qi) * D + d] =
          __float2bfloat16(acc * w / (s.l[qi] * w + __expf(sink - big)));
    } else {
      part[qi * (2 + D) + 2 + d] = acc;
      if (d == 0) part[qi * (2 + D)] = s.m[qi], part[qi * (2 + D) + 1] = s.l[qi];
    }
  }
  if (one) return;
  __threadfence();  // every thread's partials out before the ticket
  consumers_sync();
  if (tid == 0) {
    mark(a, 11);
    s.flag = atomicAdd(&a.tickets[h], 1u) == (unsigned)(n - 1);
  }
  consumers_sync();
  if (!s.flag) return;
  __threadfence();
  const float* hp = a.part + (long)h * MAX_SPLITS * GROUP * (2 + D);
  for (int i = tid; i < GROUP * D; i += THREADS) {  // merge: query i / D, dim i % D
    const int qi = i / D, d = i % D;
    const float sink = a.sinks[h * GROUP + qi];
    float big = sink;
    for (int j = 0; j < n; ++j) big = fmaxf(big, __ldcg(hp + (j * GROUP + qi) * (2 + D)));
    float num = 0.f, den = __expf(sink - big);
    for (int j = 0; j < n; ++j) {
      const float* pj = hp + (j * GROUP + qi) * (2 + D);
      const float w = __expf(__ldcg(pj) - big);
      den += w * __ldcg(pj + 1);
      num += w * __ldcg(pj + 2 + d);
    }
    a.attn[(h * GROUP + qi) * D + d] = __float2bfloat16(num / den);
  }
  if (tid == 0) a.tickets[h] = 0;
}

__global__ void __launch_bounds__(THREADS + 32, 1) attn_block(Args a) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>(smem_raw);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, P = gridDim.x, c = blockIdx.x;
  const int tq0 = c * (QKV / 16) / P, ntq = (c + 1) * (QKV / 16) / P - tq0;
  const int to0 = c * (HID / 16) / P, nto = (c + 1) * (HID / 16) / P - to0;
  const int ncq = HID / CK_QKV, nco = QO / CK_O, uq = ntq * ncq;
  if (threadIdx.x == 0) {
    for (int i = 0; i < SLOTS; ++i) mbar_init(&s.full[i], 1), mbar_init(&s.empty[i], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == NW) {  // the producer: every unit of this program, q/k/v's then o's
    if (lane == 0) {
      const int units = uq + nto * nco;
      for (int k = 0; k < units; ++k) {
        const int sl = k % SLOTS, round = k / SLOTS;
        const bool q = k < uq;
        const int j = q ? k : k - uq, nc = q ? ncq : nco, ck = q ? CK_QKV : CK_O;
        const __nv_bfloat16* src = (q ? a.w_qkv : a.w_o) +
                                   ((long)((q ? tq0 : to0) + j / nc) * nc + j % nc) * 16 * ck;
        if (round) mbar_wait(&s.empty[sl], (round - 1) & 1);
        // Copies in flight bound what a latency-bound phase's loads queue behind (call G: with
        // the whole ring in flight, the norm's loads and attention's took 5-11 us).
        const int back = k - a.inflight;
        if (back >= 0) mbar_wait(&s.full[back % SLOTS], (back / SLOTS) & 1);
        mbar_expect(&s.full[sl], 16 * ck * 2);
        bulk_copy(s.ring + sl * SLOT, src, 16 * ck * 2, &s.full[sl]);
        if (k == uq - 1) mark(a, 8);
      }
      mark(a, 9);
    }
    return;
  }
  unsigned gen = 0;
  if (threadIdx.x == 0) mark(a, 0);
  // RMSNorm of h (every program: 5.6 KB), x of q/k/v
  float ss = 0.f;
  for (int i = threadIdx.x; i < HID; i += THREADS) {
    const float v = __bfloat162float(a.h[i]);
    ss += v * v;
  }
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (lane == 0) s.red[warp] = ss;
  consumers_sync();
  ss = 0.f;
  for (int w = 0; w < NW; ++w) ss += s.red[w];
  const float inv = rsqrtf(ss / HID + a.eps);
  __nv_bfloat16* xh = reinterpret_cast<__nv_bfloat16*>(s.xs);
  for (int i = threadIdx.x; i < HID; i += THREADS)
    xh[i] = __float2bfloat16(__bfloat162float(a.norm_w[i]) * (__bfloat162float(a.h[i]) * inv));
  if (threadIdx.x == 0) mark(a, 1);
  gemv_phase<CK_QKV>(s, 0, tq0, ntq, ncq, [&](int row, float v) {
    a.qkv[row] = __float2bfloat16(v + __bfloat162float(a.b_qkv[row]));
  });
  consumers_sync();
  if (threadIdx.x == 0) mark(a, 2);
  grid_sync(a.bar, 0, gen);
  if (threadIdx.x == 0) mark(a, 3);
  const int n = (a.hi - a.lo + SPLIT - 1) / SPLIT;
  for (int item = c; item < HK * n; item += P) attention_item(s, a, item / n, item % n, n);
  consumers_sync();
  if (threadIdx.x == 0) mark(a, 4);
  grid_sync(a.bar, 1, gen);
  if (threadIdx.x == 0) mark(a, 5);
  for (int i = threadIdx.x; i < QO / 8; i += THREADS)
    reinterpret_cast<uint4*>(s.xs)[i] = __ldcg(reinterpret_cast<const uint4*>(a.attn) + i);
  if (threadIdx.x == 0) mark(a, 6);
  gemv_phase<CK_O>(s, uq, to0, nto, nco, [&](int row, float v) {
    const float o = bf(v + __bfloat162float(a.b_o[row]));
    a.out[row] = __float2bfloat16(__bfloat162float(a.h[row]) + o);
  });
  consumers_sync();
  if (threadIdx.x == 0) mark(a, 7);
}

}  // namespace

extern "C" int attn_block_smem() { return (int)sizeof(Smem); }

extern "C" int attn_block_launch(const void* args, int grid, void* stream) {
  const int bytes = (int)sizeof(Smem);
  cudaError_t e =
      cudaFuncSetAttribute(attn_block, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e) return (int)e;
  attn_block<<<grid, THREADS + 32, bytes, static_cast<cudaStream_t>(stream)>>>(
      *static_cast<const Args*>(args));
  return (int)cudaGetLastError();
}
