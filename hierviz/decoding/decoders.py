"""The decoders, sharing the model code and the trace format: AR, sequence speculative
decoding, EAGLE-2 or EAGLE-3 on the target (a tree drafted by E_T, verified by T), and HierSpec. Each is a generator of trace `Step`s, one per round, forever; the
driver (hierviz.engine) stops it on EOS, the token budget or a user's Stop. Step 0 is the
prefill round that produces the first token.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch

from hierviz.config import options
from hierviz.settings import DecodeSettings
from hierviz.decoding.state import BaseState, HeadState
from hierviz.decoding.tree import PendingTree, Tree, draft_tree_on_device
from hierviz.decoding.verify import (AcceptOracle, Sampler, forced_sequence, forced_tree_path,
                                     verify_sequence_greedy, verify_sequence_sampling, verify_tree_greedy,
                                     verify_tree_sampling)
from hierviz import methods
from hierviz.models.drafter import HEAD_SLOTS, Drafter, head_label
from hierviz.models.llama import Transformer
from hierviz.trace import DraftTree, SeqToken, Step, TreeNode, tree_rejected


class Models:
    """The models of a stack: the target T, an optional intermediate M, and a draft head per
    filled slot of HEAD_SLOTS (`models.e_m`, `models.e_t`, ...; None where the slot is empty).
    Heads may be given positionally in HEAD_SLOTS' order or by slot name."""

    def __init__(self, target: Transformer, intermediate: Optional[Transformer] = None,
                 *heads: Optional[Drafter], **named: Optional[Drafter]) -> None:
        slots = list(HEAD_SLOTS)
        if len(heads) > len(slots):
            raise TypeError(f"Models takes at most {len(slots)} heads ({', '.join(slots)})")
        unknown = sorted(set(named) - set(slots))
        if unknown:
            raise TypeError(f"unknown head slot(s) {', '.join(unknown)}; slots: {', '.join(slots)}")
        object.__setattr__(self, "heads", {**dict(zip(slots, heads)), **named})
        self.target = target
        self.intermediate = intermediate

    def __getattr__(self, name: str) -> Optional[Drafter]:
        if name in HEAD_SLOTS:
            return self.__dict__["heads"].get(name)
        raise AttributeError(name)

    def __setattr__(self, name: str, value: object) -> None:
        if name in HEAD_SLOTS:
            self.__dict__["heads"][name] = value
        else:
            object.__setattr__(self, name, value)

    def part(self, name: str) -> object:
        """A stack part by its name in Method.needs: "intermediate" or a head slot."""
        return getattr(self, name)

    def present(self) -> list:
        """The models this stack has (target first)."""
        return [m for m in (self.target, self.intermediate, *self.heads.values()) if m is not None]

    def missing(self, method: str) -> list[str]:
        """The parts `method` needs that this stack lacks, by their names in messages."""
        return [part_name(p) for p in methods.get(method).needs if self.part(p) is None]


def comparison_methods(models: Models) -> list[str]:
    """The methods a side-by-side comparison runs on this stack, in the registry's comparison order."""
    return methods.comparison_having(lambda part: models.part(part) is not None)


def part_name(part: str) -> str:
    """A stack part's name in messages."""
    if part == "intermediate":
        return "intermediate model"
    base, kind = HEAD_SLOTS[part]
    head = f"{head_label(kind)} head" if kind else "draft head"
    return f"{head} on the {base} ({part.upper()})"


