"""Where a target's fp16/bf16 forward stops being batch-invariant: verifying K tokens in one forward
vs decoding them one at a time should give the same logits bit for bit, or greedy speculative decoding
can differ from AR on near-ties.

    python -m hierviz batch-invariance [--shape smollm2] [--group 32] [--device cuda] \
        [--dtype float16] [--kernel triton] [--tokens 4,16,25,60] [--static | --dynamic]

A synthetic W4 model of the shape (random codes, hierviz.models.synthetic.synthetic_model), a random prompt, then
for each K: the hidden state after every layer and the logits at the K positions, one forward over K
tokens against K one-token forwards (same cache contents before). Prints, per K, the first layer whose
output differs and the largest logit difference; then the W4 product and the LM head alone, row 0 of an
M-row product against the same row computed alone. Those forwards take the dynamic (eager, SDPA) path;
the engine verifies on the static path, which `--static` checks: a 24-node tree and a 6-token sequence
verified in one forward against every node decoded alone after its path, with the W4 weights'
`batch_invariant` flag off and on (the target of a loaded stack has it on); `--dynamic` the same on the
CPU's dynamic path (per-token attention, chunked LM head, a row-invariant W4 kernel).
"""
from __future__ import annotations

import argparse

import torch

from hierviz.models.llama import KVCache
from hierviz.measure.common import load_shape
from hierviz.quant.w4 import FORMAT as W4A16
from hierviz.quant.w4 import w4_linear
from hierviz.models.synthetic import synthetic_model


def _layer_outputs(model, tokens, positions, cache) -> tuple[list[torch.Tensor], torch.Tensor]:
    outs: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: outs.append(out.detach().clone()))
             for layer in model.layers]
    try:
        hidden = model(tokens, positions, cache)
    finally:
        for h in hooks:
            h.remove()
    return outs, model.logits(hidden)


def tree_paths(parents: list[int]) -> tuple[list[int], list[list[int]], torch.Tensor]:
    """(depth per node, ancestor path per node (ascending, itself last), the tree's [T, T]
    visibility window) for a tree given by parent indices (-1: the root; parents before children)."""
    depth: list[int] = []
    paths: list[list[int]] = []
    win = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"node {i}'s parent {p} must come before it")
        depth.append(0 if p < 0 else depth[p] + 1)
        a, j = [], i
        while j >= 0:
            a.append(j)
            j = parents[j]
        paths.append(sorted(a))
        win[i, a] = True
    return depth, paths, win


def tree_vs_paths(model, parents: list[int], prompt: list[int], tokens: list[int],
                  nodes: list[int] | None = None, static: bool = True,
                  live: tuple[int, int] = (256, 512)) -> dict:
    """Prefill `prompt`, verify the tree `parents` with `tokens` in one forward, then decode each of
    `nodes` (default: all) alone after its path, one token per forward, from a fresh prefill. static:
    the engine's GPU path (hierviz.models.cuda_graphs: CUDA graphs, the fused kernels in fp16/bf16;
    the one-token runs in a runner of another cache size); else the dynamic path (the CPU's: the model
    called with a KVCache and a mask). Returns, per node, whether the hidden state and the logits are
    the same bits, and the largest logit difference."""
    from hierviz.models.cuda_graphs import StaticRunner, graphs_enabled
    from hierviz.models.llama import block_mask
    depth, paths, win = tree_paths(parents)
    p = len(prompt)
    dev = model.device

    def prefilled(n: int):
        if static:
            r = StaticRunner(model, n, 0, graphs_enabled(dev))
            r.run(prompt, list(range(p)), 0, 0, torch.ones(p, p, dtype=torch.bool).tril())
            return r
        cache = model.new_cache(p + len(parents) + 1)
        model(torch.tensor(prompt, device=dev), torch.arange(p, device=dev), cache)
        return cache

    def forward(r, toks: list[int], pos: list[int], start: int, window: torch.Tensor) -> torch.Tensor:
        if static:
            return r.run(toks, pos, start, start, window)
        mask = block_mask(start, window.to(dev)) if len(toks) > 1 else None
        return model(torch.tensor(toks, device=dev), torch.tensor(pos, device=dev), r, mask)
    with torch.no_grad():
        tree = forward(prefilled(live[0]), tokens, [p + d for d in depth], p, win)
        tree_logits = model.logits(tree)
        hidden, logits, diff = [], [], 0.0
        for i in nodes if nodes is not None else range(len(parents)):
            r = prefilled(live[1])
            for n, j in enumerate(paths[i]):
                h = forward(r, [tokens[j]], [p + n], p + n, torch.ones(1, 1, dtype=torch.bool))
            lg = model.logits(h)
            hidden.append(bool(torch.equal(h[0], tree[i])))
            logits.append(bool(torch.equal(lg[0], tree_logits[i])))
            diff = max(diff, float((lg[0] - tree_logits[i]).abs().max()))
    return {"hidden": hidden, "logits": logits, "max_logit_diff": diff}


