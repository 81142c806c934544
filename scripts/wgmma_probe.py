"""Does wgmma (sm_90a, A from registers) give the bits of the CUDA W4 kernel's mma.sync chains?

One warpgroup, A [64, K] fp16 (weight rows), X [N, K] fp16 (tokens), fp32 accumulation over K/16
steps in order:
  mma    4 warps x mma.sync.m16n8k16 chains (the CUDA W4 kernel's MMA), N/8 token tiles;
  wgmma  wgmma.mma_async.m64nNk16 with each warp's A fragment in mma.m16n8k16's register layout and X
         in shared memory (no swizzle, K-major core matrices of 8 tokens x 8 channels, 128 bytes),
         in the placement and descriptor (LBO, SBO) of VARIANTS.
Writes, per K (16, 256, 2048, 8192) and N (8, 16, 24, 64): wgmma's error against fp64 (is the layout
right?), the share of elements equal to mma.sync's (same bits?), and n8 against larger N on the same
tokens (same bits whatever N?). A variant with wrong strides gives garbage, and may fault, which ends
the process, so run each variant in its own:
  GPU (sm_90): for v in 0 1 2 3; do PROBE_VARIANT=$v OUT=DIR python scripts/wgmma_probe.py; done
  CPU:         python scripts/wgmma_probe.py --compile   (NVRTC only)
Results on the H200: docs/kernels.md ("What limits it"), docs/bench/wgmma-probe-h200.json."""
import ctypes, json, os, sys
sys.path.insert(0, os.getcwd())
import torch
from hierviz.quant import cuda_w4

NS = (8, 16, 24, 64)
# shared-memory placement of X's core matrices (bytes between the K halves, between token blocks, pad
# after each step's blocks) and the descriptor's (LBO, SBO): which field is which for K-major B without
# swizzle, and whether strides that are not multiples of 128 bytes (bank spreading) are taken
VARIANTS = [(128, 256, 0, 128, 256), (128, 256, 0, 256, 128), (192, 320, 16, 192, 320), (192, 320, 16, 320, 192)]


def wgmma_fn(n: int) -> str:
    regs = n // 2
    d = ",".join(f"%{i}" for i in range(regs))
    a = ",".join(f"%{regs + i}" for i in range(4))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return f"""
__device__ __forceinline__ void wgmma_n{n}(float* d, u32 a0, u32 a1, u32 a2, u32 a3, unsigned long long desc, int scale_d) {{
  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 5}, 0;\\n"
               "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {{{d}}}, {{{a}}}, %{regs + 4}, p, 1, 1, 0;\\n}}\\n"
               : {outs} : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(scale_d));
}}
"""


SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
__device__ __forceinline__ u32 pair_at(const u16* p) { return *(const u32*)p; }
__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// the m16n8k16 A fragment of rows r0 .. r0 + 15, channels k0 .. k0 + 15 (row-major A, leading dim K)
#define A_FRAGMENT(A, K, r0, k0)                                                                  \
  const u32 a0 = pair_at(A + (size_t)(r0 + g) * K + k0 + 2 * t), a1 = pair_at(A + (size_t)(r0 + g + 8) * K + k0 + 2 * t), \
            a2 = pair_at(A + (size_t)(r0 + g) * K + k0 + 2 * t + 8), a3 = pair_at(A + (size_t)(r0 + g + 8) * K + k0 + 2 * t + 8);

extern "C" __global__ void probe_mma(const u16* A, const u16* X, float* D, int N, int K) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  float acc[8][4] = {};
  for (int k0 = 0; k0 < K; k0 += 16) {
    A_FRAGMENT(A, K, 16 * w, k0)
    for (int j = 0; j < N / 8; j++)
      mma(acc[j], a0, a1, a2, a3, pair_at(X + (size_t)(8 * j + g) * K + k0 + 2 * t), pair_at(X + (size_t)(8 * j + g) * K + k0 + 2 * t + 8));
  }
  for (int j = 0; j < N / 8; j++)
    for (int i = 0; i < 4; i++)
      D[(size_t)(16 * w + g + 8 * (i >> 1)) * N + 8 * j + 2 * t + (i & 1)] = acc[j][i];
}

