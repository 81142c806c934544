"""The cost model against single W4 products as a GPU ran them.

A what-if record (`python -m hierviz whatif` on a GPU) keeps, in `w4_kernel_choices`, the
microseconds of every kind of W4 weight it multiplied, at each row count w4_choice timed, in both
kernels: the CUDA MMA kernel (its fastest timed entry: `cuda_tiles`) and the Triton kernel in the
mode the kind runs (a verifier's batch-invariant, another weight's normal). This command prices the
same products with a cost-model calibration (`python -m hierviz cost-model`) and prints each
product's error and the mean and largest per kernel. The model costs the CUDA kernel at the entry
that was timed (its grid passes over the tokens, token tiles and K slices) and the Triton kernel in
its normal mode (the profiles it is fitted to run that mode), so a verifier's Triton products are
listed and left out of the summary.
  python -m hierviz cost-check --calibration docs/bench/cost-model-h100.json \\
      --whatif assets/whatif/h100-llama3-70b-paper-trees.json [--out DIR]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

from hierviz.measure.common import refuse, stamp, write_report
from hierviz.measure.cost_model import (GPUS, Fit, Shape, cuda_mma_kernels, gpu_named, predict_us, summary, terms_of,
                                        w4_kernels)
from hierviz.quant.formats import get_format
from hierviz.quant.w4_verdicts import CUDA_VARIANT

SCHEMA = "hierviz.cost_check/1"
W4_FORMAT = "w4a16"
# the kernels a what-if record times, its field for each, and the model's kernels for them
KERNELS = {CUDA_VARIANT: ("cuda_us", cuda_mma_kernels), "triton": ("triton_us", w4_kernels)}


def timed_entry(entry: Any, choice: dict[str, Any], rows: int) -> Optional[tuple[int, int, int, int]]:
    """A record's `cuda_tiles` entry for `rows` as the model takes it (None: none was recorded);
    ValueError unless it is four whole numbers of at least 1."""
    if entry is None:
        return None
    if (not isinstance(entry, list) or len(entry) != 4
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in entry)):
        raise ValueError(f"the what-if record's cuda_tiles of {choice['K']} x {choice['N']} at {rows} row{'s' if rows != 1 else ''} is "
                         f"{entry!r}, not four whole numbers of at least 1 (token tiles, row tiles, K slices, "
                         "warps per row tile)")
    return tuple(entry)


def product_errors(fit: Fit, gpu_name: str, choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each timed product of a what-if's `w4_kernel_choices` beside the model's price on `gpu_name`:
    kernel, K, N, group, batch_invariant, rows, entry (the CUDA kernel's timed entry, `cuda_tiles`,
    which the price is for; None: its one-pass entry), measured_us, predicted_us, error (predicted /
    measured - 1) and `modeled` (False for the Triton kernel's batch-invariant mode)."""
    gpu = gpu_named(gpu_name)
    if gpu is None:
        raise ValueError(f"the model knows no GPU named {gpu_name!r} ({', '.join(GPUS)})")
    fmt = get_format(W4_FORMAT)
    out = []
    for c in choices:
        entries = c.get("cuda_tiles") or {}
        if not isinstance(entries, dict):
            raise ValueError(f"the what-if record's cuda_tiles of {c['K']} x {c['N']} is not a table of row counts")
        for kernel, (field, kernels_of) in KERNELS.items():
            for rows, measured in sorted((int(m), us) for m, us in (c.get(field) or {}).items()):
                entry = timed_entry(entries.get(str(rows)), c, rows) if kernel == CUDA_VARIANT else None
                where = Shape(cfg={}, group=c["group"], w4_kernel=kernel, w4_entry=entry)
                predicted = predict_us(fit, terms_of(kernels_of(fmt, rows, c["K"], c["N"], False, where, gpu), gpu))
                out.append({"kernel": kernel, "K": c["K"], "N": c["N"], "group": c["group"],
                            "batch_invariant": c["batch_invariant"], "rows": rows, "entry": where.w4_entry,
                            "measured_us": measured,
                            "predicted_us": predicted, "error": predicted / measured - 1,
                            "modeled": kernel == CUDA_VARIANT or not c["batch_invariant"]})
    return out


def check(calibration: dict[str, Any], whatif: dict[str, Any]) -> dict[str, Any]:
    """The report: the calibration's GPU and fit, the what-if's GPU, every product and a summary per
    kernel over the modeled products."""
    cal = calibration.get("calibration") or {}
    if "fit" not in cal or "gpu" not in cal:
        raise ValueError("the calibration file holds no fit (write one with python -m hierviz cost-model)")
    choices = whatif.get("w4_kernel_choices") or []
    measured_on = (whatif.get("machine") or {}).get("gpu")
    if not choices or not measured_on:
        raise ValueError("the what-if record holds no timed W4 products (w4_kernel_choices: a GPU run records them)")
    rows = product_errors(Fit(**cal["fit"]), measured_on, choices)
    by_kernel = {k: summary([r["error"] for r in rows if r["kernel"] == k and r["modeled"]]) for k in KERNELS
                 if any(r["kernel"] == k and r["modeled"] for r in rows)}
    return {"schema": SCHEMA, "calibrated_on": cal["gpu"], "measured_on": measured_on, "fit": cal["fit"],
            "summary": by_kernel, "products": rows}


def markdown(info: dict[str, Any]) -> str:
    lines = [f"# Cost model ({info['calibrated_on']} fit) against single W4 products on {info['measured_on']}", "",
             "| kernel | mean error | largest error |", "|---|---|---|"]
    lines += [f"| {k} | {s['mean_abs']:.1%} | {s['max_abs']:.1%} |" for k, s in info["summary"].items()]
    lines += ["", "| kernel | K x N | g | mode | rows | entry | measured us | model us | error |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in info["products"]:
        mode = "batch-invariant" if r["batch_invariant"] else "normal"
        error = f"{r['error']:+.1%}" if r["modeled"] else "not modeled"
        entry = ", ".join(map(str, r["entry"])) if r.get("entry") else ""
        lines.append(f"| {r['kernel']} | {r['K']} x {r['N']} | {r['group']} | {mode} | {r['rows']} | {entry} | "
                     f"{r['measured_us']:.1f} | {r['predicted_us']:.1f} | {error} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hierviz cost-check", description=(
        "Price the single W4 products a what-if record timed with a cost-model calibration and print each "
        "product's error and the mean and largest per kernel."))
    ap.add_argument("--calibration", required=True, help="a cost_model.json (python -m hierviz cost-model)")
    ap.add_argument("--whatif", required=True, help="a whatif.json from a GPU run (its w4_kernel_choices)")
    ap.add_argument("--out", default=None, help="also write DIR/cost_check.json and DIR/cost_check.md")
    a = ap.parse_args(argv)
    try:
        info = check(json.loads(Path(a.calibration).read_text()), json.loads(Path(a.whatif).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        return refuse(f"{type(e).__name__}: {e}" if isinstance(e, (KeyError, TypeError)) else str(e))
    info = stamp(info, "cost-check", argv)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        write_report(Path(a.out), "cost_check", info, markdown(info))
    else:
        print(markdown(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
