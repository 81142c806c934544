"""A toy decoding method, as a user would add one: this module and its `register` call, nothing else.

"repeat-last" drafts the last accepted token repeated `REPEATS` times and T verifies that sequence
(prompt-lookup decoding at its simplest). It needs no part beyond T, so it runs on every stack.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch

from hierviz import methods
from hierviz.decoding.decoders import Models, StageTimer, TextOf, make_step, prefill, verify_sequence_on
from hierviz.decoding.state import BaseState
from hierviz.decoding.verify import AcceptOracle, Sampler
from hierviz.settings import DecodeSettings
from hierviz.trace import SeqToken, Step

NAME = "repeat-last"
REPEATS = 3
STAGE_NAMES = {"draft": "repeat the last token", "target_verify": "T verifies the repeats"}


def decode_repeat_last(models: Models, prompt: list[int], s: DecodeSettings, sampler: Sampler, text: TextOf,
                       max_len: int, oracle: Optional[AcceptOracle] = None) -> Iterator[Step]:
    t = BaseState(models.target, max_len)
    timer = StageTimer(t.model.device)
    tok = prefill([t], prompt, sampler, timer, ["target_verify"])
    yield make_step(0, NAME, timer, [tok], ["target_bonus"], text, forwards={"target": 1})
    i = 1
    while True:
        timer = StageTimer(t.model.device)
        with timer.stage("draft"):
            draft = [t.tokens[-1]] * REPEATS
            # the drafter's distribution is a point mass on the repeated token (sampling stays lossless)
            q = None if sampler.greedy else [_point_mass(x, models.target.cfg.vocab_size) for x in draft]
        with timer.stage("target_verify"):
            n, bonus = verify_sequence_on(t, draft, q, sampler, oracle)
        seq = [SeqToken(x, text(x), "draft") for x in draft]
        yield make_step(i, NAME, timer, draft[:n] + [bonus], ["draft"] * n + ["target_bonus"], text,
                        sequence=seq, target_accepted=n, target_bonus=bonus, target_bonus_text=text(bonus),
                        forwards={"target": 1})
        i += 1


def _point_mass(token: int, vocab: int) -> torch.Tensor:
    p = torch.zeros(vocab)
    p[token] = 1.0
    return p


def register() -> methods.Method:
    return methods.register(methods.Method(
        NAME, "Repeat-last", "Rep", "#6B8E23", "dot", (), methods.SEQUENCE, decode_repeat_last,
        compare_rank=5, stage_names=STAGE_NAMES, roles=frozenset({"draft", "target_bonus", "rejected", "discarded"}),
        description="the last accepted token repeated, verified by T as a sequence"))
