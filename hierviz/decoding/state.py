"""Per-model decoding state: a model, its KV cache and the accepted token sequence.

Invariant of `BaseState`: the cache holds tokens[:cache.length]; tokens[cache.length:] are
*pending*: accepted but not yet run through the model (at least the last one, the root of the
next draft). `features[i]` is the model's output row at token i for i < cache.length: its last
hidden state, then any layer features its heads read (Transformer.feature_width).

Invariant of `HeadState` (a draft head, hierviz.models.drafter, over a base state): its cache
holds pairs (feature_t, token_{t+1}) at position t for t < cache.length, all built from accepted
tokens.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from hierviz.models import cuda_graphs
from hierviz.models.drafter import Drafter
from hierviz.models.llama import KVCache, Transformer, block_mask, causal_mask


@functools.lru_cache(maxsize=64)
def causal_block(n: int) -> torch.Tensor:
    """[n, n] lower-triangular bool on the CPU, shared: callers must not write to it."""
    return torch.ones(n, n, dtype=torch.bool).tril()


class BaseState:
    def __init__(self, model: Transformer, max_len: int) -> None:
        self.model = model
        # On CUDA a static-shape runner (CUDA graphs) owns the KV cache; forwards it cannot
        # take (long prefills) fall back to the dynamic path on the same cache.
        self.runner = cuda_graphs.lease(model, max_len, self)
        self.cache: KVCache = self.runner.cache if self.runner is not None else model.new_cache(max_len)
        self.tokens: list[int] = []
        self.features = torch.zeros(max_len, model.feature_width, dtype=model.dtype, device=model.device)
        self.forwards = 0

    @property
    def processed(self) -> int:
        return self.cache.length

    @property
    def pending(self) -> list[int]:
        return self.tokens[self.cache.length:]

    def _tensor(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.model.device)

    def run_pending(self, extra: Optional[list[int] | torch.Tensor] = None, extra_depths: Optional[torch.Tensor] = None,
                    extra_block: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One forward over the pending tokens (causal) plus `extra` draft tokens.

        extra_depths [S] and extra_block [S, S] (tensors, on the model's device or the CPU)
        describe a tree: each node's depth below the last pending token and the ancestor mask;
        without them the extra tokens are a causal sequence. A tree's tokens may be a device
        tensor too: nothing is read back (see tree.PendingTree). Returns hidden states
        [P + S, H]; the cache holds all of them afterwards until `commit_*` decides what stays."""
        pending = self.pending
        p = len(pending)
        s = 0 if extra is None else len(extra)
        start = self.cache.length
        dev = self.model.device
        if self.runner is not None:
            hidden = self._run_static(pending, extra, start, extra_depths, extra_block)
            if hidden is not None:
                self.forwards += 1
                return hidden
        positions = torch.arange(start, start + p + s, device=dev)
        if extra_depths is not None:
            positions[p:] = start + p - 1 + extra_depths.to(dev)
        ids = self._tensor(pending)
        if s:
            ids = torch.cat([ids, torch.as_tensor(extra, dtype=torch.long).to(dev)])
        if extra_block is None:
            mask = causal_mask(start, p + s, dev)
        else:
            block = torch.zeros(p + s, p + s, dtype=torch.bool, device=dev)
            block[:p, :p] = torch.ones(p, p, dtype=torch.bool, device=dev).tril()
            block[p:, :p] = True
            block[p:, p:] = extra_block.to(dev)
            mask = block_mask(start, block)
        hidden = self.model(ids, positions, self.cache, mask)
        self.forwards += 1
        return hidden

    def _run_static(self, pending: list[int], extra: Optional[list[int] | torch.Tensor], start: int,
                    extra_depths: Optional[torch.Tensor], extra_block: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """run_pending through the static runner: the same positions and mask; what is on the
        host is written on the host, a tree's device tensors are laid over it on the device."""
        p = len(pending)
        n = p + (0 if extra is None else len(extra))
        positions = list(range(start, start + n))
        if extra_depths is None and not isinstance(extra, torch.Tensor):   # a causal sequence: all on the host
            ids = pending + ([] if extra is None else list(extra))
            return self.runner.run(ids, positions, start, start, causal_block(n))
        # device tokens after the pending ones: a causal tail (host positions and mask) or a tree
        dev = self.model.device
        block, depths, tree_block = causal_block(n), None, None
        if extra_depths is not None:
            block = block.clone()
            block[p:, p:] = False          # the tree block comes from the device rows
            depths, tree_block = extra_depths.to(dev) + (start + p - 1), extra_block.to(dev)
        tail = cuda_graphs.DeviceRows(torch.as_tensor(extra, dtype=torch.long).to(dev), depths, tree_block, p)
        return self.runner.run(pending + [0] * (n - p), positions, start, start, block, tail=tail)

    def commit_path(self, start: int, hidden: torch.Tensor, kept: list[int], new_tokens: list[int]) -> None:
        """After run_pending from cache length `start`: keep forward rows `kept` (ascending,
        pending rows first) in the cache and their features; append new_tokens (the accepted
        draft tokens and the verifier's bonus, which stays pending)."""
        n = len(kept)
        if kept == list(range(n)):
            self.cache.keep(start, kept)
            self.features[start:start + n] = hidden[:n]
        else:
            # one upload: the kept rows of `hidden` and their absolute cache slots (a round makes
            # this call between a read-back and its next launch: few ops, the GPU waits on them)
            idx = torch.tensor(kept + [start + i for i in kept], dtype=torch.long).to(hidden.device)
            self.cache.move_to(start, idx[n:])
            torch.index_select(hidden, 0, idx[:n], out=self.features[start:start + n])
        self.tokens.extend(new_tokens)

    def commit_prefix(self, start: int, hidden: torch.Tensor, n_rows: int, new_tokens: list[int]) -> None:
        """Sequence verification: keep the first n_rows forward rows, append new_tokens."""
        self.cache.truncate(start + n_rows)
        self.features[start:start + n_rows] = hidden[:n_rows]
        self.tokens.extend(new_tokens)

    def rollback(self, n_tokens: int) -> None:
        """Forget everything after the first n_tokens accepted tokens."""
        del self.tokens[n_tokens:]
        if self.cache.length > n_tokens:
            self.cache.truncate(n_tokens)

    def consume_pending(self, after: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run every pending token (and then `after`, tokens still on the device: nothing is read
        back) and keep them all; returns their hidden states (no logits). The caller appends
        `after` to `tokens` once it has read them: until then the cache holds more than `tokens`."""
        start = self.cache.length
        hidden = self.run_pending(after)
        self.commit_prefix(start, hidden, hidden.shape[0], [])
        return hidden

    def next_logits(self, after: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run every pending token (and `after`: consume_pending), keep them all; returns the
        logits [V] after the last one."""
        return self.model.logits(self.consume_pending(after)[-1:])[0]


class HeadState:
    def __init__(self, head: Drafter, base: BaseState, max_len: int) -> None:
        self.head = head
        self.base = base
        self.runner = cuda_graphs.lease(head, max_len, self, window_extra=cuda_graphs.HEAD_WINDOW)
        self.cache: KVCache = self.runner.cache if self.runner is not None else head.new_cache(max_len)
        self.last_hidden: Optional[torch.Tensor] = None   # the head's output at its last real pair
        self.committed = 0                                # pairs built from accepted tokens only
        self.forwards = 0
        mask = head.draft_vocab_mask()
        # on the host, for the trace: which verifier tokens the head could have drafted at all
        self.draftable: Optional[list[bool]] = None if mask is None else mask.cpu().tolist()

    def forward(self, tokens: list[int], features: torch.Tensor, positions: list[int],
                mask: Optional[torch.Tensor] = None, visible_upto: Optional[int] = None) -> torch.Tensor:
        """One head forward appending len(tokens) pairs to the cache. mask: bool [T, cache.length + T]
        on the CPU (None = causal); its columns before `visible_upto` must all be True (the static
        path treats them so). Returns the predicted features [T, H]."""
        start = self.cache.length
        t = len(tokens)
        self.forwards += 1
        if self.runner is not None:
            wstart = start if visible_upto is None else visible_upto
            window = causal_block(t) if mask is None else mask[:, wstart:]
            out = self.runner.run(tokens, positions, start, wstart, window, features)
            if out is not None:
                return out
        dev = self.head.device
        return self.head(torch.tensor(tokens, dtype=torch.long, device=dev), features,
                         torch.tensor(positions, dtype=torch.long, device=dev), self.cache,
                         None if mask is None else mask.to(dev))

    def forward_tree(self, tokens: torch.Tensor, features: torch.Tensor, position: int,
                     seen: torch.Tensor) -> torch.Tensor:
        """One depth of a draft tree, inputs already on the model's device: tokens [T], all at
        `position`; seen [T, cache.length - committed + T] bool: which of the tree's slots so far
        (and its own) each token sees, where committed = cache.length - (seen columns - T); the
        committed pairs before are all visible. Returns the predicted features [T, H]."""
        start = self.cache.length
        t = tokens.shape[0]
        committed = start + t - seen.shape[1]
        self.forwards += 1
        if self.runner is not None:
            tail = cuda_graphs.DeviceRows(tokens, None, seen, 0)
            out = self.runner.run([0] * t, [position] * t, start, committed, None, features, tail=tail)
            if out is not None:
                return out
        dev = self.head.device
        mask = torch.cat([torch.ones(t, committed, dtype=torch.bool, device=dev), seen.to(dev)], 1)
        return self.head(tokens.to(dev), features, torch.full((t,), position, dtype=torch.long, device=dev),
                         self.cache, mask)

    def rollback(self, n_tokens: int) -> None:
        """Pair t stays valid while token t+1 is still accepted."""
        keep = max(0, n_tokens - 1)
        if self.cache.length > keep:
            self.cache.truncate(keep)
            self.last_hidden = None
        self.committed = min(self.committed, self.cache.length)

    def root_hidden(self) -> torch.Tensor:
        """Feed the pairs not yet seen, up to (feature_{R-2}, root); returns the predicted
        feature at the root's position (its LM-head output drafts the root's children).

        When the base model is one token short (HierSpec after T accepted all of M's draft: M
        never ran its own last bonus token), the missing feature is the head's own prediction
        of it, as for any node inside a draft tree, instead of a base forward just for it: the
        pair (predicted feature, root) is provisional and `end_tree` drops it again; the
        verifier's forward then runs both pending tokens with the tree."""
        base = self.base
        n_tok = len(base.tokens)
        known = min(base.processed, n_tok - 1)      # base features exist for tokens[:known]
        if known < n_tok - 2 or known < 1:
            raise RuntimeError("EAGLE head needs the base model's feature before the root (or the one before "
                               "it): run the pending tokens through the base model first")
        if self.cache.length > self.committed:      # a provisional pair left by an earlier call
            self.cache.truncate(self.committed)
        start = self.cache.length
        if known > start:                           # real pairs t = start .. known-1
            out = self.forward(base.tokens[start + 1:known + 1], self.head.project_features(base.features[start:known]),
                               list(range(start, known)))
            self.last_hidden = out[-1]
        if self.last_hidden is None:
            raise RuntimeError("EAGLE head has no pair for the root; the prompt must have at least one token")
        self.committed = self.cache.length
        if known == n_tok - 1:
            return self.last_hidden
        return self.forward([base.tokens[-1]], self.last_hidden[None], [n_tok - 2])[0]

    def end_tree(self) -> None:
        """Drop a draft tree's pairs, and a provisional root pair, from the cache."""
        self.cache.truncate(self.committed)
