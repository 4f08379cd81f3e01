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
// program (a counter in global memory, or Lamport polling: MODE below), read x, and take rows
// q = warp (mod WARPS) of this program's share from the ring. standin: the separate-launch
// stand-in kernel.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ring.cuh"

namespace {

using namespace ring;

struct Phase {
  const __nv_bfloat16* w;  // [N, K] (a GEMV) or null (a stand-in)
  const __nv_bfloat16* x;  // [K] (a GEMV) or [N] (a stand-in)
  __nv_bfloat16* out;      // [N]
  int N, K;
  int spin_ns, ctas;  // a stand-in's
  int dep;   // this GEMV's rows may load only after the phase before it
  int ring;  // MODE TWO: 0 rows known ahead, 1 the experts'

};

constexpr int X_BYTES = 8192;

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
template <int WARPS>
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"r"(WARPS * 32) : "memory");
}
__device__ __forceinline__ void spin(int ns) {
  const uint64_t t0 = now_ns();
  while (now_ns() - t0 < (uint64_t)ns) {
  }
}

// FAST's: four independent accumulators, one a 32-bit word (the single chain above runs 8
// dependent FMAs a 16-byte load)
__device__ __forceinline__ void dot8x4(uint4 w, uint4 x, float4& a) {
  a.x = fmaf(__uint_as_float(w.x << 16), __uint_as_float(x.x << 16), a.x);
  a.x = fmaf(__uint_as_float(w.x & 0xffff0000u), __uint_as_float(x.x & 0xffff0000u), a.x);
  a.y = fmaf(__uint_as_float(w.y << 16), __uint_as_float(x.y << 16), a.y);
  a.y = fmaf(__uint_as_float(w.y & 0xffff0000u), __uint_as_float(x.y & 0xffff0000u), a.y);
  a.z = fmaf(__uint_as_float(w.z << 16), __uint_as_float(x.z << 16), a.z);
  a.z = fmaf(__uint_as_float(w.z & 0xffff0000u), __uint_as_float(x.z & 0xffff0000u), a.z);
  a.w = fmaf(__uint_as_float(w.w << 16), __uint_as_float(x.w << 16), a.w);
  a.w = fmaf(__uint_as_float(w.w & 0xffff0000u), __uint_as_float(x.w & 0xffff0000u), a.w);
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

// MODE bits. 1, Lamport: no counter; every activation buffer starts at -0.0 (the host fills
// them before the launch), a reader polls its x until no element is -0.0, and a program takes
// part only in the phases it has work in. 2, dynamic tails (with 1): a program's static share is
// 3/4 of an even split; the rest of a phase's rows are claimed a chunk at a time (an atomic
// counter a phase, done[1 + p], zeroed before the launch) by whichever producer gets there
// first. 4, two rings (with 1): the slots split in halves, one for the GEMVs whose rows are known
// ahead (ring 0: q/k/v, o) and one for the experts' (ring 1, Phase::ring), each with its own
// producer warp, so the next layer's q/k/v can stream while the experts wait for routing.
// Every slot carries its first row and row count; a slot of 0 rows ends a program's phase.
// 8, trace: each program records where its time goes a phase into g_trace (below).
// 16, fast consumers: a row's dot product in four independent chains, its loop unrolled by 4.
// 32, no math: consumers take their slots and write 0 (the stream and the handshakes alone; the
// outputs are wrong, the bench does not check them).
// 64, x in registers (with FAST): each lane keeps its 16-byte pieces of x for the phase, so a row
// reads only its weights from shared memory (K <= 4096).
// 128, sixteen consumer warps (else eight).
constexpr int LAMPORT = 1, DYN = 2, TWO = 4, TRACE = 8, FAST = 16, NOMATH = 32, XREG = 64,
              W16 = 128;
__host__ __device__ constexpr int warps_of(int mode) { return (mode & W16) ? 16 : 8; }

// TRACE: [program][phase][field], cycles unless said. Consumers (thread 0): 0 waiting for x,
// 1 from x ready to the phase's end, 2 of which waiting for a full slot, 3 globaltimer (ns) at
// the end, 7 globaltimer when x was ready, 8 rows warp 0 computed, 9 slots it took. Producer: 4 waiting for the routing (dep), 5 issuing
// the phase's rows, 6 of which waiting for an empty slot. Phase MAX_PHASES - 1: the kernel's
// first and last clock64 and globaltimer (fields 0-3), to turn cycles into ns.
constexpr int MAX_PROGRAMS = 264, MAX_PHASES = 256, FIELDS = 10;
__device__ unsigned long long g_trace[MAX_PROGRAMS * MAX_PHASES * FIELDS];
__device__ __forceinline__ unsigned long long& tr(int p, int f) {
  return g_trace[((long)blockIdx.x * MAX_PHASES + p) * FIELDS + f];
}

struct Ring {
  uint8_t* data;
  uint64_t* full;
  uint64_t* empty;
  int* meta;  // [slots][2]: first row, rows
  int slots;
};

template <int SLOT_BYTES, int MODE>
__device__ void produce(const Phase* __restrict__ phases, int n_phases, unsigned* done,
                        const Ring& R, int which) {
  int i = 0;
  long long waited = 0;  // TRACE: cycles waiting for empty slots in this phase
  auto issue = [&](const Phase& ph, int row0, int rows) {  // rows == 0 ends the phase
    const int s = i % R.slots, round = i / R.slots, row_bytes = 2 * ph.K;
    const long long t0 = (MODE & TRACE) ? clock64() : 0;
    if (round) mbar_wait(&R.empty[s], (round - 1) & 1);
    if (MODE & TRACE) waited += clock64() - t0;
    R.meta[2 * s] = row0;
    R.meta[2 * s + 1] = rows;
    if (rows) {
      mbar_expect(&R.full[s], (uint32_t)(rows * row_bytes));
      bulk_copy(R.data + (long)s * SLOT_BYTES,
                reinterpret_cast<const uint8_t*>(ph.w) + (long)row0 * row_bytes,
                (uint32_t)(rows * row_bytes), &R.full[s]);
    } else {
      mbar_arrive(&R.full[s]);
    }
    ++i;
  };
  for (int p = 0; p < n_phases; ++p) {
    const Phase ph = phases[p];
    if (!ph.w || ((MODE & TWO) && ph.ring != which)) continue;
    const long long t_dep = (MODE & TRACE) ? clock64() : 0;
    if (ph.dep && (MODE & LAMPORT))
      wait_written(reinterpret_cast<const uint4*>(ph.x));
    else if (ph.dep)
      while (ld_acquire(done) < (unsigned)p * gridDim.x) {
      }
    const long long t_issue = (MODE & TRACE) ? clock64() : 0;
    waited = 0;
    const int per_chunk = SLOT_BYTES / (2 * ph.K), P = gridDim.x, c = blockIdx.x;
    const int share = (MODE & DYN) ? ph.N * 3 / 4 / P : (ph.N + P - 1) / P;
    const int r0 = min(ph.N, c * share), r1 = min(ph.N, r0 + share);
    for (int r = r0; r < r1; r += per_chunk) issue(ph, r, min(per_chunk, r1 - r));
    if (MODE & DYN)
      for (;;) {
        const int r = share * P + per_chunk * (int)atomicAdd(done + 1 + p, 1u);
        if (r >= ph.N) break;
        issue(ph, r, min(per_chunk, ph.N - r));
      }
    issue(ph, 0, 0);
    if (MODE & TRACE) {
      tr(p, 4) = t_issue - t_dep;
      tr(p, 5) = clock64() - t_issue;
      tr(p, 6) = waited;
    }
  }
}

template <int SLOTS, int SLOT_BYTES, int MODE>
__global__ void __launch_bounds__((warps_of(MODE) + 2) * 32, 1)
    chain_persistent(const Phase* __restrict__ phases, int n_phases, unsigned* done) {
  constexpr int WARPS = warps_of(MODE);
  static_assert(MODE == 0 || (MODE & LAMPORT), "dynamic tails and two rings need Lamport");
  static_assert(!(MODE & TWO) || SLOTS % 2 == 0, "two rings split the slots in halves");
  extern __shared__ __align__(128) uint8_t smem[];
  uint4* xs = reinterpret_cast<uint4*>(smem + SLOTS * SLOT_BYTES);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + SLOTS * SLOT_BYTES + X_BYTES);
  uint64_t* empty = full + SLOTS;
  int* meta = reinterpret_cast<int*>(empty + SLOTS);
  constexpr int PER = (MODE & TWO) ? SLOTS / 2 : SLOTS;
  const Ring ring0{smem, full, empty, meta, PER},
      ring1{smem + PER * SLOT_BYTES, full + PER, empty + PER, meta + 2 * PER, PER};
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if ((MODE & TRACE) && threadIdx.x == 0) {
    tr(MAX_PHASES - 1, 0) = clock64();
    tr(MAX_PHASES - 1, 2) = now_ns();
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < SLOTS; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp >= WARPS) {  // producers: warp WARPS for ring 0 (or the one ring), WARPS + 1 ring 1
    if (lane == 0 && warp == WARPS)
      produce<SLOT_BYTES, MODE>(phases, n_phases, done, ring0, 0);
    else if (lane == 0 && (MODE & TWO))
      produce<SLOT_BYTES, MODE>(phases, n_phases, done, ring1, 1);
    return;
  }
  int next0 = 0, next1 = 0;  // each ring's next slot use
  const bool t0 = (MODE & TRACE) && threadIdx.x == 0;
  long long c_enter = 0, c_ready = 0, c_full = 0, c_rows = 0, c_slots = 0;
  for (int p = 0; p < n_phases; ++p) {
    const Phase ph = phases[p];
    if (t0) c_enter = clock64(), c_full = 0, c_rows = 0, c_slots = 0;
    if (p && !(MODE & LAMPORT)) {  // every program is done with the phase before
      if (threadIdx.x == 0)
        while (ld_acquire(done) < (unsigned)p * gridDim.x) {
        }
      consumers_sync<WARPS>();
    }
    if (ph.w) {
      const int kv = ph.K >> 3, row_bytes = 2 * ph.K;
      const bool second = (MODE & TWO) && ph.ring;
      const Ring R = second ? ring1 : ring0;
      int i = second ? next1 : next0;
      if (MODE & LAMPORT) consumers_sync<WARPS>();  // every warp is done with the last phase's x
      for (int j = threadIdx.x; j < kv; j += WARPS * 32)
        xs[j] = (MODE & LAMPORT) ? wait_written(reinterpret_cast<const uint4*>(ph.x) + j)
                                 : __ldcg(reinterpret_cast<const uint4*>(ph.x) + j);
      consumers_sync<WARPS>();
      uint4 xr[(MODE & XREG) ? 16 : 1];
      if (MODE & XREG) {
#pragma unroll
        for (int u = 0; u < 16; ++u)
          xr[u] = lane + 32 * u < kv ? xs[lane + 32 * u] : make_uint4(0, 0, 0, 0);
      }
      if (t0) c_ready = clock64(), tr(p, 7) = now_ns();
      for (int q = 0;; ++i) {  // q: this phase's rows so far in this program
        const int s = i % R.slots;
        const long long tw = t0 ? clock64() : 0;
        mbar_wait(&R.full[s], (i / R.slots) & 1);
        if (t0) c_full += clock64() - tw, ++c_slots;
        const int r = R.meta[2 * s], rows = R.meta[2 * s + 1];
        for (int rr = (warp - q) & (WARPS - 1); rr < rows; rr += WARPS) {
          if (t0) ++c_rows;
          if (MODE & NOMATH) {
            if (lane == 0) ph.out[r + rr] = __float2bfloat16(0.f);
            continue;
          }
          const uint4* wr =
              reinterpret_cast<const uint4*>(R.data + (long)s * SLOT_BYTES + rr * row_bytes);
          float acc = 0.f;
          if (MODE & XREG) {
            float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int u = 0; u < 16; ++u)
              if (lane + 32 * u < kv) dot8x4(wr[lane + 32 * u], xr[u], a);
            acc = (a.x + a.y) + (a.z + a.w);
          } else if (MODE & FAST) {
            float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
            for (int j = lane; j < kv; j += 32) dot8x4(wr[j], xs[j], a);
            acc = (a.x + a.y) + (a.z + a.w);
          } else {
            for (int j = lane; j < kv; j += 32) acc = dot8(wr[j], xs[j], acc);
          }
#pragma unroll
          for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
          if (lane == 0)
            ph.out[r + rr] = (MODE & LAMPORT) ? written(acc) : __float2bfloat16(acc);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&R.empty[s]);
        if (!rows) {
          ++i;
          break;
        }
        q += rows;
      }
      (second ? next1 : next0) = i;
    } else if ((int)blockIdx.x < ph.ctas) {  // a stand-in: N in 8s
      const int per = (ph.N / 8 + ph.ctas - 1) / ph.ctas,
                end = min(ph.N / 8, ((int)blockIdx.x + 1) * per);
      const uint4* x = reinterpret_cast<const uint4*>(ph.x);
      if (MODE & LAMPORT)
        for (int j = blockIdx.x * per + threadIdx.x; j < end; j += WARPS * 32) wait_written(x + j);
      consumers_sync<WARPS>();
      if (t0) c_ready = clock64(), tr(p, 7) = now_ns();
      if (threadIdx.x == 0) spin(ph.spin_ns);
      consumers_sync<WARPS>();
      for (int j = blockIdx.x * per + threadIdx.x; j < end; j += WARPS * 32)
        reinterpret_cast<uint4*>(ph.out)[j] = __ldcg(x + j);
    }
    if (t0 && (ph.w || (int)blockIdx.x < ph.ctas)) {  // the programs that took part
      const long long c_end = clock64();
      tr(p, 0) = c_ready - c_enter;
      tr(p, 1) = c_end - c_ready;
      tr(p, 2) = c_full;
      tr(p, 3) = now_ns();
      tr(p, 8) = c_rows;
      tr(p, 9) = c_slots;
    }
    if (MODE & LAMPORT) continue;
    consumers_sync<WARPS>();  // this program's outputs are written: publish them
    if (threadIdx.x == 0) {
      __threadfence();
      red_release(done);
    }
  }
  if (t0) {
    tr(MAX_PHASES - 1, 1) = clock64();
    tr(MAX_PHASES - 1, 3) = now_ns();
  }
}

