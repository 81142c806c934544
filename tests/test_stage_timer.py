"""StageTimer: wall time on the CPU; on CUDA, CUDA events read once per round (checked here with
a stand-in Event class, since tests never need a GPU) and the no-sync mode."""
from __future__ import annotations

import time

import pytest
import torch

from hierviz.decoding import decoders
from hierviz.decoding.decoders import StageTimer


def test_cpu_wall_time_per_stage() -> None:
    t = StageTimer(torch.device("cpu"))
    with t.stage("draft"):
        time.sleep(0.02)
    with t.stage("draft"):
        time.sleep(0.01)
    out = t.finish()
    assert out["draft"] >= 29.0 and out["overhead"] >= 0.0


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
    t = StageTimer(torch.device("cuda"))
    assert t.use_events
    with t.stage("intermediate_verify"):
        time.sleep(0.01)
    with t.stage("target_verify"):
        time.sleep(0.02)
    out = t.finish()
    assert out["intermediate_verify"] >= 9.0 and out["target_verify"] >= 19.0
    assert FakeEvent.syncs == 1 and fake_cuda == []       # no device-wide sync inside the round


def test_no_sync_mode_uses_host_time(fake_cuda, monkeypatch) -> None:
    monkeypatch.setattr(StageTimer, "sync", False)
    t = StageTimer(torch.device("cuda"))
    assert not t.use_events
    with t.stage("draft"):
        time.sleep(0.01)
    assert t.finish()["draft"] >= 9.0 and FakeEvent.syncs == 0 and fake_cuda == []


def test_sync_fallback(fake_cuda, monkeypatch) -> None:
    monkeypatch.setattr(StageTimer, "events", False)
    t = StageTimer(torch.device("cuda"))
    with t.stage("draft"):
        pass
    t.finish()
    assert len(fake_cuda) == 4 and decoders.StageTimer is StageTimer
