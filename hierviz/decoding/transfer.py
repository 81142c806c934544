"""Small host <-> device transfers on a decoding round's critical path.

Between a verifier's read-back and the next launch the GPU waits for the host, so each of
these transfers goes through pinned host memory: a read-back is queued behind the work
that produces it and the host only waits for that copy; an upload is an asynchronous copy
from a pinned buffer, not a pageable copy. One staging area per thread (the app decodes in
worker threads)."""
from __future__ import annotations

import threading

import torch

_RING = 8          # uploads in flight per thread before a buffer is reused
_local = threading.local()


def _staging() -> "threading.local":
    if not hasattr(_local, "read"):
        _local.read = {}                 # dtype -> (pinned buffer, event)
        _local.up = [None] * _RING       # (pinned long buffer, event) per slot
        _local.up_next = 0
    return _local


def read_list(x: torch.Tensor) -> list:
    """x.tolist() (flattened), through a pinned buffer on CUDA."""
    if x.device.type != "cuda":
        return x.reshape(-1).tolist()
    st = _staging()
    n = x.numel()
    buf, done = st.read.get(x.dtype, (None, None))
    if buf is None or buf.numel() < n:
        buf, done = torch.empty(max(n, 4096), dtype=x.dtype, pin_memory=True), torch.cuda.Event()
        st.read[x.dtype] = (buf, done)
    buf[:n].copy_(x.reshape(-1), non_blocking=True)
    done.record()
    done.synchronize()
    return buf[:n].tolist()


def upload_longs(values: list[int], device: torch.device) -> torch.Tensor:
    """torch.tensor(values, dtype=long) on `device`; from a pinned buffer on CUDA."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.long, device=device)
    st = _staging()
    n = len(values)
    slot = st.up_next
    st.up_next = (slot + 1) % _RING
    buf, copied = st.up[slot] or (None, None)
    if buf is None or buf.numel() < n:
        buf, copied = torch.empty(max(n, 1024), dtype=torch.long, pin_memory=True), torch.cuda.Event()
        st.up[slot] = (buf, copied)
    else:
        copied.synchronize()             # this slot's previous copy has left the buffer
    buf.numpy()[:n] = values
    out = buf[:n].to(device, non_blocking=True)
    copied.record()
    return out
