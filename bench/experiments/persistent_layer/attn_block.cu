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
// chunk, one contiguous copy, swizzled for ldmatrix), at most `inflight` copies at once. A
// GEMV's units (tile-major) are cut evenly over the programs, so a tile may be shared by two; NW
// consumer warps take unit k from slot k % SLOTS (NW == SLOTS: a warp owns its slot) and keep
// each chunk's 16 sums in shared memory; the warp finishing a program's part of a tile adds them
// in chunk order and writes the outputs, or (a shared tile) adds its part into a global fp32 row
// (two parts: the sum does not depend on their order), the second part's warp writing them.
// Between phases the consumers of every program meet at a grid barrier (a counter never reset:
// a launch reads its generation from its first arrival). Attention: work item (KV head, split of
// 128 keys) a program, its cached keys and values prefetched at the launch's start; a head of
// several splits leaves partial softmaxes, which every program merges (with the sink) as it
// stages o's x.
#include "../../../tinyoss/kernels/moe_gemv_mma.cu"
#include "ring.cuh"

namespace {

using namespace ring;

constexpr int HID = 2880, HQ = 64, HK = 8, D = 64, GROUP = HQ / HK, PAGE = 16;
constexpr int QO = HQ * D, QKV = QO + 2 * HK * D;  // 4096, 5120
constexpr int NW = 22, SLOTS = 22;                  // consumer warps, ring slots
constexpr int CK_QKV = 192, CK_O = 256;             // K chunks: 6 KB and 8 KB units
constexpr int SLOT = 16 * CK_O * 2;                 // bytes a slot (the larger unit): 22 hold
                                                    // o's 21-22 units a program
constexpr int SPLIT = 128, MAX_SPLITS = 16;         // keys a split; splits a head at most
constexpr int MAX_TILES = 4, MAX_NC = 16;           // a program's tiles of a GEMV, chunks a tile
__host__ __device__ constexpr int barriers(int two_part) { return two_part & 2 ? 4 : 3; }
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
  __nv_bfloat16* attn;          // [QO] scratch
  __nv_bfloat16* out;           // [HID] h + o
  unsigned* bar;                // grid barrier counter, never reset
  float* gacc;                  // [QKV + HID] zero: shared tiles' rows (q/k/v's, then o's)
  unsigned* gcnt;               // [QKV / 16 + HID / 16] zero: their parts done
  float* gpart;                 // two_part: [2][QKV + HID], each row's two parts' sums
  int two_part;                 // bits, q/k/v (1) and o (2): the GEMV's rows left as two parts
                                // (the part holding chunk 0, the other; 0 for a whole tile)
                                // that their readers add after the next grid barrier, not
                                // gacc's atomic hand-over; o's then take one more barrier and
                                // a combine
  unsigned long long* trace;    // [programs][TRACE_POINTS] globaltimer ns, or null
  int inflight;                 // the producer's copies in flight at most (<= SLOTS)
  int gate_o;                   // o's units wait until every program's q/k/v is done
  int cp_async;                 // the producer's copies: 0 one bulk copy a unit, 1 the warp's
                                // cp.async (16 bytes a lane), as the product's streaming GEMVs
};

// trace points: consumers' start, x of q/k/v staged, q/k/v's units done, barrier 0 passed,
// attention done, barrier 1 passed, o's x staged, end; the producer's q/k/v units issued, all;
// an attention item's queries and new key in, its output or partials out, its scores, its
// softmax, its p . v; o's units done
constexpr int TRACE_POINTS = 16;
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
  union {  // a GEMV phase's, then attention's
    float part[MAX_TILES][MAX_NC][16];  // each chunk's 16 sums
    float p[GROUP * SPLIT];             // scores, [query][key]
  };
  int done[MAX_TILES];
  uint64_t full[SLOTS], empty[SLOTS], go;  // go: barrier 0 passed (gate_o)
  alignas(16) __nv_bfloat16 k[SPLIT * D];  // 16-byte chunks (cp.async, ldmatrix)
  alignas(16) __nv_bfloat16 v[SPLIT * D];
  __nv_bfloat16 q[GROUP * D], pb[GROUP * SPLIT];  // queries, exponentials (MMA operands)
  float m[GROUP], l[GROUP], red[NW];
};

