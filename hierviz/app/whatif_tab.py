"""The app's What-if tab (docs/whatif.md): which method wins at real model sizes?

Shows the results that `python -m hierviz whatif` recorded (whatif.json / sweep.json files
copied to assets/whatif/) and runs a small what-if live: at real small shapes on a machine
with a CUDA GPU, at tiny shapes on a CPU (plumbing only). Every figure is "projected with
replayed acceptance": timings measured on synthetic-weight models of those shapes, accept/reject
decisions given (a recorded trace or per-depth rates).

Only files listed from assets/whatif/ (recorded results) and assets/traces/ (acceptance
traces) are ever read; the browser picks among their labels, never sends a path. The live run
is the command itself (hierviz.measure.whatif.main: parser().parse_args -> run_whatif) in a child
process, so it can be killed when it runs past its time limit; it takes its turn on the device in
the app's device line (hierviz.app.line), after the live runs waiting before it.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional

import gradio as gr

from hierviz import methods
from hierviz.methods import BASELINE, PEER, SUBJECT
from hierviz.app.formats_panel import formats_section
from hierviz.app.common import ROOT, TRACE_DIR, status_html
from hierviz.app.guard import VisitorError
from hierviz.app.line import LINE
from hierviz.app.session import session_key
from hierviz.machine import formats_in_words
from hierviz.trace import MAX_TRACE_BYTES
from hierviz.viz.crossover import opening_trace_position
from hierviz.viz.style import esc, method_label
from hierviz.quant.formats import DEFAULT_FORMAT, by_width, get_format
from hierviz.retime import WHATIF_HEADLINE
from hierviz.viz.whatif_fig import (LABEL, acceptance_label, figures, kind, machine_label, model_format, row_order,
                                   reduced_draft_vocab, shapes_label, sweep_base_rates)

log = logging.getLogger(__name__)

WHATIF_DIR = ROOT / "assets" / "whatif"
HEADLINE_RESULT = WHATIF_HEADLINE.name   # opens with the tab: the result the first screen quotes
MAX_RESULT_BYTES = 5 * 2**20

# Live run. Shapes (target, intermediate) that build and run in well under the time limit on
# one GPU; a CPU gets only the tiny stand-ins.
TINY = "tiny shapes (CPU-sized stand-ins: plumbing only)"
LIVE_SHAPES = {
    "SmolLM2-135M target / 10-layer M (the offline stack's shapes)": ("smollm2", "assets/configs/smollm2-m10.json"),
    "Llama-3-8B target / Llama-3.2-1B-shaped M": ("llama3-8b", "assets/configs/llama3.2-1b.json"),
}
RATES_SOURCE = "per-depth acceptance rates (below)"
DEFAULT_RATES_TEXT = "0.9,0.8,0.75,0.7,0.65,0.6"    # == hierviz.measure.whatif_acceptance.DEFAULT_RATES (torch-free import)
DEFAULT_SEQ_RATE = 0.85
MAX_NEW_CAP = 64
PROMPT_LEN = 64
LIVE_TIMEOUT_S = {"cuda": 300, "cpu": 120}
LIVE_METHODS = ",".join((BASELINE, PEER, SUBJECT))     # the paper's comparison
SUBJECT_VS_PEER = f"{SUBJECT}_vs_{PEER}"                # the what-if JSON's key for that ratio

EXPLAIN = f"""**Which method wins at real model sizes?** `python -m hierviz whatif` builds models of real shapes with
random weights (the target in 4-bit W4A16, the intermediate M dense or W4A16, EAGLE heads), runs the **real** decoders —
same forwards, same kernels, same tree and sequence verification — and forces only the accept/reject decisions:
replayed from a recorded trace or drawn from per-depth acceptance rates. Latency does not depend on weight values
and acceptance does not depend on the GPU, so the timings are measured and the acceptance is given: every figure is
**{LABEL}**. The acceptance source is named above every chart."""

EMPTY = ("**No recorded what-if results are shipped with this build yet.** The H200 runs of "
         "`python -m hierviz whatif` (the commands are in docs/whatif.md) appear here once their `whatif.json` / "
         "`sweep.json` files are copied to `assets/whatif/`. The live run below works meanwhile.")

CPU_NOTE = ("**No GPU on this machine:** the live run uses the tiny CPU-sized stand-in shapes (`--tiny`). Its figures "
            "only show the plumbing — on a CPU every forward is compute-bound, so the numbers say nothing about which "
            "method wins on a GPU. The recorded results above are the real-shape measurements.")
GPU_NOTE = ("Runs `python -m hierviz whatif` on this GPU at small real shapes: AR, EAGLE-2 and HierSpec, "
            f"a {PROMPT_LEN}-token synthetic prompt, warm-up included; stopped after {LIVE_TIMEOUT_S['cuda']} s.")


class LiveInputError(ValueError):
    """A live-run request that cannot run; the message is fit to show a user."""


# ---- recorded results -------------------------------------------------------------------------

def _read_json(p: Path, limit: int) -> Any:
    """A JSON file listed from one of our asset folders (a plain file, not a link, not too big)."""
    if p.is_symlink() or not p.is_file() or p.stat().st_size > limit:
        raise ValueError(f"{p.name} is not a readable result file")
    return json.loads(p.read_text(encoding="utf-8"))


def _short_source(d: dict[str, Any]) -> str:
    if kind(d) == "sweep":
        return "acceptance sweep"
    acc = d.get("acceptance") or {}
    if acc.get("mode") == "trace":
        return "replayed trace " + Path(str(acc.get("source", "?"))).name
    return "acceptance rates"


def recorded_results() -> dict[str, Path]:
    """label -> file, for every whatif.json / sweep.json copy in assets/whatif/."""
    out: dict[str, Path] = {}
    if not WHATIF_DIR.is_dir():
        return out
    # sweeps first (they show where each method wins), then by name
    for p in sorted(WHATIF_DIR.glob("*.json"), key=lambda q: ("sweep" not in q.name, q.name)):
        try:
            d = _read_json(p, MAX_RESULT_BYTES)
        except (OSError, ValueError):
            continue
        if kind(d):
            where = (d.get("machine") or {}).get("gpu") or str(d.get("device", "?")).upper()
            out[f"{p.name}: {shapes_label(d)} on {where}, {_short_source(d)}"] = p
    return out


def _fmt_x(v: Optional[float]) -> str:
    return "–" if v is None else f"{v:.2f}x"


def summary_markdown(d: dict[str, Any]) -> str:
    """Table of one result: tokens/s, speedup vs AR, tau, ms/token (whatif) or the verdicts (sweep)."""
    if kind(d) == "sweep":
        tree_name = method_label(d.get("tree_method", PEER))
        best_subject = f"best_{SUBJECT}"
        lines = [f"| scale | best {tree_name} (tree size) | best HierSpec (min draft) | HierSpec / {tree_name} | winner |",
                 "|---|---|---|---|---|"]
        for v in sorted(d["verdicts"], key=lambda v: float(v["scale"])):
            ratio = v[best_subject] / v["best_tree"] if v["best_tree"] else None
            lines.append(f"| {v['scale']:g} | {v['best_tree']:.2f}x ({v['best_tree_size']}) | "
                         f"{v[best_subject]:.2f}x ({v['best_min_draft_len']}) | {_fmt_x(ratio)} | "
                         f"**{method_label(v['winner'])}** |")
        lines += ["", f"Speedups vs AR ({d.get('ar_tokens_per_s', 0):.1f} tokens/s), {LABEL}; scale multiplies "
                  "every acceptance rate (1 = the rates named below)."]
        return "\n".join(lines)
    ms = d["methods"]
    sp = d.get("speedup_vs_ar") or {}
    lines = ["| method | tok/s | vs AR | τ | ms/tok | rounds |", "|---|---|---|---|---|---|"]
    for m in row_order(ms):
        r = ms[m]
        lines.append(f"| {methods.short(m)} | {r['tokens_per_s']:.1f} | {_fmt_x(sp.get(m))} | "
                     f"{r['tokens_per_round']:.2f} | {r['ms_per_token']:.2f} | {r['rounds']} |")
    lines += ["", "tok/s: decode tokens per second (prefill excluded); vs AR: speedup; τ: tokens per round "
              "(per target verification); ms/tok: time per output token."]
    runs = {m: r["decode_s_runs"] for m, r in ms.items() if len(r.get("decode_s_runs") or []) > 1}
    if runs:     # --repeat N: the table shows each method's median run; say how far the runs spread
        spread = ", ".join(f"{methods.short(m)} {min(v):.3f}-{max(v):.3f} s" for m, v in runs.items())
        lines += ["", f"Each method: the median of {max(len(v) for v in runs.values())} timed runs "
                      f"(decode times {spread})."]
    ratios = [f"{methods.label(row)} / {methods.label(tree)}: {d[f'{row}_vs_{tree}']:.2f}x" for row in row_order(ms)
              for tree in row_order(ms) if isinstance(d.get(f"{row}_vs_{tree}"), (int, float))]
    if ratios:
        lines += ["", f"**{'; '.join(ratios)}** ({LABEL})."]
    sources = {m: r.get("acceptance_source") for m, r in ms.items() if r.get("acceptance_source")}
    if len(set(sources.values())) > 1:     # rows drew from different records: name each
        lines += ["", "Acceptance per row: " + "; ".join(f"{methods.short(m)}: {sources[m]}" for m in row_order(sources))
                  + "."]
    if (d.get("acceptance") or {}).get("mode") == "rates":
        lines += ["", assumed_rates_note()]
    return "\n".join(lines)


def assumed_rates_note() -> str:
    """What an assumed acceptance means next to a measured one: the sweep's crossover and where the
    Visualizer's opening trace sits (hierviz.viz.crossover), so this tab and the Visualizer agree."""
    pos = opening_trace_position()
    if pos is None:
        return "The acceptance here is assumed (the rates above), not measured."
    cross = (f"the acceptance sweep puts the crossover with EAGLE-2 at scale {pos.crossover_scale:.2f} of these rates"
             if pos.crossover_scale is not None else "the acceptance sweep shows where EAGLE-2 wins instead")
    return (f"The acceptance here is assumed (the rates above, scale 1), not measured: {cross}. The Visualizer's "
            f"opening trace (SmolLM2 stack) accepts at about scale {pos.run_scale:.2f}; its own tokens re-timed at "
            f"these shapes give HierSpec **{pos.run_speedup:.2f}x** EAGLE-2 (projected).")


