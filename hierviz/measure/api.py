"""The app's one way into the measurement tools: hierviz/app/ imports nothing else of
hierviz.measure (tests/test_layers.py holds it to that). The page's What-if runs the command in a
child process; the Profile tab measures one layer in the server process; the Analyse tab reads a
deployment's acceptance file. Importing this module costs nothing: each entry imports its tool
when called.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from hierviz.measure.acceptance_import import ImportedAcceptance


class AcceptanceFileError(ValueError):
    """An acceptance file that cannot be read; the message says why, fit to show a visitor."""


class WhatIfArgumentsError(ValueError):
    """Arguments the what-if command does not take."""


class WhatIfRefused(ValueError):
    """Settings the what-if refused; the message is its own `error:` line."""


def read_acceptance_file(path: Path) -> "ImportedAcceptance":
    """A deployment's acceptance, in any format hierviz.measure.acceptance_import reads."""
    from hierviz.measure.acceptance_import import AcceptanceImportError, load_acceptance
    try:
        return load_acceptance(path)
    except AcceptanceImportError as e:
        raise AcceptanceFileError(str(e)) from None


def profile_layer(shape: str, tokens: list[int], rep_ms: float, log: Callable[[str], None] = lambda s: None
                  ) -> dict[str, Any]:
    """One decoder layer of `shape` (a name of hierviz.measure.common.SHAPES) measured now on this
    process's GPU: the dict `python -m hierviz profile` writes, without the whole-model curves."""
    from hierviz.measure import profile
    from hierviz.measure.common import load_shape
    name, cfg = load_shape(shape)
    return profile.profile(cfg, name, tokens, "cuda", whole_model=False, rep_ms=rep_ms, log=log)


def whatif_in_child(argv: list[str], timeout_s: float) -> dict[str, Any]:
    """`python -m hierviz whatif argv` in a child process, killed after timeout_s: its whatif.json.
    WhatIfArgumentsError for arguments it does not take (checked here first), WhatIfRefused for
    settings it refuses, TimeoutError past the limit, RuntimeError for any other failure."""
    from hierviz.measure.common import ROOT, error_message, run_python
    from hierviz.measure.whatif import parser
    try:
        a = parser().parse_args(argv)    # the same Namespace the child builds: bad arguments end here
    except SystemExit:
        raise WhatIfArgumentsError(f"not valid what-if arguments: {' '.join(argv)}") from None
    try:
        proc = run_python(["-m", "hierviz", "whatif", *argv], timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"the what-if ran past {timeout_s:.0f} s and was stopped") from None
    if proc.returncode != 0:
        refused = error_message(proc.stderr)
        if refused:
            raise WhatIfRefused(refused)
        raise RuntimeError(f"exit code {proc.returncode}: {proc.stderr[-4000:]}")
    return json.loads((Path(a.out) / "whatif.json").read_text(encoding="utf-8"))
