"""The what-if's EAGLE-3 rows at tiny shapes on the CPU: without --head the default run reports AR,
EAGLE-2, EAGLE-3, HierSpec and HierSpec with an EAGLE-3 E_M; the EAGLE-3-drafted trees draw from
the shipped EAGLE-3 acceptance record (or a planted one), every row names its acceptance source in
the JSON, the markdown, the chart and the app's table; the shipped records hold the published
figures and the rates their stated rule derives from them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hierviz import methods
from hierviz.measure.acceptance_import import load_acceptance
from hierviz.measure.acceptance_record import expected_accepted
from hierviz.measure.whatif import build_models, main, rows_features, tiny_config, variant_models
from hierviz.measure.whatif_acceptance import (ACCEPTANCE_DIR, DEFAULT_RATES, EAGLE3_RECORD, constant_rate,
                                               scaled_shape_rates)
from tests.test_whatif import FAST, _keep_threads  # noqa: F401  (the fixture gives torch's threads back)

EAGLE2_RECORD = ACCEPTANCE_DIR / "eagle2-arxiv-2503.01840.json"
VARIANT = next(iter(methods.VARIANTS))      # HierSpec with an EAGLE-3 E_M


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("whatif")
    n = torch.get_num_threads()
    try:
        assert main(FAST + ["--max-new-tokens", "10", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(n)
    return json.loads((out / "whatif.json").read_text()), out


def _record(tmp_path: Path, rate: float) -> Path:
    p = tmp_path / f"planted-{rate}.json"
    p.write_text(json.dumps({"schema": "hierviz.acceptance-record/1", "source": f"planted record at rate {rate}",
                             "levels": {"target": {"rates": [rate], "tree_depth": 8},
                                        "intermediate": {"rates": [rate], "tree_depth": 8}}}))
    return p


def test_default_run_has_the_five_rows_each_naming_its_acceptance(default_run) -> None:
    info, out = default_run
    assert list(info["methods"]) == ["ar", "eagle2", "eagle3", "hierspec", VARIANT]
    assert methods.label(VARIANT) == "HierSpec (EAGLE-3 E_M)" and methods.row_method(VARIANT) == "hierspec"
    assert info["head"] == "eagle2" and info["heads"] == ["eagle2", "eagle3"]
    src = {m: r["acceptance_source"] for m, r in info["methods"].items()}
    assert src["eagle2"] == src["hierspec"] == "assumed default rates"
    for row, tau in (("eagle3", "5.63 for T's trees"), (VARIANT, "6.13 for M's trees")):
        assert "arXiv:2503.01840" in src[row] and tau in src[row] and EAGLE3_RECORD.name in src[row]
    record = json.loads(EAGLE3_RECORD.read_text())
    assert info["acceptance"]["eagle3"]["rates"] == {k: v["rates"] for k, v in record["levels"].items()}
    assert info["methods"][VARIANT]["forwards"]["e_m"] > 0 and info["methods"]["eagle3"]["forwards"]["e_t3"] > 0
    for key in ("hierspec_vs_eagle2", "hierspec_vs_eagle3", f"{VARIANT}_vs_eagle3"):
        assert info[key] > 0
    md = (out / "whatif.md").read_text()
    assert f"| {VARIANT} |" in md and "| eagle3 |" in md and "arXiv:2503.01840" in md
    assert "arXiv:2503.01840" in (out / "whatif.html").read_text()


def test_the_app_and_the_charts_show_the_rows_and_the_record(default_run) -> None:
    from hierviz.app.whatif_tab import summary_markdown
    from hierviz.viz.whatif_fig import acceptance_label, figures
    info, _ = default_run
    table = summary_markdown(info)
    assert "| HierSpec (E3 E_M) |" in table and "| EAGLE-3 |" in table
    assert "HierSpec / EAGLE-3:" in table and "Acceptance per row" in table and "arXiv:2503.01840" in table
    assert "arXiv:2503.01840" in acceptance_label(info)
    bars = figures(info)[0].data[0]
    assert list(bars.x) == [methods.label(m) for m in info["methods"]]
    assert bars.marker.color[-1] == methods.VARIANTS[VARIANT].color
    assert "arXiv:2503.01840" in bars.customdata[2][2]


@pytest.mark.parametrize("rate", [1.0, 0.0])
def test_eagle3_trees_draw_from_the_record(rate: float, tmp_path: Path) -> None:
    """A planted record at rate 1 accepts every EAGLE-3 tree to its full depth, at rate 0 none;
    EAGLE-2's trees keep the default rates; the outputs name the planted source."""
    assert main(FAST + ["--eagle3-acceptance", str(_record(tmp_path, rate)), "--max-new-tokens", "12",
                        "--methods", f"ar,eagle2,eagle3,hierspec,{VARIANT}", "--out", str(tmp_path)]) == 0
    info = json.loads((tmp_path / "whatif.json").read_text())
    s, ms = info["settings"], info["methods"]
    want_t, want_m = (s["t_depth"], s["m_depth"]) if rate else (0, 0)
    assert all(r["trees"] == [want_t] for r in ms["eagle3"]["accepted"])
    assert all(n == want_m for r in ms[VARIANT]["accepted"] for n in r["trees"])
    assert any(0 < n < s["m_depth"] for r in ms["hierspec"]["accepted"] for n in r["trees"])   # default rates
    assert f"planted record at rate {rate}" in ms["eagle3"]["acceptance_source"]
    assert f"planted record at rate {rate}" in (tmp_path / "whatif.md").read_text()


