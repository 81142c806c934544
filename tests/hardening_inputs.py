"""Bad inputs for tests/test_hardening.py: what a hostile or careless visitor (or operator) sends,
and what the app must answer. Plain data and small builders only; the tests use them."""
from __future__ import annotations

import copy
import html
import json
import re
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLUMBING = ROOT / "assets" / "traces" / "tiny-random-plumbing.json"

# /run's positional inputs, in order, and a good small run (tiny-random, 4 new tokens, no AR)
RUN_NAMES = ("prompt", "stack", "max_new", "temperature", "m_depth", "m_topk", "m_size", "min_draft",
             "t_depth", "t_topk", "t_size", "with_ar")
GOOD = {"prompt": "hello there", "stack": "tiny-random", "max_new": 4, "temperature": 0.0, "m_depth": 2,
        "m_topk": 4, "m_size": 8, "min_draft": 3, "t_depth": 2, "t_topk": 4, "t_size": 8, "with_ar": False}

# what no message shown to a visitor may contain: server paths, a stack trace, file content
LEAK_MARKERS = ("/root", "/tmp/", "/usr/", "site-packages", "/work/", "/home/", "Traceback", 'File "',
                "root:x:0:0", "hierviz/")
GENERIC_GRADIO = "has raised an exception but has not enabled verbose error reporting"
INTERNAL = "Internal error"


def run_args(**changes: Any) -> list:
    """/run's positional inputs: GOOD with `changes`."""
    unknown = set(changes) - set(RUN_NAMES)
    assert not unknown, unknown
    values = {**GOOD, **changes}
    return [values[n] for n in RUN_NAMES]


def text_of(status_html: str) -> str:
    """A status box's message as the visitor reads it (tags stripped, entities decoded)."""
    return html.unescape(re.sub(r"<[^>]+>", "", status_html))


def leaks(message: str, echoed: tuple[str, ...] = ()) -> list[str]:
    """The LEAK_MARKERS in `message`, once the visitor's own input it echoes (`echoed`) is removed."""
    for a in echoed:
        message = message.replace(a, "")
    return [m for m in LEAK_MARKERS if m in message]


# ---- run settings -----------------------------------------------------------------------------
# (id, changes, expected): expected is ("app", text) for Gradio's own input validation (AppError:
# a slider's range, the list of stacks), ("status", text) for the app's error in the status box,
# or ("done", field, value): an integral-valued number of any type runs, and the trace records
# the whole number. One rule for every setting (DecodeSettings.validate): a fraction is refused
# wherever a whole number is meant, a word, None or NaN wherever a number is.


# the CPU's cap on new tokens (hierviz.app.guard.DEVICE_CAPS): the slider ends there, so Gradio refuses
# more; the guard's own check answers should the slider ever offer more ("either": whichever layer)
CPU_MAX_NEW = 256
CAP_REFUSAL = ("either", (("app", f"greater than maximum value {CPU_MAX_NEW}"),
                          ("status", f"Max new tokens must be at most {CPU_MAX_NEW} on this server")))

