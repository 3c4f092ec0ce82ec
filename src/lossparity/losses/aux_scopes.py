"""Every load-balancing scope as a standalone function (semantics §5), with the state a user carries across
microbatches and steps.

All of them evaluate the Switch term ``A(X) = α·E/(k·T_c·T_p)·Σ_e c_e·Σ_{x∈X} p[x,e]``
(:func:`lossparity.losses.moe.switch_load_balancing_terms`) on a different token set ``X`` and counts ``c``:

================== ==================================================== =================================
scope              function                                             framework names
================== ==================================================== =================================
``microbatch``     :func:`~lossparity.losses.moe.switch_load_balancing_loss` Megatron/MindFormers ``aux_loss``
``sequence``       :func:`seq_load_balancing_loss`                      ``seq_aux_loss``; DeepSeek's
                                                                        sequence-wise balance loss
``global_running`` :func:`global_running_load_balancing_loss`           ``global_aux_loss``
                   + :class:`GlobalRunningCounts`
``global_lagged``  :func:`global_lagged_load_balancing_loss`            (lossparity's invariant form)
                   + :class:`GlobalLaggedCounts`
================== ==================================================== =================================

:func:`aux_scope_for` maps a framework's option value to the scope. Public path: ``lossparity.moe``.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
from torch import Tensor

from ..options import AUX_SCOPES, FRAMEWORK_AUX_SCOPES, AuxScope
from . import moe as _moe
from ._checks import check_tensor as _check_tensor

__all__ = [
    "TOKEN_LAYOUTS",
    "FRAMEWORK_AUX_SCOPES",
    "aux_scope_for",
    "seq_load_balancing_loss",
    "GlobalRunningCounts",
    "global_running_load_balancing_loss",
    "GlobalLaggedCounts",
    "global_lagged_weights",
    "global_lagged_load_balancing_loss",
]

TokenLayout = Literal["sb", "bs"]
TOKEN_LAYOUTS: tuple[TokenLayout, ...] = ("sb", "bs")


def aux_scope_for(framework: str, name: str) -> AuxScope:
    """lossparity's scope of a framework's load-balancing option value (:data:`FRAMEWORK_AUX_SCOPES`), e.g.
    ``aux_scope_for("megatron", "global_aux_loss") == "global_running"``; a lossparity scope name is returned
    as it is. Raises ``ValueError`` naming the valid values."""
    table = FRAMEWORK_AUX_SCOPES.get(framework)
    if table is None:
        raise ValueError(f"framework {framework!r}: known frameworks: {', '.join(FRAMEWORK_AUX_SCOPES)}")
    if name in table:
        return table[name]
    if name in AUX_SCOPES:
        return name  # type: ignore[return-value]
    raise ValueError(
        f"{framework} load-balancing type {name!r}: valid: {', '.join(table)} (or {', '.join(AUX_SCOPES)})"
    )


def _rows_first(x: Tensor, token_layout: str, seq_length: int | None, name: str, tail: int) -> Tensor:
    """``x`` as ``[B, S, *tail]`` (rows = sequences) from the ``[S, B, ...]``/``[B, S, ...]`` layout, or from
    flat tokens ``[S·B, ...]`` in that layout's order (``seq_length`` given)."""
    if x.dim() == tail + 1:  # flat tokens
        if isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length < 1:
            raise ValueError(
                f"{name}: flat tokens {tuple(x.shape)} need seq_length (a positive int), got {seq_length!r}"
            )
        if x.shape[0] % seq_length:
            raise ValueError(f"{name}: {x.shape[0]} tokens are not a multiple of seq_length={seq_length}")
        b = x.shape[0] // seq_length
        x = x.reshape(seq_length, b, *x.shape[1:]) if token_layout == "sb" else x.reshape(b, seq_length, *x.shape[1:])
    elif x.dim() != tail + 2:
        dims = "S, B, E] or [B, S, E" if tail else "S, B] or [B, S"
        raise ValueError(f"{name} must be [{dims}] or flat tokens, got shape {tuple(x.shape)}")
    return x.transpose(0, 1) if token_layout == "sb" else x


