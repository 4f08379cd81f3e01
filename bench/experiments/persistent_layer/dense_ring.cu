// One bf16 dense GEMV at batch 1 (q/k/v or o) as a persistent launch whose rows stream through a
// cp.async.bulk ring and are consumed on the tensor cores (bf16 mma.m16n8k16, x in every column
// of B): do tensor-core consumers take rows out of shared memory fast enough that rows loaded
// while an earlier phase runs (here: the consumers wait `delay_ns` first, a stand-in for
// attention) finish in a fraction of their stream time? chain.cu's FMA consumers (~1.6
// instructions a byte) could not; an MMA takes 512 bytes of weights an instruction.
//
// A unit is 16 rows by a K chunk of CK values (rows at a padded stride, so ldmatrix meets no bank
// conflict); a program's tiles of 16 rows are cut into K/CK units, dealt round-robin: unit k goes
// to slot k % SLOTS and warp k % NW (NW <= SLOTS for the parity waits). A tile's units land on
// different warps, which add their partial sums into shared memory; the warp that adds the last
// one writes the tile's 16 outputs.
#include "../../../tinyoss/kernels/moe_gemv_mma.cu"
#include "ring.cuh"

namespace {

using namespace ring;

constexpr int MAX_TILES = 64;  // a program's 16-row tiles at most (N <= 64 x 16 x programs)

// Where a unit's rows sit in shared memory (LAYOUT): 0, rows padded by 16 bytes, so ldmatrix's
// 8 rows meet no bank conflict; 1, rows 128-byte aligned (ldmatrix's rows share banks), to tell
// whether the copies' alignment bounds the stream; 2 (TILED), the weights re-laid on the host so
// a unit (16 rows x CK) is contiguous, one bulk copy, its 16-byte chunks XOR-swizzled within each
// 128 bytes by the row (chunk c of row r at (c & ~7) | ((c & 7) ^ (r & 7))): no bank conflict.
// Row copies of 1-4 KB at the rows' stride streamed at ~1.9 TB/s however aligned (call C).
constexpr int PADDED = 0, ALIGNED = 1, TILED = 2;
template <int CK, int LAYOUT>
__host__ __device__ constexpr int row_stride() {
  return LAYOUT == ALIGNED ? (CK * 2 + 127) / 128 * 128 : CK * 2 + (LAYOUT == PADDED ? 16 : 0);
}

template <int NW, int SLOTS, int CK, bool MATH, int LAYOUT>
__global__ void __launch_bounds__((NW + 1) * 32, 1)
    dense_ring(const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ x,
               __nv_bfloat16* __restrict__ out, int N, int K, int delay_ns) {
  static_assert(NW <= SLOTS, "a warp's parity wait needs the slot's previous fill done");
  static_assert(LAYOUT != TILED || CK % 64 == 0, "the swizzle takes 128-byte groups");
  constexpr int RS = row_stride<CK, LAYOUT>(), SLOT = 16 * RS;  // a unit's row stride and bytes
  extern __shared__ __align__(128) uint8_t dense_smem[];
  uint32_t* xs = reinterpret_cast<uint32_t*>(dense_smem + SLOTS * SLOT);  // x as bf16 pairs
  float* acc_s = reinterpret_cast<float*>(xs + 2048);                      // [MAX_TILES][16]
  int* done_s = reinterpret_cast<int*>(acc_s + MAX_TILES * 16);            // [MAX_TILES]
  uint64_t* full = reinterpret_cast<uint64_t*>(done_s + MAX_TILES);
  uint64_t* empty = full + SLOTS;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, P = gridDim.x, c = blockIdx.x;
  const int tiles = (N + 15) / 16, t0 = (int)((long)c * tiles / P);
  const int nt = (int)((long)(c + 1) * tiles / P) - t0, nc = K / CK, units = nt * nc;
  if (threadIdx.x == 0) {
    for (int s = 0; s < SLOTS; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  for (int i = threadIdx.x; i < MAX_TILES * 16; i += blockDim.x) acc_s[i] = 0.f;
  for (int i = threadIdx.x; i < MAX_TILES; i += blockDim.x) done_s[i] = 0;
  for (int i = threadIdx.x; i < K / 2; i += blockDim.x)
    xs[i] = reinterpret_cast<const uint32_t*>(x)[i];
  __syncthreads();
  if (warp == NW) {  // the producer: unit k is tile k / nc, chunk k % nc, a row a lane
    for (int k = 0; k < units; ++k) {
      const int s = k % SLOTS, round = k / SLOTS, tile = t0 + k / nc, ch = k % nc;
      const int rows = min(16, N - tile * 16);
      if (lane == 0) {
        if (round) mbar_wait(&empty[s], (round - 1) & 1);
        mbar_expect(&full[s], rows * CK * 2);
      }
      __syncwarp();
      if (LAYOUT == TILED) {
        if (lane == 0)
          bulk_copy(dense_smem + s * SLOT, w + ((long)tile * nc + ch) * 16 * CK, 16 * CK * 2,
                    &full[s]);
      } else if (lane < rows)
        bulk_copy(dense_smem + s * SLOT + lane * RS, w + ((long)(tile * 16 + lane) * K + ch * CK),
                  CK * 2, &full[s]);
    }
    return;
  }
  if (delay_ns > 0 && lane == 0) {  // the earlier phase's stand-in: the ring fills meanwhile
    unsigned long long t0ns, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0ns));
    do {
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - t0ns < (unsigned long long)delay_ns);
  }
  __syncwarp();
  const int g = lane >> 2, t = lane & 3;
  const int lrow = lane & 15, lcol = (lane >> 4) * 8;  // ldmatrix: rows 0-15 at k and k + 8
  for (int k = warp; k < units; k += NW) {
    const int s = k % SLOTS, tl = k / nc, ch = k % nc;
    mbar_wait(&full[s], (k / SLOTS) & 1);
    const uint8_t* a = dense_smem + s * SLOT + lrow * RS + lcol * 2;
    const uint32_t* xb = xs + ch * CK / 2 + t;
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    if constexpr (MATH) {
#pragma unroll 4
      for (int kk = 0; kk < CK; kk += 16) {
        uint32_t r[4];
        if (LAYOUT == TILED) {  // chunk (kk + lcol) / 8 of row lrow, swizzled
          const int ci = (kk + lcol) >> 3;
          ldsm4(r, dense_smem + s * SLOT + lrow * RS + 16 * ((ci & ~7) | ((ci & 7) ^ (lrow & 7))));
        } else {
          ldsm4(r, a + kk * 2);
        }
        mma_bf16(d, r[0], r[1], r[2], r[3], xb[kk / 2], xb[kk / 2 + 4]);
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);
    if (t == 0) atomicAdd(&acc_s[tl * 16 + g], d[0]), atomicAdd(&acc_s[tl * 16 + 8 + g], d[2]);
    __syncwarp();
    int last = 0;
    if (lane == 0) {
      __threadfence_block();
      last = atomicAdd(&done_s[tl], 1) == nc - 1;
    }
    if (__shfl_sync(0xffffffffu, last, 0)) {
      __threadfence_block();
      const int row = (t0 + tl) * 16 + (lane & 15);
      if (lane < 16 && row < N)
        out[row] = __float2bfloat16(atomicAdd(&acc_s[tl * 16 + lane], 0.f));
    }
  }
}

template <int NW, int SLOTS, int CK, bool MATH, int LAYOUT>
int launch_dense(const void* w, const void* x, void* out, int N, int K, int delay_ns, int grid,
                 cudaStream_t stream) {
  if (K % CK || K > 4096 || (N + 15) / 16 > MAX_TILES * grid) return (int)cudaErrorInvalidValue;
  constexpr int SLOT = 16 * row_stride<CK, LAYOUT>();
  const int bytes = SLOTS * SLOT + 2048 * 4 + MAX_TILES * 16 * 4 + MAX_TILES * 4 + 2 * SLOTS * 8;
  auto k = dense_ring<NW, SLOTS, CK, MATH, LAYOUT>;
  cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e) return (int)e;
  k<<<grid, (NW + 1) * 32, bytes, stream>>>(static_cast<const __nv_bfloat16*>(w),
                                            static_cast<const __nv_bfloat16*>(x),
                                            static_cast<__nv_bfloat16*>(out), N, K, delay_ns);
  return (int)cudaGetLastError();
}

}  // namespace

