"""Static-shape forwards, replayed from CUDA graphs on a GPU (the engine's fast path).

A batch-1 forward of a small model is launch-bound: SmolLM2-135M runs ~450 kernels per
token, and Python dispatch costs more than the GPU work. A CUDA graph replays all of them
with one launch, but only if every forward of a given size has the same shapes and reads
and writes the same addresses. So the static path:

  * pads the T new tokens up to a bucket (BUCKETS) and keeps one graph per bucket;
  * writes the new keys/values with `index_copy_` at slots start + arange(bucket) (a tensor,
    not a Python slice), so the cache length is data, not shape; padded rows land in scratch
    slots past the live region, which the next forward overwrites or the mask hides;
  * attends over the whole preallocated cache with a [bucket, max_len] boolean mask built
    *inside* the graph from two scalars and a small window:
        column c visible  <=>  c < wstart  or  window[row, c - wstart]
    (wstart = start for the base models, where window = causal/tree block; an EAGLE head
    drafting a tree sets wstart = the committed pairs and the window covers the tree nodes
    of earlier depths, of which each row sees only its ancestors);
  * copies the few input numbers (tokens, positions, start, wstart, window) host-to-device
    from pinned staging buffers, without a host sync.

The same code runs without graphs on the CPU when forced (`force_static(True)`), which is how
CI checks that it computes what the dynamic path computes. Forwards larger than the largest
bucket (a long prompt's prefill) and windows too wide for a bucket return None and the
caller uses the dynamic path on the same cache.
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from hierviz.config import options, overrides
from hierviz.models.drafter import is_drafter

BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 64, 96, 128)   # 24: the paper trees' E_T verification (23 nodes and the root)
HEAD_WINDOW = 128        # extra window columns for an EAGLE head's tree-drafting masks
LEN_ROUND = 256          # live cache lengths are rounded up, so runs of similar length share graphs

_force = False
_lock = threading.Lock()


def force_static(on: bool) -> None:
    """Use the static-shape path on any device (without graphs off CUDA): for tests."""
    global _force
    _force = on


def static_enabled(device: torch.device) -> bool:
    """Static path on CUDA unless HIERVIZ_STATIC=0; elsewhere only when forced."""
    if _force:
        return True
    return device.type == "cuda" and options().static


def graphs_enabled(device: torch.device) -> bool:
    """CUDA graphs on top of the static path (HIERVIZ_CUDA_GRAPHS=0 runs it eagerly, for debugging)."""
    return device.type == "cuda" and options().cuda_graphs


@contextmanager
def path_switches(static: Optional[bool] = None, graphs: Optional[bool] = None,
                  fused: Optional[bool] = None) -> Iterator[None]:
    """The static path, CUDA graphs and the fused layer kernels (hierviz.models.fused) on or off
    for runners leased inside the block (None: leave as is): benchmarks compare the paths in one
    process. Graphs already captured keep the path they were captured with (`drop_runners` first)."""
    with overrides(static=static, cuda_graphs=graphs, fused=fused):
        yield


def bucket_for(t: int) -> Optional[int]:
    for b in BUCKETS:
        if t <= b:
            return b
    return None


class _Bucket:
    """Bucket b's input buffers: on each side (device, pinned host) one byte buffer holding
    ints = tokens | positions | start | wstart ([2b + 2] int64) and the visibility window
    win ([b, w] bool), so that a forward's inputs go up in one copy."""

    def __init__(self, b: int, w: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        n_int = 8 * (2 * b + 2)
        self.raw_dev = torch.zeros(n_int + b * w, dtype=torch.uint8, device=device)
        self.raw_host = torch.zeros(n_int + b * w, dtype=torch.uint8, pin_memory=pin)
        self.ints_dev, self.ints_host = (r[:n_int].view(torch.long) for r in (self.raw_dev, self.raw_host))
        self.win_dev, self.win_host = (r[n_int:].view(torch.bool).view(b, w) for r in (self.raw_dev, self.raw_host))
        self.ints_np = self.ints_host.numpy()    # views: writes land in the host tensors
        self.win_np = self.win_host.numpy()
        self.copied: Optional[torch.cuda.Event] = torch.cuda.Event() if pin else None
        self.graph: Optional["torch.cuda.CUDAGraph"] = None
        self.out: Optional[torch.Tensor] = None


class StaticRunner:
    """Static-shape forwards of one model (a Transformer or a draft head) over one KV cache it
    owns. Leased to one decoding state at a time (see `lease`)."""

    def __init__(self, model, live_len: int, window_extra: int, graphs: bool) -> None:
        self.model = model
        self.is_head = is_drafter(model)                       # a draft head takes features too
        self.live_len = live_len
        self.window_extra = window_extra
        self.graphs = graphs
        self.device = model.device
        total = live_len + BUCKETS[-1] + window_extra         # scratch past the live region
        self.cache = model.new_cache(total)
        self.cols = torch.arange(total, device=self.device)
        self.ar = torch.arange(BUCKETS[-1] + window_extra, device=self.device)
        self.feat = (torch.zeros(BUCKETS[-1], model.cfg.hidden_size, dtype=model.dtype, device=self.device)
                     if self.is_head else None)
        self._buckets: dict[int, _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if graphs else None
        self.in_use = False
        self.tree_graphs: dict = {}      # hierviz.decoding.tree.TreeGraph per tree shape, most recent last

    # ---- buffers and the captured function -----------------------------------------------

    def _bucket(self, b: int) -> _Bucket:
        """Bucket b's input buffers (created on first use): ints_dev = tokens | positions | start |
        wstart, win_dev = the visibility window; `_forward` reads them (and `feat` for a head)."""
        bk = self._buckets.get(b)
        if bk is None:
            bk = self._buckets[b] = _Bucket(b, b + self.window_extra, self.device)
        return bk

    def _forward(self, b: int) -> torch.Tensor:
        """The static forward for bucket b, eager or under capture: reads only the bucket's device
        buffers (`run` fills them from the host, `run_on_device` with device ops)."""
        bk = self._buckets[b]
        ints = bk.ints_dev
        tok, pos, start, wstart = ints[:b], ints[b:2 * b], ints[2 * b], ints[2 * b + 1]
        slots = start + self.ar[:b]
        mask = (self.cols < wstart).unsqueeze(0).expand(b, -1).clone()
        mask.index_copy_(1, wstart + self.ar[:bk.win_dev.shape[1]], bk.win_dev)
        if self.is_head:
            return self.model(tok, self.feat[:b], pos, self.cache, mask, slots)
        return self.model(tok, pos, self.cache, mask, slots)

    def _upload(self, bk: _Bucket) -> None:
        bk.raw_dev.copy_(bk.raw_host, non_blocking=bk.copied is not None)
        if bk.copied is not None:
            bk.copied.record()

    def _scratch_inputs(self, b: int) -> _Bucket:
        """Bucket b's inputs set to write only scratch slots (start = wstart = live_len)."""
        bk = self._bucket(b)
        if bk.copied is not None:
            bk.copied.synchronize()
        bk.ints_host.zero_()
        bk.ints_host[2 * b] = bk.ints_host[2 * b + 1] = self.live_len
        bk.win_host.zero_()
        self._upload(bk)
        return bk

    def prepare(self, b: int) -> None:
        """Compile bucket b's kernels (and capture its graph) now rather than on first use."""
        with torch.no_grad():
            if self.graphs:
                if self._bucket(b).graph is None:
                    self._capture(b)
            else:
                self._scratch_inputs(b)
                self._forward(b)

    def _capture(self, b: int) -> None:
        """Warm up (compiles kernels, builds the W4 kernels' weight layouts), then capture.
        The warm-up runs write only scratch slots: start = wstart = live_len."""
        bk = self._scratch_inputs(b)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            bk.out = self._forward(b)
        bk.graph = graph

    # ---- the one entry point ----------------------------------------------------------------

    def run(self, tokens: Sequence[int], positions: Sequence[int], start: int, wstart: int,
            window: Optional[torch.Tensor], features: Optional[torch.Tensor] = None,
            tail: Optional["DeviceRows"] = None) -> Optional[torch.Tensor]:
        """Forward T = len(tokens) new tokens written at cache slots start..start+T-1.

        window: bool [T, start + T - wstart] on the CPU, or None (all False): which of the columns
        wstart.. each new token sees (columns < wstart are all visible). features [T, H] for an
        EAGLE head. tail: inputs of the last rows already on the device (a draft tree never read
        back), laid over the host ones in stream order, without a host round trip.
        Returns hidden states [T, H] (a fresh tensor), or None when this forward does not fit
        a bucket (the caller then takes the dynamic path). Sets cache.length = start + T."""
        t = len(tokens)
        w = start + t - wstart
        b = bucket_for(t)
        if b is None or w > b + self.window_extra or wstart > start or start + t > self.live_len:
            return None
        with torch.no_grad():
            bk = self._bucket(b)
            if self.graphs and bk.graph is None:
                # capture first: its warm-up overwrites the input buffers (scratch-slot inputs)
                self._capture(b)
            if bk.copied is not None:
                bk.copied.synchronize()    # the previous upload from these pinned buffers is done
            # filled through numpy views of the (pinned) host buffers: a numpy store costs ~1 us
            # where a torch indexing op costs ~5-10 us, and a round makes several forwards
            ih, wh = bk.ints_np, bk.win_np
            ih.fill(0)
            ih[:t] = tokens
            ih[b:b + t] = positions
            ih[2 * b] = start
            ih[2 * b + 1] = wstart
            wh.fill(False)
            if window is not None:
                wh[:t, :w] = window.numpy()
            if t < b:                      # padded rows see only their own (scratch) slot: no empty rows
                pad = np.arange(t, b)
                wh[pad, start - wstart + pad] = True
            self._upload(bk)
            if tail is not None:
                r0, r1 = t - tail.tokens.shape[0], t
                bk.ints_dev[r0:r1].copy_(tail.tokens)
                if tail.positions is not None:
                    bk.ints_dev[b + r0:b + r1].copy_(tail.positions)
                if tail.block is not None:
                    bk.win_dev[r0:r1, tail.col:tail.col + tail.block.shape[1]].copy_(tail.block)
            if features is not None:
                self.feat[:t].copy_(features)
            if self.graphs:
                bk.graph.replay()
                out = bk.out
            else:
                out = self._forward(b)
            self.cache.length = start + t
            return out[:t].clone()     # the static output is overwritten by the next replay

    def run_on_device(self, tokens: torch.Tensor, position: torch.Tensor, wstart: torch.Tensor, offset: int,
                      window: torch.Tensor, features: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`run` with every input already on the device and written by device ops (no upload, no
        host value), for code captured into a larger CUDA graph (tree.TreeGraph): T = len(tokens)
        rows all at `position` (a one-element tensor), wstart a one-element tensor, start =
        wstart + offset (offset a host int, fixed per call site), window bool [T, offset + T].
        The caller checks that it fits (bucket, window width, cache) and sets cache.length."""
        t = tokens.shape[0]
        b = bucket_for(t)
        bk = self._bucket(b)
        ints = bk.ints_dev
        ints.zero_()
        ints[:t].copy_(tokens)
        ints[b:2 * b].copy_(position.expand(b))
        ints[2 * b:2 * b + 1].copy_(wstart + offset)
        ints[2 * b + 1:2 * b + 2].copy_(wstart)
        bk.win_dev.zero_()
        bk.win_dev[:t, :window.shape[1]].copy_(window)
        if t < b:                      # padded rows see only their own (scratch) slot, as in `run`
            pad = torch.arange(t, b, device=ints.device)
            bk.win_dev[pad, offset + pad] = torch.ones(b - t, dtype=torch.bool, device=ints.device)  # no host scalar
        if features is not None:
            self.feat[:t].copy_(features)
        return self._forward(b)[:t]


@dataclass
class DeviceRows:
    """The last S rows of a static forward's inputs, on the device: tokens [S], positions [S]
    (None: the host ones), and a mask block [S, W] for window columns col..col+W (the rest of
    those rows comes from the host window; None: the rows' whole window is the host's)."""
    tokens: torch.Tensor
    positions: Optional[torch.Tensor]
    block: Optional[torch.Tensor]
    col: int


def lease(model, max_len: int, owner: object, window_extra: int = 0) -> Optional[StaticRunner]:
    """A runner (and its KV cache) for `owner` (a decoding state) while it lives, or None when
    the static path is off for this device. Runners are pooled on the model and reused by
    later states, so graphs are captured once per model, length class and bucket."""
    if not static_enabled(model.device):
        return None
    live = -(-max_len // LEN_ROUND) * LEN_ROUND
    with _lock:
        pool: list[StaticRunner] = model.static_runners
        runner = next((r for r in pool if not r.in_use and r.live_len == live and r.window_extra == window_extra),
                      None)
        if runner is None:
            runner = StaticRunner(model, live, window_extra, graphs_enabled(model.device))
            pool.append(runner)
        runner.in_use = True
    runner.cache.length = 0
    weakref.finalize(owner, _release, runner)
    return runner


def _release(runner: StaticRunner) -> None:
    with _lock:
        runner.in_use = False


def prepare_all(model) -> int:
    """Compile and capture every bucket of the model's pooled runners (a benchmark's warm-up:
    Triton compiles a kernel variant per tile shape, seconds each, which must not land inside
    timed decoding). Returns the number of runners prepared."""
    with _lock:
        runners = list(model.static_runners)
    for r in runners:
        for b in BUCKETS:
            r.prepare(b)
    return len(runners)


def prepare_models(models) -> int:
    """prepare_all for each of `models`: after a short warm-up run, the buckets it did
    not reach (a longer prompt's prefill, a longer draft's verification) are compiled and captured
    too, so that no Triton compile lands inside a timed or recorded run. Returns runners prepared."""
    return sum(prepare_all(m) for m in models)


def drop_runners(model) -> None:
    """Free a model's pooled runners (their caches and graphs)."""
    with _lock:
        model.static_runners.clear()