def seq_load_balancing_loss(
    probs: Tensor,
    routing_map: Tensor,
    *,
    token_layout: TokenLayout,
    topk: int,
    num_experts: int,
    coeff: float,
    seq_length: int | None = None,
    keep_mask: Tensor | None = None,
    own_length: bool = True,
) -> Tensor:
    """The ``sequence`` scope's value: ``(1/B) Σ_j A(X_j)`` over the ``B`` sequences of a microbatch, with
    ``A(X_j) = α·E/(k·n_j²)·Σ_e c[j,e]·Σ_{x∈j} p[x,e]`` (``c``, ``n_j`` the sequence's own top-k counts and
    kept tokens; a sequence without kept tokens gives 0 and still counts). Megatron/MindFormers
    ``seq_aux_loss``, DeepSeek-V3's complementary sequence-wise balance loss.

    ``token_layout`` is required, because the wrong reshape still returns a plausible number: ``"sb"`` for
    ``probs``/``routing_map`` ``[S, B, E]`` (sequence-first, as Megatron's and MindFormers' routers see the
    tokens) and ``"bs"`` for ``[B, S, E]``; flat ``[S·B, E]`` tokens in that order take ``seq_length=S``.
    ``keep_mask`` (``True`` = the token counts) has the token shape. ``own_length=False`` reproduces Megatron
    0.16.1 with a padding mask: every sequence divided by the microbatch's mean kept length ``Σ_j n_j / B``
    (it folds the batch into the expert dimension). Returns a float32 scalar (float64 stays float64), like
    :func:`~lossparity.losses.moe.switch_load_balancing_loss`; the ``(sum, count)`` form for sums over
    microbatches and ranks is :func:`~lossparity.losses.moe.sequence_load_balancing_loss`.
    """
    if token_layout not in TOKEN_LAYOUTS:
        raise ValueError(f"token_layout must be one of {TOKEN_LAYOUTS} ('sb' = [S, B, E]), got {token_layout!r}")
    _check_tensor("probs", probs)
    _check_tensor("routing_map", routing_map)
    if routing_map.shape != probs.shape:
        raise ValueError(
            f"routing_map shape {tuple(routing_map.shape)} does not match probs shape {tuple(probs.shape)}"
        )
    p = _rows_first(probs, token_layout, seq_length, "probs", 1)
    m = _rows_first(routing_map, token_layout, seq_length, "routing_map", 1)
    keep = (
        None
        if keep_mask is None
        else _rows_first(_check_tensor("keep_mask", keep_mask), token_layout, seq_length, "keep_mask", 0)
    )
    counts = None
    if not own_length:
        c, n = _moe.sequence_tokens_per_expert(m, keep_mask=keep)
        counts = (c, (n.sum() / n.shape[0]).expand(n.shape))
    total, count = _moe.sequence_load_balancing_loss(
        p, m, topk=topk, num_experts=num_experts, coeff=coeff, keep_mask=keep, counts=counts
    )
    return total / count.clamp(min=1).to(total.dtype)


class GlobalRunningCounts:
    """State of the ``global_running`` scope (Megatron ``global_aux_loss``) across the microbatches of a step:
    ``Σ_{m'≤m} c^{(m')}`` and ``m``. Call :meth:`reset` at the start of every step (Megatron resets it in
    its tracker's report; MindFormers only on logging steps, the difference the docs note)."""

    def __init__(self) -> None:
        self.total: Tensor | None = None
        self.microbatches = 0

    def update(self, tokens_per_expert: Tensor) -> Tensor:
        """Add microbatch ``m``'s counts (summed over the DP×CP(×TP-SP) ranks by the caller) and return their
        running mean ``c̄^{(m)} = (1/m) Σ_{m'≤m} c^{(m')}`` (float64)."""
        _check_tensor("tokens_per_expert", tokens_per_expert)
        c = tokens_per_expert.detach().to(torch.float64)
        if self.total is not None and self.total.shape != c.shape:
            raise ValueError(
                f"tokens_per_expert shape {tuple(c.shape)} differs from the step's {tuple(self.total.shape)}"
            )
        self.total = c.clone() if self.total is None else self.total + c.to(self.total.device)
        self.microbatches += 1
        return self.total / self.microbatches

    def reset(self) -> None:
        """Start a new step."""
        self.total, self.microbatches = None, 0


