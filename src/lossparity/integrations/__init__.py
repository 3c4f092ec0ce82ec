"""Drop-in integrations of lossparity's exact loss modes into the trainers people use.

One module per framework, each importing its framework lazily (importing ``lossparity.integrations``
itself imports no framework):

- :mod:`lossparity.integrations.hf`: ``LossParityMixin`` / ``LossParityTrainer`` for Hugging Face
  ``transformers.Trainer`` and TRL trainers (``pip install "lossparity[hf]"``, TRL: ``"lossparity[trl]"``).
- :mod:`lossparity.integrations.deepspeed`: ``DeepSpeedAccountant``, the accountant whose microbatch shares
  drive a ``deepspeed.DeepSpeedEngine`` (ZeRO 0-3, offload), and the audit helpers ``step_gradients`` /
  ``full_gradients`` (``pip install "lossparity[deepspeed]"``).
- :mod:`lossparity.integrations.megatron`: ``LossFunc``, the ``loss_func`` of a megatron-core
  ``forward_step`` with ``calculate_per_token_loss=True`` (``pip install "lossparity[megatron]"``).
- :mod:`lossparity.integrations.torchtitan`: ``LossParityLoss`` (with its step hook
  ``LossParityLoss.precount``) and ``LossParityTitanMixin``, which calls the hook from a torchtitan
  ``Trainer.train_step`` (``pip install "lossparity[torchtitan]"``).
- The live parity guard (docs/parity-guard.md): ``hf.ParityCallback`` (:mod:`.hf_parity`),
  :mod:`.titan_parity` ``ParityTitanMixin`` and :mod:`.megatron_parity` ``parity_check``.

The semantics of every mode are those of docs/semantics.md §1; how each framework is made to optimize
exactly the chosen objective for any layout is docs/semantics.md §3 (pre-counted normalizers for HF and
torchtitan, deferred normalization for Megatron).
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` or raise ``ImportError`` with one line naming the package and the extra to install.

    ``require("transformers", "hf")`` returns the ``transformers`` module; when it is missing the message
    is ``lossparity.integrations needs transformers: pip install "lossparity[hf]"``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        raise ImportError(f'lossparity.integrations needs {top}: pip install "lossparity[{extra}]" ({e})') from None