static_assert(sizeof(Smem) <= 227 * 1024, "an SM's shared memory a program");

__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory");
}

// every program's consumers at barrier `j` of this launch; `gen` from the first arrival (a
// counter for launches of one barrier count)
__device__ void grid_sync(const Args& a, int j, unsigned& gen) {
  unsigned* bar = a.bar;
  consumers_sync();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned old = atomicAdd(bar, 1u), per = barriers(a.two_part) * gridDim.x;
    if (j == 0) gen = old / per;
    const unsigned target = gen * per + (j + 1) * gridDim.x;
    while ((int)(ld_acquire(bar) - target) < 0) {
    }
  }
  consumers_sync();
}

__device__ __forceinline__ float bf(float v) { return __bfloat162float(__float2bfloat16(v)); }

// One GEMV phase's consumer side: this program's units [ulo, uhi) of the GEMV (tile u / nc,
// chunk u % nc), the first at ring position r0; x in s.xs. A tile's sums go to put(row, sum).
template <int CK, typename Put>
__device__ void gemv_phase(Smem& s, int r0, int ulo, int uhi, int nc, float* gacc,
                           unsigned* gcnt, float* gpart, long gstride, Put put) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int lrow = lane & 15, lcol = (lane >> 4) * 8, tile0 = ulo / nc;
  for (int i = threadIdx.x; i < MAX_TILES; i += THREADS) s.done[i] = 0;
  consumers_sync();
  for (int j = (warp - r0 % SLOTS + SLOTS) % SLOTS; j < uhi - ulo; j += SLOTS) {
    const int k = r0 + j, sl = k % SLOTS, u = ulo + j, tile = u / nc, ch = u % nc;
    const int tl = tile - tile0;
    mbar_wait(&s.full[sl], (k / SLOTS) & 1);  // sl == warp
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
    if (t == 0) s.part[tl][ch][g] = d[0], s.part[tl][ch][8 + g] = d[2];
    const int c0 = max(ulo, tile * nc) - tile * nc, c1 = min(uhi, (tile + 1) * nc) - tile * nc;
    __syncwarp();
    int last = 0;
    if (lane == 0) {
      __threadfence_block();
      last = atomicAdd(&s.done[tl], 1) == c1 - c0 - 1;
    }
    if (!__shfl_sync(0xffffffffu, last, 0)) continue;
    __threadfence_block();
    const int row = tile * 16 + (lane & 15);
    float v = 0.f;
    for (int c = c0; c < c1; ++c) v += s.part[tl][c][lane & 15];
    if (gpart) {  // two parts, added by their readers
      if (lane < 16) {
        gpart[(c0 == 0 ? 0 : gstride) + row] = v;
        if (c1 - c0 == nc) gpart[gstride + row] = 0.f;
      }
      continue;
    }
    if (c1 - c0 == nc) {  // the whole tile here
      if (lane < 16) put(row, v);
      continue;
    }
    if (lane < 16) atomicAdd(&gacc[row], v);
    __threadfence();
    __syncwarp();
    int second = 0;
    if (lane == 0) second = atomicAdd(&gcnt[tile], 1u) == 1u;
    if (!__shfl_sync(0xffffffffu, second, 0)) continue;
    __threadfence();
    if (lane < 16) put(row, atomicExch(&gacc[row], 0.f));
    if (lane == 0) gcnt[tile] = 0;
  }
}

// q/k/v's output row r (bf16, bias added), from a.qkv or its two parts
__device__ __forceinline__ float qkv_at(const Args& a, int r) {
  if (!(a.two_part & 1)) return __bfloat162float(__ldcg(a.qkv + r));
  const float* p = a.gpart + r;
  return bf(__ldcg(p) + __ldcg(p + QKV + HID) + __bfloat162float(a.b_qkv[r]));
}

// A head group's queries (rotated, rounded to bf16) or the new key: q/k/v's row base + d,
// rotated half-split as the product's rope does, in fp32.
__device__ __forceinline__ float rotated(const Args& a, int base, int d) {
  const float x = qkv_at(a, base + d), y = qkv_at(a, base + (d + D / 2) % D);
  const float c = a.rope[d % (D / 2)], sn = a.rope[D / 2 + d % (D / 2)];
  return bf(x * c + (d < D / 2 ? -y : y) * sn);
}

