"""Multi-token prediction (docs/semantics.md §4): the public path, ``lossparity.mtp``.

A re-export of :mod:`lossparity.losses.mtp`'s ``__all__`` (its one home): the rolled labels and masks, the
three count conventions of the objective and the log estimators ``token_mean`` and ``microbatch_mean`` that
the accountant's ``mtp_<k>_loss`` logs use. Import them from here: ``from lossparity.mtp import token_mean``.
"""

from lossparity.losses import mtp as _impl
from lossparity.losses.mtp import *  # noqa: F403 (the public names, listed once in losses.mtp.__all__)

__all__ = list(_impl.__all__)
