"""Multi-token prediction (MTP) layers in the Hugging Face drop-in (docs/semantics.md §4, docs/hf-trainer.md).

:class:`~lossparity.integrations.hf.LossParityMixin` adds lossparity's MTP term to the objective when the
model's forward output carries, besides ``logits``, one of (the documented hook, :data:`HIDDEN_KEY` /
:data:`LOGITS_KEY`):

- ``mtp_hidden_states``: a sequence of ``Dm`` tensors ``[b, S, H]``, depth ``k``'s input to the model's LM
  head (``get_output_embeddings()``, shared with the main head as in DeepSeek-V3): the logits of depth ``k``
  are ``head(h_k)`` times the main logits' known constant scale; position ``t`` of depth ``k`` predicts the
  label the main head predicts at ``t + k`` (the token ``t + k + 1``). The fused head path computes these
  depths from ``h_k`` and the head weight too (no ``[b, S, V]`` logits per depth).
- ``mtp_logits``: a sequence of ``Dm`` logits ``[b, S, V]`` (an MTP head of its own); the per-token losses
  are computed from them (needs ``fused_loss=False`` when the module calls the shared LM head itself).

A forward sets them with :func:`with_mtp_output` (``return with_mtp_output(out, "mtp_hidden_states", hs)``):
under DDP an item that the output's dataclass does not declare is refused when DDP rebuilds the output.

The labels and masks of depth ``k`` are never taken from the model: they are the main term's shifted labels
rolled left by ``k`` within each row and each document (:func:`lossparity.losses.mtp.roll_mtp`), so
padding, prompt tokens (``-100``) and the positions whose target lies in the next packed document carry no
MTP loss, by the same mask rules as the main term.

transformers 5.25's ``modeling_layers.MtpModel`` (the MTP layers of DeepSeek-V3, GLM-4-MoE, ERNIE-4.5-MoE,
Step-3.7 ... checkpoints, built by transformers for assisted decoding only: its ``forward`` drafts tokens and,
given ``labels``, starts its loss from ``None``) is trained through :func:`attach_mtp`: it registers the
layers as a submodule of the model (so that the optimizer, DDP and ``save_pretrained`` see their weights)
and a forward hook that runs them teacher-forced inside the model's own forward (inside DDP's, so its
gradient hooks see every MTP parameter): depth ``k`` embeds the input tokens ``t + k`` (rolled within each
document), takes the previous depth's hidden state (depth 1: the decoder's last hidden state, what
transformers' drafting uses) and positions ``position_ids + k`` (transformers' drafting positions; in a
packed row they keep every document boundary that transformers detects from position jumps).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "HIDDEN_KEY",
    "LOGITS_KEY",
    "MtpHook",
    "attach_mtp",
    "mtp_forward",
    "mtp_outputs",
    "rolled_inputs",
    "with_mtp_output",
]

HIDDEN_KEY = "mtp_hidden_states"  # output key of the hook: per-depth LM-head inputs
LOGITS_KEY = "mtp_logits"  # output key of the hook: per-depth logits
ATTACHED = "lossparity_mtp"  # the submodule name attach_mtp registers the layers under


def _get(outputs: Any, key: str) -> Any:
    return outputs.get(key) if isinstance(outputs, Mapping) else getattr(outputs, key, None)


_WITH_FIELD: dict[tuple[type, str], type] = {}  # (output class, key) -> its subclass with the MTP field


def with_mtp_output(output: Any, key: str, values: Sequence[Tensor]) -> Any:
    """``output`` (a forward's ``ModelOutput``) with ``key`` (:data:`HIDDEN_KEY` or :data:`LOGITS_KEY`) set to
    ``values``. DDP rebuilds a ``ModelOutput`` from its dataclass fields (``output_type(**fields)``), so an
    item set on an output whose class lacks the field is refused there: the output is re-made as a
    subclass of its class that declares the field (one per class, registered as a pytree node by
    transformers like every ``ModelOutput``). A plain dict gets the item."""
    names = {f.name for f in dataclasses.fields(output)} if dataclasses.is_dataclass(output) else None
    if names is None or key in names:
        output[key] = tuple(values)
        return output
    cls = _WITH_FIELD.get((type(output), key))
    if cls is None:
        cls = dataclasses.make_dataclass(f"{type(output).__name__}WithMTP", [(key, Any, None)], bases=(type(output),))
        _WITH_FIELD[(type(output), key)] = cls
    return cls(**{n: getattr(output, n) for n in names}, **{key: tuple(values)})


def mtp_outputs(outputs: Any, depths: int) -> tuple[str, list[Tensor]]:
    """The MTP tensors of a forward's ``outputs``: ``("hidden", [h_1..h_Dm])`` or ``("logits", [...])``.
    Raises ``ValueError`` naming the output key when they are missing or their count is not ``depths``."""
    for kind, key in (("hidden", HIDDEN_KEY), ("logits", LOGITS_KEY)):
        xs = _get(outputs, key)
        if xs is None:
            continue
        if isinstance(xs, Tensor) or not isinstance(xs, Sequence) or not all(isinstance(x, Tensor) for x in xs):
            raise ValueError(f"model: its output {key!r} must be a sequence of tensors (one per MTP depth)")
        if len(xs) != depths:
            raise ValueError(f"model: its output {key!r} has {len(xs)} MTP depths, mtp_depths is {depths}")
        return kind, list(xs)
    raise ValueError(
        f"model: mtp_depths={depths} but its outputs have neither {HIDDEN_KEY!r} nor {LOGITS_KEY!r} (attach "
        "transformers' MtpModel with lossparity.integrations.hf_mtp.attach_mtp, or return them from forward)"
    )


def rolled_inputs(input_ids: Tensor, position_ids: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Depth ``k``'s teacher-forced inputs: ``ids[t + k]`` where ``t + k`` is in the row and in ``t``'s
    document (a document starts where ``position_ids`` does not continue by +1), else ``ids[t]`` (a
    position whose loss the rolled mask drops); positions ``position_ids + k``."""
    s = input_ids.shape[-1]
    doc = (torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    ahead = torch.cat([input_ids[:, k:], input_ids[:, s - k :]], dim=-1) if k < s else input_ids
    doc_ahead = torch.cat([doc[:, k:], torch.full_like(doc[:, : min(k, s)], -1)], dim=-1) if k < s else -doc - 1
    return torch.where(doc_ahead == doc, ahead, input_ids), position_ids + k


class MtpHook:
    """The forward hooks :func:`attach_mtp` registers: the model's inputs (pre-hook), the decoder's last
    hidden state (decoder hook) and, after the model's forward, the teacher-forced depths added to its
    output as ``mtp_hidden_states``. Runs only while :attr:`active` (set by the trainer around its loss
    forward), so ``generate`` and plain forwards are unchanged."""

    def __init__(self, model: nn.Module, mtp: nn.Module) -> None:
        self.mtp = mtp
        self.active = False
        self._inputs: dict[str, Any] = {}
        self._last: Tensor | None = None
        decoder = model.get_decoder()  # type: ignore[operator]
        self.handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            decoder.register_forward_hook(self._decoder),
            model.register_forward_hook(self._post),
        ]

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.active:
            self._inputs = {"input_ids": kwargs.get("input_ids", args[0] if args else None), **kwargs}
            self._last = None

    def _decoder(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.active:
            last = _get(output, "last_hidden_state")
            self._last = last if isinstance(last, Tensor) else output[0]

    def _post(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not self.active:
            return None
        ids = self._inputs.get("input_ids")
        if not isinstance(ids, Tensor) or self._last is None:
            raise ValueError("model: the MTP layers of attach_mtp need input_ids and the decoder's last hidden state")
        pos = self._inputs.get("position_ids")
        if not isinstance(pos, Tensor):
            pos = torch.arange(ids.shape[-1], device=ids.device)
        pos = pos.expand(ids.shape)
        hidden, outs = self._last, []
        multiplier = getattr(self.mtp.config, "logits_mup_width_multiplier", None)
        for i in range(len(self.mtp.layers)):  # type: ignore[arg-type]
            ids_k, pos_k = rolled_inputs(ids, pos, i + 1)
            hidden = self.mtp.forward_layer(i, hidden, pos_k, None, input_ids=ids_k)  # type: ignore[operator]
            # MtpModel._project_to_logits divides the head input by the muP multiplier: the same head input here
            outs.append(hidden if multiplier is None else hidden / multiplier)
        self._inputs, self._last = {}, None
        return with_mtp_output(output, HIDDEN_KEY, outs)

    def remove(self) -> None:
        """Detach the hook: the model's forward no longer runs the MTP depths (the MTP module stays a submodule)."""
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def mtp_forward(model: nn.Module) -> Iterator[None]:
    """Within the block, the layers :func:`attach_mtp` attached to ``model`` (if any) run in its forward."""
    hook = getattr(model, "_lp_mtp_hook", None)
    if hook is None:
        yield
        return
    hook.active = True
    try:
        yield
    finally:
        hook.active = False


def attach_mtp(model: nn.Module, num_mtp_layers: int | None = None, mtp: nn.Module | None = None) -> MtpHook:
    """Train transformers' ``MtpModel`` with ``model`` (a causal LM): build ``MtpModel(model, n)`` (``n``:
    ``num_mtp_layers``, default the config's ``num_mtp_layers``) unless ``mtp`` is given, register it as
    ``model.lossparity_mtp`` and return the :class:`MtpHook` that adds ``mtp_hidden_states`` to the
    output of the trainer's loss forward. ``LossParityMixin`` reads the depth count from it."""
    from transformers.modeling_layers import MtpModel

    if getattr(model, "_lp_mtp_hook", None) is not None:
        raise ValueError("model: attach_mtp was already called on this model")
    if mtp is None:
        config: Any = model.config
        text = config.get_text_config()
        n = num_mtp_layers if num_mtp_layers is not None else getattr(text, "num_mtp_layers", None)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"num_mtp_layers: need an int >= 1 (or the config's num_mtp_layers), got {n!r}")
        if getattr(text, "num_mtp_layers", None) != n:
            text.num_mtp_layers = n  # MtpModel builds its config from the main config's num_mtp_layers
        mtp = MtpModel(model, n)  # type: ignore[arg-type]
    if not hasattr(mtp, "forward_layer") or not hasattr(mtp, "layers"):
        raise TypeError(f"mtp: expected a transformers MtpModel (forward_layer, layers), got {type(mtp).__name__}")
    unpadded = getattr(mtp.config, "unpadded_vocab_size", None)
    if unpadded is not None and unpadded < model.get_output_embeddings().weight.shape[0]:  # type: ignore[operator]
        raise ValueError(
            f"mtp: its logits keep the first unpadded_vocab_size={unpadded} columns of the shared head; "
            "LossParityMixin's MTP depths use the whole head (return mtp_logits from a model of your own)"
        )
    model.add_module(ATTACHED, mtp)
    hook = MtpHook(model, mtp)
    model._lp_mtp_hook = hook  # type: ignore[assignment]  # read by LossParityMixin (depths, activation)
    return hook
