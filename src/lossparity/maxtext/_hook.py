"""Install lossparity's objective into an unmodified MaxText train module (no file of MaxText is edited).

What is rebound, in the module objects of the running process only (``uninstall`` restores them):

- ``train.loss_fn``: calls MaxText's own ``loss_fn`` unchanged (so ``xent_sum``, ``total_weights``, z-loss
  and every auxiliary loss are MaxText's numbers), reads the per-token cross-entropy ``xent [b, S]`` that
  MaxText computed on the way (see ``train.max_utils`` below), and returns this microbatch's share of the
  objective of the mode: ``J_mb = numerator(mb) / denominator(global counts)`` (``lossparity.jax.share``).
- ``train.gradient_accumulation_loss_and_grad``: counts the step's normalizers from the whole batch once,
  then runs MaxText's own GA scan with the ``loss_fn`` above; the returned loss is the objective.
- ``train.train_step``: adds lossparity's own logs (``lossparity/lm_objective``, ``lossparity/units``).
- ``train.initialize``: checks the parsed config (refusals, ``calculate_per_token_loss`` if the release
  has it) before any model is built.
- ``train.max_utils``: a view of MaxText's ``max_utils`` module whose ``cross_entropy_with_logits`` also
  hands the per-token loss it returns to the active ``loss_fn`` call (everything else is the module's own).
- ``multi_token_prediction._cross_entropy_with_integer_labels``: the same for each MTP depth.

The gradient-accumulation algebra (``K`` microbatches, ``W`` the step's loss-bearing tokens): MaxText's
manual GA divides the summed gradients by ``max(W, 1)``, its tunix path by ``K``; each microbatch's
returned loss is ``J_mb · max(W, 1)`` or ``J_mb · K`` so that either division leaves ``Σ_mb ∇J_mb = ∇J``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from .. import jax as lpj

__all__ = ["MAXTEXT_MODES", "MTP_CONVENTIONS", "MaxTextRefusal", "Installed", "install", "check_config"]

MAXTEXT_MODES = ("per_token", "per_sample", "per_document")
MTP_CONVENTIONS = ("own", "pooled")


class MaxTextRefusal(ValueError):
    """A MaxText setting under which lossparity cannot make the objective exact (raised before step 0)."""


_local = threading.local()


@dataclass
class _Step:
    """What one traced train step knows: its global counts, the GA factor, and what the hooks captured."""

    norms: lpj.Normalizers
    mtp_dens: list[jax.Array]
    num_microbatches: int
    factor: Any  # multiplies each microbatch's share so that MaxText's GA division leaves Σ ∇J_mb
    logs: dict[str, Any] = field(default_factory=dict)


def _current(name: str) -> Any:
    return getattr(_local, name, None)


@contextlib.contextmanager
def _bind(name: str, value: Any) -> Iterator[Any]:
    prev = _current(name)
    setattr(_local, name, value)
    try:
        yield value
    finally:
        setattr(_local, name, prev)


def check_config(config: Any, mode: str) -> None:
    """Raise :class:`MaxTextRefusal` (one line) for a MaxText setting the hook cannot make exact under
    ``mode`` (``per_token`` installs nothing and refuses nothing)."""
    if mode == "per_token":
        return
    problems = []
    tiling = int(getattr(config, "num_vocab_tiling", 1) or 1)
    if tiling > 1:
        problems.append(
            f"num_vocab_tiling={tiling} > 1 returns only the summed loss, not the per-token loss that "
            f"{mode} needs; set num_vocab_tiling=1"
        )
    if getattr(config, "use_dpo", False):
        problems.append("use_dpo=true: DPO's preference loss is not a per-token LM loss")
    if getattr(config, "training_objective", "causal_lm") != "causal_lm":
        problems.append(
            f"training_objective={config.training_objective!r}: only the causal LM loss is hooked "
            "(block diffusion weighs tokens by its own corruption mask)"
        )
    if getattr(config, "use_indexer", False) and not getattr(config, "indexer_sparse_training", True):
        problems.append("the indexer dense warm-up (use_indexer=true, indexer_sparse_training=false) has no LM loss")
    if getattr(config, "enable_diloco", False):
        problems.append("enable_diloco=true runs its own inner step, which the hook does not cover")
    if problems:
        raise MaxTextRefusal(f"lossparity.maxtext --lp-mode {mode} refused: " + "; ".join(problems))


def _mode_from_config(config: Any, requested: str | None) -> str:
    """The mode to run: a release that has ``calculate_per_token_loss`` decides by that field (detected by
    name, not version); an explicit ``--lp-mode`` that contradicts it is refused."""
    if not hasattr(config, "calculate_per_token_loss"):
        return requested or "per_sample"
    from_field = "per_token" if bool(config.calculate_per_token_loss) else "per_sample"
    if requested is None:
        return from_field
    if (requested == "per_token") != (from_field == "per_token"):
        raise MaxTextRefusal(
            f"lossparity.maxtext --lp-mode {requested} contradicts calculate_per_token_loss="
            f"{bool(config.calculate_per_token_loss)} in the MaxText config; drop one of them"
        )
    return requested


class _MaxUtilsView(types.ModuleType):
    """MaxText's ``max_utils`` as seen by the train module: every attribute is the real module's, except
    ``cross_entropy_with_logits``, which also records the per-token loss for the active ``loss_fn``."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__(real.__name__, real.__doc__)
        self._real = real

        @functools.wraps(real.cross_entropy_with_logits)
        def cross_entropy_with_logits(*args: Any, **kwargs: Any) -> Any:
            out = self._real.cross_entropy_with_logits(*args, **kwargs)
            slot = _current("capture")
            if slot is not None:
                slot["xent"] = out[0]
            return out

        self.cross_entropy_with_logits = cross_entropy_with_logits

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _trained_rows(config: Any, x: jax.Array, k: int) -> jax.Array:
    """The rows MaxText trains on, microbatch-major as its GA scan cuts them (microbatch ``m`` = rows
    ``m, m+K, m+2K, ...``), each microbatch cut to ``micro_batch_size_to_train_on``; ``[K·b, S]``."""
    rows = x.shape[0]
    micro = jnp.swapaxes(jnp.reshape(x, (rows // k, k) + x.shape[1:]), 0, 1)
    b = getattr(config, "micro_batch_size_to_train_on", None) or micro.shape[1]
    micro = micro[:, :b]
    return jnp.reshape(micro, (-1,) + x.shape[1:])


def _mtp_masks(data: dict[str, jax.Array], depths: int, rows: int) -> list[jax.Array]:
    """Each MTP depth's rolled loss mask, rolled by MaxText's own functions exactly as its MTP block does."""
    from maxtext.layers import multi_token_prediction as mtp  # noqa: PLC0415 (MaxText is optional)

    mask = data["targets_segmentation"][:rows] != 0
    seg = data["inputs_segmentation"][:rows]
    out = []
    for _ in range(depths):
        mask = mtp.roll_and_mask_by_segment(mask, seg)
        seg = mtp.roll_and_mask(seg)
        out.append(mask)
    return out


@dataclass
class Installed:
    """Handle of an installation: ``mode`` (resolved once MaxText's config is parsed) and ``uninstall()``."""

    mode: str | None
    mtp_convention: str
    train: types.ModuleType | None
    _saved: list[tuple[Any, str, Any]] = field(default_factory=list)

    def uninstall(self) -> None:
        """Put back every MaxText attribute this installation rebound."""
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved.clear()

    def _rebind(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    # -- the objective -------------------------------------------------------------------------------------

    def _segments(self, data: dict[str, jax.Array], rows: int) -> jax.Array | None:
        return data["targets_segmentation"][:rows] if self.mode == "per_document" else None

    def step_context(self, config: Any, data: dict[str, jax.Array], k: int) -> _Step:
        """Global counts of the step from the whole batch (the rows MaxText trains on)."""
        assert self.mode is not None
        seg = _trained_rows(config, data["targets_segmentation"], k)
        mask = seg != 0
        norms = lpj.count_normalizers(mask, seg if self.mode == "per_document" else None)
        mtp_dens: list[jax.Array] = []
        depths = int(getattr(config, "mtp_num_layers", 0) or 0)
        if depths:
            trained = {
                key: _trained_rows(config, data[key], k) for key in ("targets_segmentation", "inputs_segmentation")
            }
            masks = _mtp_masks(trained, depths, seg.shape[0])
            depth_norms = lpj.mtp.mtp_normalizers(masks, seg if self.mode == "per_document" else None)
            conv = "own" if self.mtp_convention == "own" else "pooled"
            mtp_dens = lpj.mtp.mtp_denominators(self.mode, conv, norms, depth_norms)
        if k == 1:
            factor: Any = 1.0
        elif getattr(config, "use_tunix_gradient_accumulation", False):
            factor = float(k)  # MaxText divides the summed gradients by K
        else:
            factor = jnp.maximum(norms.tokens, 1).astype(jnp.float32)  # MaxText divides by max(W, 1)
        return _Step(norms, mtp_dens, k, factor)

    def loss_fn(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """MaxText's ``loss_fn`` with the objective of the mode; evaluation calls pass through unchanged."""

        @functools.wraps(original)
        def loss_fn(model, config, data, dropout_rng, params, sparsity_state=None, is_train=True):  # noqa: ANN001, ANN202
            step: _Step | None = _current("step")
            if not is_train or step is None or self.mode == "per_token":
                return original(model, config, data, dropout_rng, params, sparsity_state, is_train=is_train)
            with _bind("capture", {"mtp": []}) as slot:
                _, aux = original(model, config, data, dropout_rng, params, sparsity_state, is_train=is_train)
            if "xent" not in slot:
                raise MaxTextRefusal("lossparity.maxtext: MaxText computed no per-token cross-entropy in this step")
            xent = slot["xent"]
            rows = xent.shape[0]
            mask = data["targets_segmentation"][:rows] != 0
            lm = lpj.share(self.mode, xent, mask, step.norms, segment_ids=self._segments(data, rows))
            mtp_term = jnp.zeros((), lm.dtype)
            if slot["mtp"]:
                masks = _mtp_masks(data, len(slot["mtp"]), rows)
                conv = "own" if self.mtp_convention == "own" else "pooled"
                nums = lpj.mtp.mtp_numerator(
                    self.mode, slot["mtp"], masks, convention=conv, segment_ids=self._segments(data, rows)
                )
                terms = [n / d.astype(n.dtype) for n, d in zip(nums, step.mtp_dens)]
                mtp_term = config.mtp_loss_scaling_factor * sum(terms) / len(terms)
                # MaxText averages aux["mtp_loss"] over the K microbatches: K·share sums to the step's term
                aux["mtp_loss"] = mtp_term * step.num_microbatches
            k = step.num_microbatches
            objective = lm + mtp_term + (aux["moe_lb_loss"] + aux["indexer_loss"]) / k
            aux["lossparity_lm"] = lm
            return objective * step.factor, aux

        return loss_fn

    def ga(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """MaxText's GA scan with the step's counts taken from the whole batch first."""

        @functools.wraps(original)
        def gradient_accumulation_loss_and_grad(_loss_fn, config, model, params, params_shardings, data, dropout_rng):  # noqa: ANN001, ANN202
            if self.mode == "per_token":
                return original(_loss_fn, config, model, params, params_shardings, data, dropout_rng)
            k = int(config.gradient_accumulation_steps)
            step = self.step_context(config, data, k)
            with _bind("step", step):
                _, aux, raw_grads = original(_loss_fn, config, model, params, params_shardings, data, dropout_rng)
            # aux is summed over the microbatches, the three aux losses then divided by K (MaxText)
            loss = aux["lossparity_lm"] + aux["mtp_loss"] + aux["moe_lb_loss"] + aux["indexer_loss"]
            outer = _current("outer")
            if outer is not None:
                outer["lm"] = aux["lossparity_lm"]
            return loss, aux, raw_grads

        return gradient_accumulation_loss_and_grad

    def train_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """MaxText's ``train_step`` plus lossparity's logs; GA = 1 gets its counts here."""

        @functools.wraps(original)
        def train_step(model, config, state_mesh_shardings, params_shardings, state, data, dropout_rng=None):  # noqa: ANN001, ANN202
            if self.mode == "per_token":
                return original(model, config, state_mesh_shardings, params_shardings, state, data, dropout_rng)
            check_config(config, self.mode)
            k = int(config.gradient_accumulation_steps)
            step = self.step_context(config, data, k)
            with _bind("outer", {}) as outer, _bind("step", step if k == 1 else None):
                new_state, metrics = original(
                    model, config, state_mesh_shardings, params_shardings, state, data, dropout_rng
                )
            scalar = metrics["scalar"]
            if "lm" in outer:
                lm = outer["lm"]
            else:  # GA = 1: learning/loss is J_lm + the aux terms, each logged by MaxText
                lm = scalar["learning/loss"] - sum(
                    scalar[key] for key in ("learning/mtp_loss", "learning/moe_lb_loss", "learning/indexer_loss")
                )
            key = "samples" if self.mode == "per_sample" else "documents"
            scalar["lossparity/lm_objective"] = lm
            scalar["lossparity/units"] = getattr(step.norms, key)
            return new_state, metrics

        return train_step

    def initialize(self, original: Callable[..., Any], requested: str | None) -> Callable[..., Any]:
        """MaxText's ``initialize``, then the mode is resolved and the config checked (before any step)."""

        @functools.wraps(original)
        def initialize(argv):  # noqa: ANN001, ANN202
            config, recorder = original(argv)
            mode = _mode_from_config(config, requested)
            check_config(config, mode)
            self.mode = mode
            return config, recorder

        return initialize


def install(
    mode: str | None = "per_sample",
    *,
    mtp_convention: str = "own",
    train_module: types.ModuleType | None = None,
) -> Installed:
    """Make MaxText's train module (``maxtext.trainers.pre_train.train``, or ``train_module`` for a fork
    with the same functions) optimize lossparity's objective of ``mode``; returns the :class:`Installed`
    handle (``.uninstall()`` restores MaxText).

    ``mode``: ``per_token`` installs nothing (MaxText as released: ``J = Σ_t l_t / max(Ntok, 1)``);
    ``per_sample``: ``J = (1/N) Σ_i s_i / max(n_i, 1)`` over the ``N`` rows of the global batch;
    ``per_document``: ``J = (1/max(Ndoc, 1)) Σ_j s_j / max(n_j, 1)`` over the packed documents
    (``targets_segmentation``); ``None``: decided after MaxText parses its config (its
    ``calculate_per_token_loss`` field where the release has one, else ``per_sample``).
    MTP (``mtp_num_layers > 0``) follows the mode with ``mtp_convention`` ``own``
    (``λ·(1/Dm)·Σ_k J_k``, MaxText ``mtp_per_layer_loss_norm=True``) or ``pooled`` (one ``J`` of all depths).
    ``learning/lm_loss`` and ``learning/total_weights`` stay MaxText's global ``Σ xent / Σ w``; ``learning/loss``
    becomes the objective (LM term + MTP + MoE load balance + indexer, the last two MaxText's values, at GA ``K``
    their plain mean over the microbatches as MaxText logs them, in the value and in the gradient).
    Evaluation is MaxText's, unchanged.
    """
    if mode is not None and mode not in MAXTEXT_MODES:
        raise ValueError(f"mode: expected one of {', '.join(MAXTEXT_MODES)}, got {mode!r}")
    if mtp_convention not in MTP_CONVENTIONS:
        raise ValueError(f"mtp_convention: expected one of {', '.join(MTP_CONVENTIONS)}, got {mtp_convention!r}")
    handle = Installed(mode, mtp_convention, None)
    if mode == "per_token":
        return handle
    # MaxText is optional: imported only when something is installed
    train: Any = train_module or importlib.import_module("maxtext.trainers.pre_train.train")
    mtp_module: Any = importlib.import_module("maxtext.layers.multi_token_prediction")

    handle.train = train
    handle._rebind(train, "max_utils", _MaxUtilsView(train.max_utils))
    handle._rebind(train, "loss_fn", handle.loss_fn(train.loss_fn))
    handle._rebind(train, "gradient_accumulation_loss_and_grad", handle.ga(train.gradient_accumulation_loss_and_grad))
    handle._rebind(train, "train_step", handle.train_step(train.train_step))
    handle._rebind(train, "initialize", handle.initialize(train.initialize, mode))
    original_mtp_xent = mtp_module._cross_entropy_with_integer_labels

    @functools.wraps(original_mtp_xent)
    def mtp_xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
        out = original_mtp_xent(logits, labels)
        slot = _current("capture")
        if slot is not None:
            slot["mtp"].append(out)
        return out

    handle._rebind(mtp_module, "_cross_entropy_with_integer_labels", mtp_xent)
    return handle