def _shape_arg(name: str) -> str:
    from_assets = ROOT / "assets" / "configs" / f"{name}.json"
    if name in ("llama3-8b", "llama3-70b", "smollm2"):
        return name
    return f"assets/configs/{name}.json" if from_assets.exists() else f"{name}.json"


def command_text(d: dict[str, Any]) -> tuple[str, bool]:
    """(command, verbatim): the recorded command line if the JSON has one, else one rebuilt from
    the settings the JSON records (whatif.json and sweep.json do not store their command line)."""
    cmd = d.get("command")
    if isinstance(cmd, list) and all(isinstance(c, str) for c in cmd):
        cmd = " ".join(cmd)
    if isinstance(cmd, str) and cmd.strip():
        return cmd.strip(), True
    from hierviz.settings import DRAFT_FLAGS, DecodeSettings
    dev = str(d.get("device", "cuda"))
    parts = ["python -m hierviz whatif"]
    sh = d.get("shapes") or {}
    if d.get("tiny"):
        parts.append("--tiny")
    else:
        parts += ["--target", _shape_arg(str(sh.get("target", "?"))),
                  "--intermediate", _shape_arg(str(sh.get("intermediate", "?")))]
    m = model_format(d)
    if not m.dense:
        parts += ["--intermediate-format", m.name]
    sweep = kind(d) == "sweep"
    if not sweep:
        parts += ["--methods", ",".join(d.get("methods") or {})]
    parts += ["--device", dev]
    if d.get("dtype") and d["dtype"] != ("float16" if dev == "cuda" else "float32"):
        parts += ["--dtype", str(d["dtype"])]
    if d.get("w4_kernel") and d["w4_kernel"] != ("triton" if dev == "cuda" else "reference"):
        parts += ["--w4-kernel", str(d["w4_kernel"])]
    acc = d.get("acceptance") or {}
    default_rates = [float(x) for x in DEFAULT_RATES_TEXT.split(",")]

    def same(a: list[float], b: list[float]) -> bool:
        return len(a) == len(b) and all(abs(x - y) < 1e-6 for x, y in zip(a, b))

    if sweep:
        rates, seq = sweep_base_rates(d)
    elif acc.get("mode") == "trace":
        rates, seq = [], None
        parts += ["--acceptance", str(acc.get("source", "TRACE.json"))]
    else:
        rates, seq = acc.get("rates") or [], acc.get("seq_rate")
        if acc.get("m_rates") and not same(acc["m_rates"], rates):
            parts += ["--m-acceptance-rates", ",".join(f"{r:g}" for r in acc["m_rates"])]
    if rates and not same(rates, default_rates):
        parts += ["--acceptance-rates", ",".join(f"{r:g}" for r in rates)]
    if seq is not None and abs(seq - DEFAULT_SEQ_RATE) > 1e-6:
        parts += ["--seq-rate", f"{seq:g}"]
    s = d.get("settings") or {}
    base = DecodeSettings()
    for f in DRAFT_FLAGS:
        if f.field in s and s[f.field] != getattr(base, f.field):
            parts += [f.flag, str(s[f.field])]
    if s.get("max_new_tokens"):
        parts += ["--max-new-tokens", str(s["max_new_tokens"])]
    if s.get("seed"):
        parts += ["--seed", str(s["seed"])]
    if d.get("prompt_tokens") not in (None, 128):
        parts += ["--prompt-len", str(d["prompt_tokens"])]
    if d.get("stage_sync") is False:
        parts.append("--no-stage-sync")
    if (d.get("repeat") or 1) > 1:
        parts += ["--repeat", str(d["repeat"])]
    if reduced_draft_vocab(d):
        parts += ["--draft-vocab", str(reduced_draft_vocab(d))]
    if sweep:
        rows = d.get("rows") or []
        parts += ["--sweep", "--sweep-scales", ",".join(f"{x:g}" for x in sorted({float(r["scale"]) for r in rows})),
                  "--sweep-tree-sizes", ",".join(str(x) for x in sorted({r["t_tree_size"] for r in rows
                                                                         if "t_tree_size" in r})),
                  "--sweep-min-draft", ",".join(str(x) for x in sorted({r["min_draft_len"] for r in rows
                                                                        if "min_draft_len" in r}))]
    parts += ["--out", "OUT_DIR"]
    return " ".join(parts), False


