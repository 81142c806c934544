"""Weight formats: one module per format behind one linear interface (as gpt-fast keeps a class
per format in its quantize.py).

A format owns a weight type (the packed tensors of one linear layer: `out_features`,
`in_features`, `nbytes`, `to(device, dtype)`, `batch_invariant`), a product over the weights of
one fused linear (`make_linear(weights, kernel)` -> a `QuantLinear`), and optionally a quantizer
from a dense weight. The model code (hierviz.models.llama.Linear) asks `format_of(weight)` and
never names a format; a stack file picks one with `"quantize"` (`quantize_option`).

Registered here: W4A16 (hierviz.quant.w4, the GPTQ / GGUF / RTN importers' format), W8A8 int8
(hierviz.quant.w8a8) and W8A8 FP8 (hierviz.quant.fp8). A further format is one module that calls `register`, an import in
`_load_builtin`, and its tests (docs/formats.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch


class QuantLinear(Protocol):
    """The product of one fused linear in a format: y = x @ W.T, W the weights concatenated along
    the output dimension."""
    format: str
    weights: list[Any]
    # on the CPU, does a row's result depend on nothing but that row (at every row count)?
    rows_invariant_cpu: bool

    def __call__(self, x: torch.Tensor, add_to: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [..., K] -> [..., N]; with add_to (the residual) the product is added into it in
        place and add_to returned."""

    def set_batch_invariant(self, on: bool) -> None:
        """A verifier's linear: each row's bits independent of the other rows (up to a verification)."""


@dataclass(frozen=True)
class WeightFormat:
    name: str                     # stack files and the CLI use it: "w4a16", "w8a8-int8"
    label: str                    # for people: "W4A16"
    weight_type: type
    make_linear: Callable[[list[Any], str], QuantLinear]
    # dense [N, K] -> a weight of this format; None where a checkpoint importer is the only source
    quantize: Optional[Callable[[torch.Tensor], Any]] = None
    # a weight of this format -> the dense [N, K] it stands for, in checkpoint channel order
    dequantize: Optional[Callable[[Any], torch.Tensor]] = None
    description: str = ""
    # its product has run on a GPU here (tests/test_gpu.py); an unproven one is refused on CUDA
    # with a clear message rather than run untested
    gpu_proven: bool = False
    # the oldest CUDA compute capability whose hardware runs the product (FP8: Ada / Hopper)
    min_capability: Optional[tuple[int, int]] = None


FORMATS: dict[str, WeightFormat] = {}


def register(fmt: WeightFormat) -> WeightFormat:
    FORMATS[fmt.name] = fmt
    return fmt


def _load_builtin() -> None:
    # each format module registers itself on import
    import hierviz.quant.fp8  # noqa: F401
    import hierviz.quant.w4  # noqa: F401
    import hierviz.quant.w8a8  # noqa: F401