RUN_SETTING_CASES = [
    ("max_new=-1", {"max_new": -1}, ("app", "less than minimum value 1")),
    ("max_new=0", {"max_new": 0}, ("app", "less than minimum value 1")),
    ("max_new=1e6", {"max_new": 10**6}, CAP_REFUSAL),
    ("max_new=10**30", {"max_new": 10**30}, CAP_REFUSAL),
    ("max_new=300-above-cpu-cap", {"max_new": 300}, CAP_REFUSAL),
    ("max_new=3.5", {"max_new": 3.5}, ("status", "Max new tokens must be a whole number")),
    ("max_new=4.0-integral", {"max_new": 4.0}, ("done", "max_new_tokens", 4)),
    ("max_new=True", {"max_new": True}, ("status", "Max new tokens must be a whole number")),
    ("max_new=None", {"max_new": None}, ("status", "Max new tokens must be a whole number, got None")),
    ("max_new=abc", {"max_new": "abc"}, ("status", "Max new tokens must be a whole number, got 'abc'")),
    ("temperature=-1", {"temperature": -1}, ("app", "less than minimum value 0")),
    ("temperature=1e9", {"temperature": 1e9}, ("app", "greater than maximum value 2")),
    ("temperature=True", {"temperature": True}, ("status", "Temperature must be a number")),
    ("temperature=nan-string", {"temperature": "nan"}, ("status", "Temperature must be a number, got 'nan'")),
    ("temperature=inf-string", {"temperature": "inf"}, ("status", "Temperature must be a number, got 'inf'")),
    ("temperature=None", {"temperature": None}, ("status", "Temperature must be a number, got None")),
    ("temperature=abc", {"temperature": "abc"}, ("status", "Temperature must be a number, got 'abc'")),
    ("m_depth=1.5", {"m_depth": 1.5}, ("status", "E_M tree depth must be a whole number, got 1.5")),
    ("m_topk=3.5", {"m_topk": 3.5}, ("status", "E_M tree top-k must be a whole number, got 3.5")),
    ("m_size=3.5", {"m_size": 3.5}, ("status", "E_M tree size must be a whole number, got 3.5")),
    ("t_depth=2.7", {"t_depth": 2.7}, ("status", "E_T tree depth must be a whole number, got 2.7")),
    ("t_size=7.5", {"t_size": 7.5}, ("status", "E_T tree size must be a whole number, got 7.5")),
    ("m_size=8.0-integral", {"m_size": 8.0}, ("done", "m_tree_size", 8)),
    ("t_depth=2.0-integral", {"t_depth": 2.0}, ("done", "t_depth", 2)),
    ("m_depth=None", {"m_depth": None}, ("status", "E_M tree depth must be a whole number, got None")),
    ("t_topk=None", {"t_topk": None}, ("status", "E_T tree top-k must be a whole number, got None")),
    ("m_depth=abc", {"m_depth": "abc"}, ("status", "E_M tree depth must be a whole number, got 'abc'")),
    ("t_depth=numeric-string-3", {"t_depth": "3"}, ("status", "E_T tree depth must be a whole number, got '3'")),
    ("m_depth=True", {"m_depth": True}, ("status", "E_M tree depth must be a whole number, got True")),
    ("m_depth=10**30", {"m_depth": 10**30}, ("status", "E_M tree depth must be between 1 and 32")),
    ("m_depth=0", {"m_depth": 0}, ("status", "E_M tree depth must be between 1 and 32, got 0")),
    ("t_topk=-5", {"t_topk": -5}, ("status", "E_T tree top-k must be between 1 and 64, got -5")),
    ("m_size=500-above-candidates", {"m_size": 500}, ("status", "E_M tree size 500 exceeds the 20 candidates")),
    ("t_size=100-above-candidates", {"t_size": 100}, ("status", "E_T tree size 100 exceeds the 20 candidates")),
    ("m_size=65-above-cpu-cap", {"m_depth": 3, "m_topk": 8, "m_size": 65},
     ("status", "E_M tree size must be at most 64 on this server")),
    ("t_size=100-above-cpu-cap", {"t_depth": 3, "t_topk": 8, "t_size": 100},
     ("status", "E_T tree size must be at most 64 on this server")),
    ("m_size=10**30", {"m_size": 10**30}, ("status", "E_M tree size must be between 1 and 512")),
    ("min_draft=0", {"min_draft": 0}, ("app", "less than minimum value 1")),
    ("min_draft=1000", {"min_draft": 1000}, ("app", "greater than maximum value 32")),
    ("min_draft=3.5", {"min_draft": 3.5}, ("status", "Min sequence-draft length for T must be a whole number")),
    ("min_draft=None", {"min_draft": None}, ("status", "Min sequence-draft length for T must be a whole number, got None")),
]

