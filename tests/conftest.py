"""Shared test set-up: offline, and one CPU thread (the test models are tiny: extra threads only
add spin-wait overhead, badly so when the 2 cores are shared)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: long statistical runs, opt-in: pytest -m slow")


def pytest_collection_modifyitems(config, items) -> None:
    """Slow tests run only when the -m expression names them."""
    if "slow" in (config.getoption("-m") or ""):
        return
    import pytest
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