def test_an_explicit_acceptance_holds_for_every_tree_unless_a_record_is_named(tmp_path: Path) -> None:
    assert main(FAST + ["--acceptance-rates", "1.0", "--methods", "ar,eagle3", "--max-new-tokens", "8",
                        "--out", str(tmp_path / "given")]) == 0
    info = json.loads((tmp_path / "given" / "whatif.json").read_text())
    assert "eagle3" not in info["acceptance"]
    assert info["methods"]["eagle3"]["acceptance_source"] == "given rates (--acceptance-rates)"
    assert main(FAST + ["--eagle3-acceptance", "none", "--methods", "ar,eagle3", "--max-new-tokens", "8",
                        "--out", str(tmp_path / "none")]) == 0
    info = json.loads((tmp_path / "none" / "whatif.json").read_text())
    assert info["methods"]["eagle3"]["acceptance_source"] == "assumed default rates"


def test_the_eagle2_counterpart_record_imports_as_both_levels(tmp_path: Path) -> None:
    """--acceptance-import of the same paper's EAGLE-2 record: its 70B level drives T's trees, its
    8B level M's; the import names the publication."""
    record = json.loads(EAGLE2_RECORD.read_text())["levels"]
    assert main(FAST + ["--acceptance-import", str(EAGLE2_RECORD), "--methods", "ar,eagle2,hierspec",
                        "--max-new-tokens", "8", "--out", str(tmp_path)]) == 0
    acc = json.loads((tmp_path / "whatif.json").read_text())["acceptance"]
    assert acc["rates"] == pytest.approx(record["target"]["rates"], abs=1e-6)
    assert acc["m_rates"] == pytest.approx(record["intermediate"]["rates"], abs=1e-6)
    assert "arXiv:2503.01840" in acc["imported"]["citation"] and acc["imported"]["format"] == "acceptance-record"


