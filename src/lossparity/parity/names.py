"""Metric names: each framework's spelling -> lossparity's canonical names.

Canonical names are lossparity's log-channel names (semantics §2, §4, §5): ``lm_loss``, ``objective``,
``mtp_<k>_loss``, ``load_balancing_loss``, ``seq_load_balancing_loss``,
``global_load_balancing_loss``, ``z_loss`` (router z-loss), ``grad_norm``, ``lr``, ``tokens``.

What each framework's number means, and therefore where it maps:

- Megatron ``lm loss`` (text log, TensorBoard, golden values) is the global token mean ``S / Ntok``
  = ``lm_loss``; ``mtp_<k> loss`` = ``mtp_<k>_loss``; ``z_loss`` is the router z-loss; ``total loss``
  (knowledge distillation, the loss that is optimized) = ``objective``.
- MaxText ``learning/loss`` (and the console ``loss``) is the objective (total loss);
  ``learning/lm_loss`` / console ``lm_loss`` = ``lm_loss``; ``learning/moe_lb_loss`` =
  ``load_balancing_loss``; ``learning/total_weights`` = ``tokens``. MaxText's
  ``learning/grad_norm`` is measured *after* clipping, so it maps to ``clipped_grad_norm``; its
  ``learning/raw_grad_norm`` is the pre-clip norm that Megatron, HF and torchtitan report, so it
  maps to ``grad_norm``. ``learning/z_loss`` is MaxText's *output-logit* z-loss (part of the
  per-token loss, semantics §1), not the router z-loss, so it maps to ``logit_z_loss``.
  ``learning/mtp_loss`` (all depths together) stays ``mtp_loss``; with one MTP depth map it to
  ``mtp_1_loss`` explicitly (``learning/mtp_loss=mtp_1_loss``).
- Hugging Face ``loss`` (``train/loss`` in W&B), torchtitan ``loss``
  (``loss_metrics/global_avg_loss`` in TensorBoard) and MindFormers ``loss`` are the objective.
- Learning rates (``learning rate``, ``learning-rate``, ``learning_rate``,
  ``learning/current_learning_rate``) map to ``lr``; ``grad norm`` / ``grad-norm`` /
  MindFormers ``global_norm`` map to ``grad_norm``.

Names the table does not know are kept verbatim (they can still be compared when named explicitly).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

CANONICAL_METRICS: tuple[str, ...] = (
    "lm_loss",
    "objective",
    "load_balancing_loss",
    "seq_load_balancing_loss",
    "global_load_balancing_loss",
    "z_loss",
    "grad_norm",
    "lr",
    "tokens",
)
"""Canonical names; ``mtp_<k>_loss`` (k >= 1) is canonical too (see :func:`is_canonical`)."""

# a depth of at most 6 digits: a longer number is no MTP depth, and never reaches int()'s digit limit
MTP_RE = re.compile(r"^mtp_([1-9]\d{0,5})_loss$")
_RAW_MTP_RE = re.compile(r"^(?:learning/)?mtp_([1-9]\d{0,5})[ _-]loss$")

# Sentinel values in a user name map that drop a metric instead of renaming it.
DROP_NAMES: frozenset[str] = frozenset({"", "-"})

DEFAULT_NAME_MAP: dict[str, str] = {
    # global token-mean LM loss
    "lm loss": "lm_loss",
    "lm-loss": "lm_loss",
    "learning/lm_loss": "lm_loss",
    # objective (the optimized value)
    "loss": "objective",
    "learning/loss": "objective",
    "loss_metrics/global_avg_loss": "objective",
    "total loss": "objective",  # Megatron (ModelOpt distillation): the optimized total
    # MoE auxiliary terms (Megatron names are already canonical)
    "learning/moe_lb_loss": "load_balancing_loss",
    "moe_lb_loss": "load_balancing_loss",
    "learning/z_loss": "logit_z_loss",
    # gradient norms
    "grad norm": "grad_norm",
    "grad-norm": "grad_norm",
    "global_norm": "grad_norm",
    "learning/raw_grad_norm": "grad_norm",
    "learning/grad_norm": "clipped_grad_norm",
    # learning rate
    "learning rate": "lr",
    "learning-rate": "lr",
    "learning_rate": "lr",
    "learning/current_learning_rate": "lr",
    # token counts
    "total_weights": "tokens",
    "learning/total_weights": "tokens",
    # other Megatron spellings, so TensorBoard, text and golden values agree
    "loss scale": "loss_scale",
    "loss-scale": "loss_scale",
    "num zeros": "num_zeros",
    "num-zeros": "num_zeros",
    "params norm": "params_norm",
    "params-norm": "params_norm",
    "learning/param_norm": "params_norm",
    "global batch size": "global_batch_size",
    "batch-size": "global_batch_size",
    "learning/mtp_loss": "mtp_loss",
}

# W&B exports of HF runs prefix every metric with "train/"; those names are looked up again without it.
_STRIPPABLE_PREFIXES: tuple[str, ...] = ("train/",)


def is_canonical(name: str) -> bool:
    """True when ``name`` is one of lossparity's canonical metric names.

    Canonical = listed in :data:`CANONICAL_METRICS` or of the form ``mtp_<k>_loss`` with ``k >= 1``.
    """
    return name in CANONICAL_METRICS or MTP_RE.match(name) is not None


def default_canonical_name(raw: str) -> str:
    """Map one framework metric name to its canonical name with the built-in table only.

    Lookup order: the exact name, its lower-cased form, the ``mtp_<k> loss`` pattern, then the same
    again without a ``train/`` prefix; a name nothing matches is returned unchanged.
    """
    for name in (raw, *(raw[len(p) :] for p in _STRIPPABLE_PREFIXES if raw.startswith(p))):
        for candidate in (name, name.lower()):
            if candidate in DEFAULT_NAME_MAP:
                return DEFAULT_NAME_MAP[candidate]
            m = _RAW_MTP_RE.match(candidate)
            if m is not None:
                return f"mtp_{m.group(1)}_loss"
            if is_canonical(candidate):
                return candidate
    return raw


def canonical_name(raw: str, name_map: Mapping[str, str] | None = None) -> str | None:
    """Canonical name of the raw metric ``raw``, or ``None`` when the user map drops it.

    ``name = name_map.get(raw)``; when absent, ``name = default_canonical_name(raw)`` and then
    ``name = name_map.get(name, name)`` (so a user map may also rename a canonical name, e.g.
    ``objective=lm_loss``). A mapped value of ``""`` or ``"-"`` drops the metric.
    """
    user = name_map or {}
    if raw in user:
        name = user[raw]
    else:
        name = default_canonical_name(raw)
        name = user.get(name, name)
    return None if name in DROP_NAMES else name


def parse_name_map(spec: str | None) -> dict[str, str]:
    """Parse ``"raw=canonical,raw2=canonical2"`` into a dict.

    Entries are separated by commas and split at their first ``=``; surrounding spaces are
    stripped, inner spaces kept (``lm loss=lm_loss`` works). An empty right side drops the metric.
    Raises ``ValueError`` naming ``name_map`` and the entry when an entry has no ``=`` or an empty
    left side, or when a name is given twice.
    """
    out: dict[str, str] = {}
    if spec is None or not spec.strip():
        return out
    for entry in spec.split(","):
        if not entry.strip():
            continue
        raw, sep, canon = entry.partition("=")
        raw, canon = raw.strip(), canon.strip()
        if not sep or not raw:
            raise ValueError(f"name_map: entry {entry.strip()!r} is not of the form 'raw=canonical'")
        if raw in out:
            raise ValueError(f"name_map: name {raw!r} is mapped twice")
        out[raw] = canon
    return out
