"""Weight formats: one module per format behind one linear interface (as gpt-fast keeps a class
per format in its quantize.py), and the registry that names them.

A format owns a weight type (the packed tensors of one linear layer: `out_features`,
`in_features`, `nbytes`, `to(device, dtype)`, `batch_invariant`), a product over the weights of
one fused linear (`make_linear(weights, kernel)` -> a `QuantLinear`), optionally a quantizer
from a dense weight, and the facts other layers need about it (bytes per weight for memory
estimates, what its product launches for the cost model, its label). The model code
(hierviz.models.llama.Linear) asks `format_of(weight)` and never names a format; a stack file
picks one with `"quantize"` (`quantize_option`), tools and result files by name (`get_format`,
which takes a format's aliases too).

This module is the one place formats are named: every other layer iterates `FORMATS` or looks a
name up here. Dense weights (fp32 / fp16 / bf16, no quantization) are the `DENSE` entry: no
weight type, its product the model's own matmul. The built-in formats (W4A16 in
hierviz.quant.w4, W8A8 int8 in hierviz.quant.w8a8, W8A8 FP8 in hierviz.quant.fp8) register
themselves when hierviz.quant is imported (hierviz/quant/__init__.py); this module imports none
of them. A further format is one module that calls `register` and one import line there
(docs/formats.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol

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
    name: str                     # the one name stack files, the CLI and result files write: "w4a16", "w8a8-int8"
    label: str                    # for people: "W4A16"
    weight_type: Optional[type]   # None: dense, the model's own float tensors
    make_linear: Optional[Callable[[list[Any], str], QuantLinear]]
    # dense [N, K] -> a weight of this format; None where a checkpoint importer is the only source
    quantize: Optional[Callable[[torch.Tensor], Any]] = None
    # a weight of this format -> the dense [N, K] it stands for, in checkpoint channel order
    dequantize: Optional[Callable[[Any], torch.Tensor]] = None
    description: str = ""
    # its product has run on a GPU here (tests/test_gpu.py); an unproven one is refused on CUDA
    # with a clear message rather than run untested
    gpu_proven: bool = False
    # the oldest CUDA compute capability whose hardware runs the product (FP8: Ada / Hopper), and
    # that hardware in words ("FP8 tensor cores")
    min_capability: Optional[tuple[int, int]] = None
    hardware: str = ""
    # other names read wherever a name is (older flags and result files): never written
    aliases: tuple[str, ...] = ()
    # ---- bytes: one [N, K] linear holds N K code_bytes + N (K / group) group_bytes + N channel_bytes
    code_bytes: Optional[float] = None     # per weight; None: the activations' dtype (dense)
    group_bytes: float = 0.0               # per group of input channels of a row (W4A16: fp16 scale + offset)
    channel_bytes: float = 0.0             # per output channel (the 8-bit formats: a float32 scale)
    # copies of the group scales a loaded GPU model holds (W4A16: checkpoint order and the kernel's layout)
    resident_group_copies: int = 1
    # embedding and LM head bytes per value; None: the activations' dtype (GPTQ keeps them fp16)
    embedding_bytes: Optional[float] = None
    # ---- groups: a stack file's "<group_option><G>" quantizes into this format in groups of G
    group_option: str = ""
    quantize_grouped: Optional[Callable[[torch.Tensor, int], Any]] = None
    default_group: int = 0                 # the group `quantize` uses (0: no groups)
    # ---- the product on a GPU
    # the kernel its product runs there (make_linear's `kernel`; "" where it has one): the one
    # profiles time as the format's curve and the cost model prices
    gpu_kernel: str = ""
    # what that product launches, as hierviz.measure.cost_model prices it: "gemm" (one library
    # GEMM over dense weights), "triton_w4", "int_mm", "scaled_mm"
    gpu_product: str = "gemm"
    quantizes_activations: bool = False    # its product quantizes the activations (per token)

    @property
    def dense(self) -> bool:
        return self.weight_type is None

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def bytes_per_weight(self, group: int = 128, act_bytes: float = 2.0) -> float:
        """Bytes a product reads per weight: its code and its share of the group scales."""
        code = act_bytes if self.code_bytes is None else self.code_bytes
        return code + (self.group_bytes / group if self.group_bytes else 0.0)

    def resident_bytes_per_weight(self, group: int = 128, act_bytes: float = 2.0) -> float:
        """Bytes a loaded GPU model holds per weight (every copy of the group scales)."""
        extra = (self.resident_group_copies - 1) * self.group_bytes / group if self.group_bytes else 0.0
        return self.bytes_per_weight(group, act_bytes) + extra

    def linear_bytes(self, n: int, k: int, group: int = 128, act_bytes: float = 2.0) -> float:
        """Bytes of one [n, k] linear in this format, per-channel scales included."""
        return n * k * self.bytes_per_weight(group, act_bytes) + n * self.channel_bytes

    def series(self, kernel: str = "") -> str:
        """A profile curve's name for this format's product through `kernel` (its only one: "")."""
        return f"{self.name}-{kernel}" if kernel else self.name


FORMATS: dict[str, WeightFormat] = {}
# the paper's target format: the what-if's, the tiny stack's and the profiles' default
DEFAULT_FORMAT = "w4a16"


def register(fmt: WeightFormat) -> WeightFormat:
    """Add a format under its name; a name or alias another format holds (in any case) is refused."""
    taken = {n.lower(): f.name for f in FORMATS.values() if f.name != fmt.name for n in f.names}
    clash = [n for n in fmt.names if n.lower() in taken]
    if clash:
        raise ValueError(f"weight format name {clash[0]!r} is taken by {taken[clash[0].lower()]!r}")
    FORMATS[fmt.name] = fmt
    return fmt


def unregister(name: str) -> None:
    """Remove a format registered at run time (a test's or a plug-in's)."""
    FORMATS.pop(get_format(name).name)


DENSE = register(WeightFormat(
    "dense", "dense", None, None, aliases=("fp16", "bf16", "fp32"), gpu_proven=True,
    description="the checkpoint's float weights (fp32 / fp16 / bf16) in the model's dtype, a BLAS / cuBLAS product"))


def lookup(name: Any) -> Optional[WeightFormat]:
    """The format a name or alias (any case) stands for; None for anything else."""
    if isinstance(name, WeightFormat):
        return name
    if not isinstance(name, str):
        return None
    key = name.strip().lower()
    return next((f for f in FORMATS.values() if key in (n.lower() for n in f.names)), None)


def get_format(name: Any) -> WeightFormat:
    """The format of a name or alias; ValueError naming the known ones otherwise."""
    fmt = lookup(name)
    if fmt is None:
        raise ValueError(f"unknown weight format {name!r}; known: {', '.join(sorted(FORMATS))}")
    return fmt


def canonical_name(name: str) -> str:
    """A name or alias as the format's one name; an unknown name as given (argparse's `type`,
    so `choices` reports it)."""
    fmt = lookup(name)
    return fmt.name if fmt is not None else name


def quantized_formats() -> Iterator[WeightFormat]:
    """Every registered format but dense, in registration order."""
    return (f for f in FORMATS.values() if not f.dense)


def by_width() -> list[WeightFormat]:
    """Every format that has a quantizer (dense first), widest weights first: the order of the
    compatibility table and the What-if's choices."""
    usable = [f for f in FORMATS.values() if f.dense or f.quantize is not None]
    return sorted(usable, key=lambda f: (not f.dense, -f.bytes_per_weight()))


