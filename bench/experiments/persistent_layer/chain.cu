// Does one persistent launch that streams every weight of a decode step through shared memory
// (a bulk-copy ring per SM, filled ahead of the data dependencies) beat a CUDA graph of
// separate launches? (issue 18: at batch 1 a layer of 7 launches spends ~40 us beyond its bytes'
// time). A step here is LAYERS x (q/k/v GEMV, attention stand-in, o GEMV, norm/router
// stand-in, gate_up-sized GEMV, down-sized GEMV, combine stand-in): the GEMVs are bf16 with
// gpt-oss-20b's bytes a layer (29.5 + 23.6 + 35.2 + 17.6 MB); a stand-in is the first `ctas`
// programs spinning `spin_ns` and copying x to out (latency with no bytes, as attention and the
// small kernels are at batch 1).
//
// chain_persistent: one program an SM. Warp WARPS (one thread) issues cp.async.bulk copies of
// this program's rows of every GEMV, in order, into SLOTS slots as they free (an mbarrier pair a
// slot), without waiting for any phase, except before a phase marked `dep` (the experts: their
// rows are known only after routing). Warps 0..WARPS-1 wait for the previous phase on every
// program (a counter in global memory), read x, and take rows q = warp (mod WARPS) of this
// program's share from the ring. standin: the separate-launch stand-in kernel.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

struct Phase {
  const __nv_bfloat16* w;  // [N, K] (a GEMV) or null (a stand-in)
  const __nv_bfloat16* x;  // [K] (a GEMV) or [N] (a stand-in)
  __nv_bfloat16* out;      // [N]
  int N, K;
  int spin_ns, ctas;  // a stand-in's
  int dep, pad;       // dep: this GEMV's rows may load only after the phase before it
};

constexpr int WARPS = 8, THREADS = (WARPS + 1) * 32, X_BYTES = 8192;

__device__ __forceinline__ uint32_t saddr(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(uint64_t* b, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(saddr(b)), "r"(count));
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  uint32_t ok;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
        "selp.u32 %0, 1, 0, p; }"
        : "=r"(ok)
        : "r"(saddr(b)), "r"(parity)
        : "memory");
  } while (!ok);
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(saddr(b)) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(b)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* b) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(saddr(dst)),
      "l"(src), "r"(bytes), "r"(saddr(b))
      : "memory");
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release(unsigned* p) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p) : "memory");
}
__device__ __forceinline__ uint4 load_volatile(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}
// Lamport: a bf16 -0.0 (0x8000) is "not written yet"; writers store +0.0 for it
__device__ __forceinline__ bool unwritten(uint32_t w) {
  return (w & 0xffffu) == 0x8000u || (w >> 16) == 0x8000u;
}
__device__ __forceinline__ bool unwritten(uint4 v) {
  return unwritten(v.x) || unwritten(v.y) || unwritten(v.z) || unwritten(v.w);
}
__device__ __forceinline__ uint4 wait_written(const uint4* p) {
  uint4 v = load_volatile(p);
  while (unwritten(v)) v = load_volatile(p);
  return v;
}
__device__ __forceinline__ __nv_bfloat16 written(float v) {
  return __float2bfloat16(v == 0.f ? 0.f : v);  // -0.0 -> +0.0
}

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"r"(WARPS * 32) : "memory");
}
__device__ __forceinline__ void spin(int ns) {
  const uint64_t t0 = now_ns();
  while (now_ns() - t0 < (uint64_t)ns) {
  }
}

// this program's rows [r0, r1) of an N-row GEMV
__device__ __forceinline__ void my_rows(int N, int& r0, int& r1) {
  const int per = (N + gridDim.x - 1) / gridDim.x;
  r0 = min(N, (int)blockIdx.x * per);
  r1 = min(N, r0 + per);
}

__device__ __forceinline__ float dot8(uint4 w, uint4 x, float acc) {
  const uint32_t ws[4] = {w.x, w.y, w.z, w.w}, xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    acc = fmaf(__uint_as_float(ws[c] << 16), __uint_as_float(xs[c] << 16), acc);
    acc = fmaf(__uint_as_float(ws[c] & 0xffff0000u), __uint_as_float(xs[c] & 0xffff0000u), acc);
  }
  return acc;
}

