// Measured, not kept in cuda_w4.cu (docs/kernels.md): the staged loop with its codes and group pairs
// in a deep shared-memory ring filled by asynchronous copies together with the activations
// (Marlin's way), instead of a register ring S chunks ahead. scripts/ring_bench.py appends this
// text to cuda_w4.kernel_source() (PARAMS, ARGS, Chunks, chunks_of, chunk<T>, stage_x, copy_*,
// lds128_at and smem_address come from cuda_w4.cu), then cuda_w4.cu's w4_mma as w4_mma_ring
// calling product_staged_ring, then one RING_ENTRY line per build. The MMAs, their order and
// their operands are product_staged's: the same bits as the staged entries.

__device__ __forceinline__ void copy_async16(u32 dst, const void* src) {   // streamed once: L2 only
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void copy_async8(u32 dst, const void* src) {    // shared by a lane quad: L1
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ U2 lds64_at(u32 a) {
  U2 r;
  asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "r"(a));
  return r;
}

// One ring stage: the block's activations for S chunks (product_staged's x stage: 8T token rows of
// S * 64 + 8 halves), then the codes of 8 warps x S chunks x 32 lanes x 16 bytes, then the group
// pairs of 8 warps x S chunks x 32 lanes x 8 bytes (ring_bench.py: ring_shared_bytes).
template <int T, int S>
struct RingStage {
  static constexpr int ROW = S * 64 + 8;
  static constexpr int X_BYTES = 8 * T * ROW * 2;
  static constexpr int CODE_BYTES = 8 * S * 32 * 16;
  static constexpr int PAIR_BYTES = 8 * S * 32 * 8;
  static constexpr int BYTES = X_BYTES + CODE_BYTES + PAIR_BYTES;
  static_assert(X_BYTES % 16 == 0 && BYTES % 16 == 0, "16-byte aligned regions");
};

// The copies of the stage of chunks c_first .. c_first + S - 1 into buf: activations by the whole
// block (stage_x), the thread's own codes and group pair of each chunk inside the slice (f walks
// the chunks in order, as Chunks::get does); no commit.
template <int T, int S>
__device__ __forceinline__ void ring_issue(u32 buf, Chunks& f, const u16* x, int M, int ldx, int tok0, int c_first,
                                           int c_end, u32 own_code, u32 own_pair) {
  using RS = RingStage<T, S>;
  if (c_first >= c_end) return;
  stage_x<T, S, 256>(buf, x, M, ldx, tok0, c_first, c_end);
#pragma unroll
  for (int p = 0; p < S; p++)
    if (c_first + p < c_end) {
      copy_async16(buf + RS::X_BYTES + own_code + p * 32 * 16, f.a);
      copy_async8(buf + RS::X_BYTES + RS::CODE_BYTES + own_pair + p * 32 * 8, f.pair());
      f.advance();
    }
}

// CS stages in dynamic shared memory, CS - 1 in flight: one commit group per stage (empty past the
// slice), so waiting for all but the newest CS - 2 groups means "this stage has landed". One
// barrier per stage: after it every thread's copies of this stage are visible to the block, and
// every warp has finished the previous stage, whose buffer the copies issued next overwrite.
template <int T, int S, int CS>
__device__ __forceinline__ void product_staged_ring(float (*acc)[4], PARAMS, int rt, int tok0, int c_begin, int c_end) {
  static_assert(CS >= 3, "CS == 2 would need a second barrier per stage (product_staged's)");
  using RS = RingStage<T, S>;
  constexpr int ROW = RS::ROW;
  extern __shared__ __align__(16) unsigned char ring_smem[];
  const u32 base = smem_address(ring_smem), end = base + CS * RS::BYTES;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  // the thread's slots within a stage's code and pair regions (chunk p: + p * 32 slots)
  const u32 own_code = (u32)(warp * S * 32 + lane) * 16u, own_pair = (u32)(warp * S * 32 + lane) * 8u;
  Chunks f = chunks_of(ARGS, rt, c_begin);
#pragma unroll
  for (int s = 0; s < CS - 1; s++) {
    ring_issue<T, S>(base + s * RS::BYTES, f, x, M, ldx, tok0, c_begin + s * S, c_end, own_code, own_pair);
    copy_commit();
  }
  u32 rd = base, wr = base + (CS - 1) * RS::BYTES;   // this stage's buffer; the one stage + CS - 1 fills
  for (int c0 = c_begin; c0 < c_end; c0 += S) {
    copy_wait<CS - 2>();
    __syncthreads();
    ring_issue<T, S>(wr, f, x, M, ldx, tok0, c0 + (CS - 1) * S, c_end, own_code, own_pair);
    copy_commit();
    U4 a[S];
    U2 pair[S];
#pragma unroll
    for (int p = 0; p < S; p++)
      if (c0 + p < c_end) {
        a[p] = lds128_at(rd + RS::X_BYTES + own_code + p * 32 * 16);
        pair[p] = lds64_at(rd + RS::X_BYTES + RS::CODE_BYTES + own_pair + p * 32 * 8);
      }
    const u32 xrow = rd + 2 * (g * ROW + 16 * t);
#pragma unroll
    for (int p = 0; p < S; p++) {
      if (c0 + p < c_end) {
        U4 xa[T], xb[T];
#pragma unroll
        for (int tt = 0; tt < T; tt++) {
          xa[tt] = lds128_at(xrow + 2 * (tt * 8 * ROW + p * 64));
          xb[tt] = lds128_at(xrow + 2 * (tt * 8 * ROW + p * 64 + 8));
        }
        chunk<T>(acc, a[p], pair[p], xa, xb);
      }
    }
    wr = rd;                                       // the stage just read is the next one filled
    rd = rd + RS::BYTES == end ? base : rd + RS::BYTES;
  }
}

// the dynamic shared memory is ring_bench.py's ring_shared_bytes(T, S, CS)
#define RING_ENTRY(T, S, CS, BLOCKS)                                                             \
  extern "C" __global__ void __launch_bounds__(256, BLOCKS) w4_ring_t##T##_s##S##_c##CS(PARAMS) {  \
    w4_mma_ring<T, false, S, 0, false, CS>(ARGS);                                                \
  }
