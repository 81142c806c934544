"""`python -m hierviz compat`: the compatibility table — AR, the tree method and HierSpec on one
target shape in each weight format, with the same acceptance and trees, in one process.

Each format runs the what-if (hierviz.measure.whatif: synthetic weights of the real shape, the real
decoders and kernels, replayed acceptance) in turn, in a child process of its own. A
target that does not fit the GPU in a format (Llama-3-70B in fp16 on one H200) runs with the
first L' of its layers, and its target-verification stage is scaled by L / L' (the LM head is
scaled with the layers, so that figure errs slow by about the head's share); the table marks it.

    python -m hierviz compat --target llama3-70b --intermediate llama3-8b --trees paper --out DIR
    python -m hierviz compat --tiny --device cpu --out /tmp/c        # CPU, seconds
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from hierviz import methods as registry
from hierviz.measure.common import (MeasureError, config_path, error_message, load_shape, run_python,
                                    refuse, run_reporting_errors, stamp, write_report)
from hierviz.measure.whatif import LABEL, check_request, model_bytes, parser, target_formats
from hierviz.methods import BASELINE, SUBJECT
from hierviz.models.config import ModelConfig
from hierviz.quant.formats import canonical_name, get_format
from hierviz.settings import SettingsError

SCHEMA = "hierviz.compat/1"
GPU_FILL = 0.6      # of the GPU's memory for weights: the rest holds caches, graphs, activations, slack


def fitting_layers(t_cfg: ModelConfig, m_cfg: ModelConfig, fmt: str, m_fmt: str, budget: float) -> int:
    """How many of the target's layers fit `budget` bytes beside M (all of them when they fit)."""
    layers = t_cfg.num_layers
    while layers > 1 and (model_bytes(dataclasses.replace(t_cfg, num_layers=layers), fmt)
                          + model_bytes(m_cfg, m_fmt)) > budget:
        layers -= 1
    return layers


def _subset_config(shape: str, layers: int, folder: Path) -> str:
    """A copy of the shape's config.json with only `layers` decoder layers."""
    raw = json.loads(config_path(shape).read_text())
    raw["num_hidden_layers"] = layers
    p = folder / f"{config_path(shape).stem}-{layers}-layers.json"
    p.write_text(json.dumps(raw))
    return str(p)


def scaled(info: dict[str, Any], factor: float) -> dict[str, float]:
    """tokens/s per method with the target-verification stage multiplied by `factor`."""
    out = {}
    for m, r in info["methods"].items():
        ms = 1000.0 / r["tokens_per_s"] + r["stages_ms_per_token"].get("target_verify", 0.0) * (factor - 1.0)
        out[m] = 1000.0 / ms
    return out


def target_rows(method: str, result: dict[str, Any], settings: dict[str, Any]) -> float:
    """Rows one target verification forward holds, on average: the last token plus the draft
    (AR: 1; a tree: its nodes; HierSpec: M's accepted paths and M's bonus token per E_M tree)."""
    m = registry.get(registry.row_method(method))     # a variant row verifies as its method does
    if m.target_verifies == registry.TOKEN:
        return 1.0
    if m.target_verifies == registry.TREE:
        return settings["t_tree_size"] + 1.0
    if m.tree_settings is None:       # a sequence drafted token by token
        return settings["spec_k"] + 1.0
    drafts = [sum(t + 1 for t in a["trees"]) for a in result.get("accepted", []) if a.get("trees")]
    return 1.0 + sum(drafts) / len(drafts) if drafts else settings["min_draft_len"] + 1.0


def row(fmt: str, info: dict[str, Any], layers: int, all_layers: int, tree: str) -> dict[str, Any]:
    tps = scaled(info, all_layers / layers) if layers < all_layers else \
        {m: r["tokens_per_s"] for m, r in info["methods"].items()}
    f = get_format(fmt)
    name = f"{info['dtype'].replace('float', 'FP')} ({f.label})" if f.dense else f.label
    r: dict[str, Any] = {"format": fmt, "name": name, "target": info["formats"]["target"],
                         "tokens_per_s": tps, "layers_measured": layers, "layers": all_layers,
                         "tokens_per_round": {m: v["tokens_per_round"] for m, v in info["methods"].items()},
                         "stages_ms_per_token": {m: v["stages_ms_per_token"] for m, v in info["methods"].items()}}
    r["target_rows_per_round"] = {m: target_rows(m, v, info["settings"]) for m, v in info["methods"].items()}
    if BASELINE in tps:
        r["speedup_vs_ar"] = {m: v / tps[BASELINE] for m, v in tps.items()}
    if SUBJECT in tps and tree in tps:
        r[f"{SUBJECT}_vs_{tree}"] = tps[SUBJECT] / tps[tree]
    return r


