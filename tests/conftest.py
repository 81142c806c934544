"""Shared test set-up: offline, and one CPU thread (the test models are tiny: extra threads only
add spin-wait overhead, badly so when the 2 cores are shared)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import torch  # noqa: E402

torch.set_num_threads(1)
