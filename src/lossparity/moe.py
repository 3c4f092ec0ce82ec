"""The MoE toolkit (docs/semantics.md §5, docs/moe.md): the public path, ``lossparity.moe``.

Its names are those of :mod:`lossparity.losses.moe` (scores, counts, the Switch term, the z-loss, the expert-bias
update), :mod:`lossparity.losses.router` (top-k with expert bias and group-limited routing, the counts the aux
losses use, gate weights), :mod:`lossparity.losses.aux_scopes` (every load-balancing scope as a function, with
its carried state, and the frameworks' option names), :mod:`lossparity.losses.indexer` (the sparse-attention
indexer loss) and :mod:`lossparity.losses.moe_tracker` (the trackers' log arithmetic); this module
re-exports their ``__all__`` lists, so each name has one home. Import them from here:
``from lossparity.moe import indexer_loss``.
"""

from lossparity.losses import aux_scopes as _scopes
from lossparity.losses import indexer as _indexer
from lossparity.losses import moe as _impl
from lossparity.losses import moe_tracker as _logs
from lossparity.losses import router as _router
from lossparity.losses.aux_scopes import *  # noqa: F403 (listed once in losses.aux_scopes.__all__)
from lossparity.losses.indexer import *  # noqa: F403 (listed once in losses.indexer.__all__)
from lossparity.losses.moe import *  # noqa: F403 (the public names, listed once in losses.moe.__all__)
from lossparity.losses.moe_tracker import *  # noqa: F403 (listed once in losses.moe_tracker.__all__)
from lossparity.losses.router import *  # noqa: F403 (listed once in losses.router.__all__)

__all__ = [
    *_impl.__all__,
    *_router.__all__,
    *_scopes.__all__,
    *_indexer.__all__,
    *_logs.__all__,
]
