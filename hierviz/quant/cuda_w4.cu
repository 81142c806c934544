// The CUDA MMA W4 kernel: y = x @ W.T for fp16 activations (hierviz/quant/cuda_w4.py holds its
// weight layout, its launch and which products it serves; docs/kernels.md, "The CUDA MMA variant").
// NVRTC compiles it at run time: cuda_w4.kernel_source() defines NBUF and ROWS_PER_BLOCK
// before this text and adds one DIRECT_[ROWS_|KW_][GROUP_]ENTRY / STAGED_ENTRY / WGMMA_ENTRY line per
// build after it (cuda_w4.DIRECT_BUILD, DIRECT_ROWS_BUILD, K_WARP_BUILD, PAIR_GROUPS, STAGED_BUILD,
// WGMMA_BUILD on sm_90a).

typedef unsigned int u32;
typedef unsigned short u16;
struct __align__(16) U4 { u32 x, y, z, w; };
struct __align__(8) U2 { u32 x, y; };

__device__ __forceinline__ U4 load_codes(const U4* p) {   // streamed once: keep it out of L1
  U4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ U4 load_x(const U4* p) {       // reread by the block's 8 warps: L1
  U4 r;
  asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ U2 load_pair(const U2* p) {    // the (scale, offset) pairs of rows g, g + 8
  U2 r;
  asm("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}
__device__ __forceinline__ u32 lop3_and_or(u32 a, u32 b, u32 c) {   // (a & b) | c
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
  u32 d;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
  u32 d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ u32 prmt(u32 a, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %1, %2;" : "=r"(d) : "r"(a), "r"(sel));
  return d;
}
__device__ __forceinline__ float h2f(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ u16 f2h(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One MMA step's A fragment: the lane's 8 codes of word w (rows g, g+8) dequantized exactly to q,
// then s * q + o in one packed FMA per pair.
__device__ __forceinline__ void dequant(u32* a, u32 w, u32 sg, u32 og, u32 sh, u32 oh) {
  const u32 MAGIC = 0x64006400u, LO = 0x000f000fu, HI = 0x00f000f0u;
  const u32 w8 = w >> 8;
  a[0] = hsub2(lop3_and_or(w, LO, MAGIC), MAGIC);                 // 1024 + q   - 1024
  a[1] = hfma2(lop3_and_or(w, HI, MAGIC), 0x2c002c00u, 0xd400d400u);  // (1024 + 16q) / 16 - 64
  a[2] = hsub2(lop3_and_or(w8, LO, MAGIC), MAGIC);
  a[3] = hfma2(lop3_and_or(w8, HI, MAGIC), 0x2c002c00u, 0xd400d400u);
  a[0] = hfma2(a[0], sg, og);
  a[1] = hfma2(a[1], sh, oh);
  a[2] = hfma2(a[2], sg, og);
  a[3] = hfma2(a[3], sh, oh);
}
// One MMA step times T token tiles.
template <int T>
__device__ __forceinline__ void step(float (*acc)[4], u32 w, u32 sg, u32 og, u32 sh, u32 oh,
                                     const u32* b0, const u32* b1) {
  u32 a[4];
  dequant(a, w, sg, og, sh, oh);
#pragma unroll
  for (int tt = 0; tt < T; tt++) mma(acc[tt], a[0], a[1], a[2], a[3], b0[tt], b1[tt]);
}

__device__ __forceinline__ u32 smem_address(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void copy_async_zfill_to(u32 dst, const void* src, int bytes) {   // bytes 0: zeros
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void copy_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
__device__ __forceinline__ U4 lds128_at(u32 a) {
  U4 r;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(a));
  return r;
}

#define PARAMS const U4* __restrict__ codes, const U2* __restrict__ so, const u16* __restrict__ x, \
    u16* y, const u16* residual, float* partials, int* counters, int M, int N, int K, int ldx, int ldy, \
    int chunks_per_slice, int n_groups, int group_shift, int split, long long tile_stride
#define ARGS codes, so, x, y, residual, partials, counters, M, N, K, ldx, ldy, chunks_per_slice, n_groups, \
    group_shift, split, tile_stride

// The staged loop's codes and group pair (rows g, g + 8) of the lane's row tile, chunk after
// chunk from the slice's first: the addresses advance rather than being recomputed per chunk.
struct Chunks {
  const U4* a;         // the lane's 16 bytes of the next chunk (a chunk: 32 words of a tile)
  const U2* pairs;     // the pair of rows (g, g + 8) of group 0
  int k, group_shift;  // the next chunk's first channel of the lane's 16
  __device__ __forceinline__ const U2* pair() const { return pairs + ((u32)k >> group_shift) * 8u; }
  __device__ __forceinline__ void advance() { a += 32; k += 64; }
  __device__ __forceinline__ void get(U4& a_out, U2& so_out) {
    a_out = load_codes(a);
    so_out = load_pair(pair());
    advance();
  }
  // the first S chunks of the slice from c_begin (those inside it) into a ring of S
  template <int S>
  __device__ __forceinline__ void fill(U4* ring, U2* ring_so, int c_begin, int c_end) {
#pragma unroll
    for (int p = 0; p < S; p++)
      if (c_begin + p < c_end) get(ring[p], ring_so[p]);
  }
};

__device__ __forceinline__ Chunks chunks_of(PARAMS, int rt, int c_begin) {
  const int lane = threadIdx.x & 31;
  Chunks f;
  f.a = codes + rt * tile_stride + c_begin * 32 + lane;
  f.pairs = so + (size_t)rt * n_groups * 8 + (lane >> 2);
  f.k = c_begin * 64 + 16 * (lane & 3);
  f.group_shift = group_shift;
  return f;
}

// The four MMA steps of one 64-channel chunk; xa, xb: the lane's 16 channels of each token tile.
template <int T>
__device__ __forceinline__ void chunk(float (*acc)[4], const U4& a, U2 pair, const U4* xa, const U4* xb) {
  const u32 sg = prmt(pair.x, 0x1010u), og = prmt(pair.x, 0x3232u);
  const u32 sh = prmt(pair.y, 0x1010u), oh = prmt(pair.y, 0x3232u);
  u32 b0[T], b1[T];
#pragma unroll
  for (int tt = 0; tt < T; tt++) { b0[tt] = xa[tt].x; b1[tt] = xa[tt].y; }
  step<T>(acc, a.x, sg, og, sh, oh, b0, b1);
#pragma unroll
  for (int tt = 0; tt < T; tt++) { b0[tt] = xa[tt].z; b1[tt] = xa[tt].w; }
  step<T>(acc, a.y, sg, og, sh, oh, b0, b1);
#pragma unroll
  for (int tt = 0; tt < T; tt++) { b0[tt] = xb[tt].x; b1[tt] = xb[tt].y; }
  step<T>(acc, a.z, sg, og, sh, oh, b0, b1);
#pragma unroll
  for (int tt = 0; tt < T; tt++) { b0[tt] = xb[tt].z; b1[tt] = xb[tt].w; }
  step<T>(acc, a.w, sg, og, sh, oh, b0, b1);
}

// The lane's 16 channels of chunk c0 + s for each token tile (xp: chunk c0's, per tile).
template <int T>
__device__ __forceinline__ void load_tiles(U4* xa, U4* xb, const U4* const* xp, int s) {
#pragma unroll
  for (int tt = 0; tt < T; tt++) { xa[tt] = load_x(xp[tt] + s * 8); xb[tt] = load_x(xp[tt] + s * 8 + 1); }
}
template <int T, int AHEAD>
__device__ __forceinline__ int advance_tiles(const U4** xp) {
#pragma unroll
  for (int tt = 0; tt < T; tt++) xp[tt] += AHEAD * 8;
  return 0;
}

// Few token tiles: activations straight from global memory (L1); codes and group pairs AHEAD
// chunks ahead in registers: no shared memory, no barrier. At one token the loop is bound by
// instruction issue (docs/kernels.md), so it is unrolled by that depth (every register named at
// compile time), the tile-major codes make every code address a constant offset from one pointer,
// and while every refill lies inside the slice the loads carry no predicate (a predicated load
// makes the compiler copy the register it may not overwrite).
//
// GC > 0: groups of GC chunks (64 * GC channels), the slice starting on a group and AHEAD a
// multiple of GC, so every group-pair address is a constant offset from one pointer as well
// (GC = 0: any group size, the pair address computed per chunk from the channel index).
// R: row tiles per warp (rt0 .. rt0 + R - 1, acc[r * T + tt]): each activation load serves R MMAs,
// which is what bounds the loop from a few token tiles on; every element's MMA chain is unchanged.
// XA: the steady loop holds the next chunk's activations while it multiplies this one's, so no
// chunk's MMAs wait on their own loads, across the loop's back edge too (8T registers more).
template <int T, int AHEAD, int GC, int R, bool XA>
__device__ __forceinline__ void product_direct(float (*acc)[4], PARAMS, int rt0, int tok0, int c_begin, int c_end) {
  static_assert(GC == 0 || AHEAD % GC == 0, "a look-ahead of whole groups");
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const U4* ap[R];                    // chunk c0's word of each row tile (32 words a chunk)
  const U2* pairs[R];
  const U2* pp[R];                    // chunk c0's group pair of each row tile (GC > 0)
#pragma unroll
  for (int r = 0; r < R; r++) {
    // a second tile past N multiplies the last tile again and stores nothing
    const int rt = R == 1 ? rt0 : min(rt0 + r, (N >> 4) - 1);
    ap[r] = codes + rt * tile_stride + c_begin * 32 + lane;
    pairs[r] = so + (size_t)rt * n_groups * 8 + g;
    pp[r] = pairs[r] + (GC ? c_begin / GC : 0) * 8;
  }
  int k0 = c_begin * 64 + 16 * t;                                     // chunk c0's first channel of the lane's 16
  // the pair of row tile r for chunk c0 + j (k: its first channel of the lane's 16)
#define PAIR_AT(r, k, j) (GC ? pp[r] + ((j) / (GC ? GC : 1)) * 8 : pairs[r] + ((u32)(k) >> group_shift) * 8u)
#define ADVANCE_RING()                                                                           \
  {                                                                                              \
    _Pragma("unroll") for (int r = 0; r < R; r++) {                                             \
      ap[r] += AHEAD * 32;                                                                       \
      pp[r] += (GC ? AHEAD / (GC ? GC : 1) : 0) * 8;                                             \
    }                                                                                            \
    k0 += AHEAD * 64;                                                                            \
    advance_tiles<T, AHEAD>(xp);                                                                 \
  }
  // chunk c0 + s of every row tile from the ring, refilled (if REFILL) with chunk c0 + s + AHEAD
#define CHUNK_STEP(s, REFILL, XN)                                                                  \
  {                                                                                              \
    U4 a[R];                                                                                     \
    U2 pair[R];                                                                                  \
    _Pragma("unroll") for (int r = 0; r < R; r++) {                                             \
      a[r] = ring[r][s];                                                                         \
      pair[r] = ring_p[r][s];                                                                    \
      if (REFILL) {                                                                              \
        ring[r][s] = load_codes(ap[r] + ((s) + AHEAD) * 32);                                     \
        ring_p[r][s] = load_pair(PAIR_AT(r, k0 + ((s) + AHEAD) * 64, (s) + AHEAD));              \
      }                                                                                          \
    }                                                                                            \
    U4 xa[T], xb[T];                                                                             \
    if (XN) {                      /* this chunk's activations came a chunk ahead; load the next */ \
      _Pragma("unroll") for (int tt = 0; tt < T; tt++) { xa[tt] = xn[tt]; xb[tt] = xbn[tt]; }     \
      load_tiles<T>(xn, xbn, xp, (s) + 1);                                                       \
    } else {                                                                                     \
      load_tiles<T>(xa, xb, xp, s);                                                              \
    }                                                                                            \
    _Pragma("unroll") for (int r = 0; r < R; r++) chunk<T>(acc + r * T, a[r], pair[r], xa, xb);   \
  }
  U4 ring[R][AHEAD];
  U2 ring_p[R][AHEAD];
#pragma unroll
  for (int s = 0; s < AHEAD; s++)
    if (c_begin + s < c_end)
#pragma unroll
      for (int r = 0; r < R; r++) {
        ring[r][s] = load_codes(ap[r] + s * 32);
        ring_p[r][s] = load_pair(PAIR_AT(r, k0 + s * 64, s));
      }
  // tokens past M multiply token M - 1's activations: an MMA column depends on its own column
  // only, and those columns are never stored
  const U4* xp[T];
#pragma unroll
  for (int tt = 0; tt < T; tt++)
    xp[tt] = (const U4*)(x + (size_t)min(tok0 + 8 * tt + g, M - 1) * ldx + (size_t)c_begin * 64 + 16 * t);
  int c0 = c_begin;
  U4 xn[T], xbn[T];          // XA: the next chunk's activations
  if (XA && c0 + 2 * AHEAD <= c_end) load_tiles<T>(xn, xbn, xp, 0);
  for (; c0 + 2 * AHEAD <= c_end; c0 += AHEAD) {
#pragma unroll
    for (int s = 0; s < AHEAD; s++) CHUNK_STEP(s, true, XA)
    ADVANCE_RING()
  }
  if (c0 + AHEAD == c_end) {      // the usual end (slices of whole rings): the ring drains, no loads
#pragma unroll
    for (int s = 0; s < AHEAD; s++) {
      U4 xa[T], xb[T];
      load_tiles<T>(xa, xb, xp, s);
#pragma unroll
      for (int r = 0; r < R; r++) chunk<T>(acc + r * T, ring[r][s], ring_p[r][s], xa, xb);
    }
    return;
  }
  for (; c0 < c_end; c0 += AHEAD) {
#pragma unroll
    for (int s = 0; s < AHEAD; s++)
      if (c0 + s < c_end) CHUNK_STEP(s, c0 + s + AHEAD < c_end, false)
    ADVANCE_RING()
  }
#undef CHUNK_STEP
#undef ADVANCE_RING
#undef PAIR_AT
}

// x[tok0 .. tok0 + 8T, chunks c_first .. c_first + S) into buf (rows of S * 64 + 8 halves: the pad
// puts the 8 token rows of a load on different banks), tokens past M and chunks past the slice as
// zeros, with asynchronous copies (THREADS threads, 16 bytes each per step); no commit.
template <int T, int S, int THREADS>
__device__ __forceinline__ void stage_x(u32 buf, const u16* x, int M, int ldx, int tok0, int c_first, int c_end) {
  constexpr int PER_ROW = S * 8, ROW = S * 64 + 8, TOTAL = 8 * T * PER_ROW, ROWS_PER_PASS = THREADS / PER_ROW;
  // a thread copies the same 16 bytes of every ROWS_PER_PASS-th token row: its column and the
  // column's bounds once, a compile-time count of copies (no division or loop per copy)
  const int u = (int)(threadIdx.x % PER_ROW), row0 = (int)(threadIdx.x / PER_ROW);
  const bool c_ok = c_first + u / 8 < c_end;
  const u16* col = x + (size_t)c_first * 64 + u * 8;
#pragma unroll
  for (int i = 0; i < (TOTAL + THREADS - 1) / THREADS; i++) {
    const int row = row0 + i * ROWS_PER_PASS;
    if (TOTAL % THREADS == 0 || row < 8 * T) {
      const bool ok = c_ok && tok0 + row < M;
      copy_async_zfill_to(buf + 2 * (row * ROW + u * 8), ok ? col + (size_t)(tok0 + row) * ldx : x, ok ? 16 : 0);
    }
  }
}

// More tokens: the block's warps share each stage of S chunks of activations through shared
// memory (asynchronous copies, NBUF stages in flight); codes and group pairs one stage ahead.
template <int T, int S>
__device__ __forceinline__ void product_staged(float (*acc)[4], PARAMS, int rt, int tok0, int c_begin, int c_end) {
  constexpr int ROW = S * 64 + 8;
  constexpr int STAGE_BYTES = 8 * T * ROW * 2;
  __shared__ __align__(16) u16 xs[NBUF][8 * T * ROW];
  const u32 xs_at = smem_address(&xs[0][0]);   // shared addresses as 32-bit offsets: no conversion per load
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  Chunks f = chunks_of(ARGS, rt, c_begin);
  U4 ring[S];
  U2 ring_so[S];
  f.template fill<S>(ring, ring_so, c_begin, c_end);
  // one commit group per stage, empty ones past the slice, so waiting for all but the newest
  // NBUF - 1 groups always means "this stage has landed"
#pragma unroll
  for (int s = 0; s < NBUF - 1; s++) {
    if (c_begin + s * S < c_end) stage_x<T, S, 256>(xs_at + s * STAGE_BYTES, x, M, ldx, tok0, c_begin + s * S, c_end);
    copy_commit();
  }
  int stage = 0;
  for (int c0 = c_begin; c0 < c_end; c0 += S, stage++) {
    const int ahead = c0 + (NBUF - 1) * S;
    if (ahead < c_end)
      stage_x<T, S, 256>(xs_at + ((stage + NBUF - 1) % NBUF) * STAGE_BYTES, x, M, ldx, tok0, ahead, c_end);
    copy_commit();
    copy_wait<NBUF - 1>();
    __syncthreads();
    const u32 xrow = xs_at + (stage % NBUF) * STAGE_BYTES + 2 * (g * ROW + 16 * t);
#pragma unroll
    for (int p = 0; p < S; p++) {
      const int c = c0 + p;
      if (c < c_end) {
        const U4 a = ring[p];
        const U2 pair = ring_so[p];
        if (c + S < c_end) f.get(ring[p], ring_so[p]);   // chunks in order: c + S
        U4 xa[T], xb[T];
#pragma unroll
        for (int tt = 0; tt < T; tt++) {
          xa[tt] = lds128_at(xrow + 2 * (tt * 8 * ROW + p * 64));
          xb[tt] = lds128_at(xrow + 2 * (tt * 8 * ROW + p * 64 + 8));
        }
        chunk<T>(acc, a, pair, xa, xb);
      }
    }
    __syncthreads();     // the buffer just read is one the copies of a later stage overwrite
  }
}

// ---- the wgmma staged loop (sm_90a) ---------------------------------------------------------------
// The same chunks, steps and group pairs as the staged loop, the block's two warpgroups each
// issuing one wgmma.m64nNk16 per MMA step (N = 8T tokens) with A from registers (each warp's
// fragment is the one the mma.sync loops dequantize) and the tokens in shared memory. A k16 step's
// 16 k slots hold the channels the mma.sync step takes (slot 2t + u of core matrix kk: channel
// 16t + 4j + 2kk + u of the chunk), so every product and every accumulation is the mma.sync
// chain's: the same bits (scripts/wgmma_probe.py measured wgmma against mma.sync).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ACC4(j) "+f"(acc[j][0]), "+f"(acc[j][1]), "+f"(acc[j][2]), "+f"(acc[j][3])
// acc[j][i] is the m64nN accumulator's d[4j + i]: row 16 * (warp % 4) + g + 8 * (i >> 1) of the
// warpgroup's 64, token 8j + 2t + (i & 1): the layout of the mma.sync loops' acc[tt][i].
template <int T>
__device__ __forceinline__ void wgmma_step(float (*acc)[4], const u32* a, unsigned long long desc) {
  if constexpr (T == 4)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
                 : ACC4(0), ACC4(1), ACC4(2), ACC4(3)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1) : "memory");
  if constexpr (T == 5)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %25, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n40k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19}, {%20,%21,%22,%23}, %24, p, 1, 1, 0;\n}\n"
                 : ACC4(0), ACC4(1), ACC4(2), ACC4(3), ACC4(4)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1) : "memory");
  if constexpr (T == 6)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n48k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23}, {%24,%25,%26,%27}, %28, p, 1, 1, 0;\n}\n"
                 : ACC4(0), ACC4(1), ACC4(2), ACC4(3), ACC4(4), ACC4(5)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1) : "memory");
  if constexpr (T == 7)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %33, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n56k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27}, {%28,%29,%30,%31}, %32, p, 1, 1, 0;\n}\n"
                 : ACC4(0), ACC4(1), ACC4(2), ACC4(3), ACC4(4), ACC4(5), ACC4(6)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1) : "memory");
  if constexpr (T == 8)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
                 : ACC4(0), ACC4(1), ACC4(2), ACC4(3), ACC4(4), ACC4(5), ACC4(6), ACC4(7)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1) : "memory");
}
#undef ACC4
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
// keeps the compiler from moving the accumulators while a wgmma may still write them
template <int T> __device__ __forceinline__ void hold(float (*acc)[4]) {
#pragma unroll
  for (int j = 0; j < T; j++)
#pragma unroll
    for (int i = 0; i < 4; i++) asm volatile("" : "+f"(acc[j][i]) :: "memory");
}
// the same for a wgmma's A fragment: its registers stay live (unreused) until the wait that retires it
template <int N> __device__ __forceinline__ void hold_regs(u32* r) {
#pragma unroll
  for (int i = 0; i < N; i++) asm volatile("" : "+r"(r[i]) :: "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void sts128_at(u32 a, u32 x, u32 y, u32 z, u32 w) {
  asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" :: "r"(a), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}
// the operand descriptor of tokens at shared address a: K-major core matrices (8 tokens x 8 k slots,
// 128 bytes), no swizzle; LBO 128 (a step's second 8 slots), SBO 256 (the next 8 tokens)
__device__ __forceinline__ unsigned long long x_descriptor(u32 a) {
  return (unsigned long long)((a & 0x3FFFF) >> 4) | (8ull << 16) | (16ull << 32);
}

// A stage: S chunks x 4 steps x T token blocks x 2 core matrices; a thread's share of it (one unit:
// a token's 8h .. 8h + 7 channels of each lane quarter t of one chunk, 4 x 16 bytes) is loaded into
// registers a stage before it is stored, so the loads' latency hides behind a stage of MMAs.
template <int T, int S>
struct XStage {
  static constexpr int UNITS = 16 * T * S, PER = (UNITS + 255) / 256;
  U4 v[PER][4];
  // the first of unit u's four pieces: tokens past M read token M - 1 (their columns are never
  // stored), chunks past the slice its last (never multiplied): every load in bounds, none predicated
  static __device__ __forceinline__ const U4* source(int u, const u16* x, int M, int ldx, int tok0, int c_first,
                                                     int c_end) {
    const int r = u % (8 * T), ph = u / (8 * T);
    return (const U4*)(x + (size_t)min(tok0 + r, M - 1) * ldx + (size_t)min(c_first + (ph >> 1), c_end - 1) * 64
                       + 8 * (ph & 1));
  }
  __device__ __forceinline__ void load(const u16* x, int M, int ldx, int tok0, int c_first, int c_end) {
#pragma unroll
    for (int i = 0; i < PER; i++) {
      const U4* src = source((int)threadIdx.x + 256 * i, x, M, ldx, tok0, c_first, c_end);
#pragma unroll
      for (int t = 0; t < 4; t++) v[i][t] = load_x(src + 2 * t);
    }
  }
  // the same bytes by asynchronous copies into the thread's own slot (its 16-byte pieces 4096 bytes
  // apart, so a warp's accesses are contiguous), then back into v once they have landed
  static constexpr int SLOT_BYTES = PER * 4 * 256 * 16;
  __device__ __forceinline__ void copy(u32 slot, const u16* x, int M, int ldx, int tok0, int c_first, int c_end) const {
#pragma unroll
    for (int i = 0; i < PER; i++) {
      const int u = (int)threadIdx.x + 256 * i;
      const U4* src = source(u, x, M, ldx, tok0, c_first, c_end);
      if (UNITS % 256 == 0 || u < UNITS)
#pragma unroll
        for (int t = 0; t < 4; t++) copy_async_zfill_to(slot + ((i * 4 + t) * 256 + threadIdx.x) * 16, src + 2 * t, 16);
    }
  }
  __device__ __forceinline__ void land(u32 slot) {
#pragma unroll
    for (int i = 0; i < PER; i++)
#pragma unroll
      for (int t = 0; t < 4; t++) v[i][t] = lds128_at(slot + ((i * 4 + t) * 256 + threadIdx.x) * 16);
  }
  // lane quarter t's words 0..3 are k slots 2t, 2t + 1 of (step 2h, core 0), (2h, 1), (2h + 1, 0), (2h + 1, 1)
  __device__ __forceinline__ void store(u32 buf) const {
#pragma unroll
    for (int i = 0; i < PER; i++) {
      const int u = (int)threadIdx.x + 256 * i, r = u % (8 * T), ph = u / (8 * T);
      if (UNITS % 256 == 0 || u < UNITS) {
        const u32 at = buf + (((ph >> 1) * 4 + 2 * (ph & 1)) * T + r / 8) * 256 + (r % 8) * 16;
        sts128_at(at, v[i][0].x, v[i][1].x, v[i][2].x, v[i][3].x);
        sts128_at(at + 128, v[i][0].y, v[i][1].y, v[i][2].y, v[i][3].y);
        sts128_at(at + T * 256, v[i][0].z, v[i][1].z, v[i][2].z, v[i][3].z);
        sts128_at(at + T * 256 + 128, v[i][0].w, v[i][1].w, v[i][2].w, v[i][3].w);
      }
    }
  }
};

// Two stages of S chunks in the wgmma layout in dynamic shared memory; the activations of the stage
// after them either in registers (XRING 0: loaded a stage before they are stored) or in XRING slots
// of asynchronous copies after the two stages (each thread copies and rearranges its own pieces, so
// no barrier between). Codes and group pairs a stage ahead in registers (as the staged loop);
// fragments double-buffered, so a chunk's dequantization overlaps the previous chunk's wgmmas. The
// next stage is stored at the end of each stage into the other buffer, whose wgmmas every
// warpgroup retired before the last barrier.
template <int T, int S, int XRING>
__device__ __forceinline__ void product_wgmma(float (*acc)[4], PARAMS, int rt, int tok0, int c_begin, int c_end) {
  static_assert(S % 2 == 0, "fragments alternate within a stage");
  constexpr int STAGE_BYTES = S * 4 * T * 256;
  extern __shared__ __align__(128) unsigned char xs_wgmma[];
  const u32 xs_at = smem_address(xs_wgmma), slots_at = xs_at + 2 * STAGE_BYTES;
  using XS = XStage<T, S>;
  Chunks f = chunks_of(ARGS, rt, c_begin);
  U4 ring[S];
  U2 ring_so[S];
  f.fill<S>(ring, ring_so, c_begin, c_end);
  XS st;
  if constexpr (XRING == 0) {
    st.load(x, M, ldx, tok0, c_begin, c_end);
    st.store(xs_at);
    if (c_begin + S < c_end) st.load(x, M, ldx, tok0, c_begin + S, c_end);
  } else {
#pragma unroll
    for (int s = 0; s < XRING; s++) {   // one commit group per stage, empty past the slice
      if (c_begin + s * S < c_end) st.copy(slots_at + s * XS::SLOT_BYTES, x, M, ldx, tok0, c_begin + s * S, c_end);
      copy_commit();
    }
    copy_wait<XRING - 1>();
    st.land(slots_at);
    st.store(xs_at);
  }
  fence_proxy_async();
  __syncthreads();
  u32 frag[2][16];
#pragma unroll
  for (int i = 0; i < 16; i++) frag[0][i] = frag[1][i] = 0u;
  int stage = 0;
  for (int c0 = c_begin; c0 < c_end; c0 += S, stage++) {
    const u32 buf = xs_at + (stage & 1) * STAGE_BYTES;
    if constexpr (XRING > 0) {         // stage + XRING into the slot this stage's activations left
      if (c0 + XRING * S < c_end)
        st.copy(slots_at + (stage % XRING) * XS::SLOT_BYTES, x, M, ldx, tok0, c0 + XRING * S, c_end);
      copy_commit();
    }
#pragma unroll
    for (int p = 0; p < S; p++) {
      const int c = c0 + p;
      if (c < c_end) {
        const U4 a = ring[p];
        const U2 pair = ring_so[p];
        if (c + S < c_end) f.get(ring[p], ring_so[p]);
        const u32 sg = prmt(pair.x, 0x1010u), og = prmt(pair.x, 0x3232u);
        const u32 sh = prmt(pair.y, 0x1010u), oh = prmt(pair.y, 0x3232u);
        wgmma_wait<1>();             // the wgmmas that read frag[p % 2] (two chunks back) are done
        hold<T>(acc);
        u32* fr = frag[p % 2];
        hold_regs<16>(fr);
        dequant(fr, a.x, sg, og, sh, oh);
        dequant(fr + 4, a.y, sg, og, sh, oh);
        dequant(fr + 8, a.z, sg, og, sh, oh);
        dequant(fr + 12, a.w, sg, og, sh, oh);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < 4; j++) wgmma_step<T>(acc, fr + 4 * j, x_descriptor(buf + (p * 4 + j) * T * 256));
        wgmma_commit();
      }
    }
    if (c0 + S < c_end) {
      if constexpr (XRING == 0) {
        st.store(xs_at + ((stage + 1) & 1) * STAGE_BYTES);
        if (c0 + 2 * S < c_end) st.load(x, M, ldx, tok0, c0 + 2 * S, c_end);
      } else {
        copy_wait<XRING - 1>();        // this thread's copies of stage + 1 have landed
        st.land(slots_at + ((stage + 1) % XRING) * XS::SLOT_BYTES);
        st.store(xs_at + ((stage + 1) & 1) * STAGE_BYTES);
      }
    }
    fence_proxy_async();
    wgmma_wait<0>();
    hold<T>(acc);
    __syncthreads();
  }
  wgmma_wait<0>();
  hold<T>(acc);
  hold_regs<16>(frag[0]);
  hold_regs<16>(frag[1]);
}
#endif

// Every loop runs the same MMAs in the same order for a given token, so its bits do not depend on
// which one ran (or on M). Then: one slice: store; else fp32 partials, and the last block of the
// output tile sums them in slice order.
// KW: warps per row tile in a direct entry, each multiplying a part of the slice's chunks (whole
// rounds of 4), their sums met in shared memory in part order before the slices meet: more warps
// per block with the same K slices (other bits than KW = 1's: a sum of fixed order per shape).
template <int T, bool DIRECT, int S, int GC = 0, bool WGMMA = false, int XRING = 0, int R = 1, bool XA = false,
          int KW = 1>
__device__ __forceinline__ void w4_mma(PARAMS) {
  static_assert(DIRECT || R == 1, "one row tile per warp in the staged loops");
  static_assert(DIRECT || KW == 1, "one warp per row tile in the staged loops");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int tok0 = blockIdx.x * (8 * T);
  const int row_tiles = N >> 4, chunks = K >> 6;
  const int kh = KW == 1 ? 0 : warp / (8 / R);   // the warp's part of the slice (KW parts)
  const int rt = blockIdx.y * 8 + (KW == 1 ? warp : warp % (8 / R)) * R;   // its first row tile (8 / R warps a part)
  const int slice = blockIdx.z;
  const int c_begin = slice * chunks_per_slice;
  const int c_end = min(chunks, c_begin + chunks_per_slice);
  float acc[R * T][4];
#pragma unroll
  for (int tt = 0; tt < R * T; tt++) acc[tt][0] = acc[tt][1] = acc[tt][2] = acc[tt][3] = 0.f;
  // a warp past N idles in its loop (the staged loop's barriers need every warp) and stores nothing
  if (DIRECT) {
    const int part = KW == 1 ? 0 : ((c_end - c_begin + KW - 1) / KW + 3) / 4 * 4;
    const int p_begin = KW == 1 ? c_begin : min(c_end, c_begin + kh * part);
    const int p_end = KW == 1 ? c_end : min(c_end, p_begin + part);
    if (rt < row_tiles) product_direct<T, S, GC, R, XA>(acc, ARGS, rt, tok0, p_begin, p_end);
    if constexpr (KW > 1) {
      constexpr int PART_THREADS = 256 / R, VALUES = R * T * 4;
      __shared__ float parts_sum[(KW - 1) * PART_THREADS * VALUES];
      const int me = threadIdx.x % PART_THREADS;
      if (kh > 0)
#pragma unroll
        for (int v = 0; v < VALUES; v++) parts_sum[((kh - 1) * VALUES + v) * PART_THREADS + me] = acc[v / 4][v % 4];
      __syncthreads();
      if (kh == 0)
        for (int p = 0; p < KW - 1; p++)
#pragma unroll
          for (int v = 0; v < VALUES; v++) acc[v / 4][v % 4] += parts_sum[(p * VALUES + v) * PART_THREADS + me];
    }
  } else if constexpr (WGMMA) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    product_wgmma<T, S, XRING>(acc, ARGS, min(rt, row_tiles - 1), tok0, c_begin, c_end);
#endif
  } else {
    product_staged<T, S>(acc, ARGS, min(rt, row_tiles - 1), tok0, c_begin, c_end);
  }
  // acc[r * T + tt][i]: row (rt + r)*16 + g + 8*(i >> 1), token tok0 + tt*8 + 2t + (i & 1)
  if (split == 1) {
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
      for (int tt = 0; tt < T; tt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
          const int tok = tok0 + tt * 8 + 2 * t + (i & 1), n = (rt + r) * 16 + g + 8 * (i >> 1);
          if (tok < M && rt + r < row_tiles && kh == 0) {
            float v = acc[r * T + tt][i];
            if (residual) v += h2f(residual[(size_t)tok * ldy + n]);
            y[(size_t)tok * ldy + n] = f2h(v);
          }
        }
    return;
  }
#pragma unroll
  for (int r = 0; r < R; r++)
#pragma unroll
    for (int tt = 0; tt < T; tt++)
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const int tok = tok0 + tt * 8 + 2 * t + (i & 1), n = (rt + r) * 16 + g + 8 * (i >> 1);
        if (tok < M && rt + r < row_tiles && kh == 0) partials[((size_t)slice * M + tok) * N + n] = acc[r * T + tt][i];
      }
  // The last block of this output tile to finish sums the slices in slice order.
  __shared__ int last;
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
  __syncthreads();
  const int tile = blockIdx.y * gridDim.x + blockIdx.x;
  if (threadIdx.x == 0) last = atomicAdd(counters + tile, 1) == split - 1;
  __syncthreads();
  if (!last) return;
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
  const int rows = min(ROWS_PER_BLOCK, N - (int)blockIdx.y * ROWS_PER_BLOCK), toks = min(8 * T, M - tok0);
  for (int e = threadIdx.x; e < rows * toks; e += blockDim.x) {
    const int tok = tok0 + e / rows, n = blockIdx.y * ROWS_PER_BLOCK + e % rows;
    const float* p = partials + (size_t)tok * N + n;
    float v = 0.f;
    for (int s = 0; s < split; s++) v += __ldcg(p + (size_t)s * M * N);
    if (residual) v += h2f(residual[(size_t)tok * ldy + n]);
    y[(size_t)tok * ldy + n] = f2h(v);
  }
  if (threadIdx.x == 0) counters[tile] = 0;
}