// A key or value tile's 16-byte chunk c of row r, swizzled so ldmatrix's 8 rows meet no bank
// conflict (as dense_ring.cu's TILED units); in 16-byte units.
__device__ __forceinline__ int kv_at(int r, int c) { return r * (D / 8) + (c ^ (r & 7)); }

__device__ __forceinline__ void ldsm4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"((uint32_t)__cvta_generic_to_shared(p)));
}

// Attention item (KV head h, split sp): its keys [k0, k1), and the split holding the new key.
struct Item {
  int h, sp, k0, k1;
};
__device__ __forceinline__ Item item_of(const Args& a, int i, int n) {
  const int k0 = a.lo + (i % n) * SPLIT;
  return {i / n, i % n, k0, min(a.hi, k0 + SPLIT)};
}

// At the launch's start (they do not depend on this step): the item's cached keys and values
// into shared memory with cp.async (rows past the range, and the new key's, zero).
__device__ void attention_prefetch(Smem& s, const Args& a, const Item& it) {
  for (int i = threadIdx.x; i < SPLIT * D / 8; i += THREADS) {
    const int r = i / (D / 8), c = i % (D / 8), key = it.k0 + r;
    uint4* kd = reinterpret_cast<uint4*>(s.k) + kv_at(r, c);
    uint4* vd = reinterpret_cast<uint4*>(s.v) + kv_at(r, c);
    if (key < it.k1 && key != a.hi - 1) {
      const long row = ((long)a.table[key / PAGE] * PAGE + key % PAGE) * HK + it.h;
      cp_async16(kd, reinterpret_cast<const uint4*>(a.k_cache + row * D) + c);
      cp_async16(vd, reinterpret_cast<const uint4*>(a.v_cache + row * D) + c);
    } else {
      *kd = *vd = make_uint4(0, 0, 0, 0);
    }
  }
  cp_commit();
}

