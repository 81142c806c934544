"""Engine speed and exactness on a GPU, side by side in one run.

    python -m hierviz engine-bench --out DIR [--tokens 128] [--hf plain,static-compiled]

1. Exactness: on tiny random models (fp32), every decoder through the static/CUDA-graph path
   must emit the tokens of AR through the dynamic path (the CPU test suite checks the static
   path without graphs; this checks the graphs).
2. AR speed at SmolLM2-135M's shapes with synthetic weights (assets/configs/smollm2-135m.json):
   our engine with CUDA graphs vs our engine eager vs transformers' LlamaForCausalLM greedy
   `generate` on the same fp16 weights, three ways: its default dynamic cache, a static cache,
   and a static cache with the forward compiled (its documented recipe), plus W4A16 (RTN g32,
   Triton kernel) for the target; the engine's ratio is taken against the fastest of the three.
3. One round of EAGLE-2 and of HierSpec at the same shapes (6-layer intermediate, random EAGLE
   heads: acceptance is ~0 with random heads, so only the per-round costs mean anything).
4. What an EAGLE-3 head costs T: AR of the W4 target before, with and after its layer features
   (the rows an EAGLE-3 head reads), side by side, and one eagle3 round with a random EAGLE-3 head.
Writes DIR/engine.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional

import torch

from hierviz import methods as registry
from hierviz.decoding.decoders import Models, StageTimer, cache_margin
from hierviz.decoding.verify import Sampler
from hierviz.machine import machine_info
from hierviz.measure.common import CONFIG_DIR, ChildError, default_device, run_json, stopwatch, write_json
from hierviz.models import cuda_graphs, fused
from hierviz.models.config import ModelConfig
from hierviz.models.eagle import EagleHead
from hierviz.models.llama import Transformer
from hierviz.models.synthetic import hf_weights, synthetic_eagle3_head
from hierviz.quant.w4 import quantize_rtn
from hierviz.settings import DecodeSettings


def w4_of(weights: dict[str, torch.Tensor], group: int = 32) -> dict:
    return {k: quantize_rtn(v, group) if k.startswith("model.layers.") and k.endswith("_proj.weight") else v
            for k, v in weights.items()}


def run_decoder(models: Models, method: str, prompt: list[int], n: int, s: DecodeSettings,
                static: bool, fused_ops: Optional[bool] = None) -> tuple[list[int], float, int]:
    """(tokens after the prefill's first, seconds for them, rounds). static=False: dynamic path;
    fused_ops: the fused layer kernels on (True) / off (False) / as configured (None)."""
    with cuda_graphs.path_switches(static=static, fused=fused_ops):
        max_len = len(prompt) + n + cache_margin(s) + 16
        gen = registry.get(method).decode(models, prompt, s, Sampler(0.0), str, max_len)
        with torch.no_grad():
            first = next(gen).new_tokens
            out: list[int] = []
            rounds = 0
            with stopwatch(models.target.device, pause_gc=False) as took:
                while len(out) < n:
                    out += next(gen).new_tokens
                    rounds += 1
        gen.close()
        return first + out[:n], took(), rounds


def exactness_tiny(device: str, fused_ops: bool = False) -> dict:
    """Every decoder on the static path (graphs on CUDA) against AR on the dynamic path, fp32.
    fused_ops: with the fused layer kernels forced (they serve fp16/bf16 by default)."""
    from hierviz.stack import tiny_random_stack
    models = tiny_random_stack(device, eagle3=True).models      # every method's models
    s = DecodeSettings(m_depth=3, m_topk=4, m_tree_size=10, t_depth=3, t_topk=4, t_tree_size=12,
                       min_draft_len=4, spec_k=3)
    prompt = list(range(40, 60))
    want, _, _ = run_decoder(models, registry.BASELINE, prompt, 48, s, static=False)
    res = {}
    fused.force(fused_ops)
    try:
        for m in registry.names():
            got, _, _ = run_decoder(models, m, prompt, 48, s, static=True)
            res[m] = got == want
    finally:
        fused.force(False)
    return res


# transformers' ways to generate: its default dynamic cache; a static cache; a static cache with
# the forward compiled (its documented recipe: torch.compile with mode="reduce-overhead",
# fullgraph=True; CUDA graphs on a GPU). In the order they run: the compiled peers before the
# uncompiled static cache, whose 128 tokens take about a minute on the H200 (2.7 tokens/s), so that
# a run cut short has measured them
HF_VARIANTS = {"plain": "transformers LlamaForCausalLM.generate",
               "static-compiled-default": "transformers generate, static cache + torch.compile, default mode",
               "static-compiled": "transformers generate, static cache + torch.compile",
               "static": "transformers generate, static cache"}
# transformers' documented recipe compiles with mode="reduce-overhead" (CUDA graphs); its process has
# segfaulted on the H200, so the default mode (no CUDA graphs) is measured beside it
COMPILED = ("static-compiled", "static-compiled-default")


def hf_variants(device: str) -> tuple[str, ...]:
    """The HF_VARIANTS a run on `device` measures: on the CPU the two compiled ones are the same
    (reduce-overhead differs by its CUDA graphs alone), so only the documented one runs."""
    return tuple(v for v in HF_VARIANTS if device == "cuda" or v != "static-compiled-default")


def hf_generate(cfg_path: Path, weights: dict[str, torch.Tensor], prompt: list[int], n: int, device: str,
                dtype: torch.dtype, variant: str = "plain") -> tuple[list[int], float]:
    """Greedy tokens and seconds of transformers' `generate` on the same weights, in one of HF_VARIANTS.
    The compiled variants run in a child process (`hf_generate_in_child`): on the H200 the
    reduce-overhead one's process segfaults, which must not take the bench with it."""
    if variant in COMPILED and not _IN_CHILD[0]:
        return hf_generate_in_child(cfg_path, weights, prompt, n, device, dtype, variant)
    from transformers import LlamaConfig, LlamaForCausalLM
    raw = {k: v for k, v in json.loads(cfg_path.read_text()).items() if not k.startswith("_")}
    model = LlamaForCausalLM(LlamaConfig(**raw)).to(device=device, dtype=dtype).eval()
    model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=False)
    model.tie_weights()
    ids = torch.tensor([prompt], device=device)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    if variant != "plain":
        kw["cache_implementation"] = "static"
    if variant in COMPILED:
        mode = "reduce-overhead" if device == "cuda" and variant == "static-compiled" else None
        model.forward = torch.compile(model.forward, mode=mode, fullgraph=True)
    with torch.no_grad():
        # warm-up at the measured length: a static cache is sized prompt + max_new_tokens, and a new
        # size recompiles the compiled forward (inside the timed run, if the warm-up were shorter)
        for _ in range(2 if variant in COMPILED else 1):   # compile (prefill and step shapes), warm up
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        with stopwatch(device, pause_gc=False) as took:
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        dt = took()
    toks = out[0, len(prompt):].tolist()
    if _IN_CHILD[0]:
        # the result goes out before the compiled model is torn down (its process has segfaulted
        # at exit on the H200) and the child ends here
        print(json.dumps([toks, dt]), flush=True)
        os._exit(0)
    del model
    # generate's time includes the prefill; one forward of the prompt is small next to n steps
    return toks, dt