@pytest.mark.parametrize("path, rule, depth, taus", [
    (EAGLE3_RECORD, "flat", 8, {"target": 5.63, "intermediate": 6.13}),
    (EAGLE2_RECORD, "default shape", 6, {"target": 3.67, "intermediate": 4.05}),
])
def test_the_shipped_records_hold_the_published_figures_and_their_derivation(path, rule, depth, taus) -> None:
    """Table 1 of arXiv:2503.01840 (MT-bench, temperature 0: LLaMA-Instruct 3.3 70B at T, 3.1 8B
    at M) and the paper's tree depths; each level's rates accept tau - 1 draft tokens over that
    depth, by the rule the record states."""
    raw = json.loads(path.read_text())
    assert "arXiv:2503.01840" in raw["source"] and raw["temperature"] == 0 and raw["benchmark"] == "MT-bench"
    imp = load_acceptance(path)
    assert imp.source_format == "acceptance-record" and imp.citation == raw["source"] and imp.steps == 0
    for level, tau in taus.items():
        lv = raw["levels"][level]
        assert lv["published_tau"] == tau and lv["tree_depth"] == depth
        assert expected_accepted(lv["rates"], depth) == pytest.approx(tau - 1, abs=1e-4)
        want = ([constant_rate(tau - 1, depth)] * depth if rule == "flat"
                else scaled_shape_rates(DEFAULT_RATES, tau - 1, depth))
        assert lv["rates"] == pytest.approx(want, abs=1e-6)
        assert imp.levels[level].reported_mean_length == tau


def test_each_row_times_only_its_own_feature_rows() -> None:
    """Both head types on one target: EAGLE-2 and AR run with no feature rows, EAGLE-3 with its
    head's, the variant's M with its EAGLE-3 E_M's; afterwards the bases hand out them all again."""
    models = build_models(tiny_config(True), tiny_config(False), "cpu", torch.float32, "reference", head=None)
    variant = variant_models(models, VARIANT, 0)
    t, m = models.target, models.intermediate
    union_t, union_m = t.feature_layers, m.feature_layers
    assert union_t == models.e_t3.feature_layers and union_m == variant.e_m.feature_layers
    for stack, row, want_t, want_m in ((models, "ar", (), ()), (models, "eagle2", (), ()),
                                       (models, "eagle3", union_t, ()), (models, "hierspec", (), ()),
                                       (variant, VARIANT, (), union_m)):
        with rows_features(stack, row):
            assert (t.feature_layers, m.feature_layers) == (want_t, want_m)
    assert (t.feature_layers, m.feature_layers) == (union_t, union_m)
    assert len({id(p) for p in t.runner_pools.values()}) == len(t.runner_pools) == 2


def test_exact_mode_with_both_head_types(tmp_path: Path) -> None:
    """--exact without --head: EAGLE-2 and EAGLE-3 on one target (carrying EAGLE-3's feature rows)
    and HierSpec all equal AR, steered through their heads."""
    assert main(["--exact", *FAST, "--max-new-tokens", "16", "--methods", "ar,eagle2,eagle3,hierspec",
                 "--exact-trees", "paper", "--exact-variants", "seeded", "--out", str(tmp_path)]) == 0
    info = json.loads((tmp_path / "whatif_exact.json").read_text())
    assert info["passed"] and info["heads"] == ["eagle2", "eagle3"]
    assert {r["method"] for r in info["runs"]} == {"eagle2", "eagle3", "hierspec"}
    assert all(r["identical"] and r["tokens_per_round"] > 2 for r in info["runs"])


def test_a_mean_only_eagle3_file_spreads_its_mean_over_each_trees_depth(tmp_path: Path) -> None:
    """An EAGLE answer file knows only the mean accepted length (3 draft tokens a round here): given
    as --eagle3-acceptance, each level gets the one rate whose chain over its own trees' depth
    (E_T's, E_M's) accepts that mean, as --acceptance-import spreads a mean, never a rate over one
    position (which would accept every tree whole)."""
    from tests.test_acceptance_import import DATA
    assert main(FAST + ["--eagle3-acceptance", str(DATA / "eagle_answers.jsonl"), "--max-new-tokens", "8",
                        "--t-depth", "5", "--m-depth", "4", "--methods", f"ar,eagle3,{VARIANT}",
                        "--out", str(tmp_path)]) == 0
    rates = json.loads((tmp_path / "whatif.json").read_text())["acceptance"]["eagle3"]["rates"]
    assert rates["target"] == [pytest.approx(constant_rate(3.0, 5))] and rates["target"][0] < 1
    assert rates["intermediate"] == [pytest.approx(constant_rate(3.0, 4))] and rates["intermediate"][0] < 1