def wrap_command(cmd: str, width: int = 64) -> str:
    """A long command as shell continuation lines, breaking only before an option."""
    lines, cur = [], ""
    for tok in cmd.split(" "):
        if cur and tok.startswith("--") and len(cur) + 1 + len(tok) > width:
            lines.append(cur)
            cur = "    " + tok
        else:
            cur = f"{cur} {tok}" if cur else tok
    return " \\\n".join(lines + [cur])


def source_markdown(d: dict[str, Any], name: str = "") -> str:
    """Where the numbers come from: machine, formats, acceptance source, replay check, command."""
    lines = [f"**Machine:** {esc(machine_label(d))}" + (f" · file `{esc(name)}`" if name else ""),
             f"**Shapes:** {esc(shapes_label(d))}"]
    fm = d.get("formats") or {}
    if fm:
        # a record that ran some W4 kinds on the CUDA kernel says so, naming them on the next line
        target, inter = (formats_in_words(str(fm.get(role, "?")), d.get("machine")) for role in ("target", "intermediate"))
        lines.append(f"**Formats:** target {esc(target)}; intermediate {esc(inter)}")
    w4_kernels = (d.get("machine") or {}).get("w4_fp16_kernel")
    if isinstance(w4_kernels, str) and w4_kernels:
        lines.append(f"**fp16 W4 products:** {esc(w4_kernels)}")
    lines.append(f"**Acceptance ({LABEL}):** {esc(acceptance_label(d))}")
    rep = d.get("replay") or {}
    if rep:
        lines.append("**Replay check:** " + "; ".join(
            f"{method_label(m)} {'exact' if r.get('exact') else 'NOT exact'} "
            f"({r.get('rounds_identical', '?')}/{r.get('rounds_in_trace', '?')} rounds)"
            for m, r in rep.items() if m != BASELINE))
    if d.get("tiny"):
        lines.append("**Tiny shapes:** a plumbing check, not a measurement of any real model size.")
    cmd, verbatim = command_text(d)
    how = "Command" if verbatim else ("Command, rebuilt from the settings the JSON records (the JSON does not store "
                                      "its command line; `--threads` is not recorded)")
    lines += [f"**{how}:**", "", f"```\n{wrap_command(cmd)}\n```"]
    return "\n\n".join(lines)


