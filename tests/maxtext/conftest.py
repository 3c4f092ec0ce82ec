"""tests/maxtext run the real MaxText 0.2.5 training loop on CPU; they need the Python 3.12 venv that
``./dev.sh`` creates (``ensure_maxtext_env``) and run there as a second pytest invocation. The main
(Python 3.11, torch) run has no MaxText: it does not collect these files. ``LOSSPARITY_REQUIRE_MAXTEXT=1``
(set by dev.sh) turns a missing MaxText into an error instead."""

from __future__ import annotations

import importlib.util
import os


def _maxtext_installed() -> bool:
    # "maxtext" alone can resolve to this very folder (tests/ is on sys.path): ask for a module of the package
    try:
        return importlib.util.find_spec("maxtext.configs") is not None
    except ImportError:
        return False


if not _maxtext_installed():
    if os.environ.get("LOSSPARITY_REQUIRE_MAXTEXT"):
        raise RuntimeError("LOSSPARITY_REQUIRE_MAXTEXT=1 but maxtext is not importable in this Python")
    collect_ignore_glob = ["test_*.py"]
else:
    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
