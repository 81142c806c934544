"""Per-device state the GPU kernels share: ticket counters for kernels whose last program of a
group finishes the group's work (the W4 kernels' fixed-order split-K sums, the fused attention's
slice combine), and the multiprocessor count their launch plans split work by."""
from __future__ import annotations

import torch


def ticket_buffer(store: dict[torch.device, torch.Tensor], device: torch.device, n: int, what: str) -> torch.Tensor:
    """At least n int32 zeros kept per device in `store`, for kernels whose last program of a
    group takes a ticket and resets its own (so the buffer is zero between kernels and graph
    captures and replays share it). Made, or grown, outside CUDA-graph capture, which cannot
    allocate: `what` names the buffer in that error."""
    buf = store.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{what} must exist before CUDA-graph capture (run it once eagerly first)")
        buf = store[device] = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
    return buf


_MULTIPROCESSORS: dict[int, int] = {}


def multiprocessor_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device, asked once per device (launch plans read it per product)."""
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _MULTIPROCESSORS:
        _MULTIPROCESSORS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _MULTIPROCESSORS[i]