class StageTimer:
    """Time per stage in ms.

    On CUDA (trace mode, the default) stages are timed with CUDA events: an event is recorded at
    every stage boundary and the round synchronises once, in `finish`, to read them, so timing
    adds no host synchronisation inside a round. A stage's time is the GPU timeline between its
    two events, which includes any time the GPU waited for the host inside the stage.
    `StageTimer.sync = False` (or HIERVIZ_TIMING_SYNC=0) is the no-sync mode for benchmarks:
    no events, no syncs; stage times become host dispatch times. HIERVIZ_TIMING_EVENTS=0 falls
    back to a device synchronize around every stage. On the CPU, plain wall time."""

    sync = options().timing_sync
    events = options().timing_events

    def __init__(self, device: torch.device, since: Any = None, until: Any = None) -> None:
        """since, until: marks taken earlier (`mark`) to start and end the round at, in place of
        a mark now and one at `finish`."""
        self.cuda = device.type == "cuda" and StageTimer.sync
        self.use_events = self.cuda and StageTimer.events
        self.ms: dict[str, float] = {}
        self.marks: list[tuple[str, Any, Any]] = []
        self.t0 = self._mark() if since is None else since
        self.until = until

    def mark(self) -> Any:
        """A point on this timer's clock: a recorded CUDA event, or the host clock."""
        return self._mark()

    def span(self, name: str, start: Any, end: Any) -> None:
        """Stage `name` from one earlier mark to another."""
        if self.use_events:
            self.marks.append((name, start, end))
        else:
            self.ms[name] = self.ms.get(name, 0.0) + (end - start) * 1000.0

    def _mark(self) -> Any:
        if self.use_events:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextmanager
    def stage(self, name: str):
        t = self._mark()
        try:
            yield
        finally:
            self.span(name, t, self._mark())

    def finish(self) -> dict[str, float]:
        end = self._mark() if self.until is None else self.until
        if self.use_events:
            end.synchronize()
            for name, a, b in self.marks:
                self.ms[name] = self.ms.get(name, 0.0) + a.elapsed_time(b)
            self.marks.clear()
            total = self.t0.elapsed_time(end)
        else:
            total = (end - self.t0) * 1000.0
        out = dict(self.ms)
        out["overhead"] = max(0.0, total - sum(out.values()))
        return out


TextOf = Callable[[int], str]


def tree_to_trace(tree: Tree, path: list[int], bonus: int, verifier: str, text: TextOf,
                   draftable: Optional[list[bool]] = None) -> DraftTree:
    """The trace's tree; draftable (HeadState.draftable): marks a rejection whose correct token
    lies outside the head's draft vocabulary, which no tree could have held."""
    nodes = [TreeNode(i + 1, t, text(t), p + 1, d, s, lp)
             for i, (t, p, d, s, lp) in enumerate(zip(tree.tokens, tree.parents, tree.depths, tree.scores, tree.logprobs))]
    out = DraftTree(tree.root, text(tree.root), nodes, [i + 1 for i in path], bonus, text(bonus), verifier)
    out.undraftable = draftable is not None and not draftable[bonus] and tree_rejected(out)
    return out


def make_step(index: int, method: str, timer: StageTimer, tokens: list[int], sources: list[str], text: TextOf,
              **kw: Any) -> Step:
    """A round's trace Step: its new tokens and their sources, the stage times (`timer` finished here)."""
    return Step(index=index, method=method, new_tokens=tokens, new_text=[text(t) for t in tokens],
                new_sources=sources, timings_ms=timer.finish(), **kw)


def prefill(states: list[BaseState], prompt: list[int], sampler: Sampler, timer: StageTimer,
             stage_names: list[str]) -> int:
    """Run the prompt through every model; the first state's (the target's) pick is token 1."""
    first = None
    for st, name in zip(states, stage_names):
        st.tokens = list(prompt)
        with timer.stage(name):
            if first is None:
                first = sampler.pick(st.next_logits())
            else:
                st.consume_pending()
    for st in states:
        st.tokens.append(first)
    return first


def verify_tree_on(state: BaseState, pending_tree: PendingTree, sampler: Sampler,
                    oracle: Optional[AcceptOracle] = None, level: str = "target",
                    meanwhile: Optional[Callable[[], None]] = None):
    """Run pending + tree through the verifier and decide.
    Returns (the tree read back, path, bonus, per-emitted-token distributions or None, commit):
    `commit()` compacts the verifier's cache to the accepted path and must run before the
    verifier's next forward; a caller may first queue GPU work that does not need it.
    The tree is still on the device: the verifier's forward is queued behind the draft and the
    one read-back brings the tree and the verifier's argmax rows together. `meanwhile`: host
    work (trace bookkeeping) done while the GPU runs the forward, off the round's critical path.
    oracle (what-if replay only): forces the accepted path length; the forward and the
    compaction run exactly as they would for that decision."""
    start = state.processed
    p = len(state.pending)
    h = state.run_pending(pending_tree.tokens, pending_tree.depths, pending_tree.mask)
    logits = state.model.logits(h[p - 1:])
    sampling = oracle is None and not sampler.greedy
    best_rows = None if sampling else logits.argmax(-1)
    if meanwhile is not None:
        meanwhile()
    if best_rows is None:
        tree, _ = pending_tree.read()
        path, bonus, dists = verify_tree_sampling(tree, logits, sampler)
    else:
        tree, (best,) = pending_tree.read(best_rows)
        dists = None
        if oracle is not None:
            path, bonus = forced_tree_path(tree, best, oracle.tree(level, tree))
        else:
            path, bonus = verify_tree_greedy(tree, best)
    def commit() -> None:
        state.commit_path(start, h, list(range(p)) + [p + i for i in path], [tree.tokens[i] for i in path] + [bonus])
    return tree, path, bonus, dists, commit