// LAMPORT: no counter; every activation buffer starts at -0.0 (the host fills them before the
// launch), a reader polls its x until no element is -0.0, and a program takes part only in the
// phases it has work in. DYN (with LAMPORT): a program's static share is 3/4 of an even split;
// the rest of a phase's rows are claimed a chunk at a time (an atomic counter a phase,
// done[1 + p], zeroed before the launch) by whichever producer gets there first, and every slot
// carries its rows (a slot of 0 rows ends the phase), so faster programs take more.
template <int SLOTS, int SLOT_BYTES, bool LAMPORT, bool DYN = false>
__global__ void __launch_bounds__(THREADS, 1)
    chain_persistent(const Phase* __restrict__ phases, int n_phases, unsigned* done) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;
  uint4* xs = reinterpret_cast<uint4*>(smem + SLOTS * SLOT_BYTES);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + SLOTS * SLOT_BYTES + X_BYTES);
  uint64_t* empty = full + SLOTS;
  int* meta = reinterpret_cast<int*>(empty + SLOTS);  // DYN: [SLOTS][2] first row, rows
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < SLOTS; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == WARPS) {  // the producer
    if (lane == 0) {
      int i = 0;
      for (int p = 0; p < n_phases; ++p) {
        const Phase ph = phases[p];
        if (!ph.w) continue;
        if (ph.dep && LAMPORT)
          wait_written(reinterpret_cast<const uint4*>(ph.x));
        else if (ph.dep)
          while (ld_acquire(done) < (unsigned)p * gridDim.x) {
          }
        const int row_bytes = 2 * ph.K, per_chunk = SLOT_BYTES / row_bytes;
        if constexpr (DYN) {
          auto issue = [&](int row0, int rows) {  // rows == 0 ends the phase
            const int s = i % SLOTS, round = i / SLOTS;
            if (round) mbar_wait(&empty[s], (round - 1) & 1);
            meta[2 * s] = row0;
            meta[2 * s + 1] = rows;
            if (rows) {
              mbar_expect(&full[s], (uint32_t)(rows * row_bytes));
              bulk_copy(ring + s * SLOT_BYTES,
                        reinterpret_cast<const uint8_t*>(ph.w) + (long)row0 * row_bytes,
                        (uint32_t)(rows * row_bytes), &full[s]);
            } else {
              mbar_arrive(&full[s]);
            }
            ++i;
          };
          const int share = ph.N * 3 / 4 / (int)gridDim.x, pool = share * (int)gridDim.x;
          for (int r = blockIdx.x * share; r < ((int)blockIdx.x + 1) * share; r += per_chunk)
            issue(r, min(per_chunk, ((int)blockIdx.x + 1) * share - r));
          for (;;) {
            const int r = pool + per_chunk * (int)atomicAdd(done + 1 + p, 1u);
            if (r >= ph.N) break;
            issue(r, min(per_chunk, ph.N - r));
          }
          issue(0, 0);
          continue;
        }
        int r0, r1;
        my_rows(ph.N, r0, r1);
        for (int r = r0; r < r1; r += per_chunk, ++i) {
          const int s = i % SLOTS, round = i / SLOTS;
          if (round) mbar_wait(&empty[s], (round - 1) & 1);
          const uint32_t bytes = (uint32_t)(min(per_chunk, r1 - r) * row_bytes);
          mbar_expect(&full[s], bytes);
          bulk_copy(ring + s * SLOT_BYTES,
                    reinterpret_cast<const uint8_t*>(ph.w) + (long)r * row_bytes, bytes,
                    &full[s]);
        }
      }
    }
    return;
  }
  int i = 0;
  for (int p = 0; p < n_phases; ++p) {
    const Phase ph = phases[p];
    if (p && !LAMPORT) {  // every program is done with the phase before
      if (threadIdx.x == 0)
        while (ld_acquire(done) < (unsigned)p * gridDim.x) {
        }
      consumers_sync();
    }
    if (ph.w) {
      const int kv = ph.K >> 3, row_bytes = 2 * ph.K, per_chunk = SLOT_BYTES / row_bytes;
      if (LAMPORT) consumers_sync();  // every warp is done with the last phase's x
      for (int j = threadIdx.x; j < kv; j += WARPS * 32)
        xs[j] = LAMPORT ? wait_written(reinterpret_cast<const uint4*>(ph.x) + j)
                        : __ldcg(reinterpret_cast<const uint4*>(ph.x) + j);
      consumers_sync();
      if constexpr (DYN) {
        for (int q = 0;; ++i) {  // q: rows of this phase so far here
          const int s = i % SLOTS;
          mbar_wait(&full[s], (i / SLOTS) & 1);
          const int r = meta[2 * s], rows = meta[2 * s + 1];
          for (int rr = (warp - q) & (WARPS - 1); rr < rows; rr += WARPS) {
            const uint4* wr =
                reinterpret_cast<const uint4*>(ring + s * SLOT_BYTES + rr * row_bytes);
            float acc = 0.f;
            for (int j = lane; j < kv; j += 32) acc = dot8(wr[j], xs[j], acc);
#pragma unroll
            for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            if (lane == 0) ph.out[r + rr] = written(acc);
          }
          __syncwarp();
          if (lane == 0) mbar_arrive(&empty[s]);
          if (!rows) {
            ++i;
            break;
          }
          q += rows;
        }
        continue;
      }
      int r0, r1;
      my_rows(ph.N, r0, r1);
      for (int r = r0; r < r1; r += per_chunk, ++i) {
        const int s = i % SLOTS, rows = min(per_chunk, r1 - r);
        mbar_wait(&full[s], (i / SLOTS) & 1);
        for (int rr = (warp - (r - r0)) & (WARPS - 1); rr < rows; rr += WARPS) {
          const uint4* wr = reinterpret_cast<const uint4*>(ring + s * SLOT_BYTES + rr * row_bytes);
          float acc = 0.f;
          for (int j = lane; j < kv; j += 32) acc = dot8(wr[j], xs[j], acc);
#pragma unroll
          for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
          if (lane == 0) ph.out[r + rr] = LAMPORT ? written(acc) : __float2bfloat16(acc);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[s]);
      }
    } else if ((int)blockIdx.x < ph.ctas) {  // a stand-in: N in 8s
      const int per = (ph.N / 8 + ph.ctas - 1) / ph.ctas,
                end = min(ph.N / 8, ((int)blockIdx.x + 1) * per);
      const uint4* x = reinterpret_cast<const uint4*>(ph.x);
      if (LAMPORT)
        for (int j = blockIdx.x * per + threadIdx.x; j < end; j += WARPS * 32) wait_written(x + j);
      consumers_sync();
      if (threadIdx.x == 0) spin(ph.spin_ns);
      consumers_sync();
      for (int j = blockIdx.x * per + threadIdx.x; j < end; j += WARPS * 32)
        reinterpret_cast<uint4*>(ph.out)[j] = __ldcg(x + j);
    }
    if (LAMPORT) continue;
    consumers_sync();  // this program's outputs are written: publish them
    if (threadIdx.x == 0) {
      __threadfence();
      red_release(done);
    }
  }
}

