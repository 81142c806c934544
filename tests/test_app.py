"""The Gradio app through gradio_client: a short live run on the tiny-random stack, scrubbing,
stopping, and every bad input answered by a message in the status box."""
from __future__ import annotations

import ast
import json
import os
import re
import time
from pathlib import Path

import pytest

from hierviz.retime import TIME_SCALES

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

gradio_client = pytest.importorskip("gradio_client")

# prompt, stack, max_new, temperature, E_M depth/top-k/size, min draft, E_T depth/top-k/size, with AR
SMALL = ["hello there", "tiny-random", 6, 0.0, 2, 4, 8, 3, 2, 4, 8, False]


@pytest.fixture(scope="module", autouse=True)
def generous_rate_limits():
    """Every run here comes from this machine's address, after the rest of the suite's: the
    per-address limit (tests/test_hardening.py tests it) must not refuse them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HIERVIZ_RUNS_PER_ADDRESS", "6000")
        yield


@pytest.fixture(scope="module")
def app_url():
    from hierviz.app.check import start_app
    url, demo = start_app("tiny-random")
    yield url
    demo.close()


@pytest.fixture()
def client(app_url):
    return gradio_client.Client(app_url, verbose=False)


def status_of(outputs) -> str:
    return outputs[0]


def test_live_run_streams_every_panel(client):
    job = client.submit(*SMALL, api_name="/run")
    statuses = []
    for out in job:
        statuses.append(status_of(out))
    final = job.outputs()[-1]
    assert "Done." in status_of(final), statuses
    # progress: the method k of n and tokens done of asked (SMALL asks 6 tokens of two methods)
    assert any("Running HierSpec (method 1 of 2), step" in s and "of 6 tokens" in s for s in statuses), statuses
    assert any("Running EAGLE-2 (method 2 of 2)" in s for s in statuses)
    assert "Traceback" not in "".join(statuses)
    assert "paused while this page drew" not in status_of(final)   # an API client never reports drawing
    status, download, step, view, tree, seq, verdict, output, latency, stats, time_scale, crossover, headline, side = final
    assert side == ""                  # the side-by-side panel is built only when the visitor asks for it
    assert time_scale["value"] in TIME_SCALES and crossover["type"] == "plotly"
    # the first screen's speed line (on the tiny random stack either method may be the faster)
    assert ("HierSpec is" in headline or "faster than HierSpec" in headline) and "Over the first" in headline
    fig = json.loads(tree["plot"])
    assert tree["type"] == "plotly" and fig["layout"]["annotations"]          # node chips
    assert "Sequence draft" in seq and "hv-chip" in seq
    assert "Target T&#x27;s verdict" in verdict or "Target T's verdict" in verdict
    assert "Output:" in output
    lat = json.loads(latency["plot"])
    assert any(t["type"] == "bar" for t in lat["data"])
    assert "HierSpec" in stats and "EAGLE-2" in stats and "tokens / s" in stats
    assert step["maximum"] >= 1 and view["choices"][0][1] == "hierspec"
    runs = json.loads(open(download["value"]["path"] if isinstance(download.get("value"), dict) else download["value"]).read())
    assert [r["meta"]["method"] for r in runs["runs"]] == ["hierspec", "eagle2"]
    # scrub back to the first step (same client = same session state)
    scrub = client.predict(1, api_name="/scrub")
    assert json.loads(scrub[0]["plot"])["layout"]["title"]["text"] == "Step 1: prefill"
    assert "prefill" in scrub[1]
    scrub = client.predict(2, api_name="/scrub")
    assert "Step 2:" in json.loads(scrub[0]["plot"])["layout"]["title"]["text"]


def long_run_under_way(client):
    """A 200-token run of every method, once it is running HierSpec."""
    job = client.submit("hello", "tiny-random", 200, 0.0, 2, 4, 8, 3, 2, 4, 8, True, api_name="/run")
    t0 = time.time()
    while time.time() - t0 < 60:
        outs = job.outputs()
        if outs and "Running HierSpec" in status_of(outs[-1]):
            break
        time.sleep(0.2)
    return job


def test_stop_ends_the_run_cleanly(client):
    job = long_run_under_way(client)
    assert "Stopping" in client.predict(api_name="/stop")
    final = job.result(timeout=120)
    assert "Stopped." in status_of(final)
    runs = [c[1] for c in final[3]["choices"]]
    assert runs == ["hierspec"]              # the EAGLE-2 and AR runs never started


def test_loading_a_trace_stops_a_live_run_which_then_sends_nothing(client):
    """A trace loaded while the visitor's live run is in flight is what their page shows: the run
    stops after the step it is taking and sends no further update (no "Stopped." over the trace),
    the load answers only once the run has ended, and the session holds the trace."""
    job = long_run_under_way(client)
    from hierviz.app.shipped import shipped_traces
    path = next(p for _, p in shipped_traces() if p.endswith("handmade-demo.json"))
    loaded = client.predict(gradio_client.handle_file(path), api_name="/load_trace")
    assert "Loaded handmade-demo.json" in status_of(loaded)
    # the load returned once the run had ended ... (gradio_client hands a job's messages to it in a
    # thread of its own, so an update the server sent before the load's answer may still be on its
    # way into job.outputs(): take the count once it has stopped growing)
    sent, t0 = len(job.outputs()), time.time()
    while time.time() - t0 < 5:
        time.sleep(0.5)
        if len(job.outputs()) == sent:
            break
        sent = len(job.outputs())
    job.result(timeout=120)
    assert job.outputs()[sent:] == []              # ... so nothing of it can follow the trace
    assert not any("Stopped" in status_of(o) or "Done" in status_of(o) for o in job.outputs())
    # the session is the trace's (8 steps, its own prompt), not the live run's
    output = client.predict(8, api_name="/scrub")[3]
    assert "Explain speculative decoding" in output and "hello" not in output


def test_progress_says_method_tokens_and_time_left():
    """The status of a live run: method k of n, tokens done of asked, and the time left of the whole
    run from the measured costs and this run's pace; the stages before it say the time spent."""
    from hierviz.app.progress import MethodCost, RunPlan, Timings
    costs = {("s", m, ()): MethodCost(0.0, 0.0, rate) for m, rate in (("hierspec", 0.1), ("eagle2", 0.1), ("ar", 0.25))}
    timings = Timings(load_s={"s": 20.0}, costs=costs)
    plan = RunPlan("s", ["hierspec", "eagle2", "ar"], 41, timings=timings)     # 4 + 4 + 10 s
    text = plan.method_text("hierspec", 11, 1.0, steps=5)          # at the measured pace: 3 + 4 + 10 s left
    assert text.startswith("Running HierSpec (method 1 of 3), step 5: 11 of 41 tokens;") and "about 17 s left" in text
    assert "about 14 s left" in plan.method_text("eagle2", 0, 0.0)
    assert plan.method_text("eagle2", 8, 1.0, steps=3).startswith("Running EAGLE-2 (method 2 of 3), step 3: 8 of 41")
    assert "about 33 s left" in plan.stage_text("Loading the model stack", 20.0, 5.0)    # 15 s of loading, then 18
    assert "cannot be estimated yet" in RunPlan("new", ["ar"], 8, timings=Timings()).stage_text("Warming up", None, 3.0)