def verify_sequence_on(state: BaseState, draft: list[int], q: Optional[list[torch.Tensor]],
                        sampler: Sampler, oracle: Optional[AcceptOracle] = None,
                        meanwhile: Optional[Callable[[], None]] = None) -> tuple[int, int]:
    """Run pending + the sequence draft through the verifier, keep the longest prefix it accepts and
    its own next token; returns (accepted count, that token). `q`: the drafter's distribution per
    draft token, for sampling; `oracle`, `meanwhile`: as in verify_tree_on."""
    start = state.processed
    p = len(state.pending)
    h = state.run_pending(draft)
    logits = state.model.logits(h[p - 1:])
    if meanwhile is not None:
        meanwhile()
    if oracle is not None:   # what-if replay: forced accepted count, same forward and truncation
        n, bonus = forced_sequence(draft, logits, oracle.sequence("target", draft))
    elif sampler.greedy:
        n, bonus = verify_sequence_greedy(draft, logits)
    else:
        n, bonus = verify_sequence_sampling(draft, q, logits, sampler)
    state.commit_prefix(start, h, p + n, draft[:n] + [bonus])
    return n, bonus


class TokenAhead:
    """A greedy token picked on the device from the logits `forward()` returns, its copy to the
    host started at once: `value` waits for that copy alone, not for the work queued after it.
    `start` and `ready` mark the forward's start and the token's completion on `timer`'s clock
    (on the GPU's timeline with events: the forward's own time, without any wait before it)."""

    def __init__(self, forward: Callable[[], torch.Tensor], timer: StageTimer) -> None:
        self.start = timer.mark()
        self.token = forward().argmax(-1).view(1)
        self.host = self.token.to("cpu", non_blocking=True)    # pinned, asynchronous from a GPU
        self.copied = torch.cuda.Event() if self.token.is_cuda else None
        if self.copied is not None:
            self.copied.record()
        self.ready = timer.mark()

    def value(self) -> int:
        if self.copied is not None:
            self.copied.synchronize()
        return int(self.host)


def decode_ar(models: Models, prompt: list[int], s: DecodeSettings, sampler: Sampler, text: TextOf,
              max_len: int, oracle: Optional[AcceptOracle] = None) -> Iterator[Step]:
    t = BaseState(models.target, max_len)
    timer = StageTimer(t.model.device)
    tok = prefill([t], prompt, sampler, timer, ["target_verify"])
    yield make_step(0, "ar", timer, [tok], ["target_bonus"], text, forwards={"target": 1})
    if sampler.greedy and ar_ahead(t.model.device):
        yield from greedy_ar_ahead(t, s, text)
        return
    i = 1
    while True:
        timer = StageTimer(t.model.device)
        with timer.stage("target_verify"):
            tok = sampler.pick(t.next_logits())
            t.tokens.append(tok)
        yield ar_step(i, timer, tok, text)
        i += 1


def ar_step(index: int, timer: StageTimer, tok: int, text: TextOf) -> Step:
    """A decode round of AR: one token, the target's own."""
    return make_step(index, "ar", timer, [tok], ["target_bonus"], text, forwards={"target": 1},
                     target_bonus=tok, target_bonus_text=text(tok))


def ar_ahead(device: torch.device) -> bool:
    """Whether greedy AR queues its forwards ahead on `device` (HIERVIZ_AR_AHEAD: cuda, the
    default; off; on)."""
    mode = options().ar_ahead
    return mode == "on" or (mode == "cuda" and device.type == "cuda")


