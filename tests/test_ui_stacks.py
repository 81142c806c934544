"""The stack the page opens with: the paper's on a CUDA GPU that it fits (by hierviz.memory's
estimate) and whose models it can reach, the offline stack otherwise; and the Space's front matter
preloads exactly the paper stack's hub repositories. No GPU needed: the GPU's memory and the hub
cache are stand-ins."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hierviz import memory
from hierviz.app import stacks
from hierviz.stack import DEFAULT_STACK

ROOT = Path(__file__).resolve().parent.parent
PAPER = stacks.LARGE_GPU_STACK
NEEDED = memory.shape_estimate(stacks.preset_spec(PAPER))["total"]     # ~71 GB


@pytest.fixture
def machine(monkeypatch):
    """Set this machine's GPU memory (None: no CUDA GPU); HIERVIZ_STACK and HF_HUB_OFFLINE unset."""
    monkeypatch.delenv("HIERVIZ_STACK", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def set_gpu(total_bytes):
        monkeypatch.setattr(stacks, "device_kind", lambda: "cpu" if total_bytes is None else "cuda")
        monkeypatch.setattr(stacks, "gpu_memory_bytes", lambda: total_bytes)
    return set_gpu


@pytest.mark.parametrize("gpu_gb, expected", [(141, PAPER), (80, PAPER), (48, DEFAULT_STACK), (24, DEFAULT_STACK),
                                              (None, DEFAULT_STACK)])
def test_the_paper_stack_is_the_default_on_a_gpu_it_fits(machine, gpu_gb, expected) -> None:
    machine(None if gpu_gb is None else gpu_gb * 10**9)
    assert stacks.default_stack() == expected


def test_the_line_between_fitting_and_not_is_the_memory_estimate_with_its_margin(machine) -> None:
    usable = NEEDED / (1 - memory.MARGIN)
    machine(int(usable * 1.01))
    assert stacks.default_stack() == PAPER
    machine(int(usable * 0.99))
    assert stacks.default_stack() == DEFAULT_STACK


def test_offline_the_paper_stack_needs_its_models_in_the_hub_cache(machine, monkeypatch) -> None:
    import huggingface_hub
    machine(141 * 10**9)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cached: set[str] = set()
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache",
                        lambda repo, name: f"/cache/{repo}/{name}" if repo in cached else None)
    assert stacks.default_stack() == DEFAULT_STACK
    cached.update(stacks.hub_repos(PAPER)[:-1])              # one repository missing is enough to fall back
    assert stacks.default_stack() == DEFAULT_STACK
    cached.update(stacks.hub_repos(PAPER))
    assert stacks.default_stack() == PAPER


def test_the_operators_choice_wins(machine, monkeypatch) -> None:
    machine(141 * 10**9)
    monkeypatch.setenv("HIERVIZ_STACK", "tiny-random")
    assert stacks.default_stack() == "tiny-random"


def test_the_space_preloads_the_paper_stacks_repositories() -> None:
    front = (ROOT / "README.md").read_text(encoding="utf-8").split("---")[1]
    assert yaml.safe_load(front)["preload_from_hub"] == stacks.hub_repos(PAPER)
    assert stacks.hub_repos(PAPER) == ["OxxoCodes/Meta-Llama-3-70B-Instruct-GPTQ", "meta-llama/Meta-Llama-3-8B-Instruct",
                                       "yuhuili/EAGLE-LLaMA3-Instruct-8B", "yuhuili/EAGLE-LLaMA3-Instruct-70B"]
    assert stacks.hub_repos(DEFAULT_STACK) == []              # the offline stack ships with the app
