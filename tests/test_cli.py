"""`python -m hierviz`: one entry for every command; `record` writes a replayable comparison."""
from __future__ import annotations

import pytest

from hierviz import cli


def test_record_warms_up_before_the_recorded_runs(tmp_path, monkeypatch, capsys):
    """`record` writes a loadable three-method trace, and warms the stack up first so the first
    method's timings do not carry the first-call costs (compiles, graph captures)."""
    import hierviz.engine as engine
    from hierviz.trace import comparison_from_json
    calls = []
    real_warm, real_generate = engine.warm_up, engine.generate
    monkeypatch.setattr(engine, "warm_up", lambda *a, **k: (calls.append("warm_up"), real_warm(*a, **k))[1])
    monkeypatch.setattr(engine, "generate", lambda stack, m, *a, **k: (calls.append(m), real_generate(stack, m, *a, **k))[1])
    out = tmp_path / "t.json"
    assert cli.main(["record", "--stack", "tiny-random", "--prompt", "Hi", "--max-new-tokens", "6",
                     "--title", "test", "--out", str(out)]) == 0
    order = ["hierspec", "eagle2", "ar"]        # every method of the tiny stack's comparison
    assert calls[0] == "warm_up" and calls[-3:] == order
    runs = comparison_from_json(out.read_text())
    assert [r.meta["method"] for r in runs] == order and runs[0].meta["title"] == "test"
    assert cli.main(["record", "--stack", "no-such-stack", "--out", str(tmp_path / "x.json")]) == 2
    assert "error:" in capsys.readouterr().err


def test_every_command_answers_help(capsys):
    assert cli.main(["--help"]) == 0
    listed = capsys.readouterr().out
    for name in [*cli.COMMANDS, *cli.DELEGATED]:
        assert f"  {name}" in listed, name
    assert cli.main(["no-such-command"]) == 2


@pytest.mark.parametrize("name", ["generate", "record", "bench", "whatif", "memory", "app-check", "draft-sweep",
                                  "batch-invariance", "synthetic-stack", "w4-sweep", "profile", "kernel-bench", "op-profile", "engine-bench", "endurance"])
def test_each_command_has_its_own_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([name, "--help"])
    assert e.value.code == 0 and f"usage: python -m hierviz {name} " in capsys.readouterr().out


def test_the_drafting_flags_are_one_declaration(capsys):
    """generate, bench and whatif take every drafting setting (hierviz.settings.DRAFT_FLAGS) and
    --trees under the same flags, and the What-if tab rebuilds a command from that same list."""
    from hierviz.app.whatif_tab import command_text
    from hierviz.settings import DRAFT_FLAGS, DecodeSettings
    flags = [f.flag for f in DRAFT_FLAGS] + ["--trees"]
    for name in ("generate", "bench", "whatif"):
        with pytest.raises(SystemExit):
            cli.main([name, "--help"])
        shown = capsys.readouterr().out
        assert all(f"{flag} " in shown for flag in flags), name
    changed = {f.field: getattr(DecodeSettings(), f.field) + 1 for f in DRAFT_FLAGS}
    cmd, verbatim = command_text({"device": "cuda", "tiny": True, "settings": changed, "methods": {"ar": {}}})
    assert not verbatim and all(f"{f.flag} {changed[f.field]}" in cmd for f in DRAFT_FLAGS)