def greedy_ar_ahead(t: BaseState, s: DecodeSettings, text: TextOf) -> Iterator[Step]:
    """Greedy AR after the prefill round, each forward queued before the host reads the token it
    follows from: the token stays on the device, the next forward takes it from there, and the
    host reads it (and yields its step) while that forward runs, so the GPU does not wait on the
    host between forwards. The same forwards in the same order as one at a time: the same tokens
    and cache. Forwards are queued ahead only up to s.max_new_tokens tokens (the prefill's
    included); a consumer that goes on gets one forward at a time. A step's time is the time of
    the forward that made its token, not the host's time between steps."""
    clock = StageTimer(t.model.device)
    nxt = TokenAhead(t.next_logits, clock)      # after the prefill's token, pending on the host
    i = 1
    while True:
        ahead = TokenAhead(lambda: t.next_logits(after=nxt.token), clock) if i + 1 < s.max_new_tokens else None
        tok = nxt.value()
        t.tokens.append(tok)
        timer = StageTimer(t.model.device, since=nxt.start, until=nxt.ready)
        timer.span("target_verify", nxt.start, nxt.ready)
        yield ar_step(i, timer, tok, text)
        nxt = ahead if ahead is not None else TokenAhead(t.next_logits, clock)   # tok is pending now
        i += 1


def decode_spec(models: Models, prompt: list[int], s: DecodeSettings, sampler: Sampler, text: TextOf,
                max_len: int, oracle: Optional[AcceptOracle] = None) -> Iterator[Step]:
    if models.intermediate is None:
        raise ValueError("sequence speculative decoding needs an intermediate (draft) model in the stack")
    t = BaseState(models.target, max_len)
    m = BaseState(models.intermediate, max_len)
    timer = StageTimer(t.model.device)
    tok = prefill([t, m], prompt, sampler, timer, ["target_verify", "draft"])
    yield make_step(0, "spec", timer, [tok], ["target_bonus"], text, forwards={"target": 1, "intermediate": 1})
    i = 1
    while True:
        timer = StageTimer(t.model.device)
        base_len = len(t.tokens)
        draft: list[int] = []
        q: list[torch.Tensor] = []
        with timer.stage("draft"):
            for _ in range(s.spec_k):
                logits = m.next_logits()
                if sampler.greedy:
                    nxt = int(logits.argmax())
                else:
                    dist = sampler.probs(logits)
                    nxt = sampler.sample(dist)
                    q.append(dist)
                m.tokens.append(nxt)
                draft.append(nxt)
        with timer.stage("target_verify"):
            n, bonus = verify_sequence_on(t, draft, q, sampler, oracle)
        m.rollback(base_len + n)
        m.tokens.append(bonus)
        seq = [SeqToken(x, text(x), "draft") for x in draft]
        yield make_step(i, "spec", timer, draft[:n] + [bonus], ["draft"] * n + ["target_bonus"], text,
                    sequence=seq, target_accepted=n, target_bonus=bonus, target_bonus_text=text(bonus),
                    forwards={"target": 1, "intermediate": s.spec_k})
        i += 1


def decode_eagle2(models: Models, prompt: list[int], s: DecodeSettings, sampler: Sampler, text: TextOf,
                  max_len: int, oracle: Optional[AcceptOracle] = None) -> Iterator[Step]:
    """EAGLE-2: an EAGLE-1/2 head on T (E_T) drafts a dynamic tree, T verifies the tree."""
    yield from _decode_target_tree("eagle2", models, prompt, s, sampler, text, max_len, oracle)


def decode_eagle3(models: Models, prompt: list[int], s: DecodeSettings, sampler: Sampler, text: TextOf,
                  max_len: int, oracle: Optional[AcceptOracle] = None) -> Iterator[Step]:
    """EAGLE-3: the same rounds with an EAGLE-3 head on T (E_T3), fed by T's layer features."""
    yield from _decode_target_tree("eagle3", models, prompt, s, sampler, text, max_len, oracle)


def _decode_target_tree(method: str, models: Models, prompt: list[int], s: DecodeSettings, sampler: Sampler,
                        text: TextOf, max_len: int, oracle: Optional[AcceptOracle]) -> Iterator[Step]:
    missing = models.missing(method)
    if missing:
        raise ValueError(f"{method} needs the stack's {', '.join(missing)}")
    t = BaseState(models.target, max_len)
    slot = methods.get(method).needs[0]      # the head slot whose drafter feeds T's trees
    e = HeadState(models.part(slot), t, max_len)
    timer = StageTimer(t.model.device)
    tok = prefill([t], prompt, sampler, timer, ["target_verify"])
    yield make_step(0, method, timer, [tok], ["target_bonus"], text, forwards={"target": 1})
    i = 1
    while True:
        timer = StageTimer(t.model.device)
        e0 = e.forwards
        with timer.stage("draft"):
            drafted = draft_tree_on_device(e, s.t_depth, s.t_topk, s.t_tree_size)
        with timer.stage("target_verify"):
            tree, path, bonus, _, commit = verify_tree_on(t, drafted, sampler, oracle, "target")
            commit()
        toks = [tree.tokens[j] for j in path]
        yield make_step(i, method, timer, toks + [bonus], ["tree"] * len(path) + ["target_bonus"], text,
                    trees=[tree_to_trace(tree, path, bonus, "target", text, e.draftable)], target_accepted=len(path),
                    target_bonus=bonus, target_bonus_text=text(bonus),
                    forwards={"target": 1, slot: e.forwards - e0})
        i += 1


