"""Ticket counters for kernels whose last program of a group finishes the group's work (the W4
kernels' fixed-order split-K sums, the fused attention's slice combine)."""
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