def _run_format(whatif_args: list[str], out: Path) -> dict[str, Any]:
    """One format's what-if in a child process: its models, graphs and allocator pools end with it,
    so the next format starts with the whole GPU (and a failure is that format's alone)."""
    done = run_python(["-m", "hierviz.measure.whatif", *whatif_args, "--out", str(out)])
    if done.returncode != 0:
        err = error_message(done.stderr) or (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise MeasureError(f"the what-if failed: {err}")
    return json.loads((out / "whatif.json").read_text())


def run_compat(a: argparse.Namespace, whatif_args: list[str]) -> dict[str, Any]:
    formats = [canonical_name(f.strip()) for f in a.formats.split(",") if f.strip()]
    bad = [f for f in formats if f not in target_formats()]
    if not formats or bad:
        raise MeasureError(f"unknown --formats {', '.join(bad) or '(none)'}; choose from {', '.join(target_formats())}")
    tree = parser().parse_args(whatif_args + ["--out", "-"]).head or registry.PEER   # T's tree method
    if "--methods" not in whatif_args:   # the table's rows: AR, T's tree method and HierSpec
        whatif_args = whatif_args + ["--methods", ",".join((BASELINE, tree, SUBJECT))]
    rows, infos, configs = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in formats:
            w = parser().parse_args(whatif_args + ["--target-format", fmt, "--out", tmp])
            args = whatif_args + ["--target-format", fmt]
            all_layers = layers = None
            if not w.tiny:
                t_cfg, m_cfg = load_shape(w.target)[1], load_shape(w.intermediate)[1]
                configs = {"target": dataclasses.asdict(t_cfg), "intermediate": dataclasses.asdict(m_cfg)}
                all_layers = layers = t_cfg.num_layers
                dev = w.device or ("cuda" if torch.cuda.is_available() else "cpu")
                if dev == "cuda":
                    budget = torch.cuda.get_device_properties(0).total_memory * GPU_FILL
                    layers = fitting_layers(t_cfg, m_cfg, fmt, w.intermediate_format, budget)
                    if layers < all_layers:
                        args += ["--target", _subset_config(w.target, layers, Path(tmp))]
            try:
                info = _run_format(args, Path(tmp) / fmt)
            except MeasureError as e:
                print(f"[compat] {fmt}: {e}", file=sys.stderr, flush=True)
                rows.append({"format": fmt, "name": get_format(fmt).label, "error": str(e)})
                continue
            infos[fmt] = info
            n = info["configs"]["target"]["num_layers"]
            rows.append(row(fmt, info, layers or n, all_layers or n, tree))
            print(f"[compat] {rows[-1]['name']}: " + ", ".join(
                f"{m} {v:.1f} tok/s" for m, v in rows[-1]["tokens_per_s"].items()), flush=True)
    if not infos:
        raise MeasureError("no format ran: " + "; ".join(r["error"] for r in rows))
    first = next(iter(infos.values()))
    w = parser().parse_args(whatif_args + ["--out", "-"])
    shapes = first["shapes"] if w.tiny else {"target": load_shape(w.target)[0],
                                             "intermediate": load_shape(w.intermediate)[0]}
    return {"schema": SCHEMA, "label": LABEL, "shapes": shapes, "configs": configs or first["configs"],
            "device": first["device"],
            "machine": first["machine"], "head": first["head"], "acceptance": first["acceptance"],
            "settings": first["settings"], "intermediate": first["formats"]["intermediate"], "rows": rows}


def markdown(info: dict[str, Any]) -> str:
    tree = info["head"]
    name, subject, ar = registry.label(tree), registry.label(SUBJECT), registry.short(BASELINE)
    lines = [f"# Compatibility: {info['shapes']['target']} target, {info['shapes']['intermediate']} intermediate "
             f"({info['intermediate']}), {info['machine'].get('gpu') or info['device']}", "",
             f"| target format | {ar} tok/s | {name} tok/s | {subject} tok/s | {name} / {ar} | {subject} / {ar} | "
             f"{subject} / {name} |", "|---|---|---|---|---|---|---|"]
    notes = []
    for r in info["rows"]:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['error']} | | | | | |")
            continue
        t, s = r["tokens_per_s"], r.get("speedup_vs_ar", {})
        mark = ""
        if r["layers_measured"] < r["layers"]:
            mark = " *"
            notes.append(f"\\* {r['name']}: measured with {r['layers_measured']} of {r['layers']} target layers "
                         f"(the rest do not fit the GPU); target-verification time scaled by "
                         f"{r['layers']}/{r['layers_measured']}.")
        f = lambda d, k, fmt: fmt.format(d[k]) if k in d else "–"   # noqa: E731
        lines.append(f"| {r['name']}{mark} | {f(t, BASELINE, '{:.1f}')} | {f(t, tree, '{:.1f}')} | "
                     f"{f(t, SUBJECT, '{:.1f}')} | {f(s, tree, '{:.2f}x')} | {f(s, SUBJECT, '{:.2f}x')} | "
                     f"{f(r, f'{SUBJECT}_vs_{tree}', '{:.2f}x')} |")
    lines += ["", f"All figures {LABEL}; synthetic weights of the real shapes, real kernels."] + notes
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m hierviz compat",
        description="AR, the tree method and HierSpec per target weight format, one process (what-if with "
                    "replayed acceptance). Other flags are the what-if's (python -m hierviz whatif --help).")
    ap.add_argument("--formats", default=",".join(target_formats()),
                    help=f"target formats, comma-separated, from {', '.join(target_formats())} (or their aliases)")
    ap.add_argument("--out", required=True, help="folder for compat.json and compat.md")
    a, rest = ap.parse_known_args(argv)
    if "--target-format" in rest or "--sweep" in rest or "--exact" in rest:
        return refuse("compat sets --target-format itself and takes neither --sweep nor --exact")

    def work() -> dict[str, Any]:
        check_request(parser().parse_args(rest + ["--out", a.out]))   # the what-if's own errors, before any run
        return run_compat(a, rest)
    info = run_reporting_errors(work, (MeasureError, SettingsError, ValueError))
    if info is None:
        return 2
    write_report(Path(a.out), "compat", stamp(info, "compat", argv), markdown(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
