"""Fused layer kernels (hierviz.models.fused) under TRITON_INTERPRET=1, in a subprocess.

Each kernel against the torch code it replaces (fp32 and fp16), then a tiny model on the
static path with the kernels forced against the unfused path: hidden states, cache contents
and AR's greedy output. The GPU compile of the kernels is checked in test_triton_compile.py;
the decoders through them on a GPU by `python -m hierviz.measure.engine_bench` (docs/gpu.md).
"""
from __future__ import annotations

import json
import textwrap

import pytest
from tests.tiny import run_interpreted

pytest.importorskip("triton")

_SCRIPT = textwrap.dedent("""
    import json, os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from hierviz.models import cuda_graphs, fused
    from hierviz.models.llama import RMSNorm, apply_rope

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    out = {}
    for dt in (torch.float32, torch.float16):
        k = str(dt).split(".")[-1]
        x = torch.randn(5, 96, dtype=dt)
        w = torch.rand(96, dtype=dt) + 0.5
        out[f"norm_{k}"] = rel(fused.rms_norm(x, w, 1e-5), RMSNorm(w, 1e-5)(x))
        gu = torch.randn(3, 160, dtype=dt)
        g, u = gu.split(80, -1)
        out[f"silu_mul_{k}"] = rel(fused.silu_mul(gu), F.silu(g) * u)
        # RoPE + cache writes: 6 query heads, 2 KV heads, shared tree positions, scattered slots
        T, HQ, HKV, HD, L = 4, 6, 2, 32, 40
        qkv = torch.randn(T, (HQ + 2 * HKV) * HD, dtype=dt)
        pos = torch.tensor([7, 9, 9, 12])
        inv = 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD))
        fr = pos.float()[:, None] * inv[None]
        emb = torch.cat((fr, fr), -1)
        cos, sin = emb.cos().to(dt), emb.sin().to(dt)
        slots = torch.tensor([3, 8, 20, 21])
        kc, vc = torch.zeros(HKV, L, HD, dtype=dt), torch.zeros(HKV, L, HD, dtype=dt)
        q = fused.rope_to_cache(qkv, cos, sin, slots, kc, vc, HQ, HKV, HD)
        qr, kr, vr = qkv.split([HQ * HD, HKV * HD, HKV * HD], -1)
        qref = apply_rope(qr.view(T, HQ, HD).transpose(0, 1), cos, sin).transpose(0, 1).reshape(T, -1)
        kref = apply_rope(kr.view(T, HKV, HD).transpose(0, 1), cos, sin)
        untouched = [i for i in range(L) if i not in slots.tolist()]
        out[f"rope_{k}"] = max(rel(q, qref), rel(kc[:, slots], kref),
                               rel(vc[:, slots], vr.view(T, HKV, HD).transpose(0, 1)),
                               float(kc[:, untouched].abs().sum() + vc[:, untouched].abs().sum()))
        # attention: one token with 8 query heads on 1 KV head (split along the cache, combine),
        # GQA groups of 3 and 4 with rows that see scattered columns, a block no row sees
        for T, HQ, HKV, HD, L in [(1, 8, 1, 128, 300), (5, 9, 3, 64, 200), (20, 8, 2, 64, 150)]:
            q = torch.randn(T, HQ * HD, dtype=dt)
            kc, vc = torch.randn(HKV, L, HD, dtype=dt), torch.randn(HKV, L, HD, dtype=dt)
            mask = torch.zeros(T, L, dtype=torch.bool)
            mask[:, :37] = True
            for i in range(T):
                mask[i, 100 + torch.randint(0, 30, (3,))] = True
            o = fused.masked_attention(q, kc, vc, mask, HQ, HD)
            ref = F.scaled_dot_product_attention(q.view(T, HQ, HD).transpose(0, 1).float(), kc.float(),
                                                 vc.float(), attn_mask=mask, enable_gqa=True)
            out[f"attention_{k}_T{T}_G{HQ // HKV}"] = rel(o, ref.transpose(0, 1).reshape(T, -1))

    # batch invariance: a tree node's output (ancestors scattered among siblings, 6 tokens in the
    # forward) equals the same token's alone after its path laid out contiguously, bit for bit,
    # also in a cache of another size (other slices along the keys)
    from hierviz.measure.batch_invariance import tree_paths, tree_vs_paths
    for dt in (torch.float32, torch.float16):
        k = str(dt).split(".")[-1]
        HQ, HKV, HD, L, P = 9, 3, 64, 300, 150
        parents = [-1, 0, 0, 1, 1, 3]
        T = len(parents)
        q = torch.randn(T, HQ * HD, dtype=dt)
        kc, vc = torch.randn(HKV, L, HD, dtype=dt), torch.randn(HKV, L, HD, dtype=dt)
        _, paths, win = tree_paths(parents)
        mask = torch.zeros(T, L, dtype=torch.bool)
        mask[:, :P] = True
        mask[:, P:P + T] = win
        o = fused.masked_attention(q, kc, vc, mask, HQ, HD)
        same = []
        for L2 in (P + 8, 700):
            for i in range(T):
                k2, v2 = torch.zeros(HKV, L2, HD, dtype=dt), torch.zeros(HKV, L2, HD, dtype=dt)
                k2[:, :P], v2[:, :P] = kc[:, :P], vc[:, :P]
                for r, x in enumerate(paths[i]):
                    k2[:, P + r], v2[:, P + r] = kc[:, P + x], vc[:, P + x]
                m2 = torch.zeros(1, L2, dtype=torch.bool)
                m2[0, :P + len(paths[i])] = True
                same.append(bool(torch.equal(fused.masked_attention(q[i:i + 1], k2, v2, m2, HQ, HD)[0], o[i])))
        out[f"attention_invariant_{k}"] = same

    # the same through a whole fp16 W4 model on the static path (Triton W4 kernels, batch-invariant
    # target): a 9-node tree verified in one forward vs each node decoded alone after its path
    from hierviz.models.config import ModelConfig
    from hierviz.models.synthetic import synthetic_model
    cfg = ModelConfig.from_dict(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                     max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                     model_type="llama", bos_token_id=1, eos_token_id=2))
    model = synthetic_model(cfg, "w4", torch.float16, "cpu", "triton", seed=0, group=32)
    model.set_batch_invariant(True)
    fused.force(True)
    norms, rms_norm = [], fused.rms_norm     # which weights the fused RMSNorm normalizes with
    fused.rms_norm = lambda x, w, eps: (norms.append(w), rms_norm(x, w, eps))[1]
    r = tree_vs_paths(model, [-1, 0, 0, 1, 1, 2, 3, 3, 6], list(range(3, 9)), [40 + i for i in range(9)],
                             nodes=[4, 8])     # a leaf at depth 2 and the deepest node
    fused.rms_norm = rms_norm
    same = r["hidden"]     # (the logits go through the CPU's dense matmul, not part of this check)
    out["model_tree_invariant"] = same
    out["final_norm_fused"] = any(w is model.norm.weight for w in norms)
    fused.force(False)

    # a tiny model on the static path: fused kernels forced vs the unfused static path
    from hierviz.settings import DecodeSettings
    from hierviz.decoding.state import BaseState
    from hierviz.engine import generate, output_tokens
    from hierviz.stack import tiny_random_stack
    stack = tiny_random_stack()
    t = stack.models.target
    cuda_graphs.force_static(True)
    from tests.tiny import prefill_sequence_tree
    hidden, caches = [], []
    for on in (False, True):
        fused.force(on)
        st = BaseState(t, 64)
        st.tokens = list(range(10, 16))
        hidden.append(torch.cat(prefill_sequence_tree(st)))
        caches.append(st.cache.k[:, :, :st.cache.length].clone())
    out["model_hidden"] = rel(hidden[1], hidden[0])
    out["model_cache"] = rel(caches[1], caches[0])
    fused.force(False)
    cuda_graphs.force_static(False)
    # the prompt without the chat template (3 tokens, not 20): each interpreted forward runs a
    # program per token, and the prefill is most of them
    from hierviz.stack import Stack
    from hierviz.tokenizer import ByteTokenizer

    class Plain(ByteTokenizer):
        def encode_chat(self, prompt):
            return [1] + [3 + b for b in prompt.encode()]
    plain = Stack("plain", stack.models, Plain(), {})
    s = DecodeSettings(max_new_tokens=4)
    want = output_tokens(generate(plain, "ar", "Hi", s))
    cuda_graphs.force_static(True)
    fused.force(True)
    out["ar_tokens"] = len(want)
    out["ar_same"] = output_tokens(generate(plain, "ar", "Hi", s)) == want
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def results() -> dict:
    return json.loads(run_interpreted(_SCRIPT)[-1])


@pytest.mark.parametrize("op", ["norm", "silu_mul", "rope"])
def test_elementwise_kernels_round_like_torch(results, op) -> None:
    # same operations in the same dtype as the torch code: equal, up to exp's last bit in SiLU
    assert results[f"{op}_float32"] < 1e-6
    assert results[f"{op}_float16"] < 1e-3


def test_masked_attention_matches_sdpa(results) -> None:
    cases = [k for k in results if k.startswith("attention_") and "invariant" not in k]
    assert len(cases) == 6
    for k in cases:
        assert results[k] < (1e-5 if "float32" in k else 2e-3), (k, results[k])


def test_masked_attention_is_batch_invariant(results) -> None:
    """What lossless fp16 verification needs (docs/gpu.md): same bits for a token whatever else is
    in the forward and wherever its keys sit. (The previous kernel failed this in fp32.)"""
    for dt in ("float32", "float16"):
        assert results[f"attention_invariant_{dt}"] == [True] * 12, results[f"attention_invariant_{dt}"]
    assert results["model_tree_invariant"] == [True] * 2
    # the final norm too: torch's CUDA mean sizes its block by the row count (not batch-invariant)
    assert results["final_norm_fused"]


def test_fused_static_forward_matches_unfused(results) -> None:
    assert results["model_hidden"] < 1e-5
    assert results["model_cache"] < 1e-5
    assert results["ar_tokens"] == 4 and results["ar_same"]