// A variant: consumer warps, slots, the K chunk in values, mode (bit 0: the MMAs, else the
// consumers skip them, the structure's bound; bits 1-2: LAYOUT). A chunk is one bulk copy a row
// (a unit in TILED), so it sets the copies a byte.
#define DENSE_MODE(NW, SL, CK, M, L) \
  if (mode == (M) + 2 * (L)) return launch_dense<NW, SL, CK, M, L>(w, x, out, N, K, delay_ns, grid, st);
#define DENSE_CASE(NW, SL, CK)                                                              \
  if (nw == NW && slots == SL && ck == CK) {                                              \
    DENSE_MODE(NW, SL, CK, false, PADDED) DENSE_MODE(NW, SL, CK, true, PADDED)            \
    DENSE_MODE(NW, SL, CK, false, ALIGNED) DENSE_MODE(NW, SL, CK, true, ALIGNED)          \
  }
#define DENSE_TILED(NW, SL, CK)                                                             \
  if (nw == NW && slots == SL && ck == CK) {                                              \
    DENSE_MODE(NW, SL, CK, false, TILED) DENSE_MODE(NW, SL, CK, true, TILED)              \
  }
extern "C" int dense_ring_launch(const void* w, const void* x, void* out, int N, int K,
                                 int delay_ns, int nw, int slots, int ck, int mode, int grid,
                                 void* stream) {
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  DENSE_CASE(12, 12, 480)
  DENSE_CASE(6, 6, 960)
  DENSE_CASE(4, 4, 1440)
  DENSE_CASE(12, 12, 512)
  DENSE_CASE(6, 6, 1024)
  DENSE_CASE(3, 3, 2048)
  DENSE_TILED(10, 10, 576)
  DENSE_TILED(6, 6, 960)
  DENSE_TILED(12, 12, 512)
  DENSE_TILED(6, 6, 1024)
  DENSE_TILED(16, 16, 320)
  DENSE_TILED(16, 16, 256)
  return -1;
}
