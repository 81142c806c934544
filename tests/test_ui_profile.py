"""The Profile tab shows the shipped H200 recordings and explains itself on a machine without a GPU."""
import pytest

from hierviz.app.profile_tab import measure_profile, recorded_profiles, show_profile


def test_shipped_profiles_render():
    files = recorded_profiles()
    assert any("llama3-70b" in k for k in files), files
    for label in files:
        fig, note = show_profile(label)
        assert fig.data and "Recorded with" in note


def test_unknown_choice_is_a_message():
    _, note = show_profile("nope")
    assert "Choose" in note


def test_measure_without_gpu_explains():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    _, note = measure_profile("smollm2")
    assert "No GPU" in note