# a 24-node draft tree (its bucket, 24: EAGLE-2's tree verification at the paper's trees) and a 6-token
# sequence (HierSpec's verification by the target)
TREE_24 = [-1, 0, 0, 1, 1, 2, 3, 3, 4, 5, 6, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
CHAIN_6 = [-1, 0, 1, 2, 3, 4]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hierviz batch-invariance", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--kernel", default="triton")
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--tokens", default="4,16,25,60")
    ap.add_argument("--static", action="store_const", const="static", dest="path",
                    help="also verify a 24-node tree and a 6-token sequence on the engine's static path (CUDA "
                         "graphs, fused kernels) against their nodes decoded one by one, batch invariance off/on")
    ap.add_argument("--dynamic", action="store_const", const="dynamic", dest="path",
                    help="the same on the dynamic path (the CPU's; use --kernel int4pack_cpu --dtype float32)")
    a = ap.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    _, cfg = load_shape(a.shape)
    model = synthetic_model(cfg, W4A16.name, dtype, a.device, a.kernel, seed=0, group=a.group)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (a.prompt,), generator=gen).to(a.device)
    hd = cfg.head_dim
    with torch.no_grad():
        for k in (int(t) for t in a.tokens.split(",")):
            new = torch.randint(0, cfg.vocab_size, (k,), generator=gen).to(a.device)
            pos = torch.arange(a.prompt, a.prompt + k, device=a.device)
            caches = []
            for _ in range(2):
                c = KVCache(cfg.num_layers, cfg.num_kv_heads, hd, a.prompt + k + 1, dtype, a.device)
                model(prompt, torch.arange(a.prompt, device=a.device), c)
                caches.append(c)
            many, logits_many = _layer_outputs(model, new, pos, caches[0])
            one_by_one = [_layer_outputs(model, new[i:i + 1], pos[i:i + 1], caches[1]) for i in range(k)]
            first = None
            for li in range(cfg.num_layers):
                single = torch.cat([o[0][li] for o in one_by_one])
                if not torch.equal(single, many[li]):
                    first = (li, float((single.float() - many[li].float()).abs().max()))
                    break
            logits_one = torch.cat([o[1] for o in one_by_one])
            diff = float((logits_one - logits_many).abs().max())
            same_argmax = bool(torch.equal(logits_one.argmax(-1), logits_many.argmax(-1)))
            print(f"K={k:3d}: first differing layer output {first}, max |logit diff| {diff:.3g}, "
                  f"argmax equal {same_argmax}")
        for name, mod in model.layers[0].named_modules():
            for wt in getattr(mod, "w4", None) or []:
                x = torch.randn(64, wt.in_features, generator=gen).to(a.device, dtype)
                alone = w4_linear(x[:1], wt, kernel=a.kernel)
                same = [m for m in (2, 4, 8, 9, 16, 17, 25, 32, 60)
                        if torch.equal(w4_linear(x[:m], wt, kernel=a.kernel)[:1], alone)]
                print(f"layer 0 {name} W4 {wt.out_features}x{wt.in_features}: row 0 as at M=1 for M in {same}")
        h = torch.randn(64, cfg.hidden_size, generator=gen).to(a.device, dtype)
        alone = model.logits(h[:1])
        for m in (2, 4, 16, 25, 60):
            print(f"LM head M={m:2d}: row 0 equal to M=1: {bool(torch.equal(model.logits(h[:m])[:1], alone))}")
    if a.path:
        prompt = torch.randint(0, cfg.vocab_size, (a.prompt,), generator=gen).tolist()
        for name, parents in (("tree of 24", TREE_24), ("sequence of 6", CHAIN_6)):
            toks = torch.randint(0, cfg.vocab_size, (len(parents),), generator=gen).tolist()
            for inv in (False, True):
                model.set_batch_invariant(inv)
                r = tree_vs_paths(model, parents, prompt, toks, static=a.path == "static")
                print(f"{a.path} path, {name}, batch_invariant {inv}: hidden same for {sum(r['hidden'])}/"
                      f"{len(parents)} nodes, logits same for {sum(r['logits'])}/{len(parents)}, "
                      f"max |logit diff| {r['max_logit_diff']:.3g}")


if __name__ == "__main__":
    main()