# Values gradio_client cannot send (NaN, Infinity, lone surrogates are not JSON it writes), posted
# as raw JSON to /gradio_api/call/run: (id, JSON text of the inputs, expected ("app"|"status", text))
RAW_RUN_CASES = [
    ("temperature=NaN", '["hi", "tiny-random", 4, NaN, 2, 4, 8, 3, 2, 4, 8, false]',
     ("status", "Temperature must be between 0 and 10")),
    ("temperature=Infinity", '["hi", "tiny-random", 4, Infinity, 2, 4, 8, 3, 2, 4, 8, false]',
     ("app", "Value inf is greater than maximum value 2.0")),
    ("max_new=NaN", '["hi", "tiny-random", NaN, 0.0, 2, 4, 8, 3, 2, 4, 8, false]',
     ("status", "Max new tokens must be a whole number")),
    ("prompt=lone-surrogate", '["a\\ud800b", "tiny-random", 4, 0.0, 2, 4, 8, 3, 2, 4, 8, false]',
     ("status", "surrogates not allowed")),
]

# ---- prompts ----------------------------------------------------------------------------------
HTML_PROMPT = "<img src=x onerror=alert(1)><script>alert(1)</script>"
# (id, prompt, expected): ("status", text) an error in the status box, ("ok", None) a normal run
PROMPT_CASES = [
    ("empty", "", ("status", "The prompt is empty")),
    ("whitespace", " \n\t  ", ("status", "The prompt is empty")),
    ("None", None, ("status", "The prompt is empty")),
    ("200kB", "x" * 200_000, ("status", "the prompt has 200000 characters; the limit is 20000")),
    ("just-over-MAX_PROMPT_CHARS", "y" * 20_001, ("status", "the limit is 20000")),
    ("longer-than-context", "z" * 5000, ("status", "the model's context is 1024 tokens")),
    ("control-chars-and-NUL", "hi\x00there\x01\x07\x1b[31m\x7f\r\n", ("ok", None)),
    ("rtl-override-and-emoji", "🙂 مرحبا \u202e evil", ("ok", None)),
    ("html-script", HTML_PROMPT, ("ok", None)),
]

# ---- stack box --------------------------------------------------------------------------------
STACK_CASES = [
    ("abs-path", "/etc/passwd"),
    ("traversal", "../../../etc/passwd"),
    ("hub-id", "meta-llama/Llama-3.1-405B"),
    ("empty-string", ""),
    ("trailing-space", "tiny-random "),
    ("stack-json-next-to-presets", "../assets/stacks/smollm2-offline.json"),
]

# ---- trace uploads ----------------------------------------------------------------------------


def plumbing(full: bool = False) -> dict:
    """The shipped tiny-random comparison trace (HierSpec, EAGLE-2, AR); by default each run cut to
    four steps (faster)."""
    doc = json.loads(PLUMBING.read_text(encoding="utf-8"))
    if not full:
        doc["runs"] = [dict(r, steps=r["steps"][:4]) for r in doc["runs"]]
    return doc


def mutated(change: Callable[[dict], Any]) -> Callable[[], bytes]:
    def build() -> bytes:
        doc = copy.deepcopy(plumbing())
        change(doc)
        return json.dumps(doc).encode()     # allow_nan: NaN / Infinity written as JSON's extensions
    return build


def _step(doc: dict) -> dict:
    return doc["runs"][0]["steps"][1]


def _node(doc: dict) -> dict:
    return _step(doc)["trees"][0]["nodes"][0]


def _garbage() -> bytes:
    import random
    return random.Random(0).randbytes(4096)