// The item once q/k/v are out: its queries rotated, the new key and value (into the cache and,
// for this split, into shared memory), scores and p . v on the tensor cores (bf16, fp32 sums, as
// the product's Triton kernel), the split's partial softmax, or the output itself when the range
// is one split.
__device__ void attention_item(Smem& s, const Args& a, const Item& it, int n) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, h = it.h, sp = it.sp;
  const int nk = it.k1 - it.k0;
  for (int i = tid; i < GROUP * D; i += THREADS)  // this head group's 8 queries
    s.q[i] = __float2bfloat16(rotated(a, (h * GROUP + i / D) * D, i % D));
  if (it.k1 == a.hi && tid < D) {  // the new key and value
    const long at = ((long)a.slot * HK + h) * D + tid;
    const __nv_bfloat16 k = __float2bfloat16(rotated(a, QO + h * D, tid));
    const __nv_bfloat16 v = __float2bfloat16(qkv_at(a, QO + HK * D + h * D + tid));
    a.k_cache[at] = k, a.v_cache[at] = v;
    const int e = kv_at(nk - 1, tid / 8) * 8 + tid % 8;
    s.k[e] = k, s.v[e] = v;
  }
  cp_wait<0>();
  consumers_sync();
  if (tid == 0) mark(a, 10);
  const int g = lane >> 2, t = lane & 3;
  if (warp < SPLIT / 16) {  // scores on the tensor cores: warp w keys 16w.., K as A, q as B
    const uint4* kt = reinterpret_cast<const uint4*>(s.k);
    const uint32_t* qw = reinterpret_cast<const uint32_t*>(s.q);  // [GROUP][D / 2]
    float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kk = 0; kk < D; kk += 16) {
      uint32_t r[4];
      ldsm4(r, kt + kv_at(warp * 16 + (lane & 15), kk / 8 + (lane >> 4)));
      mma_bf16(d, r[0], r[1], r[2], r[3], qw[g * (D / 2) + kk / 2 + t],
               qw[g * (D / 2) + kk / 2 + 4 + t]);
    }
    const int k0 = warp * 16 + g, k1 = k0 + 8;  // d: (k0, 2t), (k0, 2t + 1), (k1, ..)
    s.p[2 * t * SPLIT + k0] = k0 < nk ? d[0] * a.scale : -INFINITY;
    s.p[(2 * t + 1) * SPLIT + k0] = k0 < nk ? d[1] * a.scale : -INFINITY;
    s.p[2 * t * SPLIT + k1] = k1 < nk ? d[2] * a.scale : -INFINITY;
    s.p[(2 * t + 1) * SPLIT + k1] = k1 < nk ? d[3] * a.scale : -INFINITY;
  }
  consumers_sync();
  if (tid == 0) mark(a, 12);
  if (warp < GROUP) {  // warp qi: the row's max, its exponentials (0 past the range), their sum
    float mx = -INFINITY;
    for (int r = lane; r < SPLIT; r += 32) mx = fmaxf(mx, s.p[warp * SPLIT + r]);
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    for (int r = lane; r < SPLIT; r += 32) {
      const float e = r < nk ? __expf(s.p[warp * SPLIT + r] - mx) : 0.f;
      s.pb[warp * SPLIT + r] = __float2bfloat16(e);  // p . v takes p in bf16, the sum does not
      sum += e;
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) s.m[warp] = mx, s.l[warp] = sum;
  }
  consumers_sync();
  if (tid == 0) mark(a, 13);
  float* red = reinterpret_cast<float*>(s.xs);  // [GROUP][D], free until o's x
  if (warp < D / 16) {  // p . v on the tensor cores: warp w dims 16w.., V^T as A, p as B
    const uint4* vt = reinterpret_cast<const uint4*>(s.v);
    const uint32_t* pw = reinterpret_cast<const uint32_t*>(s.pb);  // [GROUP][SPLIT / 2]
    float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int k0 = 0; k0 < SPLIT; k0 += 16) {  // matrices: (keys k0.., dims 16w..), (k0, 16w + 8),
      uint32_t r[4];                           // (k0 + 8, 16w), (k0 + 8, 16w + 8), transposed
      const int row = k0 + (lane & 7) + ((lane >> 4) << 3), chunk = 2 * warp + ((lane >> 3) & 1);
      ldsm4_trans(r, vt + kv_at(row, chunk));
      mma_bf16(d, r[0], r[1], r[2], r[3], pw[g * (SPLIT / 2) + k0 / 2 + t],
               pw[g * (SPLIT / 2) + k0 / 2 + 4 + t]);
    }
    const int m0 = warp * 16 + g;  // d: (dim m0, query 2t), (m0, 2t + 1), (m0 + 8, ..)
    red[2 * t * D + m0] = d[0], red[(2 * t + 1) * D + m0] = d[1];
    red[2 * t * D + m0 + 8] = d[2], red[(2 * t + 1) * D + m0 + 8] = d[3];
  }
  consumers_sync();
  if (tid == 0) mark(a, 14);
  if (tid >= GROUP * D) return;
  float* part = a.part + ((long)h * MAX_SPLITS + sp) * GROUP * (2 + D);
  const int qi = tid / D, d = tid % D;
  const float acc = red[qi * D + d];
  if (n == 1) {  // the output itself
    const float sink = a.sinks[h * GROUP + qi], big = fmaxf(s.m[qi], sink);
    const float w = __expf(s.m[qi] - big);
    a.attn[(h * GROUP + qi) * D + d] =
        __float2bfloat16(acc * w / (s.l[qi] * w + __expf(sink - big)));
  } else {  // merged after the next grid barrier (merge_attention)
    part[qi * (2 + D) + 2 + d] = acc;
    if (d == 0) part[qi * (2 + D)] = s.m[qi], part[qi * (2 + D) + 1] = s.l[qi];
  }
  if (tid == 0) mark(a, 11);
}