__global__ void standin(const unsigned short* __restrict__ x, unsigned short* __restrict__ out,
                        int N, int spin_ns) {
  if (threadIdx.x == 0) spin(spin_ns);
  __syncthreads();
  const int per = (N + gridDim.x - 1) / gridDim.x, end = min(N, ((int)blockIdx.x + 1) * per);
  for (int j = blockIdx.x * per + threadIdx.x; j < end; j += blockDim.x) out[j] = x[j];
}

template <int SLOTS, int SLOT_BYTES, int MODE>
int launch(const void* phases, int n, void* done, int grid, cudaStream_t stream) {
  const int bytes = SLOTS * SLOT_BYTES + X_BYTES + 2 * SLOTS * 8 + 2 * SLOTS * 4;
  auto k = chain_persistent<SLOTS, SLOT_BYTES, MODE>;
  cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e) return (int)e;
  k<<<grid, (warps_of(MODE) + 2) * 32, bytes, stream>>>(static_cast<const Phase*>(phases), n,
                                       static_cast<unsigned*>(done));
  return (int)cudaGetLastError();
}

}  // namespace

extern "C" int chain_phase_bytes() { return (int)sizeof(Phase); }

// ring: slots x KiB a slot (332, 616: two programs an SM) + 10000 x MODE
extern "C" int chain_launch(const void* phases, int n, void* done, int grid, int ring,
                            cudaStream_t stream) {
  switch (ring) {
    case 364: return launch<3, 65536, 0>(phases, n, done, grid, stream);
    case 632: return launch<6, 32768, 0>(phases, n, done, grid, stream);
    case 1216: return launch<12, 16384, 0>(phases, n, done, grid, stream);
    case 332: return launch<3, 32768, 0>(phases, n, done, grid, stream);
    case 616: return launch<6, 16384, 0>(phases, n, done, grid, stream);
    case 10364: return launch<3, 65536, LAMPORT>(phases, n, done, grid, stream);
    case 10632: return launch<6, 32768, LAMPORT>(phases, n, done, grid, stream);
    case 11216: return launch<12, 16384, LAMPORT>(phases, n, done, grid, stream);
    case 30632: return launch<6, 32768, LAMPORT | DYN>(phases, n, done, grid, stream);
    case 31216: return launch<12, 16384, LAMPORT | DYN>(phases, n, done, grid, stream);
    case 51216: return launch<12, 16384, LAMPORT | TWO>(phases, n, done, grid, stream);
    case 71216: return launch<12, 16384, LAMPORT | DYN | TWO>(phases, n, done, grid, stream);
    case 91216: return launch<12, 16384, LAMPORT | TRACE>(phases, n, done, grid, stream);
    case 111216: return launch<12, 16384, LAMPORT | DYN | TRACE>(phases, n, done, grid, stream);
    case 171216: return launch<12, 16384, LAMPORT | FAST>(phases, n, done, grid, stream);
    case 191216: return launch<12, 16384, LAMPORT | DYN | FAST>(phases, n, done, grid, stream);
    case 231216: return launch<12, 16384, LAMPORT | DYN | TWO | FAST>(phases, n, done, grid, stream);
    case 271216:
      return launch<12, 16384, LAMPORT | DYN | TRACE | FAST>(phases, n, done, grid, stream);
    case 190632: return launch<6, 32768, LAMPORT | DYN | FAST>(phases, n, done, grid, stream);
    case 351216: return launch<12, 16384, LAMPORT | DYN | NOMATH>(phases, n, done, grid, stream);
    case 831216:
      return launch<12, 16384, LAMPORT | DYN | FAST | XREG>(phases, n, done, grid, stream);
    case 911216:
      return launch<12, 16384, LAMPORT | DYN | TRACE | FAST | XREG>(phases, n, done, grid, stream);
    case 830632: return launch<6, 32768, LAMPORT | DYN | FAST | XREG>(phases, n, done, grid, stream);
    case 1471216:
      return launch<12, 16384, LAMPORT | DYN | FAST | W16>(phases, n, done, grid, stream);
    case 1551216:
      return launch<12, 16384, LAMPORT | DYN | TRACE | FAST | W16>(phases, n, done, grid, stream);
    case 1470632: return launch<6, 32768, LAMPORT | DYN | FAST | W16>(phases, n, done, grid, stream);
    case 1550632:
      return launch<6, 32768, LAMPORT | DYN | TRACE | FAST | W16>(phases, n, done, grid, stream);
    case 1470816: return launch<8, 24576, LAMPORT | DYN | FAST | W16>(phases, n, done, grid, stream);
    case 431216:
      return launch<12, 16384, LAMPORT | DYN | TRACE | NOMATH>(phases, n, done, grid, stream);
    default: return -1;
  }
}

extern "C" int standin_launch(const void* x, void* out, int N, int spin_ns, int ctas,
                              cudaStream_t stream) {
  standin<<<ctas, 256, 0, stream>>>(static_cast<const unsigned short*>(x),
                                    static_cast<unsigned short*>(out), N, spin_ns);
  return (int)cudaGetLastError();
}

// TRACE's record, [MAX_PROGRAMS][MAX_PHASES][FIELDS] uint64, into `host`
extern "C" int chain_trace(void* host) {
  return (int)cudaMemcpyFromSymbol(host, g_trace, sizeof(g_trace));
}
extern "C" int chain_trace_clear() {
  void* p = nullptr;
  cudaError_t e = cudaGetSymbolAddress(&p, g_trace);
  return (int)(e ? e : cudaMemset(p, 0, sizeof(g_trace)));
}
extern "C" int chain_trace_dims(int* dims) {
  dims[0] = MAX_PROGRAMS, dims[1] = MAX_PHASES, dims[2] = FIELDS;
  return 0;
}

extern "C" const char* chain_error(int e) { return cudaGetErrorString((cudaError_t)e); }
