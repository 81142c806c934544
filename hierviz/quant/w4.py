"""The one W4A16 weight format used inside the engine.

A linear layer y = x @ W.T with W of shape [N, K] is stored as
  codes   uint8 [N, K // 2]   two 4-bit codes per byte: element 2j in the low nibble,
                              element 2j+1 in the high nibble (values 0..15)
  scales  float [N, K // G]   one scale per group of G consecutive input channels
  offsets float [N, K // G]   one float offset per group:  W[n, k] = scales[n, g] * code + offsets[n, g]
  perm    long  [K] or None   input-channel permutation (GPTQ act-order): the matmul uses x[..., perm]

A float offset (not an integer zero point) represents both GPTQ (offset = -scale * zero) and
llama.cpp's Q4_1 (offset = min) exactly. Every importer (GPTQ, GGUF) converts into this format
and every kernel (torch reference, int4pack CPU, Triton) reads it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from hierviz.config import options


# A batch-invariant model's forwards of up to this many tokens (every decode and verification step;
# the static path's largest bucket, hierviz.models.cuda_graphs.BUCKETS) give each token the bits it
# would get alone; longer ones are prefills, which every method runs alike.
INVARIANT_MAX_ROWS = 128


@dataclass
class W4Weight:
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    group_size: int
    perm: Optional[torch.Tensor] = None
    # a verifier's weight: kernels must give a row the same bits whatever the number of rows (up
    # to a verification's size), so verifying K tokens matches decoding them one by one
    batch_invariant: bool = False
    # layouts kernels derive from this weight (packed codes, a dequantized copy), by kernel name;
    # not copied by dataclasses.replace: a variant gets its own
    kernel_state: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * 2

    def __post_init__(self) -> None:
        n, k2 = self.codes.shape
        k = 2 * k2
        if self.codes.dtype != torch.uint8:
            raise ValueError(f"W4 codes must be uint8, got {self.codes.dtype}")
        if self.group_size <= 0 or k % self.group_size:
            raise ValueError(f"group size {self.group_size} does not divide in_features {k}")
        want = (n, k // self.group_size)
        if tuple(self.scales.shape) != want or tuple(self.offsets.shape) != want:
            raise ValueError(f"W4 scales/offsets must have shape {want}, got "
                             f"{tuple(self.scales.shape)} / {tuple(self.offsets.shape)}")
        if self.perm is not None and tuple(self.perm.shape) != (k,):
            raise ValueError(f"W4 perm must have shape ({k},), got {tuple(self.perm.shape)}")

    def to(self, device=None, dtype: Optional[torch.dtype] = None) -> "W4Weight":
        """Move to a device; dtype applies to scales and offsets (codes stay uint8)."""
        return W4Weight(codes_of(self).to(device), self.scales.to(device, dtype), self.offsets.to(device, dtype),
                        self.group_size, None if self.perm is None else self.perm.to(device), self.batch_invariant)

    @property
    def nbytes(self) -> int:
        total = self.codes.numel() + self.scales.numel() * self.scales.element_size() * 2
        return total + (0 if self.perm is None else self.perm.numel() * 8)


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """int codes [N, K] in 0..15 -> uint8 [N, K // 2] (even k low nibble, odd k high nibble)."""
    if q.shape[-1] % 2:
        raise ValueError("in_features must be even to pack 4-bit codes")
    q = q.to(torch.uint8)
    return (q[..., 0::2] & 0xF) | ((q[..., 1::2] & 0xF) << 4)


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] -> uint8 codes [N, K] in 0..15."""
    low = codes & 0xF
    high = codes >> 4
    return torch.stack([low, high], dim=-1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)


def codes_released(w: W4Weight) -> bool:
    """Whether w.codes is only a zero-stride placeholder (see codes_of)."""
    c = w.codes
    return c.dim() == 2 and c.numel() > 1 and c.stride() == (0, 0)


def release_codes(w: W4Weight, restore: Callable[[W4Weight, Optional[torch.Tensor]], torch.Tensor]) -> None:
    """Drop w's codes in this format's order once a kernel's layout holds them (their shape stays,
    as a zero-stride view): a 70B GPU model then holds its codes once. `restore(w, rows)` rebuilds
    them from that layout for every other reader (codes_of)."""
    w.codes = torch.empty(1, dtype=torch.uint8, device=w.codes.device).expand(*w.codes.shape)
    w.kernel_state["restore_codes"] = restore


def codes_of(w: W4Weight, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """w's codes in this format's order (only `rows` of them, when given). A GPU weight's codes
    live only in a kernel's layout once it has run (release_codes); they are rebuilt from it here
    for every other reader."""
    if codes_released(w):
        return w.kernel_state["restore_codes"](w, rows)
    return w.codes if rows is None else w.codes.index_select(0, rows.to(w.codes.device))


def dequantize(w: W4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float matrix [N, K] that w represents, in the permuted input order (see perm)."""
    q = unpack_codes(codes_of(w)).to(dtype)
    n, k = q.shape
    g = w.group_size
    q = q.view(n, k // g, g)
    out = q * w.scales.to(dtype).unsqueeze(-1) + w.offsets.to(dtype).unsqueeze(-1)
    return out.view(n, k)


def dequantize_unpermuted(w: W4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float matrix [N, K] in the checkpoint's original input-channel order."""
    dense = dequantize(w, dtype)
    if w.perm is None:
        return dense
    out = torch.empty_like(dense)
    out[:, w.perm] = dense
    return out


def quantize_rtn(weight: torch.Tensor, group_size: int = 32) -> W4Weight:
    """Round-to-nearest asymmetric 4-bit quantization with a float min per group (Q4_1-like)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide in_features {k}")
    w = weight.detach().float().view(n, k // group_size, group_size)
    lo = w.amin(-1)
    hi = w.amax(-1)
    scale = (hi - lo) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round((w - lo.unsqueeze(-1)) / scale.unsqueeze(-1)), 0, 15)
    return W4Weight(pack_codes(q.view(n, k)), scale, lo, group_size)


def quantize_linears(weights: dict[str, Any], group: int) -> dict[str, Any]:
    """RTN-quantize every dense decoder-layer linear to W4 (keeps norms, embeddings, LM head)."""
    from hierviz.quant.formats import quantize_linears as to_format
    return to_format(weights, lambda w: quantize_rtn(w, group))


# ---- kernels: the seam where fast matmuls plug in ------------------------------------------

CPU_NT_MAX_ROWS = 128

# Which form of x @ w^T is fastest for a few rows on the CPU depends on the machine's MKL, by up to
# 2x either way (docs/kernels.md, "CPU dense products"). So each (N, K, dtype, row bucket) is timed
# once per process, on first use, and the winner kept. HIERVIZ_CPU_MATMUL=plain|nt fixes the choice
# (reproducible rounding across processes); the default is auto.
_CPU_FORMS: dict[tuple, str] = {}
_FORM_MARGIN = 0.85       # another form must beat plain by 15 %: near-equal timings keep plain


def _form_product(form: str, x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if form == "plain":
        return x2 @ w.t()
    if form == "nt2":    # one row padded to two: a two-column gemm instead of MKL's gemv
        return torch.mm(w, x2.expand(2, -1).contiguous().t())[:, :1].t()
    return torch.mm(w, x2.t()).t()


def cpu_matmul_form(rows: int, w: torch.Tensor, x2: Optional[torch.Tensor] = None) -> str:
    """The form matmul_nt uses on the CPU for `rows` rows against w (timed on first use)."""
    fixed = options().cpu_matmul
    if fixed in ("plain", "nt"):
        return "nt2" if fixed == "nt" and rows == 1 else fixed
    bucket = 1 if rows == 1 else 1 << (rows - 1).bit_length()
    key = (w.shape[0], w.shape[1], w.dtype, bucket)
    form = _CPU_FORMS.get(key)
    if form is None:
        if x2 is None:
            x2 = torch.randn(rows, w.shape[1], dtype=w.dtype)
        cands = ["plain", "nt", "nt2"] if rows == 1 else ["plain", "nt"]
        best = {c: float("inf") for c in cands}
        with torch.no_grad():               # timing only: nothing for autograd to record
            for _ in range(3):              # interleaved, best of three: background load hits all alike
                for c in cands:
                    t = time.perf_counter()
                    _form_product(c, x2, w)
                    best[c] = min(best[c], time.perf_counter() - t)
        fastest = min(cands, key=best.get)
        form = _CPU_FORMS[key] = fastest if best[fastest] < _FORM_MARGIN * best["plain"] else "plain"
    return form


def cpu_matmul_choices() -> dict[str, object]:
    """What cpu_matmul_form chose in this process ("NxK dtype rows<=B" -> form), for reports."""
    return {"setting": options().cpu_matmul,
            "forms": {f"{n}x{k} {str(dt).replace('torch.', '')} rows<={b}": f
                      for (n, k, dt, b), f in sorted(_CPU_FORMS.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][3]))}}


def matmul_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T: every dense product of the engine (layers, LM head, drafter heads).

    On the CPU, for the few rows of a decode or verification step (up to CPU_NT_MAX_ROWS), the
    fastest of x @ w^T and (w @ x^T)^T (see cpu_matmul_form); larger products (training, long
    prefills) keep the plain form."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.device.type != "cpu" or not 0 < rows <= CPU_NT_MAX_ROWS:
        return x @ w.t()
    x2 = x.reshape(rows, x.shape[-1])
    return _form_product(cpu_matmul_form(rows, w, x2), x2, w).reshape(*x.shape[:-1], w.shape[0])


def _matmul_reference(x: torch.Tensor, w: W4Weight) -> torch.Tensor:
    """Dequantize on the fly, then a plain matmul. Runs anywhere; the correctness reference."""
    return matmul_nt(x, dequantize(w, x.dtype))


def _matmul_dequant_cached(x: torch.Tensor, w: W4Weight) -> torch.Tensor:
    """Dequantize once and keep the float matrix: 4-bit storage, float compute (a baseline that
    shows what the W4 kernels save or cost)."""
    cache = w.kernel_state.setdefault("dequantized", {})
    dense = cache.get(x.dtype)
    if dense is None:
        dense = cache[x.dtype] = dequantize(w, x.dtype)
    return matmul_nt(x, dense)


W4Kernel = Callable[[torch.Tensor, W4Weight], torch.Tensor]
KERNELS: dict[str, W4Kernel] = {"reference": _matmul_reference, "dequant_cached": _matmul_dequant_cached}
# kernels that live in their own modules register themselves on import
_KERNEL_MODULES = {"int4pack_cpu": "hierviz.quant.int4pack_cpu", "triton": "hierviz.quant.triton_w4"}


def register_kernel(name: str, fn: W4Kernel) -> None:
    KERNELS[name] = fn


def get_kernel(name: str) -> W4Kernel:
    """The kernel registered under `name`, importing its module on first use."""
    if name not in KERNELS and name in _KERNEL_MODULES:
        import importlib
        importlib.import_module(_KERNEL_MODULES[name])
    if name not in KERNELS:
        raise ValueError(f"W4 kernel {name!r} is not available here; available: {sorted(KERNELS)}")
    return KERNELS[name]


def w4_linear(x: torch.Tensor, w: W4Weight, kernel: str = "reference",
              add_to: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ W.T for x [..., K]. add_to [..., N] (x's dtype): the product is added into it in
    place and add_to is returned (a layer's residual; kernels with `accumulates` do it inside
    the product, which saves the zero fill of a split-K output and the separate add)."""
    if w.perm is not None:
        x = x.index_select(-1, w.perm)
    fn = KERNELS.get(kernel) or get_kernel(kernel)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if add_to is not None and getattr(fn, "accumulates", False) and add_to.is_contiguous():
        fn(x2, w, add_to=add_to.view(-1, w.out_features))
        return add_to
    y = fn(x2, w).reshape(*shape[:-1], w.out_features)
    return y if add_to is None else add_to.add_(y)


ROW_INVARIANT_CPU_KERNELS = ("int4pack_cpu",)   # measured: a row's bits do not depend on the other rows


# ---- the W4A16 format behind hierviz.quant.formats' linear interface ---------------------------

def fuse_w4(ws: list[W4Weight]) -> list[W4Weight]:
    """One W4Weight when group sizes and input permutations agree, else the list unchanged."""
    if len(ws) == 1:
        return ws
    g = ws[0].group_size
    same_perm = all((w.perm is None and ws[0].perm is None) or
                    (w.perm is not None and ws[0].perm is not None and torch.equal(w.perm, ws[0].perm)) for w in ws)
    if not same_perm or any(w.group_size != g for w in ws):
        return ws
    return [W4Weight(torch.cat([w.codes for w in ws]), torch.cat([w.scales for w in ws]),
                     torch.cat([w.offsets for w in ws]), g, ws[0].perm)]


class W4Linear:
    """The W4A16 product of one fused linear: one W4Weight where the parts fuse, else one product
    per part; `kernel` names the W4 kernel (KERNELS)."""

    format = "w4a16"

    def __init__(self, weights: list[W4Weight], kernel: str = "reference") -> None:
        self.weights = fuse_w4(weights)
        self.kernel = kernel

    @property
    def rows_invariant_cpu(self) -> bool:
        return self.kernel in ROW_INVARIANT_CPU_KERNELS

    def set_batch_invariant(self, on: bool) -> None:
        for w in self.weights:
            w.batch_invariant = on

    def __call__(self, x: torch.Tensor, add_to: Optional[torch.Tensor] = None) -> torch.Tensor:
        if len(self.weights) == 1:     # the kernel adds into add_to itself where it can
            return w4_linear(x, self.weights[0], self.kernel, add_to)
        y = torch.cat([w4_linear(x, w, self.kernel) for w in self.weights], -1)
        return y if add_to is None else add_to.add_(y)


def _register() -> None:
    from hierviz.quant.formats import WeightFormat, register
    register(WeightFormat("w4a16", "W4A16", W4Weight, W4Linear, quantize=lambda w: quantize_rtn(w, 128),
                          dequantize=dequantize_unpermuted, gpu_proven=True,
                          description="4-bit weights in groups with a float scale and offset each (GPTQ, GGUF "
                                      "Q4_0/Q4_1, RTN), 16-bit activations"))


_register()