def global_running_load_balancing_loss(
    probs: Tensor,
    tokens_per_expert: Tensor,
    total_num_tokens: int | float | Tensor,
    state: GlobalRunningCounts,
    *,
    topk: int,
    num_experts: int,
    coeff: float,
    keep_mask: Tensor | None = None,
) -> Tensor:
    """The ``global_running`` scope (Megatron ``global_aux_loss``) of microbatch ``m``:
    ``A_m = α·E/(k·T_m²)·Σ_e c̄_e^{(m)}·Σ_x p[x,e]`` with ``c̄^{(m)}`` the running mean of the counts of
    microbatches ``1..m`` (:meth:`GlobalRunningCounts.update`, which this call performs) and ``T_m`` this
    microbatch's tokens, both summed over the data-parallel (and CP, TP-SP) ranks by the caller; ``probs``
    are this rank's scores. The step's term is ``(1/K) Σ_m A_m``. Layout-dependent by construction (parity)."""
    if not isinstance(state, GlobalRunningCounts):
        raise TypeError(f"state must be a GlobalRunningCounts, got {type(state).__name__}")
    avg = state.update(tokens_per_expert)
    return _moe.switch_load_balancing_loss(probs, avg, total_num_tokens, topk, num_experts, coeff, keep_mask=keep_mask)


class GlobalLaggedCounts:
    """State of the ``global_lagged`` scope across steps: the previous step's global top-k counts ``c^prev``
    and tokens ``T^prev`` (initially the uniform fractions ``c/T = k/E``), and this step's running sums.

    Per step: :meth:`accumulate` every microbatch's top-k counts and kept-token count (no host
    synchronization: the sums stay on the inputs' device); with several ranks, sum :attr:`step_counts` and
    :attr:`step_tokens` (float64 tensors) over the ranks holding distinct tokens (e.g. ``dist.all_reduce``);
    then :meth:`end_step` (one host read). ``counts [E]`` or ``[layers, E]``. :meth:`state_dict` /
    :meth:`load_state_dict` checkpoint ``c^prev`` and ``T^prev``."""

    def __init__(self, num_experts: int, topk: int, layers: int | None = None) -> None:
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= num_experts:
            raise ValueError(f"topk must be an int in 1..num_experts={num_experts}, got {topk!r}")
        shape = (num_experts,) if layers is None else (layers, num_experts)
        self.counts = torch.full(shape, float(topk) / num_experts, dtype=torch.float64)
        self.tokens = 1.0
        self.step_counts = torch.zeros(shape, dtype=torch.float64)
        self.step_tokens = torch.zeros((), dtype=torch.float64)

    def fractions(self) -> Tensor:
        """``f^prev = c^prev / T^prev`` (float64)."""
        return self.counts / self.tokens

    def accumulate(self, tokens_per_expert: Tensor, num_tokens: float | Tensor) -> None:
        """Add a microbatch's top-k counts and kept-token count to this step's sums (device tensors, no sync)."""
        _check_tensor("tokens_per_expert", tokens_per_expert)
        if tokens_per_expert.shape != self.step_counts.shape:
            raise ValueError(
                f"tokens_per_expert shape {tuple(tokens_per_expert.shape)} != {tuple(self.step_counts.shape)}"
            )
        c = tokens_per_expert.detach().to(torch.float64)
        self.step_counts = self.step_counts.to(c.device) + c
        n = num_tokens.detach() if isinstance(num_tokens, Tensor) else torch.tensor(float(num_tokens))
        self.step_tokens = self.step_tokens.to(c.device) + n.to(device=c.device, dtype=torch.float64).reshape(())

    def end_step(self) -> None:
        """This step's sums become the previous step's counts (a step without tokens keeps the old ones)."""
        t = float(self.step_tokens)  # the one host read of the step
        if t > 0:
            self.counts, self.tokens = self.step_counts.clone(), t
        self.step_counts = torch.zeros_like(self.step_counts)
        self.step_tokens = torch.zeros_like(self.step_tokens)

    def state_dict(self) -> dict[str, Tensor | float]:
        """``{"counts": c^prev (CPU float64), "tokens": T^prev}``."""
        return {"counts": self.counts.detach().cpu().clone(), "tokens": float(self.tokens)}

    def load_state_dict(self, state: dict[str, Tensor | float]) -> None:
        """Restore :meth:`state_dict` (same shape of counts, ``tokens > 0``)."""
        counts, tokens = state.get("counts"), state.get("tokens")
        if not isinstance(counts, Tensor) or counts.shape != self.counts.shape:
            got = tuple(counts.shape) if isinstance(counts, Tensor) else type(counts).__name__
            raise ValueError(f"state['counts'] must be a tensor of shape {tuple(self.counts.shape)}, got {got}")
        if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not tokens > 0:
            raise ValueError(f"state['tokens'] must be a number > 0, got {tokens!r}")
        self.counts, self.tokens = counts.to(torch.float64).clone(), float(tokens)


