"""StageTimer: wall time on the CPU; on CUDA, CUDA events read once per round (checked here with
a stand-in Event class, since tests never need a GPU) and the no-sync mode."""
from __future__ import annotations

import time

import pytest
import torch

from hierviz.decoding import decoders
from hierviz.decoding.decoders import StageTimer


def _ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def test_cpu_wall_time_per_stage() -> None:
    """Each stage's time lies between the time it slept and the time measured around it (both in
    ms; the small slack below a sleep is clock granularity): a unit slip or a stage counted twice
    falls outside."""
    outer = time.perf_counter()
    t = StageTimer(torch.device("cpu"))
    a = time.perf_counter()
    with t.stage("draft"):
        time.sleep(0.02)
    with t.stage("draft"):
        time.sleep(0.01)
    draft_ms = _ms_since(a)
    time.sleep(0.005)
    b = time.perf_counter()
    with t.stage("target_verify"):
        time.sleep(0.01)
    verify_ms = _ms_since(b)
    out = t.finish()
    total_ms = _ms_since(outer)
    assert set(out) == {"draft", "target_verify", "overhead"}
    assert 29.9 <= out["draft"] <= draft_ms
    assert 9.9 <= out["target_verify"] <= verify_ms
    assert 4.9 <= out["overhead"] and 44.9 <= sum(out.values()) <= total_ms


class FakeEvent:
    """Records host time; elapsed_time like torch.cuda.Event (ms). Counts synchronize calls."""
    syncs = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.t = None

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        FakeEvent.syncs += 1

    def elapsed_time(self, other: "FakeEvent") -> float:
        return (other.t - self.t) * 1000.0


@pytest.fixture
def fake_cuda(monkeypatch):
    FakeEvent.syncs = 0
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    device_syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: device_syncs.append(1))
    return device_syncs


def test_cuda_events_one_sync_per_round(fake_cuda) -> None:
    outer = time.perf_counter()
    t = StageTimer(torch.device("cuda"))
    assert t.use_events
    a = time.perf_counter()
    with t.stage("intermediate_verify"):
        time.sleep(0.01)
    iv_ms = _ms_since(a)
    b = time.perf_counter()
    with t.stage("target_verify"):
        time.sleep(0.02)
    tv_ms = _ms_since(b)
    out = t.finish()
    total_ms = _ms_since(outer)
    assert 9.9 <= out["intermediate_verify"] <= iv_ms and 19.9 <= out["target_verify"] <= tv_ms
    assert 29.9 <= sum(out.values()) <= total_ms
    assert FakeEvent.syncs == 1 and fake_cuda == []       # no device-wide sync inside the round


def test_no_sync_mode_uses_host_time(fake_cuda, monkeypatch) -> None:
    monkeypatch.setattr(StageTimer, "sync", False)
    t = StageTimer(torch.device("cuda"))
    assert not t.use_events
    a = time.perf_counter()
    with t.stage("draft"):
        time.sleep(0.01)
    draft_ms = _ms_since(a)
    assert 9.9 <= t.finish()["draft"] <= draft_ms and FakeEvent.syncs == 0 and fake_cuda == []


def test_sync_fallback(fake_cuda, monkeypatch) -> None:
    monkeypatch.setattr(StageTimer, "events", False)
    t = StageTimer(torch.device("cuda"))
    with t.stage("draft"):
        pass
    t.finish()
    assert len(fake_cuda) == 4 and decoders.StageTimer is StageTimer