def _plots(figs: list) -> tuple[Any, Any]:
    a = gr.update(value=figs[0], visible=True) if figs else gr.update(value=None, visible=False)
    b = gr.update(value=figs[1], visible=True) if len(figs) > 1 else gr.update(value=None, visible=False)
    return a, b


def show_recorded(label: Optional[str]) -> tuple[Any, Any, str, str]:
    """(plot A, plot B, table, source) of one recorded file, chosen by its label."""
    files = recorded_results()
    if not files:
        return *_plots([]), EMPTY, ""
    if not label or label not in files:
        return *_plots([]), "Choose one of the recorded results.", ""
    try:
        d = _read_json(files[label], MAX_RESULT_BYTES)
        return *_plots(figures(d)), summary_markdown(d), source_markdown(d, files[label].name)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError) as e:
        log.warning("what-if result %s unreadable: %s", files[label], e)
        return *_plots([]), f"Could not show {files[label].name}: it is not a complete what-if result.", ""


# ---- live run ---------------------------------------------------------------------------------

def cuda_available() -> bool:
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:   # a broken torch install must not take the tab down
        return False


def live_shape_choices(cuda: bool) -> list[str]:
    return [*LIVE_SHAPES, TINY] if cuda else [TINY]


def replay_traces() -> dict[str, Path]:
    """label -> file of the recorded (not hand-made) traces in assets/traces/ that have both a
    HierSpec and an EAGLE-2 run, so their accepted lengths can be replayed."""
    out: dict[str, Path] = {}
    for p in sorted(TRACE_DIR.glob("*.json")) if TRACE_DIR.is_dir() else []:
        try:
            d = _read_json(p, MAX_TRACE_BYTES)
            runs = d["runs"] if isinstance(d, dict) and "runs" in d else [d]
            metas = [r.get("meta") or {} for r in runs]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        methods = {m.get("method") for m in metas}
        if any(m.get("synthetic") for m in metas) or not {SUBJECT, PEER} <= methods:
            continue
        out[f"replay trace: {metas[0].get('title') or p.stem} ({p.name})"] = p
    return out