# (id, build() -> bytes, expected): ("error", text) "Could not read NAME: ...text..." in the status
# box, or ("loads", None): a document the schema allows (it only displays ids and numbers), which
# must load and render without an error
UPLOAD_CASES = [
    ("malformed-json", lambda: b"{not json", ("error", "not valid JSON")),
    ("binary-garbage", _garbage, ("error", "not a trace file (it is not text; a trace is JSON text)")),
    ("empty-file", lambda: b"", ("error", "not a trace file (it is empty)")),
    ("plain-text", lambda: b"Hello, this is a note.\n", ("error", "not a trace file (it is not JSON)")),
    ("spaces-then-text", lambda: b"  \n\tnope", ("error", "not a trace file (it is not JSON)")),
    ("json-list", lambda: b"[1, 2, 3]", ("error", "a trace must be a JSON object")),
    ("json-string", lambda: b'"hello"', ("error", "a trace must be a JSON object")),
    ("wrong-schema", lambda: b'{"foo": 1}', ("error", "unsupported trace schema version None")),
    ("version-99", mutated(lambda d: d.update(version=99)), ("error", "unsupported trace schema version 99")),
    ("runs-empty", lambda: b'{"version": 1, "runs": []}', ("error", "'runs' must be a non-empty list")),
    ("nested-100000-arrays", lambda: b"[" * 100_000, ("error", "not valid JSON")),
    ("nested-100000-objects", lambda: b'{"a":' * 100_000, ("error", "not valid JSON")),
    ("timing-negative", mutated(lambda d: _step(d)["timings_ms"].update(draft=-1)), ("error", "bad entry 'draft': -1")),
    ("timing-NaN", mutated(lambda d: _step(d)["timings_ms"].update(draft=float("nan"))),
     ("error", "bad entry 'draft': nan")),
    ("timing-Infinity", mutated(lambda d: _step(d)["timings_ms"].update(overhead=float("inf"))),
     ("error", "bad entry 'overhead': inf")),
    ("timing-1e308-twice", mutated(lambda d: _step(d)["timings_ms"].update(draft=1e308, overhead=1e308)),
     ("loads", None)),
    ("score-NaN-logprob-inf", mutated(lambda d: _node(d).update(score=float("nan"), logprob=float("inf"))),
     ("loads", None)),
    ("prefill-1e308", mutated(lambda d: d["runs"][0].update(prefill_ms=1e308)), ("loads", None)),
    ("forwards-negative", mutated(lambda d: _step(d).update(forwards={"target": -1})),
     ("error", "counts must be non-negative integers")),
    ("token-id-negative", mutated(lambda d: _step(d).update(new_tokens=[-5] * len(_step(d)["new_tokens"]))),
     ("loads", None)),
    ("token-id-10**30", mutated(lambda d: (_step(d).update(new_tokens=[10**30] * len(_step(d)["new_tokens"])),
                                           _node(d).update(token=10**40))), ("loads", None)),
    ("token-id-bool", mutated(lambda d: _step(d).update(new_tokens=[True] * len(_step(d)["new_tokens"]))),
     ("error", "new_tokens must be integers")),
    ("node-text-not-a-string", mutated(lambda d: _node(d).update(text=5)), ("error", "text: expected str, got int")),
    ("lengths-differ", mutated(lambda d: _step(d).update(new_text=[])), ("error", "differ in length")),
    ("meta-a-list", mutated(lambda d: d["runs"][0].update(meta=[])), ("error", "trace.meta: expected dict, got list")),
    ("unknown-method", mutated(lambda d: d["runs"][0]["meta"].update(method="medusa")), ("error", "unknown method")),
    ("unknown-parent", mutated(lambda d: _node(d).update(parent=10**6)), ("error", "unknown parent")),
    pytest.param("meta-settings-a-string", mutated(lambda d: d["runs"][0]["meta"].update(settings="x")),
                 ("error", "trace.meta.settings must be an object")),
    pytest.param("meta-temperature-a-word",
                 mutated(lambda d: d["runs"][0]["meta"]["settings"].update(temperature="hot")),
                 ("error", "temperature must be a number")),
]

INJECT = "<script>alert(1)</script>"


def html_everywhere() -> bytes:
    """The full plumbing trace with INJECT in every text field: meta, output, steps, trees, sequences."""
    doc = plumbing(full=True)
    for run in doc["runs"]:
        meta = run["meta"]
        for k in ("title", "prompt", "description", "stack", "target", "intermediate", "host"):
            meta[k] = f"{k} {INJECT}"
        run["output_text"] = INJECT
        run["finish_reason"] = INJECT
        for st in run["steps"]:
            st["new_text"] = [f"{INJECT}{t}" for t in st["new_text"]]
            st["target_bonus_text"] = INJECT
            for tree in st.get("trees", []):
                tree["root_text"] = tree["bonus_text"] = INJECT
                for n in tree["nodes"]:
                    n["text"] = INJECT
            for s in st.get("sequence", []):
                s["text"] = INJECT
    return json.dumps(doc).encode()