@pytest.mark.quiet      # judges wall time: a report after about one second
def test_a_blocking_stage_reports_every_second():
    from hierviz.app import progress
    gen = progress.with_heartbeat(lambda: time.sleep(1.3) or "loaded", lambda elapsed: elapsed)
    reports = []
    with pytest.raises(StopIteration) as end:
        while True:
            reports.append(next(gen))
    assert end.value.value == "loaded" and len(reports) == 1 and 0.9 < reports[0] < 1.3

    done = []
    gen = progress.with_heartbeat(lambda: time.sleep(1.2) or done.append(1), lambda elapsed: elapsed)
    next(gen)
    gen.close()                  # a closed page: the work ends before the device is given back
    assert done == [1]

    def broken() -> None:
        raise ValueError("no such stack")
    with pytest.raises(ValueError, match="no such stack"):
        list(progress.with_heartbeat(broken, lambda elapsed: elapsed))


def test_run_is_disabled_while_a_run_is_in_flight():
    """Run's click disables it, runs /run, then enables it again however the run ended."""
    from hierviz.app import build_app, handlers
    demo = build_app("tiny-random")
    fns = list(demo.fns.values()) if isinstance(demo.fns, dict) else list(demo.fns)
    names = [f.name for f in fns if not f.is_cancel_function]     # Run also stops a replay (below)
    run = names.index("run_live")
    assert names[run - 1] == "run_button_busy" and names[run + 1] == "run_button_ready"
    assert handlers.run_button_busy().interactive is False and handlers.run_button_ready().interactive is True


