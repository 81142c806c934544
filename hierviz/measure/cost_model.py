"""`python -m hierviz cost-model`: a roofline cost model of one decoder layer per weight format,
calibrated on profiles measured on one GPU, checked against them, and applied to other GPUs from
their spec sheets. Every figure it gives for a GPU it did not run on is labelled projected.

One layer verifying T tokens (a profile curve, hierviz.measure.profile) costs

    t(T) = c0 + max(bytes / (e_bw * BW),  2 * T * params / (e_c * P_fmt))

bytes: the layer's weights in the format (codes and scales); BW: the GPU's memory bandwidth;
params: the layer's linear weights; P_fmt: the GPU's dense tensor-core rate for the format's
arithmetic (FP16 for dense and W4A16, which dequantizes to FP16; INT8; FP8); e_bw, e_c: the
fraction of each a kernel reaches; c0: what does not scale with either (attention over a short
cache, norms, activation quantization, kernel launches). The three are fitted per format on the
measured GPU and assumed to carry to another GPU: a kernel keeps its efficiencies, the fixed part
keeps its microseconds. The model is checked by leaving one model shape out (fit on the other,
predict it) and one format out (efficiencies and fixed part shared by the other formats).

A method's step on another GPU: the measured stages of `python -m hierviz compat` (same shapes),
each target / intermediate verification scaled by the model's ratio of that GPU to the measured
one at the rows it verifies; drafting and bookkeeping are kept as measured (launch-bound).

    python -m hierviz cost-model --profiles assets/profile/h200-llama3-70b-formats.json,assets/profile/h200-llama3-8b-formats.json \\
        --compat assets/whatif/compat-h200-llama3-70b.json --out DIR
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

SCHEMA = "hierviz.cost_model/1"
LABEL = "projected by the roofline cost model"


@dataclass(frozen=True)
class GPU:
    name: str
    bandwidth_GBps: float           # memory bandwidth, spec sheet
    memory_GB: float
    tflops: dict[str, float]        # dense tensor-core rates: "fp16" (fp32 accumulate), "int8", "fp8"
    capability: tuple[int, int]
    note: str = ""


# Spec-sheet figures, dense (no sparsity), FP16 with FP32 accumulation.
GPUS = {g.name: g for g in (
    GPU("NVIDIA H200", 4800, 141, {"fp16": 989.5, "int8": 1979, "fp8": 1979}, (9, 0)),
    GPU("NVIDIA H100 SXM", 3350, 80, {"fp16": 989.5, "int8": 1979, "fp8": 1979}, (9, 0)),
    GPU("NVIDIA A100 80GB SXM", 2039, 80, {"fp16": 312, "int8": 624}, (8, 0), "no FP8 tensor cores"),
    GPU("NVIDIA GeForce RTX 4090", 1008, 24, {"fp16": 165.2, "int8": 660.6, "fp8": 330.3}, (8, 9)),
    GPU("NVIDIA L4", 300, 24, {"fp16": 121, "int8": 242.5, "fp8": 242.5}, (8, 9)),
    GPU("NVIDIA RTX PRO 6000 Blackwell", 1792, 96, {"fp16": 500, "int8": 1000, "fp8": 1000}, (12, 0),
        "tensor rates derived from the 4,000 sparse FP4 TOPS of the spec sheet (/8, /4)"),
)}
# a profile curve's name -> (compat format, arithmetic whose peak bounds it)
CURVES = {"fp16": ("dense", "fp16"), "w4a16-triton": ("w4", "fp16"), "w8a8-int8": ("w8a8-int8", "int8"),
          "w8a8-fp8": ("w8a8-fp8", "fp8")}
MIN_CAPABILITY = {"w8a8-fp8": (8, 9)}


@dataclass(frozen=True)
class Fit:
    e_bw: float
    e_c: float
    c0_us: float


@dataclass(frozen=True)
class Curve:
    """One measured layer curve: a format at a shape on the calibration GPU."""
    fmt: str
    shape: str
    tokens: list[int]
    us: list[float]
    weight_bytes: float
    params: float


def layer_us(f: Fit, gpu: GPU, math: str, weight_bytes: float, params: float, t: int) -> float:
    mem = weight_bytes / (f.e_bw * gpu.bandwidth_GBps * 1e3)          # bytes / (bytes per us)
    compute = 2.0 * t * params / (f.e_c * gpu.tflops[math] * 1e6)
    return f.c0_us + max(mem, compute)


def _math(fmt: str) -> str:
    return next(m for f, m in CURVES.values() if f == fmt)


def fit(curves: list[Curve], gpu: GPU, e_bw: float) -> Fit:
    """(e_c, c0) minimising the squared relative error over the curves (a grid for e_c, c0 in
    closed form). e_bw is the GPU's measured copy rate over its spec (the profile's own
    measurement): one shape alone cannot tell a slower read from a larger fixed part."""
    best: Optional[tuple[float, Fit]] = None
    pts = [(c, t, u) for c in curves for t, u in zip(c.tokens, c.us)]
    for j in range(1, 201):
        probe = Fit(e_bw, j / 200, 0.0)
        roof = [layer_us(probe, gpu, _math(c.fmt), c.weight_bytes, c.params, t) for c, t, _ in pts]
        c0 = max(0.0, sum((u - r) / u ** 2 for (_, _, u), r in zip(pts, roof)) / sum(1 / u ** 2 for *_, u in pts))
        err = sum(((r + c0 - u) / u) ** 2 for (_, _, u), r in zip(pts, roof))
        if best is None or err < best[0]:
            best = (err, Fit(e_bw, j / 200, c0))
    assert best is not None
    return best[1]


def errors(f: Fit, curves: list[Curve], gpu: GPU) -> list[float]:
    return [layer_us(f, gpu, _math(c.fmt), c.weight_bytes, c.params, t) / u - 1
            for c in curves for t, u in zip(c.tokens, c.us)]


def _params(cfg: dict[str, Any]) -> float:
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_heads"] * cfg["head_dim"]
    kv = cfg["num_kv_heads"] * cfg["head_dim"]
    return 2.0 * h * q + 2.0 * h * kv + 3.0 * h * i


def curves_of(profile: dict[str, Any]) -> list[Curve]:
    """The layer curves of a profile that the model knows (hierviz.measure.profile's JSON)."""
    out = []
    for s in profile["series"]:
        if s["scope"] == "layer" and s["format"] in CURVES and not s.get("estimated"):
            out.append(Curve(CURVES[s["format"]][0], profile["shape"], list(profile["tokens"]), list(s["us"]),
                             s["weight_bytes"] / s["layers"], _params(profile["config"])))
    return out


def calibrate(profiles: list[dict[str, Any]], gpu: GPU) -> dict[str, Any]:
    """Per-format fits on every curve, and the two checks: each shape left out, each format left out."""
    curves = [c for p in profiles for c in curves_of(p)]
    copy = sum(p["copy_bandwidth_GBps"] for p in profiles) / len(profiles)
    e_bw = min(1.0, copy / gpu.bandwidth_GBps)
    fmts = sorted({c.fmt for c in curves})
    shapes = sorted({c.shape for c in curves})
    fits = {fm: fit([c for c in curves if c.fmt == fm], gpu, e_bw) for fm in fmts}
    summary = lambda errs: {"mean_abs": sum(map(abs, errs)) / len(errs), "max_abs": max(map(abs, errs))}  # noqa: E731
    in_sample = {fm: summary(errors(fits[fm], [c for c in curves if c.fmt == fm], gpu)) for fm in fmts}
    shape_out = {}
    for fm in fmts:
        for sh in shapes:
            train = [c for c in curves if c.fmt == fm and c.shape != sh]
            test = [c for c in curves if c.fmt == fm and c.shape == sh]
            if train and test:
                shape_out[f"{fm} @ {sh}"] = summary(errors(fit(train, gpu, e_bw), test, gpu))
    format_out = {}
    for fm in fmts:
        train = [c for c in curves if c.fmt != fm]
        test = [c for c in curves if c.fmt == fm]
        if train:
            format_out[fm] = summary(errors(fit(train, gpu, e_bw), test, gpu))
    return {"gpu": gpu.name, "copy_bandwidth_GBps": copy, "e_bw": e_bw, "fits": {fm: asdict(f) for fm, f in fits.items()}, "in_sample": in_sample,
            "leave_one_shape_out": shape_out, "leave_one_format_out": format_out,
            "curves": [{"format": c.fmt, "shape": c.shape} for c in curves]}


def model_us(f: Fit, gpu: GPU, fmt: str, cfg: dict[str, Any], bytes_per_param: float, t: int,
             layers: Optional[int] = None) -> float:
    """A whole forward: its layers (the layer model) and the LM head (dense FP16, bandwidth-bound)."""
    n = cfg["num_layers"] if layers is None else layers
    layer = layer_us(f, gpu, _math(fmt), _params(cfg) * bytes_per_param, _params(cfg), t)
    head = 2.0 * cfg["vocab_size"] * cfg["hidden_size"] / (f.e_bw * gpu.bandwidth_GBps * 1e3)
    return n * layer + head


def fits_memory(gpu: GPU, weight_bytes: float) -> bool:
    return weight_bytes <= 0.9 * gpu.memory_GB * 1e9


def project(calibration: dict[str, Any], compat: dict[str, Any], configs: dict[str, dict[str, Any]],
            gpus: list[GPU]) -> dict[str, Any]:
    """Each compat row's methods on each GPU: measured stages, verification scaled by the model."""
    from hierviz.measure.whatif import BYTES_PER_WEIGHT, model_bytes
    from hierviz.models.config import ModelConfig
    base = GPUS[calibration["gpu"]]
    fits = {fm: Fit(**f) for fm, f in calibration["fits"].items()}
    s = compat["settings"]
    t_cfg, m_cfg = configs["target"], configs["intermediate"]
    m_fmt = "w4" if compat["intermediate"].startswith("W4A16") else "dense"
    rows_of = {"ar": 1, compat["head"]: s["t_tree_size"] + 1, "hierspec": s["min_draft_len"] + 2}
    out = []
    for r in compat["rows"]:
        fm = r["format"]
        if "error" in r or fm not in fits or m_fmt not in fits:
            continue
        need = (model_bytes(ModelConfig(**_cfg_fields(t_cfg)), fm)
                + model_bytes(ModelConfig(**_cfg_fields(m_cfg)), m_fmt))
        for gpu in gpus:
            entry: dict[str, Any] = {"gpu": gpu.name, "format": fm, "name": r["name"], "projected": gpu.name != base.name}
            if r.get("layers_measured", 0) < r.get("layers", 0):
                entry["layers_note"] = f"{r['layers_measured']} of {r['layers']} layers measured, scaled"
            if fm not in MIN_CAPABILITY or gpu.capability >= MIN_CAPABILITY[fm]:
                pass
            else:
                entry["skipped"] = "no FP8 tensor cores"
                out.append(entry)
                continue
            if gpu.name != base.name and not fits_memory(gpu, need):    # the calibration GPU's rows were measured
                entry["skipped"] = f"needs ~{need / 1e9:.0f} GB of weights; has {gpu.memory_GB:.0f} GB"
                out.append(entry)
                continue
            tps = {}
            subset = r.get("layers", 1) / r.get("layers_measured", 1)    # a layer subset's target stage, scaled
            for m, st in r["stages_ms_per_token"].items():
                if gpu.name == base.name:      # measured here
                    tps[m] = r["tokens_per_s"][m]
                    continue
                t_rows = r.get("target_rows_per_round", {}).get(m, rows_of.get(m, 1))
                ratio_t = (model_us(fits[fm], gpu, fm, t_cfg, BYTES_PER_WEIGHT[fm], t_rows)
                           / model_us(fits[fm], base, fm, t_cfg, BYTES_PER_WEIGHT[fm], t_rows))
                ratio_m = (model_us(fits[m_fmt], gpu, m_fmt, m_cfg, BYTES_PER_WEIGHT[m_fmt], s["m_tree_size"] + 1)
                           / model_us(fits[m_fmt], base, m_fmt, m_cfg, BYTES_PER_WEIGHT[m_fmt], s["m_tree_size"] + 1))
                ms = (st.get("target_verify", 0.0) * subset * ratio_t + st.get("intermediate_verify", 0.0) * ratio_m
                      + st.get("draft", 0.0) + st.get("overhead", 0.0))
                tps[m] = 1000.0 / ms
            entry["tokens_per_s"] = tps
            if "ar" in tps:
                entry["speedup_vs_ar"] = {m: v / tps["ar"] for m, v in tps.items()}
            entry["winner"] = max(tps, key=tps.get)
            out.append(entry)
    return {"shapes": compat["shapes"], "head": compat["head"], "settings": s, "rows": out}


def _cfg_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    from hierviz.models.config import ModelConfig
    names = set(ModelConfig.__dataclass_fields__)
    return {k: v for k, v in cfg.items() if k in names}


def markdown(info: dict[str, Any]) -> str:
    cal = info["calibration"]
    lines = [f"# Cost model, calibrated on {cal['gpu']}", "",
             "| format | e_bw | e_c | c0 us | in-sample mean / max error | each shape left out (max) | "
             "format left out (mean / max) |", "|---|---|---|---|---|---|---|"]
    for fm, f in cal["fits"].items():
        ins = cal["in_sample"][fm]
        so = [v["max_abs"] for k, v in cal["leave_one_shape_out"].items() if k.startswith(fm + " @")]
        fo = cal["leave_one_format_out"].get(fm)
        fo_text = f"{fo['mean_abs']:.1%} / {fo['max_abs']:.1%}" if fo else "–"
        lines.append(f"| {fm} | {f['e_bw']:.2f} | {f['e_c']:.2f} | {f['c0_us']:.0f} | "
                     f"{ins['mean_abs']:.1%} / {ins['max_abs']:.1%} | "
                     f"{', '.join(f'{x:.1%}' for x in so) or '–'} | "
                     f"{fo_text} |")
    for proj in info.get("projections", []):
        tree = proj["head"]
        lines += ["", f"## {proj['shapes']['target']} target, {proj['shapes']['intermediate']} intermediate ({LABEL}"
                      " except the calibration GPU's own rows)", "",
                  f"| GPU | format | AR tok/s | {tree} / AR | HierSpec / AR | HierSpec / {tree} | winner |",
                  "|---|---|---|---|---|---|---|"]
        for e in proj["rows"]:
            if "skipped" in e:
                lines.append(f"| {e['gpu']} | {e['name']} | {e['skipped']} | | | | |")
                continue
            sp, tps = e["speedup_vs_ar"], e["tokens_per_s"]
            lines.append(f"| {e['gpu']}{' (projected)' if e['projected'] else ''} | {e['name']} | {tps['ar']:.1f} | "
                         f"{sp.get(tree, 0):.2f}x | {sp.get('hierspec', 0):.2f}x | "
                         f"{tps['hierspec'] / tps[tree]:.2f}x | {e['winner']} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hierviz cost-model", description=(
        "Fit a roofline cost model per weight format to measured profiles, check it (shape and format left out) "
        "and project compat tables to other GPUs from their spec sheets."))
    ap.add_argument("--profiles", required=True, help="comma-separated profile.json files of one GPU")
    ap.add_argument("--compat", default="", help="comma-separated compat.json files of the same GPU to project")
    ap.add_argument("--gpus", default=",".join(GPUS), help="GPUs to project onto (names as in the model's table)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        profiles = [json.loads(Path(p).read_text()) for p in a.profiles.split(",") if p]
        compats = [json.loads(Path(p).read_text()) for p in a.compat.split(",") if p]
        names = {p.get("device") for p in profiles}
        if len(names) != 1 or next(iter(names)) not in GPUS:
            raise ValueError(f"the profiles must come from one GPU the model knows ({', '.join(GPUS)}); got {names}")
        gpus = [GPUS[g.strip()] for g in a.gpus.split(",") if g.strip()]
    except KeyError as e:
        print(f"error: unknown GPU {e}; known: {', '.join(GPUS)}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from hierviz.measure.compat import write_report
    gpu = GPUS[next(iter(names))]
    cal = calibrate(profiles, gpu)
    info: dict[str, Any] = {"schema": SCHEMA, "label": LABEL, "calibration": cal,
                            "gpus": [asdict(g) for g in gpus], "projections": []}
    for c in compats:
        configs = {"target": c["configs"]["target"], "intermediate": c["configs"]["intermediate"]}
        info["projections"].append(project(cal, c, configs, gpus))
    info["command"] = "python -m hierviz cost-model " + shlex.join(sys.argv[1:] if argv is None else argv)
    write_report(Path(a.out), "cost_model", info, markdown(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