# ---- stack files (hierviz.stack.load_stack) ------------------------------------------------------
# (id, the stack JSON text, expected message)
SPEC_CASES = [
    ("not-json", "{nope", "is not valid JSON"),
    ("json-list", "[1, 2]", "has no 'target'"),
    ("json-null", "null", "has no 'target'"),
    ("missing-folder", '{"target": {"path": "./no-such-folder"}}', "no such model file or folder"),
    ("target-is-etc-passwd", '{"target": {"path": "/etc/passwd"}}', "neither a model folder nor a .gguf file"),
    ("unknown-quantize", '{"target": {"path": "target", "quantize": 5}}', "unknown quantize option 5"),
    ("unknown-dtype", '{"target": {"path": "target"}, "dtype": "float8"}', "unknown dtype 'float8'"),
    ("target-a-string", '{"target": "target"}', "'target' must be an object"),
    ("target-empty-object", '{"target": {}}', "\"path\" string"),
    ("target-null", '{"target": null}', "'target' must be an object"),
    ("target-path-a-number", '{"target": {"path": 5}}', "\"path\" string"),
    ("dtype-a-list", '{"target": {"path": "target"}, "dtype": []}', "'dtype' must be a string"),
    ("intermediate-a-string", '{"target": {"path": "target"}, "intermediate": "target"}', "'intermediate' must be an object"),
    ("e_t-a-string", '{"target": {"path": "target"}, "e_t": "e_t"}', "'e_t' must be an object"),
    ("draft_vocab-missing-file", '{"target": {"path": "target"}, "e_t": {"path": "e_t"}, "draft_vocab": "nope.json"}',
     "cannot read the draft vocabulary"),
    ("draft_vocab-an-object", '{"target": {"path": "target"}, "e_t": {"path": "e_t"}, '
                              '"draft_vocab": "target/config.json"}', "must be a non-empty JSON list"),
    ("target-quantize_lm_head", '{"target": {"path": "target", "quantize_lm_head": "rtn-g32"}}',
     "only the intermediate's LM head may be quantized"),
    ("quantize_lm_head-a-number", '{"target": {"path": "target"}, "intermediate": {"path": "target", "quantize_lm_head": 4}}',
     "only the intermediate's LM head may be quantized"),
    ("quantize_lm_head-unknown", '{"target": {"path": "target"}, "intermediate": {"path": "target", "quantize_lm_head": "rtn"}}',
     "quantize_lm_head 'rtn': unknown quantize option"),
    ("quantize_lm_head-group", '{"target": {"path": "target"}, "intermediate": {"path": "target", "quantize_lm_head": "rtn-g7"}}',
     "quantize_lm_head 'rtn-g7'"),
    ("quantize_lm_head-int8-with-fr-spec-rows", '{"target": {"path": "target"}, "intermediate": {"path": "target", '
     '"quantize_lm_head": "w8a8-int8"}, "e_m": {"path": "e_t"}, "draft_vocab": "vocab.json"}',
     "draft_vocab: a reduced vocabulary needs a dense or W4 LM head"),
]


def write_tiny_llama(folder: Path, vocab: int = 97, hidden: int = 32, inter: int = 64, heads: int = 4,
                     kv_heads: int = 2, seed: int = 0) -> None:
    """A one-layer random Llama checkpoint (config.json + model.safetensors in HF's layout), written
    directly: tests/tiny.make_tiny_hf builds the same through transformers, seconds slower."""
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    hd = hidden // heads

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.15).contiguous()
    pre = "model.layers.0."
    sd = {"model.embed_tokens.weight": r(vocab, hidden), "model.norm.weight": torch.ones(hidden),
          "lm_head.weight": r(vocab, hidden), pre + "input_layernorm.weight": torch.ones(hidden),
          pre + "post_attention_layernorm.weight": torch.ones(hidden),
          pre + "self_attn.q_proj.weight": r(heads * hd, hidden),
          pre + "self_attn.k_proj.weight": r(kv_heads * hd, hidden),
          pre + "self_attn.v_proj.weight": r(kv_heads * hd, hidden),
          pre + "self_attn.o_proj.weight": r(hidden, heads * hd),
          pre + "mlp.gate_proj.weight": r(inter, hidden), pre + "mlp.up_proj.weight": r(inter, hidden),
          pre + "mlp.down_proj.weight": r(hidden, inter)}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hd, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0}))