// A head of several splits: query head hq's output from every split's partial softmax and the
// sink (a program a query head, between two grid barriers: 64 programs, 64 outputs each).
__device__ void merge_attention(const Args& a, int hq, int n) {
  const int d = threadIdx.x;  // < D
  const int h = hq / GROUP, qi = hq % GROUP;
  const float* hp = a.part + ((long)h * MAX_SPLITS * GROUP + qi) * (2 + D);
  const float sink = a.sinks[hq];
  float ms[MAX_SPLITS], ls[MAX_SPLITS], acc[MAX_SPLITS], big = sink;
#pragma unroll
  for (int j = 0; j < MAX_SPLITS; ++j) {  // every split's loads in flight at once
    const float* pj = hp + j * GROUP * (2 + D);
    ms[j] = j < n ? __ldcg(pj) : -INFINITY;
    ls[j] = j < n ? __ldcg(pj + 1) : 0.f;
    acc[j] = j < n ? __ldcg(pj + 2 + d) : 0.f;
    big = fmaxf(big, ms[j]);
  }
  float num = 0.f, den = __expf(sink - big);
#pragma unroll
  for (int j = 0; j < MAX_SPLITS; ++j) {
    const float w = __expf(ms[j] - big);  // 0 past the n splits
    den += w * ls[j];
    num += w * acc[j];
  }
  a.attn[hq * D + d] = __float2bfloat16(num / den);
}

