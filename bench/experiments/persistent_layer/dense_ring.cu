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

// A unit's row stride in shared memory: padded by 16 bytes, so ldmatrix's 8 rows meet no bank
// conflict, or (ALIGN) rounded up to 128 bytes, where every row's copy lands 128-byte aligned and
// ldmatrix's rows share banks (to tell whether the bulk copies' alignment bounds the stream).
template <int CK, bool ALIGN>
__host__ __device__ constexpr int row_stride() {
  return ALIGN ? (CK * 2 + 127) / 128 * 128 : CK * 2 + 16;
}

template <int NW, int SLOTS, int CK, bool MATH, bool ALIGN>
__global__ void __launch_bounds__((NW + 1) * 32, 1)
    dense_ring(const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ x,
               __nv_bfloat16* __restrict__ out, int N, int K, int delay_ns) {
  static_assert(NW <= SLOTS, "a warp's parity wait needs the slot's previous fill done");
  constexpr int RS = row_stride<CK, ALIGN>(), SLOT = 16 * RS;  // a unit's row stride and bytes
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
      if (lane < rows)
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
        ldsm4(r, a + kk * 2);
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

template <int NW, int SLOTS, int CK, bool MATH, bool ALIGN>
int launch_dense(const void* w, const void* x, void* out, int N, int K, int delay_ns, int grid,
                 cudaStream_t stream) {
  if (K % CK || K > 4096 || (N + 15) / 16 > MAX_TILES * grid) return (int)cudaErrorInvalidValue;
  constexpr int SLOT = 16 * row_stride<CK, ALIGN>();
  const int bytes = SLOTS * SLOT + 2048 * 4 + MAX_TILES * 16 * 4 + MAX_TILES * 4 + 2 * SLOTS * 8;
  auto k = dense_ring<NW, SLOTS, CK, MATH, ALIGN>;
  cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e) return (int)e;
  k<<<grid, (NW + 1) * 32, bytes, stream>>>(static_cast<const __nv_bfloat16*>(w),
                                            static_cast<const __nv_bfloat16*>(x),
                                            static_cast<__nv_bfloat16*>(out), N, K, delay_ns);
  return (int)cudaGetLastError();
}

}  // namespace

// A variant: consumer warps, slots, the K chunk in values, mode (bit 0: the MMAs, else the
// consumers skip them, the structure's bound; bit 1: rows 128-byte aligned). A chunk is one bulk
// copy a row, so it sets the copies a byte: 240 values (480 bytes a copy) to 2048 (4 KB).
#define DENSE_MODE(NW, SL, CK, M, A) \
  if (mode == (M) + 2 * (A)) return launch_dense<NW, SL, CK, M, A>(w, x, out, N, K, delay_ns, grid, st);
#define DENSE_CASE(NW, SL, CK)                                                              \
  if (nw == NW && slots == SL && ck == CK) {                                              \
    DENSE_MODE(NW, SL, CK, false, false) DENSE_MODE(NW, SL, CK, true, false)              \
    DENSE_MODE(NW, SL, CK, false, true) DENSE_MODE(NW, SL, CK, true, true)                \
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
  return -1;
}