def fixed_row_chunks(x2: torch.Tensor, chunk: int, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """product(rows) over fixed-size row chunks of x2 [M, K], the last one zero-padded: every call
    has one shape, so a row's bits never depend on how many rows came with it (libraries pick
    kernels, and kernels round, by shape)."""
    parts = []
    for i in range(0, x2.shape[0], chunk):
        part = x2[i:i + chunk]
        rows = part.shape[0]
        if rows < chunk:
            part = torch.cat([part, part.new_zeros(chunk - rows, part.shape[1])])
        parts.append(product(part)[:rows])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def format_of(w: Any) -> Optional[WeightFormat]:
    """The format of a weight; None for a dense tensor."""
    if isinstance(w, torch.Tensor):
        return None
    _load_builtin()
    for fmt in FORMATS.values():
        if isinstance(w, fmt.weight_type):
            return fmt
    raise TypeError(f"{type(w).__name__} is neither a tensor nor a registered weight format's weight")


def get_format(name: str) -> WeightFormat:
    _load_builtin()
    if name not in FORMATS:
        raise ValueError(f"unknown weight format {name!r}; known: {', '.join(sorted(FORMATS))}")
    return FORMATS[name]


def quantize_option(q: Any, device: Optional[torch.device] = None) -> Callable[[torch.Tensor], Any]:
    """A stack file's `"quantize"` value -> the quantizer of dense linears: "rtn-g<G>" (W4A16,
    round-to-nearest, group G) or the name of a format with a quantizer (e.g. "w8a8-int8").
    On a CUDA device a format whose product has not run on a GPU here is refused."""
    _load_builtin()
    if isinstance(q, str) and q.startswith("rtn-g") and q[5:].isdigit() and int(q[5:]) > 0:
        from hierviz.quant.w4 import quantize_rtn
        group = int(q[5:])
        return lambda w: quantize_rtn(w, group)
    fmt = FORMATS.get(q) if isinstance(q, str) else None
    if fmt is not None and device is not None and torch.device(device).type == "cuda" and not fmt.gpu_proven:
        raise ValueError(f"the {fmt.label} format has not been run on a GPU by hierviz's GPU tests yet: load this "
                         f"stack on the CPU, or use W4A16 ('rtn-g<group>') on the GPU")
    if fmt is not None and device is not None and torch.device(device).type == "cuda" and fmt.min_capability:
        have = torch.cuda.get_device_capability(device)
        if have < fmt.min_capability:
            need = ".".join(map(str, fmt.min_capability))
            raise ValueError(f"the {fmt.label} format needs a GPU of compute capability {need} or newer "
                             f"(this one is {have[0]}.{have[1]}): use W4A16 or W8A8-int8 here")
    if fmt is None or fmt.quantize is None:
        names = [n for n, f in sorted(FORMATS.items()) if f.quantize is not None]
        raise ValueError(f"unknown quantize option {q!r} (use 'rtn-g<group>' for W4A16, e.g. 'rtn-g32', or one of "
                         f"{', '.join(names)})")
    return fmt.quantize


def quantize_linears(weights: dict[str, Any], quantize: Callable[[torch.Tensor], Any]) -> dict[str, Any]:
    """Every dense decoder-layer linear through `quantize` (norms, embeddings, LM head kept)."""
    out = dict(weights)
    for k, w in weights.items():
        if k.startswith("model.layers.") and k.endswith("_proj.weight") and isinstance(w, torch.Tensor):
            out[k] = quantize(w)
    return out


# ---- the shared shape of 8-bit formats: codes [N, K] with one float32 scale per output channel ----

@dataclass
class PerChannelWeight:
    """codes [N, K] of the format's CODE_DTYPE and scales float32 [N]: W[n, k] ~= scales[n] * codes[n, k]."""
    codes: torch.Tensor
    scales: torch.Tensor
    batch_invariant: bool = False
    CODE_DTYPE = torch.int8
    NAME = "8-bit"

    def __post_init__(self) -> None:
        if self.codes.dtype != self.CODE_DTYPE or self.codes.dim() != 2:
            raise ValueError(f"{self.NAME} codes must be a 2-D {self.CODE_DTYPE} tensor, got {self.codes.dtype} "
                             f"{tuple(self.codes.shape)}")
        if tuple(self.scales.shape) != (self.codes.shape[0],):
            raise ValueError(f"{self.NAME} scales must have shape ({self.codes.shape[0]},), got {tuple(self.scales.shape)}")

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * 4

    def to(self, device=None, dtype: Optional[torch.dtype] = None) -> "PerChannelWeight":
        """Move to a device (codes and scales keep their dtypes: dtype is the activations' business)."""
        return type(self)(self.codes.to(device), self.scales.to(device), self.batch_invariant)


class PerChannelLinear:
    """The product of one fused linear of a per-channel format: the parts concatenated into one
    weight, `product(x, weight)` doing the work (a row-invariant one: rows_invariant_cpu)."""
    format = ""
    rows_invariant_cpu = True

    @staticmethod
    def product(x: torch.Tensor, w: Any) -> torch.Tensor:
        raise NotImplementedError

    def __init__(self, weights: list[PerChannelWeight], kernel: str = "") -> None:
        self.weights = weights if len(weights) == 1 else [
            type(weights[0])(torch.cat([w.codes for w in weights]), torch.cat([w.scales for w in weights]))]

    def set_batch_invariant(self, on: bool) -> None:
        for w in self.weights:
            w.batch_invariant = on

    def __call__(self, x: torch.Tensor, add_to: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = self.product(x, self.weights[0])
        return y if add_to is None else add_to.add_(y)


def dense_of(w: Any) -> torch.Tensor:
    """The dense [N, K] a weight of any format stands for (a dense tensor as it is)."""
    fmt = format_of(w)
    if fmt is None:
        return w
    if fmt.dequantize is None:
        raise ValueError(f"the {fmt.label} format has no dequantizer")
    return fmt.dequantize(w)


def weight_to(w: Any, device: torch.device | str, dtype: Optional[torch.dtype]) -> Any:
    """A weight of any format (or a dense tensor) on `device`, its float parts as `dtype`."""
    if isinstance(w, torch.Tensor):
        return w.to(device=device, dtype=dtype) if dtype is not None else w.to(device)
    return w.to(device, dtype)


def out_features(w: Any) -> int:
    return w.shape[0] if isinstance(w, torch.Tensor) else w.out_features
