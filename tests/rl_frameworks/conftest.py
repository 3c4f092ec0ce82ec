"""tests/rl_frameworks call verl's and OpenRLHF's own loss functions; they need the side packages that
``./dev.sh`` installs (``ensure_rl_env``: verl 0.9.1, verl 0.7.1 and OpenRLHF 0.11.2 with ``--no-deps`` into
``.venv-rl/``, used with the main venv's torch). The main run does not collect these files when the folder is
absent; ``LOSSPARITY_REQUIRE_RL=1`` (set by dev.sh) turns a missing side environment into an error."""

from __future__ import annotations

import os
import pathlib

SITE = pathlib.Path(os.environ.get("LOSSPARITY_RL_SITE", pathlib.Path(__file__).resolve().parents[2] / ".venv-rl"))

if not (SITE / "site" / "verl").is_dir():
    if os.environ.get("LOSSPARITY_REQUIRE_RL"):
        raise RuntimeError(f"LOSSPARITY_REQUIRE_RL=1 but the RL side packages are missing under {SITE}")
    collect_ignore_glob = ["test_*.py"]
