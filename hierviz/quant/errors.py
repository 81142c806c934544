"""Errors raised by the checkpoint importers (GPTQ, GGUF, native W4)."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, truncated or in a format hierviz does not support.

    A ValueError subclass so callers that only catch ValueError still see it; the message
    always names the file or tensor at fault.
    """