def tiny_session():
    from hierviz.app.handlers import sorted_runs
    from hierviz.app.session import Session
    from hierviz.app.shipped import shipped_runs, shipped_traces
    path = next(p for _, p in shipped_traces() if "tiny-random" in p)
    return Session(runs=sorted_runs(shipped_runs(path)))


@pytest.mark.parametrize("speed, shown, steps", [(10, 0, 11), (2.5, 9, 2)])
def test_replay_keeps_its_speed(speed, shown, steps):
    """N steps at `speed` steps per second keep that pace (steps shown within 25 % of the run's
    length of their due times, their rendering included) and the replay never ends early; the last
    step, which draws every panel, is judged by the end only. Play resumes after the step on screen."""
    from hierviz.app import handlers as h
    sess = tiny_session()
    assert len(sess.run().steps) == 11
    # what a step costs to draw here (all its panels): a step is shown after it is drawn, so it is
    # judged with that much more slack, and a machine that cannot draw a step in two thirds of the
    # period is judged at the pace it can keep (if drawing were added to the wait, every step would
    # still fall one drawing further behind)
    render = []
    for i in range(3):
        t = time.monotonic()
        h.inspect_step(sess, sess.run(), i)
        h.panel_updates(sess, i, None)
        render.append(time.monotonic() - t)
    draw = max(render)
    speed = min(speed, 1 / (1.5 * draw))
    slack = 0.25 * steps / speed

    def one_replay() -> tuple[list, list[float]]:
        t0 = time.monotonic()
        outs, shown_at = [], []
        for o in h.replay(sess, speed, shown):
            outs.append(o)
            shown_at.append(time.monotonic() - t0)
        return outs, shown_at

    def holds_pace(shown_at: list[float]) -> bool:
        # step k is due at k / speed: never shown early, and late by less than the slack on the median
        # step (due times are fixed, so one slow render on a busy machine does not delay the rest)
        late = [shown_at[k] - k / speed for k in range(steps - 1)] or [0.0]
        return (min(late) >= 0 and sorted(late)[len(late) // 2] <= slack + draw
                and 0.95 * steps / speed <= shown_at[-1] <= steps / speed + max(slack, 1.0))

    # at 10 steps a second the whole replay lasts 1.1 s, so one stall of the machine (the other test
    # worker) can make it late: up to three replays, one of which must hold the pace. Rendering
    # added to the wait would make every one late
    tries = []
    for _ in range(3):
        outs, shown_at = one_replay()
        assert len(outs) == steps + 1 and "Replay finished" in outs[-1][0]
        assert [o[1].value for o in outs[:-1]] == list(range(shown + 1, shown + steps + 1))
        tries.append([round(t - k / speed, 3) for k, t in enumerate(shown_at)])
        if holds_pace(shown_at):
            return
    raise AssertionError(f"no replay held {speed:.1f} steps/s (lateness per step, s): {tries}; draw {draw:.3f} s")


def test_a_stopped_replay_never_moves_the_step():
    """Pause, a step button, the slider, another run, a new trace or a live run stop a replay: a
    step it was waiting to show (the cancelled event's generator may still wake up) does not land
    in the session, and the replay ends there."""
    from hierviz.app import handlers as h
    for stop in (lambda s: h.replay_stopped(s), lambda s: h.next_step(s, 2), lambda s: h.scrub(s, 5),
                 lambda s: h.switch_view(s, "eagle2"), lambda s: s.carried(runs=[])):
        sess = tiny_session()
        replay = h.replay(sess, 1000, 0)
        next(replay)
        assert sess.step == 0
        stop(sess)
        after = (sess.view, sess.step)
        assert list(replay) == []                  # no further step, no "finished" message
        assert (sess.view, sess.step) == after
    sess = tiny_session()                          # an unstopped replay still runs to its end
    assert len(list(h.replay(sess, 1000, 8))) == 4 and sess.step == 10


def test_every_control_that_moves_the_step_cancels_the_replay():
    """On the page, the replay's event is cancelled by Pause and by every control that changes the
    step or what is shown, so none of its updates overwrites what the visitor chose."""
    from hierviz.app import build_app
    demo = build_app("tiny-random")
    fns = demo.fns.items() if isinstance(demo.fns, dict) else enumerate(demo.fns)
    fns = list(fns)
    play = next(k for k, f in fns if f.name == "replay")
    cancelling = {(demo.blocks[cid].elem_id, event) for _, f in fns if f.is_cancel_function and play in f.cancels
                  for cid, event in f.targets}
    assert cancelling == {("hv-pause", "click"), ("hv-prev", "click"), ("hv-next", "click"), ("hv-step", "input"),
                          ("hv-view", "input"), ("hv-trace-pick", "input"), ("hv-upload", "upload"),
                          ("hv-run", "click"), ("hv-prompt", "submit")}


def test_step_buttons_and_replay_bounds():
    from hierviz.app import handlers as h
    sess = tiny_session()
    assert h.next_step(sess, 3)[0].value == 4 and sess.step == 3
    assert h.previous_step(sess, 1)[0].value == 1           # stays at the first step
    assert h.next_step(sess, 11)[0].value == 11             # and at the last
    assert h.replay_start(sess.run(), 11) == 0                 # at the end, Play starts over
    assert h.replay_start(sess.run(), "x") == 0
    out = list(h.replay(sess, 1000, 10))                       # the speed is capped at MAX_SPEED
    assert len(out) == 2


@pytest.mark.parametrize("args, message", [
    (["   "] + SMALL[1:], "prompt is empty"),
    (SMALL[:4] + [0] + SMALL[5:], "E_M tree depth must be between 1 and 32"),
    (SMALL[:6] + [500] + SMALL[7:], "exceeds"),
    (SMALL[:4] + [None] + SMALL[5:], "E_M tree depth must be a whole number, got None"),
    (SMALL[:2] + [2.5] + SMALL[3:], "Check the settings: Max new tokens must be a whole number, got 2.5"),
])
def test_bad_run_inputs_show_a_message(client, args, message):
    final = client.predict(*args, api_name="/run")
    assert "hv-status-error" in status_of(final) and message in status_of(final)


@pytest.mark.parametrize("stack", ["no-such-stack", "/etc/passwd", "../../../../etc/passwd",
                                   pytest.param("paper-llama3-70b", marks=pytest.mark.skipif(
                                       __import__("torch").cuda.is_available(), reason="a GPU offers hub presets"))])
def test_a_stack_outside_the_list_is_refused_before_anything_is_read(client, stack):
    """The stack box is an allow-list (hub presets only on a GPU): a path or another name never
    reaches the loader, and the answer names nothing of the server's."""
    with pytest.raises(gradio_client.exceptions.AppError, match="not in the list of choices") as e:
        client.predict("hi", stack, *SMALL[2:], api_name="/run")
    assert "root" not in str(e.value) and "No such file" not in str(e.value)


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ('{"version": 99, "meta": {}, "steps": []}', "unsupported trace schema version"),
    ('{"version": 1, "meta": {"method": "hierspec"}, "steps": [{"index": 0}]}', "missing field"),
    ("[1, 2, 3]", "must be a JSON object"),
])
def test_malformed_trace_upload_shows_the_error(client, tmp_path, content, message):
    f = tmp_path / "bad.json"
    f.write_text(content)
    out = client.predict(gradio_client.handle_file(str(f)), api_name="/load_trace")
    assert "Could not read bad.json" in status_of(out) and message in status_of(out)