def global_lagged_weights(
    counts_prev: Tensor,
    tokens_prev: float | Tensor,
    tokens_now: float | Tensor,
    *,
    topk: int,
    num_experts: int,
    coeff: float,
) -> Tensor:
    """The ``global_lagged`` term as a linear form of the score sums: ``A = Σ_e K_e·P_e`` with
    ``K_e = α·E·c_e^prev / (k·T^prev·T)`` (``counts_prev [..., E]``, ``T^prev = tokens_prev``,
    ``T = tokens_now`` the current step's global kept tokens); ``K`` is also ``∂A/∂p[x,e]``. The accountant's
    ``global_lagged`` scope forms its gradient from these weights. No validation, no host sync."""
    return _moe.switch_load_balancing_weights(
        counts_prev, tokens_prev, tokens_now, topk=topk, num_experts=num_experts, coeff=coeff
    )


def global_lagged_load_balancing_loss(
    probs: Tensor,
    total_num_tokens: int | float | Tensor,
    state: GlobalLaggedCounts | None = None,
    *,
    topk: int,
    num_experts: int,
    coeff: float,
    keep_mask: Tensor | None = None,
) -> Tensor:
    """This rank's and microbatch's share of the ``global_lagged`` scope:
    ``α·E/k · Σ_e (c_e^prev/T^prev) · Σ_{x kept} p[x,e] / T`` with ``T`` = ``total_num_tokens``, the current
    step's kept tokens of the whole global batch. Summed over the step's microbatches and ranks it is the Switch
    term of the global batch with the previous step's fractions: layout-invariant. ``probs [tokens, E]``
    (``state.counts`` ``[E]``).

    Argument order, the one of every load-balancing function: ``probs``, this microbatch's counts where the
    scope takes them, ``total_num_tokens``, the carried ``state``, then the keywords
    (:func:`global_running_load_balancing_loss` ``(probs, counts, T, state)``). The former order
    ``(probs, state, T)`` still works for one release with a ``DeprecationWarning``."""
    t_arg: object = total_num_tokens
    st: object = state
    if isinstance(t_arg, GlobalLaggedCounts):  # the former (probs, state, T) order
        warnings.warn(
            "global_lagged_load_balancing_loss(probs, state, total_num_tokens) is deprecated and will be removed "
            "in the next release: pass (probs, total_num_tokens, state), the order of every load-balancing "
            "function (state after the token count)",
            DeprecationWarning,
            stacklevel=2,
        )
        t_arg, st = st, t_arg
    if not isinstance(st, GlobalLaggedCounts):
        raise TypeError(f"state must be a GlobalLaggedCounts, got {type(st).__name__}")
    if isinstance(t_arg, bool) or not isinstance(t_arg, (int, float, Tensor)):
        raise TypeError(
            f"total_num_tokens must be a number or a scalar tensor (the step's global kept tokens), "
            f"got {type(t_arg).__name__}"
        )
    state, total_num_tokens = st, t_arg
    if state.counts.dim() != 1:
        raise ValueError("global_lagged_load_balancing_loss takes one layer: a state of counts [E]")
    p = probs
    if keep_mask is not None:  # where, not a product: a NaN in a dropped row must not leak
        keep = _check_tensor("keep_mask", keep_mask).bool().unsqueeze(-1)
        p = torch.where(keep, probs, torch.zeros_like(probs))
    t: float | Tensor
    if isinstance(total_num_tokens, Tensor):  # a device count: no host read (the caller's T > 0)
        t = total_num_tokens.detach().to(device=probs.device, dtype=torch.float64).reshape(())
    else:
        t = float(total_num_tokens)
        if not t > 0:
            raise ValueError(f"total_num_tokens must be > 0, got {total_num_tokens!r}")
    pw = p if p.dtype == torch.float64 else p.float()
    c = state.counts.to(device=pw.device, dtype=pw.dtype)
    weights = global_lagged_weights(c, state.tokens, t, topk=topk, num_experts=num_experts, coeff=coeff)
    return (pw.sum(dim=0) * weights).sum()
