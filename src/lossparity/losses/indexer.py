"""DeepSeek-V3.2 sparse-attention indexer loss (semantics §5, "Indexer loss").

Pure tensor functions, float32 math (float64 inputs stay float64). Per valid query token ``t`` the loss
is ``KL(p_t || q_t)`` where
``q_t = softmax(I_t)`` is the indexer's distribution over keys and ``p_t`` the main attention summed
over heads and L1-normalized (a detached target: gradient flows only into the indexer logits).

Key set. A key is *kept* for query ``t`` when its indexer logit is finite (``-inf`` marks causal or
otherwise invalid keys); with ``topk`` only the ``topk`` largest indexer logits are kept as well. Both
distributions live on the kept set: ``q_t`` is the softmax over kept keys, and each head's attention is
renormalized over kept keys *before* the heads are summed — exactly Megatron-LM's
``compute_dsa_indexer_loss`` (which adds the same ``-inf`` mask to the attention scores and the indexer
scores before both softmaxes). When the main attention already has no mass outside the kept set (the
dense loss with a causal mask) this renormalization is the identity. A sparse indexer may instead pass the
selected keys themselves (``topk_indices``), and with ``sparse_logits=True`` only their logits ``[B, Tq, k]``
(MindFormers 2.1.0's ``index_scores``), which :func:`scatter_indexer_logits` places on the key axis.

Queries without a kept key (the first rows of compressed attention, where no compressed key is causal yet):
their two distributions are undefined, so by rule their ``KL_t`` is 0, they carry no gradient, and they are
not *valid* queries; they still count among *all* queries. :func:`indexer_loss` offers both means and the
log forms (coefficient included or not).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "INDEXER_REDUCTIONS",
    "INDEXER_MEANS",
    "indexer_kl",
    "indexer_token_count",
    "indexer_loss",
    "scatter_indexer_logits",
]

INDEXER_REDUCTIONS = ("sum", "none")
INDEXER_MEANS = ("all", "valid")


def _check_mask(mask: Tensor | None, shape: torch.Size, device: torch.device) -> Tensor:
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.shape != shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} must be [batch, query_len] = {tuple(shape)}")
    if mask.is_complex():
        raise TypeError(f"mask must be bool or 0/1, got dtype {mask.dtype}")
    if mask.dtype != torch.bool:
        if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
            bad = mask[(mask != 0) & (mask != 1)].flatten()[:3].tolist()
            raise ValueError(f"mask values must be 0 or 1 (1 = valid query token), found {bad}")
        mask = mask != 0
    return mask.to(device)


def _check_floats(main_attn_probs: object, indexer_logits: object, reduction: str) -> None:
    if reduction not in INDEXER_REDUCTIONS:
        raise ValueError(f"reduction must be one of {INDEXER_REDUCTIONS}, got {reduction!r}")
    for name, x in (("main_attn_probs", main_attn_probs), ("indexer_logits", indexer_logits)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be floating point, got dtype {x.dtype}")


def _selected_keys(idx: Tensor, b: int, tq: int, tk: int, unbatched: bool, device: torch.device) -> Tensor:
    """Bool ``[B, Tq, Tk]``: the keys listed in ``topk_indices`` (``-1`` entries ignored)."""
    if not isinstance(idx, Tensor) or idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise TypeError("topk_indices must be an integer tensor [B, Tq, k] (-1 = no key)")
    if unbatched and idx.dim() == 2:
        idx = idx.unsqueeze(0)
    if idx.dim() != 3 or idx.shape[:2] != (b, tq):
        raise ValueError(f"topk_indices shape {tuple(idx.shape)} must be [B, Tq, k] = [{b}, {tq}, k]")
    idx = idx.to(device=device, dtype=torch.long)
    if idx.numel() and bool(((idx < -1) | (idx >= tk)).any()):
        raise ValueError(f"topk_indices must be in -1..{tk - 1} (-1 = no key)")
    out = torch.zeros(b, tq, tk + 1, dtype=torch.bool, device=device)
    return out.scatter_(-1, torch.where(idx < 0, tk, idx), True)[..., :tk]  # -1 lands in a dropped column


def scatter_indexer_logits(selected_logits: Tensor, topk_indices: Tensor, num_keys: int) -> Tensor:
    """The dense indexer logits ``I [..., Tq, Tk]`` of a sparse indexer's output: ``I[..., t, j] = s[..., t, i]``
    where ``topk_indices[..., t, i] = j``, ``-inf`` at every key not listed (``-1`` entries list none).

    ``selected_logits`` ``[B, Tq, k]`` (or ``[Tq, k]``) are the logits of the selected keys, in the order of
    ``topk_indices`` (int, same shape; MindFormers 2.1.0's ``index_scores`` and ``topk_indices``); ``num_keys``
    is ``Tk``. A key listed twice in one row is an error. Gradients flow to ``selected_logits``.
    """
    if not isinstance(selected_logits, Tensor) or not selected_logits.is_floating_point():
        raise TypeError("selected_logits must be a floating-point torch.Tensor [B, Tq, k]")
    if not isinstance(topk_indices, Tensor) or topk_indices.is_floating_point() or topk_indices.is_complex():
        raise TypeError("topk_indices must be an integer tensor [B, Tq, k] (-1 = no key)")
    if topk_indices.dtype == torch.bool:
        raise TypeError("topk_indices must be an integer tensor [B, Tq, k] (-1 = no key), got bool")
    if selected_logits.shape != topk_indices.shape or selected_logits.dim() not in (2, 3):
        raise ValueError(
            f"sparse indexer logits {tuple(selected_logits.shape)} and topk_indices {tuple(topk_indices.shape)} "
            "must have the same shape [B, Tq, k] (or [Tq, k])"
        )
    if isinstance(num_keys, bool) or not isinstance(num_keys, int) or num_keys < 1:
        raise ValueError(f"num_keys must be a positive int (Tk), got {num_keys!r}")
    idx = topk_indices.to(device=selected_logits.device, dtype=torch.long)
    if idx.numel() and bool(((idx < -1) | (idx >= num_keys)).any()):
        raise ValueError(f"topk_indices must be in -1..{num_keys - 1} (-1 = no key)")
    listed = torch.where(idx < 0, num_keys, idx)  # -1 lands in a column that is cut off below
    ordered = listed.sort(dim=-1).values
    if idx.shape[-1] > 1 and bool(((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] < num_keys)).any()):
        raise ValueError("topk_indices lists a key twice in one query row")
    dense = selected_logits.new_full((*idx.shape[:-1], num_keys + 1), float("-inf"))
    return dense.scatter(-1, listed, selected_logits)[..., :num_keys]


def indexer_loss(
    main_attn_probs: Tensor,
    indexer_logits: Tensor,
    mask: Tensor | None,
    *,
    coeff: float = 1.0,
    include_coeff: bool = True,
    mean_over: str = "all",
    topk: int | None = None,
    topk_indices: Tensor | None = None,
    sparse_logits: bool = False,
) -> Tensor:
    """The indexer loss of one set of queries in the forms frameworks train and log:
    ``c · Σ_t KL_t / Q`` (:func:`indexer_kl`), with ``c = coeff`` when ``include_coeff`` (the objective term;
    Megatron's ``compute_dsa_indexer_loss`` and MindFormers' trackers) else 1 (a log divided by its coefficient),
    and ``Q`` the number of ``all`` queries (``mask`` ones, or ``B·Tq`` without a mask: Megatron's mean over
    ``b·sq``, MindFormers' mean over ``b·sq``) or of the ``valid`` ones (mask ones with at least one kept key).
    ``Q = 0`` gives 0. With ``sparse_logits=True``, ``indexer_logits`` are the ``[B, Tq, k]`` logits of the keys
    ``topk_indices`` lists (MindFormers 2.1.0 ``index_scores``), placed on the key axis by
    :func:`scatter_indexer_logits` first. Public path: ``lossparity.moe.indexer_loss``."""
    if mean_over not in INDEXER_MEANS:
        raise ValueError(f"mean_over must be one of {INDEXER_MEANS}, got {mean_over!r}")
    indexer_logits = _dense_logits(main_attn_probs, indexer_logits, topk_indices, sparse_logits)
    per_q = indexer_kl(main_attn_probs, indexer_logits, mask, topk=topk, reduction="none", topk_indices=topk_indices)
    q = per_q.new_ones(per_q.shape) if mask is None else (mask != 0).to(per_q.dtype).reshape(per_q.shape)
    if mean_over == "valid":  # a query keeps a key iff one is finite (and selected): topk keeps the largest
        lg = indexer_logits.unsqueeze(0) if per_q.dim() == 1 else indexer_logits
        has_key = torch.isfinite(lg)
        if topk_indices is not None:
            b, tq, tk = lg.shape
            has_key = has_key & _selected_keys(topk_indices, b, tq, tk, per_q.dim() == 1, has_key.device)
        q = q * has_key.any(dim=-1).reshape(per_q.shape).to(q.dtype)
    scale = float(coeff) if include_coeff else 1.0
    return per_q.sum() * scale / q.sum().clamp(min=1)


def _dense_logits(
    main_attn_probs: Tensor, indexer_logits: Tensor, topk_indices: Tensor | None, sparse_logits: bool
) -> Tensor:
    """``indexer_logits`` on the key axis: scattered from the sparse ``[B, Tq, k]`` form when ``sparse_logits``."""
    if not isinstance(sparse_logits, bool):
        raise TypeError(f"sparse_logits must be a bool, got {type(sparse_logits).__name__}")
    if not sparse_logits:
        return indexer_logits
    if topk_indices is None:
        raise ValueError("sparse_logits=True needs topk_indices (the keys whose logits indexer_logits holds)")
    if not isinstance(main_attn_probs, Tensor) or main_attn_probs.dim() not in (3, 4):
        raise ValueError("main_attn_probs must be [B, heads, Tq, Tk] or [heads, Tq, Tk]")
    return scatter_indexer_logits(indexer_logits, topk_indices, main_attn_probs.shape[-1])


def indexer_token_count(mask: Tensor) -> Tensor:
    """Number of valid query tokens ``Σ_t mask[t]`` (int64 scalar): the local share of ``Tq_global``.

    The invariant indexer loss is ``Σ_t KL_t / Tq_global`` with ``Tq_global`` the sum of these counts
    over microbatches and the ranks holding distinct query tokens.
    """
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    return _check_mask(mask, mask.shape, mask.device).sum(dtype=torch.int64)


def indexer_kl(
    main_attn_probs: Tensor,
    indexer_logits: Tensor,
    mask: Tensor | None,
    *,
    topk: int | None = None,
    reduction: str = "sum",
    topk_indices: Tensor | None = None,
    sparse_logits: bool = False,
) -> Tensor:
    """Indexer KL loss ``Σ_{valid t} KL(p_t || softmax(I_t))`` (``reduction="sum"``, float32 scalar).

    ``main_attn_probs`` ``[B, H, Tq, Tk]`` (or ``[H, Tq, Tk]``) are the main attention probabilities,
    ``indexer_logits`` ``[B, Tq, Tk]`` (or ``[Tq, Tk]``) the indexer scores with ``-inf`` at invalid keys,
    ``mask`` ``[B, Tq]`` (or ``[Tq]``, ``None`` = all valid) marks valid query tokens. With ``K_t`` the
    kept keys (finite logit, and among the ``topk`` largest when ``topk`` is given, or among ``topk_indices``
    ``[B, Tq, k]`` (or ``[Tq, k]``) int, the keys a sparse indexer selected, ``-1`` = no key):
    ``p_t ∝ Σ_h a[h,t,·]|K_t / Σ_{K_t} a[h,t,·]`` (L1-normalized), ``q_t = softmax(I_t over K_t)``,
    ``KL_t = Σ_{j in K_t, p>0} p_t[j] (log p_t[j] − log q_t[j])`` (``0·log 0 = 0``). ``reduction="none"``
    returns ``KL_t`` as ``[B, Tq]`` (``[Tq]``) with 0 at masked queries and at queries with no kept key (the
    module's rule). ``p_t`` is detached. Errors: NaN/``+inf`` logits, negative/NaN probabilities, a query with
    kept keys but no attention mass on them, ``topk`` together with ``topk_indices``. ``sparse_logits=True``:
    ``indexer_logits`` are ``[B, Tq, k]``, the logits of the keys ``topk_indices`` lists
    (:func:`scatter_indexer_logits`).
    """
    _check_floats(main_attn_probs, indexer_logits, reduction)
    indexer_logits = _dense_logits(main_attn_probs, indexer_logits, topk_indices, sparse_logits)
    unbatched = main_attn_probs.dim() == 3
    if main_attn_probs.dim() not in (3, 4):
        raise ValueError(
            f"main_attn_probs must be [B, heads, Tq, Tk] or [heads, Tq, Tk], got {tuple(main_attn_probs.shape)}"
        )
    a = main_attn_probs.unsqueeze(0) if unbatched else main_attn_probs
    logits = indexer_logits.unsqueeze(0) if unbatched and indexer_logits.dim() == 2 else indexer_logits
    b, _, tq, tk = a.shape
    if logits.shape != (b, tq, tk):
        expect = (tq, tk) if unbatched else (b, tq, tk)
        hint = ""
        if topk_indices is not None and indexer_logits.shape == topk_indices.shape:
            hint = " (logits of the selected keys only? pass sparse_logits=True)"
        raise ValueError(
            f"indexer_logits shape {tuple(indexer_logits.shape)} does not match main_attn_probs "
            f"{tuple(main_attn_probs.shape)}: expected {expect}{hint}"
        )
    if mask is not None and unbatched and isinstance(mask, Tensor) and mask.dim() == 1:
        mask = mask.unsqueeze(0)
    valid_q = _check_mask(mask, torch.Size((b, tq)), logits.device)
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 1):
        raise ValueError(f"topk must be a positive int or None, got {topk!r}")
    if topk is not None and topk_indices is not None:
        raise ValueError("pass topk (select by the indexer logits) or topk_indices (the selected keys), not both")
    sel = None if topk_indices is None else _selected_keys(topk_indices, b, tq, tk, unbatched, logits.device)

    i = logits if logits.dtype == torch.float64 else logits.float()
    if i.numel() and bool((torch.isnan(i) | (i == float("inf"))).any()):
        raise ValueError("indexer_logits contain NaN or +inf (only -inf is allowed, for excluded keys)")
    target = a.detach().to(i.dtype)
    if target.numel() and bool((torch.isnan(target) | (target < 0)).any()):
        raise ValueError("main_attn_probs must be non-negative probabilities without NaN")

    keep = torch.isfinite(i)
    if topk is not None and topk < tk:
        top = torch.topk(i.detach(), k=topk, dim=-1).indices
        keep = keep & torch.zeros_like(keep).scatter(-1, top, True)
    if sel is not None:
        keep = keep & sel
    has_key = keep.any(dim=-1)
    active = valid_q & has_key  # a query without a kept key: KL 0 by rule (module docstring)

    # Rows without any kept key get finite dummy logits so that no NaN enters the graph.
    i_safe = torch.where(keep, i, torch.where(has_key.unsqueeze(-1), float("-inf"), 0.0))
    log_q = torch.log_softmax(i_safe, dim=-1).masked_fill(~keep, 0.0)

    kept = target * keep.unsqueeze(1)
    head_mass = kept.sum(dim=-1, keepdim=True)
    per_head = kept / torch.where(head_mass > 0, head_mass, torch.ones_like(head_mass))
    p = per_head.sum(dim=1)  # [B, Tq, Tk]
    mass = p.sum(dim=-1, keepdim=True)
    no_mass = active & (mass.squeeze(-1) <= 0)
    if bool(no_mass.any()):
        bi, ti = no_mass.nonzero()[0].tolist()
        raise ValueError(
            f"main_attn_probs has no attention mass on the kept keys of valid query token (batch {bi}, position {ti})"
        )
    p = p / torch.where(mass > 0, mass, torch.ones_like(mass))
    pos = p > 0
    log_p = torch.log(torch.where(pos, p, torch.ones_like(p)))
    kl = torch.where(pos, p * (log_p - log_q), torch.zeros_like(p)).sum(dim=-1)
    kl = torch.where(active, kl, torch.zeros_like(kl))
    if reduction == "none":
        return kl.squeeze(0) if unbatched else kl
    return kl.sum()