def format_of_series(series: str) -> Optional[WeightFormat]:
    """The format of a profile curve's name: a format's name or alias, or one followed by
    "-<kernel>" ("w4a16-triton")."""
    parts = str(series).split("-")
    for i in range(len(parts), 0, -1):
        fmt = lookup("-".join(parts[:i]))
        if fmt is not None:
            return fmt
    return None


def format_of_description(text: Any) -> Optional[WeightFormat]:
    """The format a result file's description starts with: its label, name or alias as the first
    word ("W4A16 synthetic codes, group 128", "dense float16")."""
    words = str(text or "").split()
    if not words:
        return None
    first = words[0].lower()
    return lookup(first) or next((f for f in FORMATS.values() if f.label.lower() == first), None)


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
    for fmt in quantized_formats():
        if isinstance(w, fmt.weight_type):
            return fmt
    raise TypeError(f"{type(w).__name__} is neither a tensor nor a registered weight format's weight")


@dataclass(frozen=True)
class QuantizeChoice:
    """What a stack file's `"quantize"` value asks for: the format, the group (formats with
    groups; else 0) and the quantizer of dense linears."""
    format: WeightFormat
    group: int
    quantize: Callable[[torch.Tensor], Any]


def _grouped(fmt: WeightFormat, group: int) -> Callable[[torch.Tensor], Any]:
    return lambda w: fmt.quantize_grouped(w, group)


