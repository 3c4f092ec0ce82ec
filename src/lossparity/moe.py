"""The MoE auxiliary-loss formulas (docs/semantics.md §5): the public path, ``lossparity.moe``.

Every name is that of :mod:`lossparity.losses.moe`, where the formulas are implemented (the library's
own modules import them from there, inside the ``losses`` layer); this module re-exports that module's
``__all__`` unchanged, so that the list of public MoE functions has one home. Import them from here:
``from lossparity.moe import switch_load_balancing_loss``.
"""

from lossparity.losses import moe as _impl
from lossparity.losses.moe import *  # noqa: F403 (the public names, listed once in losses.moe.__all__)

__all__ = list(_impl.__all__)