def test_good_trace_upload_renders_panels(client, tmp_path):
    from hierviz.trace import save_comparison
    from hierviz.viz import sample
    f = tmp_path / "good.json"
    save_comparison(sample.comparison(0, 24), f)
    out = client.predict(gradio_client.handle_file(str(f)), api_name="/load_trace")
    assert "Loaded good.json" in status_of(out)
    assert "hv-chip" in out[5] and "HierSpec" in out[9]
    assert out[2]["maximum"] > 1
    prompt = sample.comparison(0, 24)[0].meta["prompt"]
    shown = out[10].get("value") if isinstance(out[10], dict) else out[10]     # the prompt box (after the panels)
    assert prompt and shown == prompt          # the prompt box shows the loaded trace's prompt


def test_sessions_do_not_share_state(app_url, tmp_path):
    from hierviz.trace import save_comparison
    from hierviz.viz import sample
    a = gradio_client.Client(app_url, verbose=False)
    b = gradio_client.Client(app_url, verbose=False)
    f = tmp_path / "a.json"
    save_comparison(sample.comparison(0, 24), f)
    a.predict(gradio_client.handle_file(str(f)), api_name="/load_trace")
    assert "Step 2:" in json.loads(a.predict(2, api_name="/scrub")[0]["plot"])["layout"]["title"]["text"]
    # b never loaded anything: its panels stay as they were (a skip), never a's trace
    assert "Step 2" not in str(b.predict(2, api_name="/scrub"))