__global__ void standin(const unsigned short* __restrict__ x, unsigned short* __restrict__ out,
                        int N, int spin_ns) {
  if (threadIdx.x == 0) spin(spin_ns);
  __syncthreads();
  const int per = (N + gridDim.x - 1) / gridDim.x, end = min(N, ((int)blockIdx.x + 1) * per);
  for (int j = blockIdx.x * per + threadIdx.x; j < end; j += blockDim.x) out[j] = x[j];
}

template <int SLOTS, int SLOT_BYTES, bool LAMPORT, bool DYN = false>
int launch(const void* phases, int n, void* done, int grid, cudaStream_t stream) {
  const int bytes = SLOTS * SLOT_BYTES + X_BYTES + 2 * SLOTS * 8 + 2 * SLOTS * 4;
  auto k = chain_persistent<SLOTS, SLOT_BYTES, LAMPORT, DYN>;
  cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e) return (int)e;
  k<<<grid, THREADS, bytes, stream>>>(static_cast<const Phase*>(phases), n,
                                       static_cast<unsigned*>(done));
  return (int)cudaGetLastError();
}

}  // namespace

extern "C" int chain_phase_bytes() { return (int)sizeof(Phase); }

extern "C" int chain_launch(const void* phases, int n, void* done, int grid, int ring,
                            cudaStream_t stream) {
  switch (ring) {  // slots x KiB a slot; + 10000: Lamport (no counter); + 20000: and DYN
    case 20632: return launch<6, 32768, true, true>(phases, n, done, grid, stream);
    case 21216: return launch<12, 16384, true, true>(phases, n, done, grid, stream);
    case 10632: return launch<6, 32768, true>(phases, n, done, grid, stream);
    case 10364: return launch<3, 65536, true>(phases, n, done, grid, stream);
    case 11216: return launch<12, 16384, true>(phases, n, done, grid, stream);
    case 364: return launch<3, 65536, false>(phases, n, done, grid, stream);
    case 632: return launch<6, 32768, false>(phases, n, done, grid, stream);
    case 1216: return launch<12, 16384, false>(phases, n, done, grid, stream);
    case 332: return launch<3, 32768, false>(phases, n, done, grid, stream);  // two programs an SM
    case 616: return launch<6, 16384, false>(phases, n, done, grid, stream);
    default: return -1;
  }
}

extern "C" int standin_launch(const void* x, void* out, int N, int spin_ns, int ctas,
                              cudaStream_t stream) {
  standin<<<ctas, 256, 0, stream>>>(static_cast<const unsigned short*>(x),
                                    static_cast<unsigned short*>(out), N, spin_ns);
  return (int)cudaGetLastError();
}

extern "C" const char* chain_error(int e) { return cudaGetErrorString((cudaError_t)e); }
