"""`python -m hierviz whatif --exact`: lossless decoding at real model shapes, with real acceptance.

The what-if's timing runs force accept/reject decisions; this mode forces none. It builds the
same synthetic full-shape models (W4A16 target with batch-invariant products, intermediate, EAGLE-2
or EAGLE-3 heads), decodes with AR, then with every speculative method twice:

* unsteered: the random drafters as they are (acceptance is whatever the models give);
* seeded: M and the heads have their logits raised for AR's own token at the position a row
  predicts, so draft paths that follow AR's continuation rank first and get accepted, compacted
  and rolled back (a path that left it proposes AR's later tokens, which the verifier rejects). Only proposals are steered: the target
  verifies with its own logits, so every accept/reject decision still comes from the models.

Each method's output must equal AR's token for token, for every tree preset asked for
(`--exact-trees`, default eagle2,paper: hierviz.settings.TREE_PRESETS). Exit code 1 on
any difference, and on a steering miss: a seeded run that accepts no tree node or draft token, or
that makes 2 tokens per round or fewer with every draft seeded, proves nothing.

A head with a reduced draft vocabulary (EAGLE-3's d2t, FR-Spec rows) cannot draft AR's token where
it lies outside that vocabulary: the boost goes to the token's draft index, and such a token gets
none. The tree is then cut there, an honest miss the trace marks (`undraftable`) and each run counts
(`undraftable_trees`); the steering-miss check looks only where no cut could interfere (steering_miss).

Steering reaches rows through the forward outputs they are views of (data pointers), so it also
works inside the CUDA graphs of the static path, where a forward runs only at capture time.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from hierviz.methods import BASELINE, METHODS
from hierviz.decoding.decoders import Models, cache_margin
from hierviz.decoding.verify import Sampler
from hierviz.measure.common import stopwatch, write_json
from hierviz.models.drafter import HEAD_SLOTS, Drafter, head_label
from hierviz.models.llama import Transformer
from hierviz.settings import TREE_PRESETS, DecodeSettings

BOOST = 30.0           # above every other logit of a row: the steered token ranks first


class SuccessorTable:
    """The reference sequence (prompt + AR's continuation) by position, on the device: a row at
    position p of a model predicts position p + 1 (a head's row at p, fed token p + 1, predicts
    p + 2); -1 past the sequence or when cleared."""

    def __init__(self, length: int, device: torch.device) -> None:
        self.by_position = torch.full((length + 2,), -1, dtype=torch.long, device=device)

    def clear(self) -> None:
        self.by_position.fill_(-1)

    def fill(self, sequence: list[int], vocab: int, start: int, miss_every: int = 0) -> None:
        """Steer to `sequence`, except that every miss_every-th position from `start` on gets a
        wrong token (drafts are then rejected there: partial acceptance and rollbacks)."""
        self.clear()
        n = min(len(sequence), self.by_position.shape[0])
        seq = torch.tensor(sequence[:n], dtype=torch.long, device=self.by_position.device)
        if miss_every > 0:
            pos = torch.arange(n, device=seq.device)
            miss = (pos >= start) & ((pos - start) % miss_every == miss_every - 1)
            seq = torch.where(miss, (seq + 1) % vocab, seq)
        self.by_position[:n] = seq

    def successors(self, positions: torch.Tensor, ahead: int) -> torch.Tensor:
        idx = (positions.reshape(-1).long() + ahead).clamp(0, self.by_position.shape[0] - 1)
        return self.by_position[idx]


class _Registry:
    """Forward outputs and the positions their rows sit at, so that logits computed later from a
    slice of an output can be steered row by row."""

    def __init__(self, table: SuccessorTable) -> None:
        self.table = table
        # (output, successors) of graph captures: the successors are computed in the graph, so
        # every replay recomputes them from the table and the replay's positions
        self.captured: list[tuple[torch.Tensor, torch.Tensor]] = []
        # (output, positions, ahead) of eager forwards: the successors are looked up when a row is
        # matched, never kept, since the table changes between runs while a CUDA graph's replays
        # (which call no forward) hand out copies that still match an old eager output by value
        self.eager: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def record(self, positions: torch.Tensor, ahead: int, out: torch.Tensor) -> None:
        if out.is_cuda and torch.cuda.is_current_stream_capturing():
            self.captured.append((out, self.table.successors(positions, ahead)))
        else:
            self.eager = ([(out, positions.reshape(-1).clone(), ahead)] + self.eager)[:4]

    def _entries(self, hidden: torch.Tensor) -> Iterator[tuple[torch.Tensor, Callable[[int, int], torch.Tensor]]]:
        # Inside a capture only captured entries may match: an eager entry's positions are a
        # snapshot, and a persistent buffer (a tree graph's root row, filled eagerly on the
        # graph's first call) would bake that one call's positions into every replay.
        if not (hidden.is_cuda and torch.cuda.is_current_stream_capturing()):
            for out, pos, ahead in self.eager:
                yield out, lambda a, b, pos=pos, ahead=ahead: self.table.successors(pos[a:b], ahead)
        for out, succ in reversed(self.captured):       # newest first
            yield out, lambda a, b, succ=succ: succ[a:b]

    def successors(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """The successors of hidden's rows: hidden is a slice of a recorded output (found by its
        data pointer: eager forwards, and inside a graph capture), or a copy of one (the static
        path hands out clones of its graphs' outputs: found by value, eagerly)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        rows = flat.shape[0]
        entries = [(o, f) for o, f in self._entries(hidden)
                   if o.dim() >= 2 and o.shape[-1] == hidden.shape[-1] and o.dtype == hidden.dtype]
        for out, succ in entries:
            row_bytes = out.stride(-2) * out.element_size()
            offset = hidden.data_ptr() - out.data_ptr()
            n_out = out.reshape(-1, out.shape[-1]).shape[0]
            if offset >= 0 and offset % row_bytes == 0 and offset // row_bytes + rows <= n_out:
                first = offset // row_bytes
                return succ(first, first + rows)
        if rows == 0 or (hidden.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None
        for out, succ in entries:
            o = out.reshape(-1, out.shape[-1])
            for first in torch.nonzero((o == flat[0]).all(-1)).flatten().tolist():
                if first + rows <= o.shape[0] and torch.equal(o[first:first + rows], flat):
                    return succ(first, first + rows)
        return None


def _boost(logits: torch.Tensor, succ: Optional[torch.Tensor]) -> torch.Tensor:
    if succ is None:
        return logits
    flat = logits.reshape(-1, logits.shape[-1])
    top = flat.max(-1).values + BOOST
    raised = flat.scatter(1, succ.clamp(min=0)[:, None], top[:, None])
    return torch.where((succ >= 0)[:, None], raised, flat).reshape(logits.shape)


def steer_model(model: Transformer, registry: _Registry) -> None:
    """Make an intermediate model propose (and accept) the table's successors."""
    base = type(model)

    class Steered(base):  # type: ignore[misc, valid-type]
        def forward(self, tokens, positions, *args, **kw):
            out = base.forward(self, tokens, positions, *args, **kw)
            registry.record(positions, 1, out)
            return out

        def logits(self, hidden):
            return _boost(base.logits(self, hidden), registry.successors(hidden))

    model.__class__ = Steered


def draft_index(draft_ids: Optional[torch.Tensor], vocab: int) -> Optional[torch.Tensor]:
    """Target id -> its index in the draft vocabulary whose entries are the target ids `draft_ids`
    (the inverse of EAGLE-3's arange + d2t), -1 where t2d is false; None for the full vocabulary."""
    if draft_ids is None:
        return None
    index = torch.full((vocab,), -1, dtype=torch.long, device=draft_ids.device)
    index[draft_ids.long()] = torch.arange(draft_ids.numel(), device=draft_ids.device)
    return index


def steer_head(head: Drafter, registry: _Registry) -> None:
    """Make a draft head (any head type with draft_logits: EAGLE-1/2, EAGLE-3) draft the table's
    successors first. Set its draft vocabulary before: the successors are mapped to it here."""
    base = type(head)
    ids_now = head.draft_vocab
    index = draft_index(ids_now, head.base.cfg.vocab_size)

    class Steered(base):  # type: ignore[misc, valid-type]
        def forward(self, tokens, features, positions, *args, **kw):
            out = base.forward(self, tokens, features, positions, *args, **kw)
            registry.record(positions, 2, out)
            return out

        steering = registry

        def draft_logits(self, hidden):
            # raised before the head's own sharpening and log-softmax (SharpDraft), which stay as
            # they are: the boost keeps the steered token first at any positive scale
            logits, ids = base.draft_logits(self, hidden)
            if ids is not ids_now:
                raise ValueError("the head's draft vocabulary changed after steer_head: set it before steering")
            succ = registry.successors(hidden)
            if succ is not None and index is not None:
                # target ids -> draft indices; one outside the draft vocabulary maps to -1, left unboosted
                succ = torch.where(succ >= 0, index[succ.clamp(min=0)], succ)
            return _boost(logits, succ), ids

    head.__class__ = Steered
    _steer_tree_graphs()


def _steer_tree_graphs() -> None:
    """A tree graph copies the root's hidden state into a buffer of its own before drafting (and
    the capture cannot match that copy by value), so for a steered head the buffer is recorded
    with the root's successor, computed on the device from the graph's root position: replays
    then steer each tree's first depth too."""
    from hierviz.decoding.tree import TreeGraph
    if getattr(TreeGraph._body, "steered", False):
        return
    body = TreeGraph._body

    def steered_body(self):
        registry = getattr(self.draft_head, "steering", None)
        if registry is not None:         # the root's pair sits at root_pos - 1 and predicts root_pos + 1
            registry.record(self.scalars[1:2] - 1, 2, self.h_root[None])
        return body(self)

    steered_body.steered = True
    TreeGraph._body = steered_body


def decode(models: Models, method: str, s: DecodeSettings, prompt: list[int]) -> tuple[list[int], list]:
    """Greedy output tokens (at most max_new_tokens) and the steps, no oracle."""
    max_len = len(prompt) + s.max_new_tokens + cache_margin(s)
    gen = METHODS[method].decode(models, prompt, s, Sampler(0.0), str, max_len, oracle=None)
    tokens: list[int] = []
    steps = []
    with torch.no_grad():
        for st in gen:
            steps.append(st)
            tokens.extend(st.new_tokens)
            if len(tokens) >= s.max_new_tokens:
                break
    gen.close()
    return tokens[:s.max_new_tokens], steps


def acceptance(steps: list) -> dict[str, Any]:
    """The decode rounds' acceptance (steps[0] is the prefill)."""
    return _tally(steps[1:])


def _tally(rounds: list) -> dict[str, Any]:
    trees = [t for st in rounds for t in st.trees]
    full = sum(1 for t in trees if t.accepted and max(n.depth for n in t.nodes if n.id in set(t.accepted))
               == max(n.depth for n in t.nodes))
    return {"rounds": len(rounds), "trees_n": len(trees),
            "accepted_tree_nodes": sum(len(t.accepted) for t in trees), "full_depth_trees": full,
            "undraftable_trees": sum(1 for t in trees if t.undraftable),
            "target_accepted": sum(st.target_accepted for st in rounds),
            "tokens_per_round": sum(len(st.new_tokens) for st in rounds) / max(1, len(rounds))}


def outside_draft_vocab(models: Models, tokens: list[int]) -> dict[str, int]:
    """Per head: how many of `tokens` (AR's continuation) its draft vocabulary lacks, which no
    steering can make it draft."""
    out = {}
    for name in HEAD_SLOTS:
        head = getattr(models, name)
        if head is not None:
            mask = head.draft_vocab_mask()
            out[name] = 0 if mask is None else int((~mask[torch.tensor(tokens, device=mask.device)]).sum())
    return out


VARIANTS = ("drawn", "partly-seeded", "seeded")


def run_exact(models: Models, prompt: list[int], base: DecodeSettings, presets: list[str],
              methods: list[str], miss_every: int = 7, log=print,
              variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    """AR once, then for every preset every method: drafts as drawn, seeded with every
    miss_every-th draft position wrong, and seeded exactly (those of `variants`); results per run."""
    registry = _Registry(SuccessorTable(len(prompt) + base.max_new_tokens + cache_margin(base) + 64,
                                        models.target.device))
    steer_model(models.intermediate, registry)
    for head in (getattr(models, name) for name in HEAD_SLOTS):
        if head is not None:
            steer_head(head, registry)
    want, _ = decode(models, BASELINE, base, prompt)
    outside = outside_draft_vocab(models, want)
    log(f"AR: {len(want)} tokens" + "".join(f"; {n} outside {name}'s draft vocabulary"
                                             for name, n in outside.items() if n))
    runs = []
    for preset in presets:
        s = dataclasses.replace(base, **TREE_PRESETS[preset])
        for variant in variants:
            seeded, miss = variant != "drawn", miss_every if variant == "partly-seeded" else 0
            if seeded:
                registry.table.fill(prompt + want, models.target.cfg.vocab_size, len(prompt), miss)
            else:
                registry.table.clear()
            for method in methods:
                with stopwatch(models.target.device, pause_gc=False) as took:
                    got, steps = decode(models, method, s, prompt)
                secs = round(took(), 1)
                first_diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                                  None if len(got) == len(want) else min(len(got), len(want)))
                row = {"trees": preset, "seeded": seeded, "miss_every": miss, "method": method, "identical": first_diff is None,
                       "first_difference": first_diff, "tokens": len(got), "seconds": secs, **acceptance(steps)}
                row["steering_miss"] = steering_miss(row, steps)
                runs.append(row)
                log(f"{'ok   ' if row['identical'] else 'DIFF '} trees={preset:6s} seeded={int(seeded)} miss={miss} {method:8s} "
                    f"tokens={len(got)} tokens/round={row['tokens_per_round']:.2f} accepted tree nodes="
                    f"{row['accepted_tree_nodes']} full-depth trees={row['full_depth_trees']}/{row['trees_n']} "
                    f"target accepted={row['target_accepted']} "
                    + (f"trees cut by the draft vocabulary={row['undraftable_trees']} "
                       if row["undraftable_trees"] else "")
                    + f"({secs} s)"
                    + ("" if row["identical"] else f" first difference at token {first_diff}")
                    + (f" STEERING MISS: {row['steering_miss']}" if row["steering_miss"] else ""))
    registry.table.clear()
    misses = [r for r in runs if r["steering_miss"]]
    return {"ar_tokens": len(want), "ar_tokens_outside_draft_vocab": outside, "runs": runs,
            "identical": all(r["identical"] for r in runs), "steering_misses": len(misses), "passed": all(r["identical"] for r in runs) and not misses}


def steering_miss(row: dict[str, Any], steps: list) -> str:
    """Why a seeded run shows the steering did not reach its drafts ('' when it did). A seeded
    run that accepts nothing would pass the identity check while proving nothing.

    A tree cut by a token outside its head's draft vocabulary (marked undraftable) accepts less
    however well steered. So no accepted tree node, or no draft token the target accepted, is a
    miss only where some tree, or some round's target-verified tree, was not cut; the tokens per
    round of a fully seeded run are judged over the rounds whose target-verified tree was not cut
    (HierSpec's trees are verified by M, and its draft to T goes on past a cut tree). With the full
    vocabulary that is every tree and round; where every one was cut there is nothing to judge."""
    if not row["seeded"] or row["tokens"] < 8:
        return ""
    rounds = steps[1:-1]     # the last round drafts past the end of AR's continuation: nothing seeded there
    judged = [st for st in rounds if not any(t.undraftable and t.verifier == "target" for t in st.trees)]
    total = _tally(rounds)
    some_tree_uncut = total["undraftable_trees"] < total["trees_n"]
    drafts_trees = METHODS[row["method"]].tree_settings is not None
    if drafts_trees and total["accepted_tree_nodes"] == 0 and some_tree_uncut:
        return "no tree node accepted"
    if judged and total["target_accepted"] == 0:
        return "the target accepted no draft token"
    per_round = _tally(judged)["tokens_per_round"]
    if not row["miss_every"] and judged and per_round <= 2:
        return f"{per_round:.2f} tokens per round with every draft seeded (needs > 2)"
    return ""


def markdown(info: dict[str, Any]) -> str:
    lines = [f"# What-if --exact: {info['shapes']['target']} / {info['shapes']['intermediate']} on "
             f"{info['machine'].get('gpu', 'CPU')}, {info['settings']['max_new_tokens']} tokens, "
             + ", ".join(f"{head_label(t)} heads drafting over {n} tokens"
                         for t, n in (info.get("draft_vocabs") or {info["head"]: info["draft_vocab"]}).items()),
             "", "| trees | drafts | method | identical to AR | tokens/round | accepted tree nodes | full-depth trees | "
             "target accepted | trees cut by the draft vocabulary |", "|---|---|---|---|---|---|---|---|---|"]
    for r in info["runs"]:
        lines.append(f"| {r['trees']} | {_drafts(r)} | {r['method']} | "
                     f"{'yes' if r['identical'] else 'NO (token %s)' % r['first_difference']}"
                     f"{' (steering miss: %s)' % r['steering_miss'] if r.get('steering_miss') else ''} | "
                     f"{r['tokens_per_round']:.2f} | {r['accepted_tree_nodes']} | {r['full_depth_trees']}/{r['trees_n']} | "
                     f"{r['target_accepted']} | {r['undraftable_trees']} |")
    return "\n".join(lines)


def _drafts(r: dict[str, Any]) -> str:
    if not r["seeded"]:
        return "as drawn"
    return f"seeded, every {r['miss_every']}th wrong" if r["miss_every"] else "seeded"


def write(info: dict[str, Any], out: Path) -> None:
    write_json(out / "whatif_exact.json", info)
    (out / "whatif_exact.md").write_text(markdown(info) + "\n")
