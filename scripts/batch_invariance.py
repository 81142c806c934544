"""Where a target's fp16/bf16 forward stops being batch-invariant: verifying K tokens in one forward
vs decoding them one at a time should give the same logits bit for bit, or greedy speculative decoding
can differ from AR on near-ties.

    PYTHONPATH=. python scripts/batch_invariance.py [--shape smollm2] [--group 32] [--device cuda] \
        [--dtype float16] [--kernel triton] [--tokens 4,16,25,60]

A synthetic W4 model of the shape (random codes, hierviz.whatif.synthetic_model), a random prompt, then
for each K: the hidden state after every layer and the logits at the K positions, one forward over K
tokens against K one-token forwards (same cache contents before). Prints, per K, the first layer whose
output differs and the largest logit difference; then the W4 product and the LM head alone, row 0 of an
M-row product against the same row computed alone.
"""
from __future__ import annotations

import argparse

import torch

from hierviz.models.llama import KVCache
from hierviz.profile import load_shape
from hierviz.quant.w4 import w4_linear
from hierviz.whatif import synthetic_model


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--kernel", default="triton")
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--tokens", default="4,16,25,60")
    a = ap.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    _, cfg = load_shape(a.shape)
    model = synthetic_model(cfg, "w4", dtype, a.device, a.kernel, seed=0, group=a.group)
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


if __name__ == "__main__":
    main()