_IN_CHILD = [False]


def hf_generate_in_child(cfg_path: Path, weights: dict[str, torch.Tensor], prompt: list[int], n: int, device: str,
                         dtype: torch.dtype, variant: str) -> tuple[list[int], float]:
    """hf_generate in a fresh Python process (weights through a temporary safetensors file); its
    result is read from its last line, whatever its exit code after that."""
    import tempfile

    from safetensors.torch import save_file

    code = ("import json, sys, torch; from pathlib import Path; from safetensors.torch import load_file; "
            "from hierviz.measure import engine_bench as eb; eb._IN_CHILD[0] = True; "
            "a = json.loads(sys.argv[1]); "
            "eb.hf_generate(Path(a['cfg']), load_file(a['weights']), a['prompt'], a['n'], a['device'], "
            "getattr(torch, a['dtype']), a['variant'])")
    with tempfile.TemporaryDirectory() as d:
        wfile = Path(d) / "weights.safetensors"
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(wfile))
        args = json.dumps({"cfg": str(cfg_path), "weights": str(wfile), "prompt": list(prompt), "n": n,
                           "device": device, "dtype": str(dtype).removeprefix("torch."), "variant": variant})
        try:
            toks, dt = run_json(code, args, timeout=1800)
        except ChildError as e:
            raise RuntimeError(f"{HF_VARIANTS[variant]} failed in its process: {e}") from None
    return toks, float(dt)