def test_runs_wait_in_the_apps_line_not_in_gradios_queue():
    """Live runs start at once (no Gradio concurrency limit) and wait in the app's device line,
    which has its own bound; Gradio's queue bound is far above it, so the light events (scrub,
    loads, Stop) are never refused because runs wait. The other tabs' device work keeps one
    Gradio worker and takes its turn in the same line."""
    import inspect

    from hierviz.app import build_app, layout, profile_tab, whatif_tab
    from hierviz.config import options
    demo = build_app("tiny-random")
    fns = list(demo.fns.values()) if isinstance(demo.fns, dict) else list(demo.fns)
    runs = [f for f in fns if f.name == "run_live"]
    assert runs and all(f.concurrency_limit is None for f in runs)
    assert demo._queue.max_size == layout.EVENT_BACKLOG > 10 * options().queue_size
    others = [f for f in fns if f.name in ("live_run", "measure_here")]
    assert len(others) == 2 and all(f.concurrency_id == "gpu" and f.concurrency_limit == 1 for f in others)
    for fn in (whatif_tab.live_run, profile_tab.measure_profile):
        assert "LINE.hold(" in inspect.getsource(fn)
    assert all(f.concurrency_id != "gpu" for f in fns if f.name not in ("measure_here", "live_run"))


def test_tabs_are_pluggable():
    import gradio as gr

    from hierviz.app import build_app, layout, register_tab
    register_tab("Extra", lambda: gr.Markdown("a plug-in tab"))
    try:
        demo = build_app("tiny-random")
        labels = [b.label for b in demo.blocks.values() if isinstance(b, gr.Tab)]
        assert labels == ["Visualizer", "Profile", "What-if", "Analyse", "Extra", "How it works"]
    finally:
        layout.TAB_BUILDERS.clear()


class _Req:
    def __init__(self, session: str, host: str) -> None:
        self.session_hash = session
        self.client = type("Client", (), {"host": host})()


def test_render_pacing_waits_only_for_pages_that_report(monkeypatch):
    """A run waits for a page to draw each update only once that page has reported drawing one (API
    clients never do), and by default only for a page on this machine, whose drawing competes with
    the engine for the cores."""
    from hierviz.app.handlers import forget_session, report_rendered
    from hierviz.app.live import live_pace_mode
    from hierviz.app.pacing import pace_mode, should_pace
    from hierviz.app.session import SESSIONS
    from hierviz.config import ConfigError
    local, remote, silent = _Req("pace-local", "127.0.0.1"), _Req("pace-remote", "10.1.2.3"), _Req("pace-api", "::1")
    monkeypatch.delenv("HIERVIZ_UI_PACE", raising=False)
    assert pace_mode() == "auto"
    for r in (local, remote, silent):
        assert not should_pace(r)
    report_rendered(local)
    report_rendered(remote)
    assert SESSIONS.flags("pace-local").rendered.is_set()
    assert should_pace(local) and not should_pace(remote) and not should_pace(silent)
    assert should_pace(remote, "on") and not should_pace(silent, "on")
    assert not should_pace(local, "off")
    forget_session(local)                          # the page closed
    assert not should_pace(local) and "pace-local" not in SESSIONS
    monkeypatch.setenv("HIERVIZ_UI_PACE", "sometimes")
    with pytest.raises(ConfigError, match="HIERVIZ_UI_PACE must be auto, on or off, not 'sometimes'"):
        pace_mode()
    assert live_pace_mode() == "off"               # a bad value does not stop a run: it is not paced