// XA: 1 for the entries of cuda_w4.X_AHEAD_ENTRIES (activations a chunk ahead), else 0
#define DIRECT_ENTRY(T, AHEAD, BLOCKS, XA)                                                       \
  extern "C" __global__ void __launch_bounds__(256, BLOCKS) w4_direct_t##T(PARAMS) {               \
    w4_mma<T, true, AHEAD, 0, false, 0, 1, XA>(ARGS);                                            \
  }
#define DIRECT_GROUP_ENTRY(T, AHEAD, BLOCKS, G, XA)                                              \
  extern "C" __global__ void __launch_bounds__(256, BLOCKS) w4_direct_t##T##_g##G(PARAMS) {        \
    w4_mma<T, true, AHEAD, G / 64, false, 0, 1, XA>(ARGS);                                       \
  }
// R row tiles per warp: 8 / R warps a block, the same 128 rows, grid and K slices
#define DIRECT_ROWS_ENTRY(T, AHEAD, BLOCKS, R, XA)                                               \
  extern "C" __global__ void __launch_bounds__(256 / R, BLOCKS) w4_direct_t##T##_r##R(PARAMS) {    \
    w4_mma<T, true, AHEAD, 0, false, 0, R, XA>(ARGS);                                            \
  }
#define DIRECT_ROWS_GROUP_ENTRY(T, AHEAD, BLOCKS, R, G, XA)                                      \
  extern "C" __global__ void __launch_bounds__(256 / R, BLOCKS) w4_direct_t##T##_r##R##_g##G(PARAMS) { \
    w4_mma<T, true, AHEAD, G / 64, false, 0, R, XA>(ARGS);                                       \
  }
