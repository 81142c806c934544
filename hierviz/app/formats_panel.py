"""The What-if tab's "formats and GPUs" panel: which method wins on which GPU and weight format.

It reads one shipped file, assets/whatif/cost-model.json (`python -m hierviz cost-model`):
the compat tables measured on the H200 (`python -m hierviz compat`) and their projections to other
GPUs by the roofline cost model. Every projected figure says so; nothing here imports a model.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import gradio as gr

from hierviz.methods import BASELINE, PEER, SUBJECT, short
from hierviz.quant.w4_verdicts import CUDA_VARIANT
from hierviz.viz.style import method_label

ROOT = Path(__file__).resolve().parents[2]
COST_MODEL_FILE = ROOT / "assets" / "whatif" / "cost-model.json"
COMPAT_70B = ROOT / "assets" / "whatif" / "compat-h200-llama3-70b.json"
SWEEP_70B = ROOT / "assets" / "whatif" / "h200-llama3-70b-sweep.json"
MAX_BYTES = 2_000_000

EXPLAIN = """**Which method wins on my GPU and format?** Each table is one target / intermediate pair at the
paper's trees and the what-if's default acceptance. The rows marked measured are
(`python -m hierviz compat`, synthetic weights of the real shapes, real kernels); every other row is
**projected**: the measured stages scaled by a roofline cost model fitted to measured per-format
forward curves and applied to each GPU's spec sheet (`python -m hierviz cost-model`, docs/formats.md
says how well it fits), its 4-bit forwards at the faster of the Triton kernel and the CUDA MMA
kernel, as the default kernel choice runs them. A format the GPU cannot run or hold is named with
the reason."""


def _read(path: Path) -> Optional[dict[str, Any]]:
    try:
        if path.stat().st_size > MAX_BYTES:
            return None
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def load_cost_model(path: Path = COST_MODEL_FILE) -> Optional[dict[str, Any]]:
    d = _read(path)
    return d if d and d.get("schema") == "hierviz.cost_model/1" else None


def curves_figure(compat_path: Path = COMPAT_70B, sweep_path: Path = SWEEP_70B) -> tuple[Any, str]:
    """(figure or None, note): speedup over AR against acceptance per format at 70B, crossovers marked."""
    from hierviz.viz.format_curves import LABEL, format_curves, format_curves_figure
    compat, sweep = _read(compat_path), _read(sweep_path)
    if not compat or not sweep:
        return None, "The 70B compat table or acceptance sweep is not shipped."
    try:
        curves = format_curves(compat, sweep)
    except (KeyError, ValueError, TypeError, ZeroDivisionError):
        return None, "The shipped compat table and sweep do not fit together."
    tree = sweep.get("tree_method", PEER)
    marks = []
    for c in curves.values():
        x = c["crossovers"][f"{SUBJECT}_over_{tree}"]
        marks.append(f"{c['name']} from {x:.2f}" if x is not None else f"{c['name']}: no crossover in the sweep")
    note = (f"HierSpec overtakes {method_label(tree)} at acceptance scale: " + "; ".join(marks)
            + f". Llama-3-70B target, H200; {LABEL}.")
    return format_curves_figure(curves, tree), note


def pair_labels(d: Optional[dict[str, Any]]) -> list[str]:
    if not d:
        return []
    return [f"{p['shapes']['target']} target, {p['shapes']['intermediate']} intermediate" for p in d["projections"]]


def _cell(e: dict[str, Any], tree: str) -> str:
    if "skipped" in e:
        # the cost model's reasons: the weights over the GPU's memory, or hardware the format needs
        return "does not fit" if "GB of weights" in e["skipped"] else e["skipped"]
    sp = e["speedup_vs_ar"]
    note = f"<br>({e['layers_note']})" if "layers_note" in e else ""
    return (f"{method_label(tree)} {sp.get(tree, 0):.2f}x · **{method_label(SUBJECT)} {sp.get(SUBJECT, 0):.2f}x**"
            f"<br>{short(BASELINE)} {e['tokens_per_s'][BASELINE]:.0f} tok/s{note}")


def table_markdown(d: Optional[dict[str, Any]], label: Optional[str]) -> str:
    """GPUs down, target formats across: each cell the tree method's and HierSpec's speedup over AR
    and AR's tokens/s, or why the GPU cannot run that format."""
    labels = pair_labels(d)
    if not d or label not in labels:
        return "No cost-model file is shipped (assets/whatif/cost-model.json)."
    proj = d["projections"][labels.index(label)]
    tree = proj["head"]
    fmts = list(dict.fromkeys(e["name"] for e in proj["rows"]))
    gpus = list(dict.fromkeys(e["gpu"] for e in proj["rows"]))
    cell = {(e["gpu"], e["name"]): e for e in proj["rows"]}
    lines = ["| GPU | " + " | ".join(fmts) + " |", "|---|" + "---|" * len(fmts)]
    for g in gpus:
        measured = any(not cell[(g, f)].get("projected", True) for f in fmts if (g, f) in cell)
        tag = "measured" if measured else "*projected*"
        lines.append(f"| {g.removeprefix('NVIDIA ')}<br>{tag} | "
                     + " | ".join(_cell(cell[(g, f)], tree) if (g, f) in cell else "" for f in fmts) + " |")
    cal = d["calibration"]
    worst = max(v["max_abs"] for v in cal["in_sample"].values())
    lines.append(f"\nSpeedups over AR of the same format and GPU. \"Does not fit\": the target's and M's weights "
                 f"exceed 90 % of the GPU's memory. Cost model calibrated on the {cal['gpu']} (largest error on "
                 f"its own measured curves {worst:.0%}).")
    if "measured_on" in proj:
        kernels = " and the CUDA MMA kernel" if len(proj.get("projected_w4_kernels", [])) > 1 else ""
        ran = "the CUDA MMA kernel" if proj.get("measured_w4_kernel") == CUDA_VARIANT else "the Triton kernel"
        lines.append(f"Measured rows: the {proj['measured_on'].removeprefix('NVIDIA ')}, W4A16 in {ran}; "
                     f"projected W4A16 forwards at the faster of the Triton kernel{kernels}.")
    fused = sorted({e["gpu"].removeprefix("NVIDIA ") for e in proj["rows"] if e.get("activation_quantizer") == "fused"})
    if fused:
        lines.append(f"The 8-bit rows of the {', '.join(fused)} ran hierviz's fused activation quantizer (proven "
                     "there); the other GPUs are projected with torch's, which launches more kernels per product.")
    return "\n".join(lines)


def formats_section() -> None:
    d = load_cost_model()
    labels = pair_labels(d)
    gr.Markdown("## Formats and GPUs")
    gr.Markdown(EXPLAIN, elem_classes=["hv-teach"])
    pick = gr.Dropdown(labels, value=labels[0] if labels else None, label="model pair", elem_id="hv-formats-pick")
    table = gr.Markdown(table_markdown(d, labels[0] if labels else None), elem_id="hv-formats-table")
    fig, note = curves_figure()
    if fig is not None:
        gr.Plot(fig, label="speedup against acceptance per format (projected)", elem_id="hv-formats-curves")
    gr.Markdown(note, elem_id="hv-formats-curves-note")
    pick.change(lambda lb: table_markdown(load_cost_model(), lb), pick, table, api_visibility="private")