def _agree(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two outputs."""
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def _exactness(res: dict, dev: str) -> None:
    res["exact_tiny_fp32"] = exactness_tiny(dev)
    print("[engine] tiny fp32, static/graphs vs AR dynamic, identical:", res["exact_tiny_fp32"], flush=True)
    if fused.HAVE_TRITON and dev == "cuda":
        res["exact_tiny_fp32_fused"] = exactness_tiny(dev, fused_ops=True)
        print("[engine] tiny fp32, static/graphs with fused layer kernels vs AR dynamic, identical:",
              res["exact_tiny_fp32_fused"], flush=True)


def _ar_speeds(t_fp16: Transformer, t_w4: Transformer, prompt: list[int], n: int, s: DecodeSettings,
               res: dict, save) -> tuple[dict, dict]:
    """AR tokens/s of each engine path (graphs, eager, fused or not); outputs per path."""
    rows, toks = {}, {}
    StageTimer.sync = False                        # benchmark mode: sync only where decisions are read
    for name, model, static, fused_ops in (
            ("ours fp16, CUDA graphs", t_fp16, True, None), ("ours fp16, eager", t_fp16, False, None),
            ("ours W4A16 triton, CUDA graphs", t_w4, True, None),
            ("ours W4A16 triton, CUDA graphs, unfused layer ops", t_w4, True, False),
            ("ours W4A16 triton, eager", t_w4, False, None)):
        cuda_graphs.drop_runners(model)      # graphs keep the path they were captured with
        run_decoder(Models(model), registry.BASELINE, prompt, 8, s, static, fused_ops)        # warm-up: kernels, graphs
        out, dt, _ = run_decoder(Models(model), registry.BASELINE, prompt, n, s, static, fused_ops)
        rows[name] = n / dt
        toks[name] = out
        print(f"[engine] AR {name:34s} {n / dt:8.1f} tokens/s", flush=True)
        res["ar_tokens_per_s"] = rows
        save()
    StageTimer.sync = True
    out, dt, _ = run_decoder(Models(t_w4), registry.BASELINE, prompt, n, s, True)
    rows["ours W4A16 triton, CUDA graphs, trace-mode syncs"] = n / dt
    print(f"[engine] AR W4A16 graphs with per-stage syncs      {n / dt:8.1f} tokens/s", flush=True)
    StageTimer.sync = False
    return rows, toks


def _against_transformers(res: dict, rows: dict, toks: dict, cfg_path: Path, dense: dict, prompt: list[int],
                          n: int, dev: str, dtype: torch.dtype, variants: tuple[str, ...] = tuple(HF_VARIANTS)) -> None:
    """transformers' generate in each variant on the same weights, in this run; a variant that fails
    (API drift, no compiler) is reported and the rest kept."""
    for v in variants:
        try:
            hf_toks, hf_dt = hf_generate(cfg_path, dense, prompt, n, dev, dtype, v)
        except Exception as e:
            res.setdefault("hf_error", {})[v] = repr(e)
            print(f"[engine] {HF_VARIANTS[v]} failed:", repr(e), flush=True)
            continue
        rows[f"{HF_VARIANTS[v]} fp16"] = n / hf_dt
        res["identical_prefix"][f"ours fp16 graphs vs {HF_VARIANTS[v]}"] = _agree(toks["ours fp16, CUDA graphs"][:n],
                                                                                  hf_toks)
        print(f"[engine] AR {HF_VARIANTS[v]:48s} {n / hf_dt:8.1f} tokens/s", flush=True)
    best = max((r for k, r in rows.items() if k.startswith("transformers")), default=None)
    if best:
        res["ours_fp16_graphs_over_best_transformers"] = rows["ours fp16, CUDA graphs"] / best
        res["ours_w4_graphs_over_best_transformers"] = rows["ours W4A16 triton, CUDA graphs"] / best


def _speculative_rounds(t_w4: Transformer, dense: dict, cfg_path: Path, prompt: list[int], s: DecodeSettings,
                        dev: str, dtype: torch.dtype) -> dict:
    """Per-round costs of the speculative methods at these shapes: a 6-layer intermediate made of
    the target's layers, random heads."""
    cfg = ModelConfig.from_file(cfg_path)
    raw = json.loads(cfg_path.read_text())
    keep = [0, 6, 12, 18, 24, 29]
    m_w = {"model.embed_tokens.weight": dense["model.embed_tokens.weight"], "model.norm.weight": dense["model.norm.weight"]}
    for new, old in enumerate(keep):
        for k, v in dense.items():
            if k.startswith(f"model.layers.{old}."):
                m_w[k.replace(f"layers.{old}.", f"layers.{new}.")] = v
    inter = Transformer(ModelConfig.from_dict(dict(raw, num_hidden_layers=len(keep))), m_w, dtype=dtype, device=dev)
    h_cfg = ModelConfig.from_dict(dict(raw, num_hidden_layers=1))
    hw = {k.replace("model.layers.0.", "layers.0."): v for k, v in hf_weights(h_cfg, dev, seed=5).items()
          if k.startswith("model.layers.0.")}
    hw["fc.weight"] = torch.randn(cfg.hidden_size, 2 * cfg.hidden_size, device=dev) * 0.02
    models = Models(t_w4, inter, EagleHead(h_cfg, hw, inter), EagleHead(h_cfg, hw, t_w4))
    spec_rows = {}
    for m in registry.comparison_having(lambda part: getattr(models, part) is not None):
        try:
            run_decoder(models, m, prompt, 8, s, True)
            out, dt, rounds = run_decoder(models, m, prompt, 32, s, True)
            spec_rows[m] = {"ms_per_round": 1000 * dt / rounds, "tokens_per_round": len(out[1:]) / rounds,
                            "tokens_per_s": (len(out) - 1) / dt}
            print(f"[engine] {m:8s} W4 target: {spec_rows[m]}", flush=True)
        except Exception as e:
            spec_rows[m] = {"error": repr(e)}
            print(f"[engine] {m} failed: {e!r}", flush=True)
    return spec_rows


def _eagle3_feature_cost(t_w4: Transformer, prompt: list[int], n: int, s: DecodeSettings, repeat: int = 3) -> dict:
    """AR tokens/s of the W4 target without layer features, with an EAGLE-3 head's three, and
    without again (interleaved, best of `repeat` each: a loaded EAGLE-3 head's cost to every T
    forward, and none once it is gone); then one eagle3 run's per-round cost (random head)."""
    head = synthetic_eagle3_head(t_w4, seed=9)
    plain = t_w4.feature_layers

    def ar(layers: tuple[int, ...]) -> float:
        t_w4.feature_layers = layers
        cuda_graphs.drop_runners(t_w4)       # a runner's outputs are as wide as its model's rows
        run_decoder(Models(t_w4), registry.BASELINE, prompt, 8, s, True)
        return n / run_decoder(Models(t_w4), registry.BASELINE, prompt, n, s, True)[1]
    best: dict[str, float] = {}
    for _ in range(repeat):
        for name, layers in (("without features", plain), ("with EAGLE-3 features", head.feature_layers)):
            best[name] = max(best.get(name, 0.0), ar(layers))
    row: dict = {"ar_tokens_per_s": best, "feature_layers": list(head.feature_layers),
                 "ratio_with_to_without": best["with EAGLE-3 features"] / best["without features"]}
    t_w4.feature_layers = head.feature_layers
    cuda_graphs.drop_runners(t_w4)
    models = Models(t_w4, e_t3=head)
    method = next(m for m in registry.names() if registry.get(m).needs == ("e_t3",))   # the one drafting with it
    run_decoder(models, method, prompt, 8, s, True)
    out, dt, rounds = run_decoder(models, method, prompt, 32, s, True)
    row["eagle3_round"] = {"ms_per_round": 1000 * dt / rounds, "tokens_per_round": len(out[1:]) / rounds}
    t_w4.feature_layers = plain
    cuda_graphs.drop_runners(t_w4)
    print(f"[engine] AR W4 with/without EAGLE-3 features: {best}; eagle3 round {row['eagle3_round']}", flush=True)
    return row


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hierviz engine-bench", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--device", default=default_device())
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf", default=None, metavar="VARIANT[,VARIANT]",
                    help=f"the transformers variants to run (default: all of {', '.join(HF_VARIANTS)})")
    a = ap.parse_args(argv)
    variants = hf_variants(a.device)
    if a.hf:
        variants = tuple(v.strip() for v in a.hf.split(",") if v.strip())
        unknown = [v for v in variants if v not in HF_VARIANTS]
        if unknown:
            ap.error(f"unknown --hf variant(s) {', '.join(unknown)}; choose from {', '.join(HF_VARIANTS)}")
    dev, n = a.device, a.tokens
    res: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "tokens": n,
                 "machine": machine_info(dev)}

    def save() -> None:
        if a.out:
            write_json(Path(a.out) / "engine.json", res)

    _exactness(res, dev)
    save()
    cfg_path = CONFIG_DIR / "smollm2-135m.json"
    cfg = ModelConfig.from_file(cfg_path)
    dense = hf_weights(cfg, dev)
    dtype = torch.float16 if dev == "cuda" else torch.float32
    prompt = [1] + list(range(100, 163))           # 64 prompt tokens
    t_fp16 = Transformer(cfg, dense, dtype=dtype, device=dev)
    t_w4 = Transformer(cfg, w4_of(dense), w4_kernel="triton" if dev == "cuda" else "reference", dtype=dtype, device=dev)
    s = DecodeSettings(max_new_tokens=n)
    rows, toks = _ar_speeds(t_fp16, t_w4, prompt, n, s, res, save)
    res["identical_prefix"] = {
        "fp16 graphs vs fp16 eager": _agree(toks["ours fp16, CUDA graphs"], toks["ours fp16, eager"]),
        "w4 graphs vs w4 eager": _agree(toks["ours W4A16 triton, CUDA graphs"], toks["ours W4A16 triton, eager"]),
    }
    if not a.skip_hf:
        _against_transformers(res, rows, toks, cfg_path, dense, prompt, n, dev, dtype, variants)
    print("[engine] identical prefix lengths:", res["identical_prefix"], flush=True)
    save()
    res["rounds_random_heads"] = _speculative_rounds(t_w4, dense, cfg_path, prompt, s, dev, dtype)
    save()
    res["eagle3_feature_cost"] = _eagle3_feature_cost(t_w4, prompt, n, s)
    save()
    print("\n| AR, SmolLM2-135M shapes, synthetic weights | tokens/s |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.0f} |")
    return 0

if __name__ == "__main__":
    sys.exit(main())
