"""hierviz.measure.acceptance_import: each format's file in tests/data/acceptance/ (the engine's own
layout, numbers chosen so the expected statistics are computable by hand), detection, bad inputs and
a hierviz trace round trip."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from hierviz.measure import acceptance_import as ai  # noqa: E402
from hierviz.measure.acceptance_import import (  # noqa: E402
    FORMATS, AcceptanceImportError, detect_format, load_acceptance, rates_from_lengths,
)

DATA = Path(__file__).parent / "data" / "acceptance"
FILES = {
    "vllm_metrics.prom": "vllm-prometheus",
    "vllm_get_metrics.json": "vllm-metrics-json",
    "vllm_request.jsonl": "vllm-request",
    "sglang_generate.json": "sglang-meta-info",
    "sglang_generate_v2.jsonl": "sglang-meta-info",
    "specbench_answers.jsonl": "specbench-jsonl",
    "eagle_answers.jsonl": "eagle-jsonl",
    "specmquant_answers.jsonl": "specmquant-jsonl",
}
approx = pytest.approx


@pytest.mark.parametrize("name,fmt", sorted(FILES.items()))
def test_detects_each_format(name, fmt):
    data = (DATA / name).read_bytes()
    assert detect_format(data, name) == fmt
    got = load_acceptance(DATA / name)
    assert got.source_format == fmt and got.definition
    assert fmt in FORMATS


@pytest.mark.parametrize("name,fmt", sorted(FILES.items()))
def test_mislabelled_format_is_refused(name, fmt):
    wrong = "sglang-meta-info" if fmt != "sglang-meta-info" else "vllm-prometheus"
    with pytest.raises(AcceptanceImportError, match="read as"):
        load_acceptance(DATA / name, wrong)


def test_vllm_prometheus_sums_engines():
    # engines 0 and 1: drafts 60+40, draft tokens 180+120, accepted 90+60, per position [70, 50, 30]
    a = load_acceptance(DATA / "vllm_metrics.prom")
    assert a.steps == 100 and a.draft_length == 3
    assert a.accepted_per_position == approx([0.7, 0.5, 0.3])
    assert a.rates == approx([0.7, 50 / 70, 30 / 50])
    assert a.mean_accepted_length == approx(1.5)
    assert a.tokens_per_step == approx(2.5)
    assert a.reported_mean_length == approx(2.5)      # vLLM's 1 + accepted / drafts
    assert a.accept_lengths is None
    assert any("2 engines" in w for w in a.warnings)


def test_vllm_prometheus_several_models():
    text = (DATA / "vllm_metrics.prom").read_text()
    other = "\n".join(line.replace('engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"',
                                   'engine="0",model_name="other"') for line in text.splitlines())
    with pytest.raises(AcceptanceImportError, match="several models"):
        load_acceptance(other.encode())
    a = load_acceptance(other.encode(), model="other")
    assert a.steps == 40 and a.rates == approx([30 / 40, 20 / 30, 10 / 20])


def test_vllm_get_metrics_json():
    a = load_acceptance(DATA / "vllm_get_metrics.json")
    assert a.steps == 50 and a.draft_length == 4
    assert a.accepted_per_position == approx([0.8, 0.6, 0.4, 0.2])
    assert a.rates == approx([0.8, 0.75, 2 / 3, 0.5])
    assert a.mean_accepted_length == approx(2.0)


def test_vllm_per_request_detailed():
    # per_step_accepted [3,1,0,2] + [0,3,3,1]; the second request drafted only 2 at its last step
    a = load_acceptance(DATA / "vllm_request.jsonl")
    assert a.accept_lengths == [3, 1, 0, 2, 0, 3, 3, 1]
    assert a.steps == 8 and a.draft_length == 3
    assert a.rates == approx([6 / 8, 4 / 6, 3 / 4])
    assert a.accepted_per_position == approx([6 / 8, 4 / 8, 3 / 8])
    assert a.mean_accepted_length == approx(13 / 8)
    assert a.reported_mean_length == approx(1 + 13 / 8)


def test_vllm_per_request_summary_uses_histogram():
    import json
    lines = [json.loads(x) for x in (DATA / "vllm_request.jsonl").read_text().splitlines()]
    for r in lines:
        del r["metrics"]["speculative_decoding"]["per_step_accepted"]
        del r["metrics"]["speculative_decoding"]["per_step_drafted"]
    a = load_acceptance("\n".join(json.dumps(r) for r in lines).encode())
    # histograms [1,1,1,1] + [1,1,0,2] = [2,2,1,3]: >=1: 6, >=2: 4, >=3: 3 of 8 steps
    assert a.rates == approx([6 / 8, 4 / 6, 3 / 4]) and a.accept_lengths is None
    assert any("fewer than num_spec_tokens" in w for w in a.warnings)


def test_sglang_meta_info():
    # histograms [2,3,1,4] + [3,2,1,4] = [5,5,2,8]: 20 steps, 33 accepted draft tokens
    a = load_acceptance(DATA / "sglang_generate.json")
    assert a.steps == 20 and a.draft_length == 3
    assert a.rates == approx([15 / 20, 10 / 15, 8 / 10])
    assert a.accepted_per_position == approx([0.75, 0.5, 0.4])
    assert a.mean_accepted_length == approx(33 / 20)
    # SGLang's spec_accept_length: completion_tokens / spec_verify_ct = (28 + 27) / 20, which counts
    # each request's prefill token on top of tokens_per_step
    assert a.reported_mean_length == approx(55 / 20)
    assert a.tokens_per_step == approx(53 / 20)


def test_sglang_newer_field_names():
    a = load_acceptance(DATA / "sglang_generate_v2.jsonl")     # histogram [2,2,2,2]
    assert a.rates == approx([6 / 8, 4 / 6, 2 / 4]) and a.mean_accepted_length == approx(1.5)


def test_sglang_without_histogram_gives_mean_only():
    body = (b'{"text": "x", "meta_info": {"id": "r1", "completion_tokens": 31, "spec_verify_ct": 10, '
            b'"spec_accept_token_num": 20, "spec_draft_token_num": 30, "spec_accept_rate": 0.6667, '
            b'"spec_accept_length": 3.1}}')
    a = load_acceptance(body)
    assert a.rates == [] and a.mean_accepted_length == approx(2.0) and a.steps == 10
    assert any("only the mean" in w for w in a.warnings)


def test_specbench_lengths_drop_the_bonus_token():
    # accept_lengths (bonus included) [1,2,3,4,2] + [4,4,1] -> accepted drafts [0,1,2,3,1,3,3,0]
    a = load_acceptance(DATA / "specbench_answers.jsonl")
    assert a.accept_lengths == [0, 1, 2, 3, 1, 3, 3, 0]
    assert a.rates == approx([6 / 8, 4 / 6, 3 / 4])
    assert a.mean_accepted_length == approx(13 / 8)
    assert a.reported_mean_length == approx(21 / 8)      # Spec-Bench's "Mean accepted tokens"


def test_eagle_answers_mean_only():
    # idxs [9, 4] -> 15 rounds, new_tokens 60 -> 4 tokens a round, 3 accepted draft tokens
    a = load_acceptance(DATA / "eagle_answers.jsonl")
    assert a.steps == 15 and a.mean_accepted_length == approx(3.0) and a.tokens_per_step == approx(4.0)
    assert a.rates == [] and a.warnings


def test_specmquant_two_levels():
    a = load_acceptance(DATA / "specmquant_answers.jsonl")
    seq, inter = a.levels["sequence"], a.levels["intermediate"]
    # target level: [5,3,7,1] -> [4,2,6,0]
    assert seq.accept_lengths == [4, 2, 6, 0] and a.mean_accepted_length == approx(3.0)
    assert a.rates == seq.rates == approx([3 / 4, 3 / 3, 2 / 3, 2 / 2, 1 / 2, 1 / 1])
    # draft-model level: [3,4,2,1,3,4] -> [2,3,1,0,2,3]
    assert inter.accept_lengths == [2, 3, 1, 0, 2, 3]
    assert inter.rates == approx([5 / 6, 4 / 5, 2 / 4])
    assert inter.mean_accepted_length == approx(11 / 6)


def test_rates_from_lengths():
    assert rates_from_lengths([2, 0, 1, 2]) == (approx([3 / 4, 2 / 3]), approx([3 / 4, 2 / 4]))
    # a step that drafted one position does not try position 2
    assert rates_from_lengths([1, 1], [1, 2])[0] == approx([1.0, 0.0])
    assert rates_from_lengths([]) == ([], [])
    # drafts of different lengths: a position is tried only in steps that drafted that far (step 0
    # drafted 2 and accepted both: position 3 was never proposed to it)
    assert rates_from_lengths([2, 1, 3], [2, 3, 4]) == (approx([1.0, 2 / 3, 1.0, 0.0]), approx([1.0, 2 / 3, 1 / 3, 0.0]))


# ---- bad inputs ---------------------------------------------------------------------------------

PROM_HEAD = "# TYPE vllm:spec_decode_num_drafts_total counter\n"


@pytest.mark.parametrize("data,match", [
    (b"", "empty"),
    (b"  \n\n", "empty"),
    (b'{"text": "x", "meta_info": {"id": "a", "spec_verify_ct": 3', "truncated"),
    (b'[{"question_id": 1, "choices": [{"accept_lengths": [1, 2', "truncated"),
    (b"# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"
     b'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n', "no vllm:spec_decode"),
    ((PROM_HEAD + 'vllm:spec_decode_num_drafts_total{model_name="m"} 100.0\n'
      'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 300.0\n'
      'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 400.0\n').encode(), "accepted > |400 accepted"),
    ((PROM_HEAD + 'vllm:spec_decode_num_drafts_total{model_name="m"} 10.0\n'
      'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 5.0\n'
      'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 11.0\n').encode(),
     "more than drafts"),
    (b'{"question_id": 1, "choices": [{"accept_lengths": [2, 0, 1]}]}', "at least 1"),
    (b'{"choices": [{"idxs": [9], "new_tokens": [3]}]}', "inconsistent counts"),
    (b'{"id": "x", "object": "chat.completion", "choices": []}', "no speculative-decoding fields"),
    (b'{"text": "x", "meta_info": {"id": "a", "completion_tokens": 5}}', "spec_verify_ct"),
    (b"\xff\xfe\x00garbage", "UTF-8"),
    (b"[" * 100000, "JSON"),
    (b'{"metrics": {"speculative_decoding": {"acceptance_histogram": [1, 1], "num_spec_steps": 2, '
     b'"num_accepted_draft_tokens": 1, "num_draft_tokens": 0, "num_spec_tokens": 1}}}', "inconsistent counts"),
    (b'{"metrics": {"speculative_decoding": {"acceptance_histogram": "x"}}}', "list of counts"),
])
def test_bad_inputs(data, match):
    with pytest.raises(AcceptanceImportError, match=match):
        load_acceptance(data)


def test_bad_files(tmp_path, monkeypatch):
    empty = tmp_path / "empty.json"
    empty.write_bytes(b"")
    with pytest.raises(AcceptanceImportError, match="empty.json: the data is empty"):
        load_acceptance(empty)
    with pytest.raises(AcceptanceImportError, match="cannot read"):
        load_acceptance(tmp_path / "missing.jsonl")
    with pytest.raises(AcceptanceImportError, match="unknown format 'csv'.*vllm-prometheus"):
        load_acceptance(DATA / "vllm_metrics.prom", "csv")
    monkeypatch.setattr(ai, "MAX_IMPORT_BYTES", 100)
    with pytest.raises(AcceptanceImportError, match="limit is"):
        load_acceptance(DATA / "vllm_metrics.prom")
    with pytest.raises(AcceptanceImportError, match="limit is"):
        detect_format((DATA / "vllm_metrics.prom").read_bytes())


# ---- hierviz traces -----------------------------------------------------------------------------

def _by_position(accepted: list[int], drafted: list[int]) -> list[float]:
    """Per-depth acceptance as hierviz.trace.count_depth_acceptance counts it, written out again."""
    rates = []
    for k in range(1, max(drafted) + 1):
        tried = sum(1 for a, d in zip(accepted, drafted) if a >= k - 1 and d >= k)
        if not tried:
            break
        rates.append(sum(1 for a in accepted if a >= k) / tried)
    return rates


def test_hierviz_trace_round_trip(tmp_path):
    from hierviz.engine import DecodeSettings, generate
    from hierviz.stack import load_stack
    from hierviz.trace import save_comparison
    st = load_stack("tiny-random", device="cpu")
    tr = generate(st, "eagle2", "hello", DecodeSettings(max_new_tokens=16))
    trees = [t for s in tr.steps if s.index > 0 for t in s.trees]
    assert trees
    acc, drafted = [len(t.accepted) for t in trees], [t.depth for t in trees]

    a = load_acceptance(tr.to_json().encode())
    assert a.source_format == "hierviz-trace" and set(a.levels) == {"target"}
    assert a.accept_lengths == acc and a.steps == len(trees)
    assert a.rates == approx(_by_position(acc, drafted))
    assert a.mean_accepted_length == approx(sum(acc) / len(acc))
    # the trace's own statistics agree where its step 0 drafted nothing
    if not tr.steps[0].trees:
        per_depth = tr.stats()["per_depth_acceptance"]
        assert a.rates == approx([per_depth[d] for d in sorted(per_depth)][:len(a.rates)])

    path = tmp_path / "cmp.json"
    save_comparison([tr, tr], path)
    assert detect_format(path.read_bytes()) == "hierviz-trace"
    b = load_acceptance(path)
    assert b.steps == 2 * len(trees) and b.rates == approx(a.rates)


def test_hierviz_trace_errors():
    with pytest.raises(AcceptanceImportError, match="hierviz-trace"):
        load_acceptance(b'{"version": 99, "runs": []}')
