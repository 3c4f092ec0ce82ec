"""lossparity inside a MindSpore MindFormers 2.x pynative run (docs/mindformers.md); imports neither torch nor,
until :func:`install` runs, MindFormers.

:func:`install` (one call after MindFormers' ``Trainer`` is built, before ``train()``; no MindFormers file is
edited) makes the run optimize lossparity's language-model objective of a mode, exact at any gradient
accumulation and data-parallel size, logs it beside MindFormers' own loss, and applies the fixes of three
MindFormers 2.0.0 defects (:data:`FIXES`), each of which can be left off (:data:`PRESETS`).
"""

from __future__ import annotations

from ._hook import FIXES, MINDFORMERS_MODES, PRESETS, Installed, MindFormersRefusal, install

__all__ = ["FIXES", "MINDFORMERS_MODES", "PRESETS", "Installed", "MindFormersRefusal", "install"]