// X [N, K] into shared memory: step s (16 channels), token block j (8 tokens), half kk (8 channels) is
// one core matrix (8 rows of 16 bytes) at s * step_b + j * nb_b + kk * kk_b; descriptor (lbo, sbo) as given.
__device__ __forceinline__ unsigned long long descriptor(u32 addr, u32 lbo, u32 sbo) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) | ((unsigned long long)(sbo >> 4) << 32);
}
#define WGMMA_PROBE(NN)                                                                           \
extern "C" __global__ void probe_wgmma_n##NN(const u16* A, const u16* X, float* D, int K, int kk_b, int nb_b, \
                                            int step_b, int lbo, int sbo) {                        \
  extern __shared__ __align__(128) u16 xs[];                                                      \
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;           \
  const int steps = K / 16;                                                                       \
  for (int e = threadIdx.x; e < NN * K / 8; e += blockDim.x) {   /* 16 bytes per e */             \
    const int n = e / (K / 8), c8 = e % (K / 8), s = c8 / 2, kk = c8 % 2, j = n / 8, r = n % 8;   \
    *(uint4*)((char*)xs + s * step_b + j * nb_b + kk * kk_b + r * 16) = *(const uint4*)(X + (size_t)n * K + c8 * 8); \
  }                                                                                               \
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");                                    \
  __syncthreads();                                                                                \
  float d[NN / 2];                                                                                \
  for (int i = 0; i < NN / 2; i++) d[i] = 0.f;                                                    \
  const u32 base = (u32)__cvta_generic_to_shared(xs);                                             \
  for (int s = 0; s < steps; s++) {                                                               \
    A_FRAGMENT(A, K, 16 * w, 16 * s)                                                              \
    const unsigned long long desc = descriptor(base + s * step_b, lbo, sbo);                      \
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");                                       \
    wgmma_n##NN(d, a0, a1, a2, a3, desc, 1);                                                      \
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");                                \
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");                                \
  }                                                                                               \
  for (int j = 0; j < NN / 8; j++)                                                                \
    for (int i = 0; i < 4; i++)                                                                   \
      D[(size_t)(16 * w + g + 8 * (i >> 1)) * NN + 8 * j + 2 * t + (i & 1)] = d[4 * j + i];      \
}
""" + "".join(wgmma_fn(n) for n in NS) + "".join(f"WGMMA_PROBE({n})\n" for n in NS)


def main() -> None:
    if "--compile" in sys.argv:
        cub = cuda_w4.compile_cubin("sm_90a", SOURCE)
        print("compiled sm_90a:", len(cub), "bytes")
        return
    out = os.environ.get("OUT", "/tmp")
    idx = torch.cuda.current_device()
    cuda_w4.functions(idx)                      # the driver and torch's context
    drv = cuda_w4._DRIVER
    module = ctypes.c_void_p()
    drv.check(drv.lib.cuModuleLoadData(ctypes.byref(module), cuda_w4.compile_cubin("sm_90a", SOURCE)), "load")
    fns = {}
    for name in ["probe_mma"] + [f"probe_wgmma_n{n}" for n in NS]:
        f = ctypes.c_void_p(); drv.check(drv.lib.cuModuleGetFunction(ctypes.byref(f), module, name.encode()), name); fns[name] = f
    stream = torch.cuda.current_stream().cuda_stream

    def launch(name, threads, smem, *args):
        c = []
        for a in args:
            c.append(ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int(a))
        ptrs = (ctypes.c_void_p * len(c))(*[ctypes.addressof(v) for v in c])
        if smem > 48 * 1024:
            drv.check(drv.lib.cuFuncSetAttribute(fns[name], 8, smem), "smem attr")   # MAX_DYNAMIC_SHARED_SIZE_BYTES
        drv.check(drv.lib.cuLaunchKernel(fns[name], 1, 1, 1, threads, 1, 1, smem, stream, ptrs, None), name)
        torch.cuda.synchronize()

    res = {"what": __doc__, "cases": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for k in (16, 256, 2048, 8192):
        a = (torch.randn(64, k, device="cuda", generator=gen) * 0.1).half()
        x = torch.randn(64, k, device="cuda", generator=gen).half()
        ref = a.double() @ x.double().t()
        row = {"K": k}
        for n in NS:
            dm = torch.zeros(64, n, device="cuda")
            launch("probe_mma", 128, 0, a, x, dm, n, k)
            row[f"mma_n{n}_rel_err"] = float((dm.double() - ref[:, :n]).norm() / ref[:, :n].norm())
            for variant, (kk_b, nb_b, pad, lbo, sbo) in enumerate(VARIANTS):
                if os.environ.get("PROBE_VARIANT", str(variant)) != str(variant):
                    continue
                step_b = (n // 8) * nb_b + pad
                # slack past the last step: a descriptor variant with the strides the wrong way round reads
                # there (garbage, not a fault: a fault is sticky and would end the whole probe)
                smem = (k // 16) * step_b + (n // 8 + 2) * max(lbo, sbo, kk_b, nb_b) + 1024
                if smem > 200 * 1024:
                    continue
                dw = torch.full((64, n), float("nan"), device="cuda")
                try:
                    launch(f"probe_wgmma_n{n}", 128, smem, a, x, dw, k, kk_b, nb_b, step_b, lbo, sbo)
                except RuntimeError as e:
                    row[f"wgmma_n{n}_v{variant}"] = str(e); continue
                row[f"wgmma_n{n}_v{variant}_rel_err"] = float((dw.double() - ref[:, :n]).norm() / ref[:, :n].norm())
                row[f"wgmma_n{n}_v{variant}_equal_to_mma"] = float((dw == dm).float().mean())
                row.setdefault(f"_d{variant}", {})[n] = dw
            row[f"mma_n{n}_vs_mma_n8_equal"] = float((dm[:, :8] == row.setdefault("_m8", dm)[:, :8]).float().mean())
        for variant in range(len(VARIANTS)):
            ds = row.pop(f"_d{variant}", {})
            for n, dw in ds.items():
                if 8 in ds:
                    row[f"wgmma_n{n}_v{variant}_vs_n8_equal"] = float((dw[:, :8] == ds[8]).float().mean())
        row.pop("_m8", None)
        res["cases"].append(row); print(row, flush=True)
    json.dump(res, open(os.path.join(out, f"wgmma_probe{os.environ.get('PROBE_VARIANT', '')}.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