__global__ void __launch_bounds__(THREADS + 32, 1) attn_block(Args a) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>(smem_raw);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, P = gridDim.x, c = blockIdx.x;
  const int ncq = HID / CK_QKV, nco = QO / CK_O, nuq = QKV / 16 * ncq, nuo = HID / 16 * nco;
  const int uq0 = c * nuq / P, uq1 = (c + 1) * nuq / P, uo0 = c * nuo / P, uo1 = (c + 1) * nuo / P;
  const int uq = uq1 - uq0;  // q/k/v's units here; o's follow in the ring
  if (threadIdx.x == 0) {  // a full slot: the bulk copy's bytes, or every producer lane's copies
    for (int i = 0; i < SLOTS; ++i)
      mbar_init(&s.full[i], a.cp_async ? 32 : 1), mbar_init(&s.empty[i], 1);
    mbar_init(&s.go, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == NW) {  // the producer: every unit of this program, q/k/v's then o's
    const int units = uq + uo1 - uo0;
    for (int k = 0; k < units; ++k) {
      const int sl = k % SLOTS, round = k / SLOTS;
      const bool q = k < uq;
      const int bytes = 16 * (q ? CK_QKV : CK_O) * 2;  // the tiled layout: unit u at u * bytes
      const uint8_t* src = q ? reinterpret_cast<const uint8_t*>(a.w_qkv) + (long)(uq0 + k) * bytes
                             : reinterpret_cast<const uint8_t*>(a.w_o) +
                                   (long)(uo0 + k - uq) * bytes;
      if (round) mbar_wait(&s.empty[sl], (round - 1) & 1);
      // gate_o: o's rows would take bandwidth from other programs' q/k/v, the critical path
      if (k == uq && a.gate_o) mbar_wait(&s.go, 0);
      // Copies in flight bound what a latency-bound phase's loads queue behind (call G: with
      // the whole ring in flight, the norm's loads and attention's took 5-11 us).
      const int back = k - a.inflight;
      if (back >= 0) mbar_wait(&s.full[back % SLOTS], (back / SLOTS) & 1);
      if (a.cp_async) {
        for (int i = lane; i < bytes / 16; i += 32)
          cp_async16<2>(s.ring + sl * SLOT + i * 16, src + i * 16);
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(
                         saddr(&s.full[sl]))
                     : "memory");
      } else if (lane == 0) {
        mbar_expect(&s.full[sl], bytes);
        bulk_copy(s.ring + sl * SLOT, src, bytes, &s.full[sl]);
      }
      if (k == uq - 1 && lane == 0) mark(a, 8);
    }
    if (lane == 0) mark(a, 9);
    return;
  }
  unsigned gen = 0;
  if (threadIdx.x == 0) mark(a, 0);
  constexpr int PER = (HID + THREADS - 1) / THREADS;
  float hv[PER], wv[PER];  // RMSNorm of h in one pass (every program: 11 KB), x of q/k/v
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int at = threadIdx.x + i * THREADS;
    hv[i] = at < HID ? __bfloat162float(a.h[at]) : 0.f;
    wv[i] = at < HID ? __bfloat162float(a.norm_w[at]) : 0.f;
  }
  const int n = (a.hi - a.lo + SPLIT - 1) / SPLIT;
  const bool has_item = c < HK * n;
  if (has_item) attention_prefetch(s, a, item_of(a, c, n));
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < PER; ++i) ss += hv[i] * hv[i];
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (lane == 0) s.red[warp] = ss;
  consumers_sync();
  ss = 0.f;
  for (int w = 0; w < NW; ++w) ss += s.red[w];
  const float inv = rsqrtf(ss / HID + a.eps);
  __nv_bfloat16* xh = reinterpret_cast<__nv_bfloat16*>(s.xs);
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int at = threadIdx.x + i * THREADS;
    if (at < HID) xh[at] = __float2bfloat16(wv[i] * (hv[i] * inv));
  }
  if (threadIdx.x == 0) mark(a, 1);
  const long gs = QKV + HID;
  gemv_phase<CK_QKV>(s, 0, uq0, uq1, ncq, a.gacc, a.gcnt, a.two_part & 1 ? a.gpart : nullptr, gs,
                     [&](int row, float v) {
    a.qkv[row] = __float2bfloat16(v + __bfloat162float(a.b_qkv[row]));
  });
  consumers_sync();
  if (threadIdx.x == 0) mark(a, 2);
  grid_sync(a, 0, gen);
  if (threadIdx.x == 0) mark(a, 3), mbar_arrive(&s.go);
  if (has_item) {
    attention_item(s, a, item_of(a, c, n), n);
  } else if (a.two_part & 1) {  // q/k/v's rows into a.qkv, for the check (programs without one)
    const int idle = P - HK * n, i = c - HK * n, r0 = i * QKV / idle, r1 = (i + 1) * QKV / idle;
    for (int r = r0 + threadIdx.x; r < r1; r += THREADS) a.qkv[r] = __float2bfloat16(qkv_at(a, r));
  }
  consumers_sync();
  if (threadIdx.x == 0) mark(a, 4);
  grid_sync(a, 1, gen);
  if (n > 1 && c < HQ && threadIdx.x < D) merge_attention(a, c, n);
  grid_sync(a, 2, gen);
  if (threadIdx.x == 0) mark(a, 5);
  for (int i = threadIdx.x; i < QO / 8; i += THREADS)
    reinterpret_cast<uint4*>(s.xs)[i] = __ldcg(reinterpret_cast<const uint4*>(a.attn) + i);
  if (threadIdx.x == 0) mark(a, 6);
  auto residual = [&](int row, float v) {
    const float o = bf(v + __bfloat162float(a.b_o[row]));
    a.out[row] = __float2bfloat16(__bfloat162float(a.h[row]) + o);
  };
  gemv_phase<CK_O>(s, uq, uo0, uo1, nco, a.gacc + QKV, a.gcnt + QKV / 16,
                   a.two_part & 2 ? a.gpart + QKV : nullptr, gs, residual);
  consumers_sync();
  if (threadIdx.x == 0) mark(a, 15);
  if (a.two_part & 2) {  // o's two parts, the bias and the residual: a share of rows a program
    grid_sync(a, 3, gen);
    for (int r = c * HID / P + threadIdx.x; r < (c + 1) * HID / P; r += THREADS)
      residual(r, __ldcg(a.gpart + QKV + r) + __ldcg(a.gpart + gs + QKV + r));
  }
  consumers_sync();
  if (threadIdx.x == 0) mark(a, 7);
}

}  // namespace

extern "C" int attn_block_smem() { return (int)sizeof(Smem); }

extern "C" int attn_block_launch(const void* args, int grid, void* stream) {
  const Args& a = *static_cast<const Args*>(args);
  // an item a program (its keys prefetched at the start); a tile in two programs' parts at most
  if (a.hi - a.lo > SPLIT * MAX_SPLITS || HK * MAX_SPLITS > grid || grid < HQ ||
      grid > HID / 16 || a.inflight < 1 || a.inflight > SLOTS)
    return (int)cudaErrorInvalidValue;
  const int bytes = (int)sizeof(Smem);
  cudaError_t e =
      cudaFuncSetAttribute(attn_block, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e) return (int)e;
  attn_block<<<grid, THREADS + 32, bytes, static_cast<cudaStream_t>(stream)>>>(
      *static_cast<const Args*>(args));
  return (int)cudaGetLastError();
}