def parse_rates(text: Any) -> list[float]:
    """Comma-separated probabilities, e.g. "0.9,0.8,0.7"; a clear message otherwise."""
    raw = str(text if text is not None else "").strip()
    hint = "e.g. 0.9,0.8,0.7 (depth 1, 2, 3...; the last one repeats)"
    if not raw:
        raise LiveInputError(f"Acceptance rates are empty: give comma-separated probabilities, {hint}.")
    try:
        vals = [float(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise LiveInputError(f"Acceptance rates must be comma-separated numbers, {hint}; got {raw[:60]!r}.") from None
    if not vals or len(vals) > 32:
        raise LiveInputError(f"Give 1 to 32 acceptance rates, {hint}.")
    if any(not 0.0 <= v <= 1.0 for v in vals):   # also rejects nan
        raise LiveInputError(f"Acceptance rates are probabilities: each must be between 0 and 1; got {raw[:60]!r}.")
    return vals


def _number(v: Any, what: str, lo: float, hi: float) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise LiveInputError(f"{what} must be a number.") from None
    if not lo <= x <= hi:
        raise LiveInputError(f"{what} must be between {lo:g} and {hi:g}; got {x:g}.")
    return x


def live_formats() -> dict[str, str]:
    """The live run's target formats, label -> whatif --target-format (every registered format the
    what-if builds, hierviz.quant.formats): the paper's first, then widest first."""
    paper = get_format(DEFAULT_FORMAT)
    rest = [f for f in by_width() if f is not paper]
    return {f"{paper.label} (the paper's)": paper.name,
            **{(f"{f.label} (the run's dtype)" if f.dense else f.label): f.name for f in rest}}


def live_argv(shape: Any, source: Any, rates_text: Any, scale: Any, seq_rate: Any, max_new: Any,
              cuda: bool, out: str, target_format: Any = None) -> list[str]:
    """The `python -m hierviz whatif` arguments of a live run; LiveInputError for bad input."""
    formats = live_formats()
    target_format = next(iter(formats)) if target_format is None else target_format
    if target_format not in formats:
        raise LiveInputError("Choose one of the listed target formats.")
    if shape not in live_shape_choices(cuda):
        if shape in LIVE_SHAPES:
            raise LiveInputError("Real shapes need a CUDA GPU; this machine has none. Choose the tiny shapes.")
        raise LiveInputError("Choose one of the listed model shapes.")
    n = int(_number(max_new, "Max new tokens", 2, MAX_NEW_CAP))
    if shape == TINY:
        argv = ["--tiny"]
    else:
        t, m = LIVE_SHAPES[shape]
        argv = ["--target", _live_shape(t), "--intermediate", _live_shape(m)]
    argv += ["--device", "cuda"] if cuda else ["--device", "cpu", "--threads", "1"]
    argv += ["--methods", LIVE_METHODS, "--max-new-tokens", str(n), "--prompt-len", str(PROMPT_LEN)]
    if formats[target_format] != DEFAULT_FORMAT:      # the what-if's default stays out of the shown command
        argv += ["--target-format", formats[target_format]]
    if source == RATES_SOURCE or source is None or source == "":
        sc = _number(scale, "Acceptance scale", 0.1, 1.5)
        rates = [min(1.0, r * sc) for r in parse_rates(rates_text)]
        seq = min(1.0, _number(seq_rate, "Sequence acceptance rate", 0.0, 1.0) * sc)
        argv += ["--acceptance-rates", ",".join(f"{r:.4g}" for r in rates), "--seq-rate", f"{seq:.4g}"]
    else:
        traces = replay_traces()
        if source not in traces:
            raise LiveInputError("Choose one of the listed acceptance sources.")
        argv += ["--acceptance", str(traces[source])]
    return argv + ["--out", out]


def _live_shape(shape: str) -> str:
    """A preset name as it is; a config under assets/ as an absolute path (the child's cwd is the root)."""
    return shape if "/" not in shape else str(ROOT / shape)


def live_command(argv: list[str], out: str) -> str:
    """The live run's exact command line, with repository paths relative and the output folder named OUT_DIR."""
    root = str(ROOT) + os.sep
    shown = ["OUT_DIR" if x == out else (x[len(root):] if x.startswith(root) else x) for x in argv]
    return " ".join(["python -m hierviz whatif", *shown])


def run_child(argv: list[str], timeout_s: float) -> dict[str, Any]:
    """Run the what-if command in a child process (killed after timeout_s) and read its whatif.json;
    a child that fails otherwise raises RuntimeError with its output (the server log's)."""
    from hierviz.measure.api import WhatIfArgumentsError, WhatIfRefused, whatif_in_child
    try:
        return whatif_in_child(argv, timeout_s)
    except WhatIfArgumentsError:
        raise LiveInputError("These settings are not valid what-if arguments.") from None
    except WhatIfRefused as e:
        raise LiveInputError(f"The what-if refused these settings: {e}") from None
    except TimeoutError:
        raise LiveInputError(f"The live run took longer than {timeout_s:.0f} s and was stopped: "
                             "try fewer new tokens or smaller shapes.") from None


def live_run(shape: Any, source: Any, rates_text: Any, scale: Any, seq_rate: Any, max_new: Any,
             target_format: Any = None, request: Optional[gr.Request] = None) -> Iterator[tuple[str, Any, Any, str]]:
    """Gradio handler: (status, plot A, plot B, table); every failure is a message."""
    keep = gr.skip()
    cuda = cuda_available()
    dev = "cuda" if cuda else "cpu"
    with tempfile.TemporaryDirectory(prefix="hierviz-whatif-") as tmp:
        try:
            argv = live_argv(shape, source, rates_text, scale, seq_rate, max_new, cuda, tmp, target_format)
            where = "this GPU" if cuda else "the CPU (tiny shapes: plumbing only)"
            after = f" after the {LINE.waiting() + 1} live run(s) in line" if LINE.busy() else ""
            yield (status_html(f"Running AR, EAGLE-2 and HierSpec on {where}{after}… (stopped after "
                               f"{LIVE_TIMEOUT_S[dev]} s)"), keep, keep, keep)
            with LINE.hold(session_key(request)):      # the device is the live runs' too
                d = run_child(argv, LIVE_TIMEOUT_S[dev])
            d["command"] = live_command(argv, tmp)
            a, b = _plots(figures(d))
            note = ("Done: " + (f"HierSpec / EAGLE-2 = {d[SUBJECT_VS_PEER]:.2f}x, " if SUBJECT_VS_PEER in d
                                else "") + f"{LABEL}." + ("" if cuda else " Tiny CPU shapes: these numbers only show "
                                                          "the plumbing."))
            yield status_html(note, "ok"), a, b, summary_markdown(d) + "\n\n" + source_markdown(d)
        except (LiveInputError, VisitorError) as e:
            yield status_html(str(e), "error"), keep, keep, keep
        except Exception as e:   # last resort: the page stays usable, the details go to the server log
            log.exception("live what-if failed")
            yield (status_html(f"The live run failed (internal error: {type(e).__name__}); the details are in the "
                               "server log.", "error"), keep, keep, keep)


# ---- the tab ----------------------------------------------------------------------------------

def whatif_tab() -> None:
    files = recorded_results()
    labels = list(files)
    # the headline result (the paper's settings) if shipped, else the first real-scale result
    first: Optional[str] = next((lb for lb in labels if files[lb].name == HEADLINE_RESULT),
                                next((lb for lb in labels if "70b" in lb and "sweep" not in lb),
                                     labels[0] if labels else None))
    a, b, table, source = show_recorded(first)
    cuda = cuda_available()
    traces = replay_traces()
    gr.Markdown("## Recorded results")
    with gr.Row(equal_height=False):
        if not labels:    # nothing shipped yet: the message where the charts would be
            with gr.Column(scale=3):
                gr.Markdown(EMPTY, elem_id="hv-whatif-table", elem_classes=["hv-warn"])
            with gr.Column(scale=2):
                gr.Markdown(EXPLAIN, elem_classes=["hv-teach"])
        else:
            with gr.Column(scale=3):
                plot_a = gr.Plot(label="what-if (recorded)", elem_id="hv-whatif-a", **_plot_kw(a))
                plot_b = gr.Plot(label="what-if (recorded), per stage", elem_id="hv-whatif-b", **_plot_kw(b))
            with gr.Column(scale=2):
                gr.Markdown(EXPLAIN, elem_classes=["hv-teach"])
                choice = gr.Dropdown(labels, value=first, label="recorded what-if result (assets/whatif/)",
                                     elem_id="hv-whatif-pick")
                table_md = gr.Markdown(table, elem_id="hv-whatif-table")
                source_md = gr.Markdown(source, elem_id="hv-whatif-source")
            choice.change(show_recorded, choice, [plot_a, plot_b, table_md, source_md], api_visibility="private")

    formats_section()

    gr.Markdown("## Live run")
    with gr.Row(equal_height=False):
        with gr.Column(scale=2, min_width=320):
            gr.Markdown(GPU_NOTE if cuda else CPU_NOTE, elem_classes=["hv-teach"], elem_id="hv-whatif-note")
            shapes = live_shape_choices(cuda)
            shape = gr.Dropdown(shapes, value=shapes[0], label="model shapes (target / intermediate)",
                                elem_id="hv-whatif-shape")
            source_dd = gr.Dropdown([RATES_SOURCE, *traces], value=RATES_SOURCE, label="acceptance source",
                                    elem_id="hv-whatif-source-pick")
            rates = gr.Textbox(DEFAULT_RATES_TEXT,
                               label="per-depth tree acceptance rates (depth 1, 2, …; the last repeats)",
                               elem_id="hv-whatif-rates")
            with gr.Row():
                scale = gr.Slider(0.5, 1.2, value=1.0, step=0.05, label="acceptance scale (x every rate)",
                                  elem_id="hv-whatif-scale")
                seq = gr.Slider(0.0, 1.0, value=DEFAULT_SEQ_RATE, step=0.05,
                                label="sequence rate (T accepts M's token)")
            max_new = gr.Slider(8, MAX_NEW_CAP, value=32, step=8, label="max new tokens", elem_id="hv-whatif-max-new")
            fmt = gr.Dropdown(list(live_formats()), value=next(iter(live_formats())), label="target weight format",
                              elem_id="hv-whatif-format")
            go_btn = gr.Button("Run what-if live", variant="primary", elem_id="hv-whatif-run")
        with gr.Column(scale=3):
            live_status = gr.HTML(status_html("Press “Run what-if live”. The default rates are an assumption "
                                              "(docs/whatif.md), not a measurement."), elem_id="hv-whatif-status")
            live_a = gr.Plot(label="what-if (live)", visible=False, elem_id="hv-whatif-live-a")
            live_b = gr.Plot(label="what-if (live), per stage", visible=False, elem_id="hv-whatif-live-b")
            live_md = gr.Markdown("", elem_id="hv-whatif-live-table")
    go_btn.click(live_run, [shape, source_dd, rates, scale, seq, max_new, fmt], [live_status, live_a, live_b, live_md],
                 concurrency_id="gpu", concurrency_limit=1, show_progress="hidden", api_visibility="private")


def _plot_kw(update: Any) -> dict[str, Any]:
    """gr.update(...) of show_recorded as constructor arguments."""
    u = dict(update) if isinstance(update, dict) else {}
    return {"value": u.get("value"), "visible": bool(u.get("visible", False))}
