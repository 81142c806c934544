"""Planted bugs: each is a small wrong edit to the source that the named tests must catch.

`python -m tests.planted_bugs [ID ...]` copies the working tree (tracked and untracked files, not
ignored ones) to a temporary folder, plants each bug there in turn, runs its test files (stopping
at the first failure) and prints whether the suite caught it; it exits 1 if any bug went
uncaught. It takes a few minutes (each bug runs its files); CI does not run it, but
tests/test_planted_bugs.py checks that every bug still applies to the source as it is, so the list
is kept up with the code. A bug that no test can see (an edit that changes nothing observable) does
not belong here.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Bug:
    id: str
    what: str          # what the bug breaks, in a user's words
    path: str          # the file, relative to the repository
    old: str           # text that occurs exactly once in the file
    new: str           # what the bug puts there
    tests: tuple[str, ...]


# the test files that must catch a bug in each area
DEC = ('tests/test_decoding.py', 'tests/test_oracle_acceptance.py', 'tests/test_tree.py', 'tests/test_greedy_oracle.py', 'tests/test_eagle.py', 'tests/test_eagle3.py', 'tests/test_cuda_graphs.py', 'tests/test_trace_stats.py', 'tests/test_train_stack.py')
SAMP = ('tests/test_sampling_power.py',)
Q = ('tests/test_gptq.py', 'tests/test_formats.py', 'tests/test_streaming_load.py', 'tests/test_quantize.py')
RT = ('tests/test_retime.py', 'tests/test_app.py', 'tests/test_ui_live_runs.py', 'tests/test_ui_side_by_side.py')
WI = ('tests/test_whatif.py', 'tests/test_acceptance_import.py', 'tests/test_compat.py')
KG = ('tests/test_kernel_guard.py', 'tests/test_w4_proof.py', 'tests/test_triton_w4.py', 'tests/test_cuda_w4.py')
APP = ('tests/test_hardening.py', 'tests/test_app.py')
MEM = ('tests/test_memory.py',)
AI = ('tests/test_acceptance_import.py',)
GG = ('tests/test_gguf.py',)
TV = ('tests/test_trace_validation.py', 'tests/test_hardening.py')
CM = ('tests/test_cost_model.py',)
MODEL = ('tests/test_model.py',)
TRITON = ('tests/test_triton_w4.py',)
HEADS = ('tests/test_eagle3.py', 'tests/test_decoding.py')
W8 = ('tests/test_formats.py', 'tests/test_compressed_tensors.py', 'tests/test_act_quant.py')
ENGINE = ('tests/test_oracle_acceptance.py', 'tests/test_decoding.py')
STATIC = ('tests/test_cuda_graphs.py', 'tests/test_tree.py')

BUGS = [
    Bug('S1', 'a draft head fed misaligned base features',
        'hierviz/decoding/state.py',
        'self.head.project_features(base.features[start:known])',
        'self.head.project_features(base.features[start:known].roll(1, 0))', DEC),
    Bug('S3', "a tree verification keeps the last row's features for every row",
        'hierviz/decoding/state.py',
        '            self.features[start:start + n] = hidden[:n]\n',
        '            self.features[start:start + n] = hidden[n - 1:n]\n', DEC),
    Bug('S4', 'the provisional root pair at the wrong position',
        'hierviz/decoding/state.py',
        'self.last_hidden[None], [n_tok - 2])[0]',
        'self.last_hidden[None], [n_tok - 1])[0]', DEC),
    Bug('S5', "a sequence verification's kept features shifted by a row",
        'hierviz/decoding/state.py',
        '        self.features[start:start + n_rows] = hidden[:n_rows]\n',
        '        self.features[start:start + n_rows] = hidden[:n_rows].roll(1, 0)\n', DEC),
    Bug('V1', 'top-p drops the token that crosses the threshold',
        'hierviz/decoding/verify.py',
        'drop = (sp.cumsum(-1) - sp) >= self.top_p',
        'drop = sp.cumsum(-1) >= self.top_p', SAMP),
    Bug('V2', 'a rejected tree child keeps its mass',
        'hierviz/decoding/verify.py',
        '            residual[t] = 0.0\n',
        '            pass\n', SAMP),
    Bug('V4', 'a rejected sequence token resamples from p, not the residual',
        'hierviz/decoding/verify.py',
        'residual = (pi - qi).clamp_min(0.0)',
        'residual = pi.clone()', SAMP),
    Bug('V6', 'the all-accepted bonus drawn from the wrong row',
        'hierviz/decoding/verify.py',
        'sampler.sample(p[len(draft)])',
        'sampler.sample(p[len(draft) - 1])', SAMP),
    Bug('T1', 'EAGLE-2 expands the worst frontier',
        'hierviz/decoding/tree.py',
        'pick = torch.sort(flat, descending=True, stable=True).indices[:topk]',
        'pick = torch.sort(flat, descending=False, stable=True).indices[:topk]', DEC),
    Bug('T2', 'tree scores not cumulative',
        'hierviz/decoding/tree.py',
        'cums.append(parent_scores[:, None] + top_lp)',
        'cums.append(top_lp + 0 * parent_scores[:, None])', DEC),
    Bug('T3', 'a tree one node short of its size',
        'hierviz/decoding/tree.py',
        'stable=True).indices[:size]',
        'stable=True).indices[:size - 1]', DEC),
    Bug('T4', "a tree's deepest nodes miss an ancestor in the mask",
        'hierviz/decoding/tree.py',
        'for _ in range(depth - 1):',
        'for _ in range(depth - 2):', DEC),
    Bug('D1', "E_M not rolled back after T's verdict",
        'hierviz/decoding/decoders.py',
        '        e.rollback(base_len + n)\n',
        '        pass\n', DEC),
    Bug('D2', 'HierSpec drafts past min_draft_len',
        'hierviz/decoding/decoders.py',
        'if len(draft) >= s.min_draft_len:',
        'if len(draft) > s.min_draft_len:', DEC),
    Bug('D4', "the trace over-counts M's forwards",
        'hierviz/decoding/decoders.py',
        '"intermediate": m.forwards - m0, "e_m"',
        '"intermediate": m.forwards - m0 + 1, "e_m"', DEC),
    Bug('D5', 'undraftable rejections not marked',
        'hierviz/decoding/decoders.py',
        '"target", text, e.draftable)',
        '"target", text, None)', DEC),
    Bug('D6', 'every accepted HierSpec token credited to a tree',
        'hierviz/decoding/decoders.py',
        '[x.source for x in seq[:n]] + ["target_bonus"]',
        '["tree"] * n + ["target_bonus"]', DEC),
    Bug('R1', 'per-depth acceptance counts depths never reached',
        'hierviz/trace.py',
        'for d in range(1, min(t.depth, n_acc + 1) + 1):',
        'for d in range(1, t.depth + 1):', DEC),
    Bug('R2', "tau_intermediate without M's bonus",
        'hierviz/trace.py',
        '"tau_intermediate": (sum(len(t.accepted) + 1 for t in m_trees)',
        '"tau_intermediate": (sum(len(t.accepted) for t in m_trees)', DEC),
    Bug('R3', "a tree's rejection judged at the first accepted node",
        'hierviz/trace.py',
        '    last = tree.accepted[-1] if tree.accepted else 0\n',
        '    last = tree.accepted[0] if tree.accepted else 0\n', DEC),
    Bug('G1', 'GPTQ v1 zero points read without the +1',
        'hierviz/quant/gptq.py',
        '        z = z + 1                                             # v1 stores zero - 1\n',
        '        z = z + 0\n', Q),
    Bug('G2', 'GPTQ v1 zero points written without the -1',
        'hierviz/quant/gptq.py',
        '        stored = stored - 1\n',
        '        stored = stored - 0\n', Q),
    Bug('G3', 'act-order codes with swapped nibbles',
        'hierviz/quant/gptq.py',
        'codes = q[:, 0::2] | (q[:, 1::2] << 4)',
        'codes = q[:, 1::2] | (q[:, 0::2] << 4)', Q),
    Bug('RT1', "re-timing prices T's sequence without the root",
        'hierviz/retime.py',
        '"target_verify": costs.target.at(len(step.sequence) + 1), "overhead": 0.0}\n    if t_trees:',
        '"target_verify": costs.target.at(len(step.sequence)), "overhead": 0.0}\n    if t_trees:', RT),
    Bug('RT2', "re-timing prices M's trees without the root",
        'hierviz/retime.py',
        'm_ms = sum(costs.intermediate.at(len(t.nodes) + 1) for t in m_trees)',
        'm_ms = sum(costs.intermediate.at(len(t.nodes)) for t in m_trees)', RT),
    Bug('RT3', 're-timing interpolates between counts wrongly',
        'hierviz/retime.py',
        'return y0 + (y1 - y0) * (n - t0) / (t1 - t0)',
        'return y0 + (y1 - y0) * (n - t0) / (t1 - t0 + 1)', RT),
    Bug('RT4', 'time-to-N-tokens one step late',
        'hierviz/retime.py',
        '        if produced >= n_tokens:\n',
        '        if produced > n_tokens:\n', RT),
    Bug('RT6', 'sequence acceptance counts unchecked tokens',
        'hierviz/retime.py',
        'checked += s.target_accepted + (1 if s.target_accepted < len(s.sequence) else 0)',
        'checked += len(s.sequence)', RT),
    Bug('RT7', "re-timing prices T's tree without the root",
        'hierviz/retime.py',
        't_ms = sum(costs.target.at(len(t.nodes) + 1) for t in t_trees)',
        't_ms = sum(costs.target.at(len(t.nodes)) for t in t_trees)', RT),
    Bug('RT8', 're-timing ignores the recorded head forwards',
        'hierviz/retime.py',
        'draft = costs.draft_head_ms * draft_depths(step)',
        'draft = costs.draft_head_ms * sum(t.depth for t in step.trees)', RT),
    Bug('W1', "the what-if's depth rates shifted by one",
        'hierviz/measure/whatif_acceptance.py',
        'while n < most and self.rng.random() < rates[min(n, len(rates) - 1)]:',
        'while n < most and self.rng.random() < rates[min(n + 1, len(rates) - 1)]:', WI),
    Bug('W2', "the intermediate's trees forced at the target's rates",
        'hierviz/measure/whatif_acceptance.py',
        'return self._run(self.m_rates if level == "intermediate" else self.rates, max(tree.depths, default=0))',
        'return self._run(self.rates, max(tree.depths, default=0))', WI),
    Bug('W4', 'the forced path takes the least likely branch',
        'hierviz/decoding/verify.py',
        'end = max((i for i, d in enumerate(tree.depths) if d == depth), key=lambda i: (tree.scores[i], -i))',
        'end = min((i for i, d in enumerate(tree.depths) if d == depth), key=lambda i: (tree.scores[i], -i))', WI),
    Bug('W5', "--intermediate-lm-head ignored: M's LM head stays dense",
        'hierviz/measure/whatif.py',
        '    inter = synthetic_model(m_cfg, m_format, dtype, device, kernel, seed + 1, lm_head_format=m_lm_head)\n',
        '    inter = synthetic_model(m_cfg, m_format, dtype, device, kernel, seed + 1)\n', WI),
    Bug('W7', '--intermediate-draft-vocab ignored: M still predicts over the whole vocabulary',
        'hierviz/measure/whatif.py',
        '        inter.restrict_output_vocab(torch.arange(draft_vocab, device=inter.device))\n',
        '        pass\n', WI),
    Bug('W6', "FR-Spec rows of a W4 LM head take the first rows' scales",
        'hierviz/models/llama.py',
        '        rows = W4Weight(codes_of(w, ids), w.scales[ids], w.offsets[ids], w.group_size, w.perm)\n',
        '        rows = W4Weight(codes_of(w, ids), w.scales[:len(ids)], w.offsets[ids], w.group_size, w.perm)\n',
        ('tests/test_decoding.py',)),
    Bug('K22', "w4-sweep's workers not capped by the GPU's free memory",
        'hierviz/measure/w4_sweep.py',
        '    return max(1, min(asked, free_bytes // max(1, peak_bytes)))\n',
        '    return max(1, asked)\n', KG),
    Bug('K1', 'a variant that failed here still used',
        'hierviz/quant/kernel_guard.py',
        'return frozenset(v for v in supported if not verdict.failures(v) and (v in static or verdict.products(v)))',
        'return frozenset(v for v in supported if (v in static or verdict.products(v)))', KG),
    Bug('K2', 'a variant never proven here used',
        'hierviz/quant/kernel_guard.py',
        'return frozenset(v for v in supported if not verdict.failures(v) and (v in static or verdict.products(v)))',
        'return frozenset(v for v in supported if not verdict.failures(v))', KG),
    Bug('K3', 'the static list covers a variant it does not name',
        'hierviz/quant/kernel_guard.py',
        '    return bool(proven) and set(supported_variants(device)) <= proven\n',
        '    return bool(proven)\n', KG),
    Bug('K4', 'the kernel check reads only the first output features',
        'hierviz/quant/kernel_guard.py',
        '    tail = torch.arange(max(n - CHECK_TAIL_ROWS, len(head)), n)\n',
        '    tail = torch.arange(0)\n', KG),
    Bug('K5', 'a proof at fewer row counts covers a load',
        'hierviz/quant/w4_proof.py',
        '    return (record is not None and set(rows) <= set(record["rows"])\n',
        '    return (record is not None\n', KG),
    Bug('K6', 'auto gives a weight the CUDA kernel when it is faster at some row count only',
        'hierviz/quant/w4_choice.py',
        '    return bool(rows) and all(cuda_us[m] <= noise * triton_us[m] for m in rows)\n',
        '    return bool(rows) and any(cuda_us[m] <= noise * triton_us[m] for m in rows)\n',
        ('tests/test_w4_choice.py',)),
    Bug('K7', 'a weight that already ran on Triton moves to the CUDA kernel when timed later',
        'hierviz/quant/w4_verdicts.py',
        '    return _KERNEL_CHOICE.setdefault(kind, cuda)\n',
        '    _KERNEL_CHOICE[kind] = cuda\n    return cuda\n',
        ('tests/test_w4_choice.py',)),
    Bug('K8', "a row count runs the plan timed for the next larger one",
        'hierviz/quant/w4_verdicts.py',
        '    return next((value for rows, value in plan if rows >= m), past)\n',
        '    return next((value for rows, value in plan if rows > m), past)\n',
        ('tests/test_w4_choice.py',)),
    Bug('K9', "a workload's row count decided by the timed count below it, not the bucket it pads to",
        'hierviz/quant/w4_choice.py',
        '    return sorted({next((c for c in CHOICE_ROWS if c >= m), CHOICE_ROWS[-1]) for m in rows if m >= 1})\n',
        '    return sorted({max((c for c in CHOICE_ROWS if c <= m), default=1) for m in rows if m >= 1})\n',
        ('tests/test_w4_choice.py',)),
    Bug('K10', "HierSpec's M rows miss the round with two pending tokens",
        'hierviz/methods.py',
        '    return {"intermediate": (s.m_tree_size + 1, s.m_tree_size + 2),\n',
        '    return {"intermediate": (s.m_tree_size + 1, s.m_tree_size + 1),\n',
        ('tests/test_decoding.py', 'tests/test_whatif.py')),
    Bug('K11', "a verifier's kind gets a kernel per row count (its rows would change bits with M)",
        'hierviz/quant/w4_choice.py',
        '        if kind[5]:     # a verifier: one kernel for every row count its forwards run\n',
        '        if False:\n',
        ('tests/test_w4_choice.py',)),
    Bug('K12', "an intermediate's kind chosen by rows runs Triton past its largest timed row count",
        'hierviz/quant/w4_verdicts.py',
        '        return _at_rows(by_rows, m, by_rows[-1][1])\n',
        '        return _at_rows(by_rows, m)\n',
        ('tests/test_w4_choice.py',)),
    Bug('K13', 'the look-ahead flag of a direct entry ignores X_AHEAD_ENTRIES',
        'hierviz/quant/cuda_w4.py',
        '        xa = int((t, r) in x_ahead)\n',
        '        xa = int(r > 1 and (t, r) in x_ahead)\n',
        ('tests/test_cuda_w4.py',)),
    Bug('K14', "a verifier's plan keeps two warps per row tile (its rows would sum in another order)",
        'hierviz/quant/cuda_w4.py',
        '        split, k_warps = default[2], 1\n',
        '        split = default[2]\n',
        ('tests/test_w4_choice.py',)),
    Bug('K15', "the CUDA kernel's kept build is keyed without its source (an edited kernel would load the old code)",
        'hierviz/quant/cubin_cache.py',
        '    key = json.dumps({"arch": arch, "compiler": compiler, "source": source}, sort_keys=True)\n',
        '    key = json.dumps({"arch": arch, "compiler": compiler}, sort_keys=True)\n',
        ('tests/test_cubin_cache.py',)),
    Bug('K16', "a stack's W4 kernels are proven and chosen without its heads (their FR-Spec rows of a W4 head never timed)",
        'hierviz/stack.py',
        '    w4_status = prepare_w4_kernels(models, dtype, dev)\n',
        '    w4_status = prepare_w4_kernels(Models(target, inter), dtype, dev)\n',
        ('tests/test_hardening.py',)),
    Bug('K17', "the what-if's kernel choice leaves out the heads (their FR-Spec rows of a W4 head)",
        'hierviz/measure/whatif.py',
        '    w4_choice.choose_for_models(models.present(), device, workload=workload)\n',
        '    w4_choice.choose_for_models([target, inter], device, workload=workload)\n', WI),
    Bug('K18', 'w4-sweep leaves out the LM heads',
        'hierviz/measure/w4_sweep.py',
        '                          ("lm_head", (h, vocab))):',
        '                          ):', KG),
    Bug('K20', "the what-if decides the target's kernels over every row count (its heads hold the target)",
        'hierviz/quant/w4_choice.py',
        '            covered |= ids\n',
        '            pass\n', ('tests/test_whatif.py', 'tests/test_w4_choice.py')),
    Bug('K21', "ring_bench's staged loop loads its codes from global memory, not its ring",
        'scripts/ring_bench.cu',
        '        a[p] = lds128_at(rd + RS::X_BYTES + own_code + p * 32 * 16);\n',
        '        a[p] = load_codes(f.a);\n', ('tests/test_cuda_w4.py',)),
    Bug('K19', "sass_report reads a direct entry's tail loop as its steady loop",
        'scripts/sass_report.py',
        '(sum(x.op in ("HMMA", "HGMMA") for x in body), -len(body))',
        '(sum(x.op in ("HMMA", "HGMMA") for x in body), len(body))', ('tests/test_cuda_w4.py',)),
    Bug('K23', "sass_report's Marlin rows include the configurations without groups",
        'scripts/sass_report.py',
        'if int(c[3]) == blocks]',
        'if int(c[3]) in (blocks, -1)]', ('tests/test_cuda_w4.py',)),
    Bug('K24', "a direct entry of several row tiles at a staged token count named as the staged entry",
        'hierviz/quant/cuda_w4.py',
        '    if row_tiles > 1:       # a direct entry at any token tiles',
        '    if row_tiles > 1 and tiles in DIRECT_BUILD:       # a direct entry at any token tiles', ('tests/test_cuda_w4.py',)),
    Bug('A1', 'a visitor names any stack',
        'hierviz/app/guard.py',
        'if isinstance(name, str) and (name in offered or (options().allow_custom_stacks and name.strip())):',
        'if isinstance(name, str) and (name in offered or name.strip()):', APP),
    Bug('A2', "E_T's tree size uncapped",
        'hierviz/app/guard.py',
        '    for field, name in (("m_tree_size", "E_M"), ("t_tree_size", "E_T")):\n',
        '    for field, name in (("m_tree_size", "E_M"),):\n', APP),
    Bug('A3', 'hub presets offered on a CPU',
        'hierviz/app/guard.py',
        '    names = [n for n in STACK_PRESETS if gpu or is_local_preset(n)]\n',
        '    names = list(STACK_PRESETS)\n', APP),
    Bug('ME1', 'memory estimate: K/V projections as wide as Q',
        'hierviz/memory.py',
        '    return h * heads * hd + 2 * h * kv_heads * hd + heads * hd * h + 3 * h * inter\n',
        '    return h * heads * hd + 2 * h * heads * hd + heads * hd * h + 3 * h * inter\n', MEM),
    Bug('ME2', 'memory estimate: tied embeddings counted twice',
        'hierviz/memory.py',
        '    return n * bytes_per * (1 if c.get("tie_word_embeddings") else 2)\n',
        '    return n * bytes_per * 2\n', MEM),
    Bug('ME3', 'memory estimate: one KV cache per model',
        'hierviz/memory.py',
        '    parts["kv caches"] = 2 * sum(',
        '    parts["kv caches"] = 1 * sum(', MEM),
    Bug('ME4', 'memory estimate: W4 scales counted once',
        'hierviz/quant/formats.py',
        '        extra = (self.resident_group_copies - 1) * self.group_bytes / group if self.group_bytes else 0.0\n',
        '        extra = 0.0\n', MEM),
    Bug('ME5', "memory estimate: a quantized M LM head counted as fp16",
        'hierviz/memory.py',
        '        parts[role] = model_bytes(c, fmt, g, act_bytes, (lm_heads or {}).get(role))\n',
        '        parts[role] = model_bytes(c, fmt, g, act_bytes)\n', MEM),
    Bug('AI1', 'imported acceptance tries positions never drafted',
        'hierviz/measure/acceptance_import.py',
        '                    if a >= k - 1 and (drafted[i] if drafted else most) >= k)\n',
        '                    if a >= k - 1)\n', AI),
    Bug('AI2', 'imported unconditional rates divided by the tried steps',
        'hierviz/measure/acceptance_import.py',
        '        uncond.append(got / n)\n',
        '        uncond.append(got / tried)\n', AI),
    Bug('AI3', 'vLLM per-position rates not conditional',
        'hierviz/measure/acceptance_import.py',
        '        uncond.append(c / drafts)\n        tried = c\n',
        '        uncond.append(c / drafts)\n', AI),
    Bug('AI4', "vLLM's mean acceptance length without the bonus",
        'hierviz/measure/acceptance_import.py',
        '    return ImportedAcceptance(fmt, definition, rates, uncond, mean, drafts, k or None, 1.0 + mean, None, {}, warnings)',
        '    return ImportedAcceptance(fmt, definition, rates, uncond, mean, drafts, k or None, mean, None, {}, warnings)', AI),
    Bug('GG1', 'GGUF Q4_0 offset -7d',
        'hierviz/quant/gguf.py',
        '    offsets = _fp16_field(b, 2) if with_min else -8.0 * d   # -8d is exact in float32\n',
        '    offsets = _fp16_field(b, 2) if with_min else -7.0 * d\n', GG),
    Bug('GG2', 'GGUF Q4 high nibbles swapped',
        'hierviz/quant/gguf.py',
        '    high = (even >> 4) | (odd & 0xF0)\n',
        '    high = (odd >> 4) | (even & 0xF0)\n', GG),
    Bug('GG3', 'GGUF Q8_0 read unsigned',
        'hierviz/quant/gguf.py',
        '    q = np.ascontiguousarray(b[..., 2:34]).view(np.int8).astype(np.float32)\n',
        '    q = np.ascontiguousarray(b[..., 2:34]).view(np.uint8).astype(np.float32)\n', GG),
    Bug('GG4', 'GGUF BF16 read as F16',
        'hierviz/quant/gguf.py',
        '        arr = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)\n',
        '        arr = raw.view(np.float16).astype(np.float32)\n', GG),
    Bug('TV1', "an uploaded node's parent may come later",
        'hierviz/trace.py',
        '        if not 0 <= n.parent < n.id:\n',
        '        if not 0 <= n.parent:\n', TV),
    Bug('TV2', 'an uploaded accepted path need not be a path',
        'hierviz/trace.py',
        '        if nodes[a - 1].parent != parent:\n',
        '        if False:\n', TV),
    Bug('TV3', 'an uploaded sequence token may name a missing tree',
        'hierviz/trace.py',
        '        if tree_idx is not None and not 0 <= tree_idx < len(trees):\n',
        '        if tree_idx is not None and not 0 <= tree_idx:\n', TV),
    Bug('TV4', 'an uploaded stage time may be infinite',
        'hierviz/trace.py',
        '        if k not in STAGES or isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:\n',
        '        if k not in STAGES or isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v:\n', TV),
    Bug('CM1', 'cost model adds memory and compute time',
        'hierviz/measure/cost_model.py',
        '        total = total + np.maximum((mem + fill * fl) / e_bw, comp / e_c)\n',
        '        total = total + (mem + fill * fl) / e_bw + comp / e_c\n', CM),
    Bug('CM2', 'cost model: int_mm at the int8 rate on Hopper',
        'hierviz/measure/cost_model.py',
        '        return gpu.tflops["f16"] if gpu.capability == (9, 0) else gpu.tflops["i8"]\n',
        '        return gpu.tflops["i8"]\n', CM),
    Bug('CM3', 'cost model: W4 scales counted once',
        'hierviz/measure/cost_model.py',
        '    return sum(f.linear_bytes(n, k, where.group) for _, k, n, _ in products(where.cfg))',
        '    return sum(f.linear_bytes(n, k, 2 * where.group) for _, k, n, _ in products(where.cfg))', CM),
    Bug('CM4', 'cost model: a projected GPU prices its W4 forwards in the Triton kernel only',
        'hierviz/measure/cost_model.py',
        '    cuda = f.e_mma is not None and gpu.capability >= (8, 0)\n',
        '    cuda = False\n', CM),
    Bug('CM5', 'cost model: the CUDA MMA loop scales with the tensor rate, not multiprocessors x clock',
        'hierviz/measure/cost_model.py',
        '                 tuple(k.flops / (issue_tflops(gpu) * 1e6) for k in sync), tuple(comp([k]) for k in sync))',
        '                 tuple(comp([k]) for k in sync), tuple(comp([k]) for k in sync))', CM),
    Bug('CM6', 'cost model: the CUDA MMA variant read and loop times added, not the slower taken',
        'hierviz/measure/cost_model.py',
        '        total = total + np.maximum(np.maximum(mem / e_bw, comp / rate), peak)',
        '        total = total + np.maximum(mem / e_bw + comp / rate, peak)', CM),
    Bug('CM7', 'cost-check prices the CUDA kernel at its one-pass entry, not the entry the what-if timed',
        'hierviz/measure/cost_model.py',
        '    tiles, _, split, _ = where.w4_entry or cuda_w4.one_pass_entry(t, cuda_w4.split_for(n, k, gpu.sms))\n',
        '    tiles, _, split, _ = cuda_w4.one_pass_entry(t, cuda_w4.split_for(n, k, gpu.sms))\n', CM),
    Bug('AR1', 'greedy AR past its queued-ahead budget runs its last token twice',
        'hierviz/decoding/decoders.py',
        'TokenAhead(t.next_logits, clock)   # tok is pending now',
        'TokenAhead(lambda: t.next_logits(after=nxt.token), clock)   # tok is pending now', DEC),
    Bug('AR2', "a static forward's device tokens (greedy AR's queued token, a tree's) are not laid over the host's zeros",
        'hierviz/decoding/state.py',
        'start, start, block, tail=tail)',
        'start, start, block)', DEC),
    Bug('MO1', 'Llama-3 RoPE scaling smooths between the wrong frequencies',
        'hierviz/models/config.py',
        '        mid = (1 - smooth) * scaled / factor + smooth * scaled\n',
        '        mid = (1 - smooth) * scaled + smooth * scaled\n', MODEL),
    Bug('MO2', 'RoPE rotates the other way',
        'hierviz/models/llama.py',
        '    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)\n',
        '    rotated = torch.cat((x[..., half:], -x[..., :half]), -1)\n', MODEL),
    Bug('MO3', 'a new token sees the one after it',
        'hierviz/models/llama.py',
        '    m[:, prefix:] = torch.ones(t, t, dtype=torch.bool, device=device).tril()\n',
        '    m[:, prefix:] = torch.ones(t, t, dtype=torch.bool, device=device).tril(1)\n', MODEL),
    Bug('TW1', "the batch-invariant W4 product splits K as M's own tile shape does",
        'hierviz/quant/triton_w4.py',
        '    return dataclasses.replace(cfg, split_k=one.split_k, factored=one.factored)\n',
        '    return dataclasses.replace(cfg, factored=one.factored)\n', TRITON),
    Bug('H3', "a stack's quantized head also quantizes its base model's dense linears",
        'hierviz/stack.py',
        '            quantize_own_linears(head, quantize, kernel, skip=(model,))\n',
        '            quantize_own_linears(head, quantize, kernel)\n', ('tests/test_train_stack.py',)),
    Bug('H4', "the what-if's heads built dense whatever --head-format says",
        'hierviz/models/synthetic.py',
        "    w: dict[str, Any] = {f\"layers.0.{k}\": v for k, v in layer_weights(cfg, fmt, g,",
        "    w: dict[str, Any] = {f\"layers.0.{k}\": v for k, v in layer_weights(cfg, DENSE.name, g,", ('tests/test_whatif.py',)),
    Bug('H1', "EAGLE-3's draft tokens map to the target ids without d2t's offsets",
        'hierviz/models/eagle3.py',
        '        ids = torch.arange(vd) + d2t.to(torch.int64).cpu()\n',
        '        ids = torch.arange(vd) + 0 * d2t.to(torch.int64).cpu()\n', HEADS),
    Bug('H2', 'EAGLE-3 accepts a d2t that maps two draft tokens to one target token',
        'hierviz/models/eagle3.py',
        '        if torch.unique(ids).numel() != vd:\n',
        '        if torch.unique(ids).numel() > vd:\n', HEADS),
    Bug('Q8', "W8A8's per-token activation scale from the row sum, not its largest magnitude",
        'hierviz/quant/w8a8.py',
        '    s = (xf.abs().amax(-1) / QMAX).clamp_min(1e-12)\n',
        '    s = (xf.abs().mean(-1) / QMAX).clamp_min(1e-12)\n', W8),
    Bug('A9', "a stack file quantizes the target's LM head (T's verification would no longer be T's own)",
        'hierviz/stack.py',
        'if "quantize_lm_head" in entry and (key != "intermediate" or not isinstance(entry["quantize_lm_head"], str)):',
        'if "quantize_lm_head" in entry and not isinstance(entry["quantize_lm_head"], str):', ('tests/test_hardening.py',)),
    Bug('E1', 'an EOS token dropped from the output',
        'hierviz/engine.py',
        '                cut = j + 1\n',
        '                cut = j\n', ENGINE),
    Bug('E2', 'an EOS past the token budget ends the run as EOS',
        'hierviz/engine.py',
        '        for j, t in enumerate(step.new_tokens[:room]):\n',
        '        for j, t in enumerate(step.new_tokens):\n', ENGINE),
    Bug('A10', 'the side-by-side panel is sized from a top never measured (it runs past a 720-pixel screen)',
        'hierviz/app/layout.py',
        'for (const [id, name] of [["hv-tree", "--hv-tree-top"], ["hv-side-by-side", "--hv-side-top"]]) {',
        'for (const [id, name] of [["hv-tree", "--hv-tree-top"]]) {', ('tests/test_browser.py',)),
    Bug('A4', "a paused replay's generator still moves the session's step",
        'hierviz/app/session.py',
        '            if self.replay != replay:\n',
        '            if False:\n', APP),
    Bug('A5', 'the step slider does not stop a running replay',
        'hierviz/app/handlers.py',
        '    sess.stop_replay()\n    return pack(SCRUB_OUTPUTS',
        '    return pack(SCRUB_OUTPUTS', APP),
    Bug('A6', 'a live run keeps sending its updates over a trace the visitor loaded',
        'hierviz/app/live.py',
        '            if replaced():\n                return\n            yield update\n    finally:',
        '            yield update\n    finally:', APP),
    Bug('CG1', "the static path places a tree's nodes one position late",
        'hierviz/decoding/state.py',
        'depths, tree_block = extra_depths.to(dev) + (start + p - 1), extra_block.to(dev)',
        'depths, tree_block = extra_depths.to(dev) + (start + p), extra_block.to(dev)', STATIC),
]


def applies(bug: Bug, root: Path = ROOT) -> bool:
    """Whether the bug's text occurs exactly once in its file."""
    return (root / bug.path).read_text(encoding="utf-8").count(bug.old) == 1