def resolve_quantize(q: Any, group: Optional[int] = None) -> Optional[QuantizeChoice]:
    """A `"quantize"` value -> its choice: "<group_option><G>" (W4A16's "rtn-g<G>") or a format's
    name or alias (its quantizer; `group` overrides a grouped format's default); None for
    anything else, a format without a quantizer included."""
    if not isinstance(q, str):
        return None
    for fmt in quantized_formats():
        opt = fmt.group_option
        if opt and fmt.quantize_grouped and q.startswith(opt) and q[len(opt):].isdigit() and int(q[len(opt):]) > 0:
            return QuantizeChoice(fmt, int(q[len(opt):]), _grouped(fmt, int(q[len(opt):])))
    fmt = lookup(q)
    if fmt is None or fmt.quantize is None:
        return None
    if group and fmt.quantize_grouped and group != fmt.default_group:
        return QuantizeChoice(fmt, group, _grouped(fmt, group))
    return QuantizeChoice(fmt, fmt.default_group, fmt.quantize)


def _options_text() -> str:
    grouped = [f"'{f.group_option}<group>' for {f.label}, e.g. '{f.group_option}32'"
               for f in quantized_formats() if f.group_option and f.quantize_grouped]
    names = [f.name for f in quantized_formats() if f.quantize is not None]
    return f"use {', '.join(grouped)} or one of {', '.join(names)}" if grouped else f"use one of {', '.join(names)}"


def check_runs_on(fmt: WeightFormat, device: Optional[torch.device | str]) -> None:
    """ValueError where a CUDA device may not run the format: its product unproven on a GPU
    here, or the GPU too old for its hardware."""
    if device is None or torch.device(device).type != "cuda" or fmt.dense:
        return
    if not fmt.gpu_proven:
        runs = [f"{f.label} ('{f.group_option}<group>')" for f in quantized_formats() if f.gpu_proven and f.group_option]
        raise ValueError(f"the {fmt.label} format has not been run on a GPU by hierviz's GPU tests yet: load this "
                         f"stack on the CPU" + "".join(f", or use {r} on the GPU" for r in runs[:1]))
    if fmt.min_capability:
        have = torch.cuda.get_device_capability(device)
        if have < fmt.min_capability:
            need = ".".join(map(str, fmt.min_capability))
            runs = [f.label for f in quantized_formats() if f.gpu_proven and (f.min_capability or (0, 0)) <= have]
            raise ValueError(f"the {fmt.label} format needs a GPU of compute capability {need} or newer "
                             f"(this one is {have[0]}.{have[1]}): use {' or '.join(runs)} here")


def quantize_option(q: Any, device: Optional[torch.device] = None) -> Callable[[torch.Tensor], Any]:
    """A stack file's `"quantize"` value -> the quantizer of dense linears (`resolve_quantize`).
    On a CUDA device a format whose product has not run on a GPU here is refused."""
    choice = resolve_quantize(q)
    if choice is None:
        raise ValueError(f"unknown quantize option {q!r} ({_options_text()})")
    check_runs_on(choice.format, device)
    return choice.quantize


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


def weight_shape(w: Any) -> tuple[int, int]:
    """[out, in] of a linear weight, dense or in a weight format."""
    return tuple(w.shape) if isinstance(w, torch.Tensor) else (w.out_features, w.in_features)
