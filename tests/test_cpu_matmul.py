"""The CPU dense product picks its fastest form per shape on first use (hierviz.quant.w4.matmul_nt):
every form computes x @ w^T, the choice is made once per (N, K, dtype, row bucket), a form must beat
the plain one clearly to be chosen, and HIERVIZ_CPU_MATMUL fixes it."""
from __future__ import annotations

import time

import pytest
import torch

from hierviz.quant import w4


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(w4, "_CPU_FORMS", {})
    monkeypatch.delenv("HIERVIZ_CPU_MATMUL", raising=False)


@pytest.mark.parametrize("setting", ["auto", "plain", "nt"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, 128, 200])
def test_every_form_is_the_product(setting, rows, monkeypatch) -> None:
    monkeypatch.setenv("HIERVIZ_CPU_MATMUL", setting)
    torch.manual_seed(rows)
    w = torch.randn(96, 64)
    x = torch.randn(1, rows, 64)
    y = w4.matmul_nt(x, w)
    assert y.shape == (1, rows, 96)
    torch.testing.assert_close(y, x @ w.t(), rtol=1e-5, atol=1e-5)


def _slowed(slow: set[str], monkeypatch) -> list[str]:
    """Make the named forms take 3 ms longer; returns the log of forms run."""
    real, log = w4._form_product, []

    def product(form, x2, w):
        log.append(form)
        if form in slow:
            time.sleep(0.003)
        return real(form, x2, w)
    monkeypatch.setattr(w4, "_form_product", product)
    return log


def test_the_fastest_form_is_chosen_once_per_bucket(monkeypatch) -> None:
    log = _slowed({"plain"}, monkeypatch)
    w = torch.randn(96, 64)
    assert w4.cpu_matmul_form(3, w) == "nt"
    n = len(log)
    assert set(log) == {"plain", "nt"} and n == 6           # best of three, interleaved
    assert w4.cpu_matmul_form(4, w) == "nt" and len(log) == n  # rows 3 and 4 share bucket 4
    assert w4.cpu_matmul_form(5, w) == "nt" and len(log) == 2 * n   # bucket 8: timed anew
    assert w4.cpu_matmul_form(1, w) in ("nt", "nt2")          # one row: gemv or padded to two
    assert w4.cpu_matmul_form(3, torch.randn(96, 32)) == "nt"  # another shape: timed anew


def test_plain_stays_unless_clearly_beaten(monkeypatch) -> None:
    _slowed({"nt", "nt2"}, monkeypatch)
    assert w4.cpu_matmul_form(2, torch.randn(96, 64)) == "plain"
    monkeypatch.setattr(w4, "_FORM_MARGIN", 0.0)         # nothing can beat plain by 100 %
    monkeypatch.setattr(w4, "_CPU_FORMS", {})
    _slowed({"plain"}, monkeypatch)
    assert w4.cpu_matmul_form(2, torch.randn(96, 64)) == "plain"


def test_setting_fixes_the_form(monkeypatch) -> None:
    log = _slowed(set(), monkeypatch)
    monkeypatch.setenv("HIERVIZ_CPU_MATMUL", "nt")
    w = torch.randn(96, 64)
    assert (w4.cpu_matmul_form(1, w), w4.cpu_matmul_form(7, w)) == ("nt2", "nt")
    monkeypatch.setenv("HIERVIZ_CPU_MATMUL", "plain")
    assert w4.cpu_matmul_form(7, w) == "plain" and log == [] and w4._CPU_FORMS == {}
    monkeypatch.setenv("HIERVIZ_CPU_MATMUL", "fast")
    with pytest.raises(ValueError, match="auto, plain or nt"):
        w4.matmul_nt(torch.randn(2, 64), w)