def copy_tree(dst: Path) -> None:
    """The working tree's tracked and untracked (not ignored) files."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)


def run(bug: Bug, copy: Path) -> tuple[bool, float, str]:
    """(caught, seconds, the first failing test or the pass line) for one planted bug."""
    target = copy / bug.path
    original = target.read_text(encoding="utf-8")
    target.write_text(original.replace(bug.old, bug.new), encoding="utf-8")
    try:
        t0 = time.time()
        workers = ["-n", "2", "--dist", "loadfile"] if len(bug.tests) > 1 else []   # as scripts/test.sh
        r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *workers, *bug.tests],
                           cwd=copy, capture_output=True, text=True, timeout=1800,
                           env={**os.environ, "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"})
        lines = r.stdout.splitlines()
        said = next((x for x in lines if x.startswith("FAILED") or x.startswith("ERROR")), lines[-1] if lines else "")
        return r.returncode != 0, time.time() - t0, said
    finally:
        target.write_text(original, encoding="utf-8")


def main(argv: list[str]) -> int:
    chosen = [b for b in BUGS if not argv or b.id in argv]
    unknown = set(argv) - {b.id for b in BUGS}
    if unknown:
        print(f"unknown bug ids: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    stale = [b.id for b in chosen if not applies(b)]
    if stale:
        print(f"these bugs no longer apply to the source (update their text): {', '.join(stale)}", file=sys.stderr)
        return 2
    missed = []
    with tempfile.TemporaryDirectory(prefix="hierviz-planted-") as tmp:
        copy = Path(tmp)
        copy_tree(copy)
        for bug in chosen:
            caught, seconds, said = run(bug, copy)
            print(f"{bug.id:5} {'caught' if caught else 'MISSED':7} {seconds:5.0f} s  {bug.what}  [{said[:100]}]", flush=True)
            if not caught:
                missed.append(bug.id)
    print(f"{len(chosen) - len(missed)} of {len(chosen)} planted bugs caught" + (f"; missed: {', '.join(missed)}" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
