"""What a visitor sends, as the app receives it: Gradio's Blocks and input components with their
input processing made visitor-proof.

Through the API a visitor sends any JSON for any input. Gradio's own input processing then fails
in ways that are not the app's to accept: a word, None or NaN in a number field raises a bare
TypeError/ValueError (the visitor gets Gradio's generic error, the log a traceback); a value out
of a slider's range, a stack outside the list, a file that was not uploaded here or a file input
that is not a file raise errors whose tracebacks Gradio prints, one per refusal; and
gr.File(type="filepath") leaves an empty temp file behind for every upload. Here:

- `NumberField`, `SliderField`: a number the component cannot read reaches the handler as sent,
  and DecodeSettings.validate answers it with the same message as any other bad setting;
- `PublicBlocks`: whatever Gradio refuses while reading the inputs is answered with a message
  that names no server path, and logged as one line (guard.log_refusal), no traceback;
- `TraceUpload`: an upload is passed on as its path, with no temp file made.

`is_template` makes Gradio draw each component with the one it derives from.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import gradio as gr
from gradio import component_meta
from gradio.data_classes import FileData, ListFiles
from gradio.exceptions import InvalidPathError

from hierviz.app.guard import log_refusal

UNREADABLE = "An input could not be read: a file must be one uploaded to this app, any other value plain JSON."


class PublicBlocks(gr.Blocks):
    """gr.Blocks whose input processing refuses a visitor's bad input quietly (module docstring)."""

    async def preprocess_data(self, block_fn: Any, inputs: list[Any], state: Any, explicit_call: bool = False) -> Any:
        where = getattr(block_fn, "api_name", None) or getattr(block_fn, "name", None) or "input"
        try:
            return await super().preprocess_data(block_fn, inputs, state, explicit_call)
        except gr.Error as e:                    # Gradio's own check: its message is fit to show
            log_refusal(where, str(e.message))
            raise gr.Error(str(e.message), print_exception=False) from None
        # InvalidPathError names the server path it refused; pydantic's ValidationError (a file
        # input that is not a file) is a ValueError too
        except (InvalidPathError, ValueError, TypeError) as e:
            log_refusal(where, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            raise gr.Error(UNREADABLE, print_exception=False) from None


@contextmanager
def no_stub_files() -> Iterator[None]:
    """Gradio writes a .pyi stub next to the source of every component class defined (tooling for
    custom components); these classes change no signature, and the app must not write into its
    own source tree."""
    write_stub = component_meta.create_or_modify_pyi
    component_meta.create_or_modify_pyi = lambda *args, **kwargs: None
    try:
        yield
    finally:
        component_meta.create_or_modify_pyi = write_stub


with no_stub_files():
    class NumberField(gr.Number):
        is_template = True

        def preprocess(self, payload: Any) -> Any:
            try:
                return super().preprocess(payload)
            except gr.Error:                    # out of range: Gradio's message (a ValueError too)
                raise
            except (TypeError, ValueError):     # a word, NaN: the handler's validation answers
                return payload

    class SliderField(gr.Slider):
        is_template = True

        def preprocess(self, payload: Any) -> Any:
            try:
                return super().preprocess(payload)
            except gr.Error:
                raise
            except (TypeError, ValueError):
                return payload

    class TraceUpload(gr.File):
        """A single uploaded file, passed on as its path (the handler checks its name and content)."""
        is_template = True

        def preprocess(self, payload: Any) -> Any:
            if isinstance(payload, ListFiles):
                payload = payload[0] if len(payload) else None
            return payload.path if isinstance(payload, FileData) else None
