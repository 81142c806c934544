"""Shared test set-up: offline, and one CPU thread (the test models are tiny: extra threads only
add spin-wait overhead, badly so when the 2 cores are shared)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: long statistical runs, opt-in: pytest -m slow")


# the files whose tests take longest (each over a minute on 2 cores), started first: with
# `-n 2 --dist loadfile` a worker takes files in collection order, and one of these started last
# ran alone for minutes after the other worker had finished
LONGEST_FIRST = ("test_hardening.py", "test_fused.py", "test_oracle_acceptance.py", "test_train.py",
                 "test_triton_w4.py", "test_sampling_power.py", "test_browser.py", "test_whatif.py")


def pytest_collection_modifyitems(config, items) -> None:
    """The longest files first (a stable sort keeps each file's own order); slow tests run only
    when the -m expression names them."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    if "slow" in (config.getoption("-m") or ""):
        return
    import pytest
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