// KW warps per row tile (K_WARP_BUILD): 256 / R * KW threads a block, the same 128 rows, grid and K slices
#define DIRECT_KW_ENTRY(T, AHEAD, BLOCKS, R, KW, XA)                                             \
  extern "C" __global__ void __launch_bounds__(256 / R * KW, BLOCKS) w4_direct_t##T##_r##R##_k##KW(PARAMS) { \
    w4_mma<T, true, AHEAD, 0, false, 0, R, XA, KW>(ARGS);                                        \
  }
#define DIRECT_KW_GROUP_ENTRY(T, AHEAD, BLOCKS, R, KW, G, XA)                                    \
  extern "C" __global__ void __launch_bounds__(256 / R * KW, BLOCKS) w4_direct_t##T##_r##R##_k##KW##_g##G(PARAMS) { \
    w4_mma<T, true, AHEAD, G / 64, false, 0, R, XA, KW>(ARGS);                                   \
  }
#define STAGED_ENTRY(T, S, BLOCKS)                                                               \
  extern "C" __global__ void __launch_bounds__(256, BLOCKS) w4_staged_t##T(PARAMS) {               \
    w4_mma<T, false, S>(ARGS);                                                                   \
  }
// sm_90a only (cuda_w4.kernel_source adds these lines for it): the dynamic shared memory is
// cuda_w4.wgmma_shared_bytes(T)
#define WGMMA_ENTRY(T, S, XRING, BLOCKS)                                                         \
  extern "C" __global__ void __launch_bounds__(256, BLOCKS) w4_wgmma_t##T(PARAMS) {                \
    w4_mma<T, false, S, 0, true, XRING>(ARGS);                                                   \
  }