def decode_hierspec(models: Models, prompt: list[int], s: DecodeSettings, sampler: Sampler, text: TextOf,
                    max_len: int, oracle: Optional[AcceptOracle] = None) -> Iterator[Step]:
    missing = models.missing("hierspec")
    if missing:
        raise ValueError(f"HierSpec needs the stack's {', '.join(missing)}")
    t = BaseState(models.target, max_len)
    m = BaseState(models.intermediate, max_len)
    e = HeadState(models.e_m, m, max_len)
    timer = StageTimer(t.model.device)
    tok = prefill([t, m], prompt, sampler, timer, ["target_verify", "intermediate_verify"])
    yield make_step(0, "hierspec", timer, [tok], ["target_bonus"], text, forwards={"target": 1, "intermediate": 1})
    i = 1
    while True:
        timer = StageTimer(t.model.device)
        base_len = len(t.tokens)
        m0, e0 = m.forwards, e.forwards
        draft: list[int] = []
        q: list[torch.Tensor] = []
        seq: list[SeqToken] = []
        trees: list[DraftTree] = []
        unrecorded: list[tuple[Tree, list[int], int]] = []

        def record() -> None:
            """Trace entries of the trees verified so far (run while the next forward runs)."""
            for tree, path, bonus in unrecorded:
                k = len(trees)
                seq.extend(SeqToken(tree.tokens[j], text(tree.tokens[j]), "tree", k) for j in path)
                seq.append(SeqToken(bonus, text(bonus), "intermediate_bonus", k))
                trees.append(tree_to_trace(tree, path, bonus, "intermediate", text, e.draftable))
            unrecorded.clear()

        while True:
            # after a fully accepted round M has not run its own last bonus yet: E_M predicts
            # that feature (HeadState.root_hidden) and M's verification runs both pending tokens
            with timer.stage("draft"):
                drafted = draft_tree_on_device(e, s.m_depth, s.m_topk, s.m_tree_size)
            with timer.stage("intermediate_verify"):
                tree, path, bonus, dists, commit_m = verify_tree_on(m, drafted, sampler, oracle, "intermediate",
                                                                     record)
            draft += [tree.tokens[j] for j in path] + [bonus]
            if dists is not None:
                q += dists
            unrecorded.append((tree, path, bonus))
            if len(draft) >= s.min_draft_len:
                break
            with timer.stage("intermediate_verify"):
                commit_m()

        def meanwhile() -> None:
            # T's forward does not need M's compaction: it is queued behind T's forward
            # instead of keeping the GPU waiting before it (its GPU time counts as T's stage)
            commit_m()
            record()

        with timer.stage("target_verify"):
            n, bonus_t = verify_sequence_on(t, draft, q if q else None, sampler, oracle, meanwhile)
        m.rollback(base_len + n)
        e.rollback(base_len + n)
        m.tokens.append(bonus_t)
        yield make_step(i, "hierspec", timer, draft[:n] + [bonus_t], [x.source for x in seq[:n]] + ["target_bonus"], text,
                    trees=trees, sequence=seq, target_accepted=n, target_bonus=bonus_t,
                    target_bonus_text=text(bonus_t),
                    forwards={"target": 1, "intermediate": m.forwards - m0, "e_m": e.forwards - e0})
        i += 1



def cache_margin(s: DecodeSettings) -> int:
    """Slots a round may use beyond the accepted tokens (drafts and trees not yet compacted).
    An EAGLE head's cache also holds every expanded frontier node of its tree: (depth-1) x top-k."""
    return max(s.t_tree_size, s.m_tree_size + s.min_draft_len + s.m_depth + 1, s.spec_k,
               (s.t_depth - 1) * s.t_topk, (s.m_depth - 1) * s.m_topk + s.min_draft_len + s.m_depth + 1) + 8
