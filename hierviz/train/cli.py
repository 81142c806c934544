"""`python -m hierviz train {data,distill,eagle,agreement,pack-head} ...`: the offline stack's training commands."""
from __future__ import annotations

import importlib
import sys
from typing import Optional

STAGES = {"data": "hierviz.train.data", "distill": "hierviz.train.distill", "eagle": "hierviz.train.eagle_train",
          "agreement": "hierviz.train.agreement", "pack-head": "hierviz.train.pack_head"}


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in STAGES:
        print("usage: python -m hierviz train {data,distill,eagle,agreement,pack-head} [options]  (each takes --help)\n"
              "  data     T's own answers to prompts that avoid Spec-Bench / MT-Bench\n"
              "  distill  distill the intermediate M from T and quantize it (GPTQ)\n"
              "  eagle    train an EAGLE-1/2 head on a base model's features\n"
              "  agreement  M's top-1 agreement with T on T's answers to benchmark questions\n"
              "  pack-head  store a draft head's linears as int8 per channel (half the file)", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    return int(importlib.import_module(STAGES[argv[0]]).main(argv[1:]) or 0)