def test_app_check_drives_a_live_comparison(tmp_path, capsys) -> None:
    """`python -m hierviz app-check`: starts the app, runs one comparison through /run, keeps the
    downloaded trace and reports that every method equals AR. On a stack with an EAGLE-3 head on
    T the comparison holds HierSpec, EAGLE-2, EAGLE-3 and AR."""
    from hierviz.app import check as app_check
    from hierviz.trace import comparison_from_json
    out = tmp_path / "trace.json"
    assert app_check.main(["--stack", "tiny-random-eagle3", "--max-new-tokens", "8", "--device", "cpu",
                           "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["identical_to_ar"] == {"hierspec": True, "eagle2": True, "eagle3": True} and report["ar_tokens"] == 8
    runs = comparison_from_json(out.read_bytes())
    assert [t.meta["method"] for t in runs] == ["hierspec", "eagle2", "eagle3", "ar"]
    assert runs[2].meta["head_types"]["e_t3"] == "eagle3"


APP_DIR = Path(__file__).resolve().parent.parent / "hierviz" / "app"


def _app_sources() -> dict[str, ast.Module]:
    """hierviz.app's modules by dotted name, parsed."""
    out = {}
    for p in sorted(APP_DIR.glob("*.py")):
        name = "hierviz.app" if p.stem == "__init__" else f"hierviz.app.{p.stem}"
        out[name] = ast.parse(p.read_text(encoding="utf-8"), str(p))
    return out


def _imports(tree: ast.Module, modules: set[str]) -> set[str]:
    """The hierviz.app modules a module imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module in modules:
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules
            out |= subs or {node.module}
    return out


def test_app_modules_import_without_cycles():
    """No hierviz.app module imports itself back through others (a package's submodules count as
    their own modules; importing one runs hierviz/app/__init__.py first, which is not a cycle)."""
    trees = _app_sources()
    graph = {m: _imports(t, set(trees)) - {m} for m, t in trees.items()}
    assert graph["hierviz.app.layout"] and graph["hierviz.app.handlers"]   # the parse sees the imports

    def cycle_from(m: str, path: list[str]) -> list[str] | None:
        for n in sorted(graph[m]):
            if n in path:
                return path[path.index(n):] + [n]
            found = cycle_from(n, path + [n])
            if found:
                return found
        return None

    for m in graph:
        assert cycle_from(m, [m]) is None, f"import cycle: {' -> '.join(cycle_from(m, [m]))}"


def test_app_code_stays_readable():
    """No function over 80 lines, no private name imported from another module, the engine
    imported like any module, and HIERVIZ_* options only through hierviz.config."""
    for name, tree in _app_sources().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                assert n <= 80, f"{name}.{node.name} is {n} lines long"
            if isinstance(node, ast.ImportFrom):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{name} imports private {private} from {node.module}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(m.startswith("importlib") for m in mods), f"{name} imports through importlib"
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"HIERVIZ_\w+", node.value):
                raise AssertionError(f"{name} names {node.value}: read options through hierviz.config.options()")


def test_start_up_warm_up_leaves_the_first_run_warm() -> None:
    """app.py warms the default stack at start-up: afterwards the page's default settings find it
    warm (no warm-up on the first click) and the measured times give the first ETA; a stack that
    cannot load is logged, never raised (the server keeps serving)."""
    from hierviz.app.live import prewarm
    from hierviz.app.progress import TIMINGS, settings_key
    from hierviz.app.stacks import get_stack
    from hierviz.settings import default_settings
    from hierviz.engine import is_warm
    assert prewarm("tiny-random")
    assert is_warm(get_stack("tiny-random"), ["hierspec", "eagle2", "ar"], default_settings())
    assert "tiny-random" in TIMINGS.load_s
    # and each method's costs with those settings, for the first run's time left
    assert all(TIMINGS.costs.get(("tiny-random", m, settings_key(default_settings()))) for m in ("hierspec", "eagle2", "ar"))
    assert not prewarm("no-such-stack")
