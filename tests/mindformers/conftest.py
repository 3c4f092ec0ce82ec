"""tests/mindformers run MindSpore 2.10 / MindFormers 2.0.0 on CPU; they need the Python 3.11 venv that
``./dev.sh`` creates (``ensure_mindformers_env``) and run there as their own pytest invocation (the
``mindformers`` part of ``./dev.sh test``). The main (torch) run has no MindSpore: it does not collect these
files. ``LOSSPARITY_REQUIRE_MINDFORMERS=1`` (set by dev.sh) turns a missing MindSpore/MindFormers into an error.

The test-only stand-ins (the ``hyper_parallel`` import stub in ``stubs/``) go on ``sys.path`` here; the library
never imports them. The torch references run in the main venv (``_torch_ref.py``), reading and writing .npz.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import tempfile

STUBS = pathlib.Path(__file__).resolve().parent / "stubs"


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


if not (_installed("mindspore") and _installed("mindformers")):
    if os.environ.get("LOSSPARITY_REQUIRE_MINDFORMERS"):
        raise RuntimeError("LOSSPARITY_REQUIRE_MINDFORMERS=1 but mindspore/mindformers is not importable here")
    collect_ignore_glob = ["test_*.py"]
else:
    os.environ.setdefault("GLOG_v", "3")  # MindSpore's C++ warnings off the test output
    # MindFormers' logger writes ./output/log at import: into a temporary folder, not the checkout
    os.environ.setdefault("LOCAL_DEFAULT_PATH", tempfile.mkdtemp(prefix="lossparity-mindformers-"))
    if str(STUBS) not in sys.path:
        sys.path.insert(0, str(STUBS))
