"""Which weight did the stack give each document? Identification of a step's gradient as a named mode.

For a row-separable loss the gradient a step leaves is a linear combination of the documents' own
gradients, ``G = Σ_u c_u ∇s_u`` with ``s_u = Σ_{t ∈ u} ℓ_t`` (the summed next-token losses of document
``u``). The coefficients are found by least squares over the parameters (``P ≫ U``), in float64; every
normalization mode of ``docs/semantics.md`` §1 predicts them:

    c_u = r_u / max(C, 1),   r_u = 1 (sum), 1 / max(n_unit(u), 1) (unit_mean), 1 / L (sum_over_length)

with ``C`` the mode's global count (tokens, rows, documents, microbatches) and ``n_unit(u)`` the targets of
the row, document or microbatch that holds ``u``. The named mode is the one whose prediction is parallel
to ``c`` (``c ≈ α · p``), its factor ``α``; a relative residual ``‖G − Bc‖ / ‖G‖`` far above rounding
means the loss is not row-separable (MoE aux terms, batch-dependent layers, randomness).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..losses.mode_table import MODE_TABLE
from .batch import IGNORE, AuditBatch

__all__ = [
    "Basis",
    "AuxBasis",
    "aux_basis",
    "Identification",
    "basis_gradients",
    "identify",
    "default_logits",
    "logits_losses",
    "token_losses",
    "mode_weights",
    "fmt_factor",
]

# A named mode fits when its prediction is parallel to the fitted coefficients to this relative misfit.
NAME_TOL = 1e-3
# Modes whose predictions coincide on a batch are named in this order (per_sample before per_document on
# one-document rows, per_token before per_microbatch at one microbatch).
_PREFERENCE = ("per_token", "per_sample", "per_document", "per_microbatch", "sample_sum", "sample_sum_norm", "per_rank")
# The mean over the D ranks of each rank's token mean: what a stack that counts tokens per rank computes
# (Hugging Face's ``average_tokens_across_devices=False``); named by the audit, not a mode one can train.
PER_RANK = "per_rank"


def default_logits(model: nn.Module, mb: Mapping[str, Tensor]) -> Tensor:
    """The logits ``[b, s, V]`` of a causal LM: ``model(input_ids=, attention_mask=, position_ids=)``
    (its ``.logits`` for a Hugging Face output), or ``model(input_ids)`` for a module without those
    keywords."""
    try:
        out = model(
            input_ids=mb["input_ids"], attention_mask=mb.get("attention_mask"), position_ids=mb.get("position_ids")
        )
    except TypeError:
        out = model(mb["input_ids"])
    logits = getattr(out, "logits", out)
    if isinstance(out, (tuple, list)):
        logits = out[0]
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        raise TypeError("audit: the model's forward must return logits [b, s, vocab] (or an output with .logits)")
    return logits


def token_losses(logits: Tensor, labels: Tensor) -> Tensor:
    """``ℓ[:, t] = CE(logits[:, t-1], labels[:, t])`` for ``t ≥ 1`` (0 where ignored), ``ℓ[:, 0] = 0``."""
    b, s, v = logits.shape
    lt = F.cross_entropy(
        logits[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1), reduction="none", ignore_index=IGNORE
    ).view(b, s - 1)
    return torch.cat([lt.new_zeros(b, 1), lt], dim=1)


@dataclass
class Basis:
    """The documents' gradients ``B [P, U]`` and loss sums ``s [U]`` at the step's initial parameters
    (float64), with the parameter names in the order of ``B``'s rows."""

    names: list[str]
    shapes: list[torch.Size]
    grads: Tensor
    sums: Tensor
    batch: AuditBatch

    def flatten(self, grads: Mapping[str, Tensor]) -> Tensor:
        """A gradient dict as one float64 vector in the basis's parameter order (missing: zeros)."""
        parts = []
        for name, shape in zip(self.names, self.shapes):
            g = grads.get(name)
            parts.append(torch.zeros(shape.numel(), dtype=torch.float64) if g is None else g.double().reshape(-1))
        return torch.cat(parts)


def logits_losses(
    logits_fn: Callable[[nn.Module, Mapping[str, Tensor]], Tensor],
) -> Callable[[nn.Module, Mapping[str, Tensor]], Tensor]:
    """The per-token losses ``ℓ [b, S]`` of a model whose forward gives logits (:func:`token_losses`)."""

    def losses(model: nn.Module, mb: Mapping[str, Tensor]) -> Tensor:
        return token_losses(logits_fn(model, mb).double(), mb["labels"])

    return losses


def basis_gradients(
    model: nn.Module, batch: AuditBatch, losses_fn: Callable[[nn.Module, Mapping[str, Tensor]], Tensor]
) -> Basis:
    """Each document's ``∇s_u`` in float64 on ``model`` (a float64 copy of the stack's model at its
    initial parameters), one row at a time (a row-separable model gives the same losses in any batch);
    ``losses_fn(model, microbatch)`` gives the per-token losses ``ℓ[:, t]`` of predicting ``labels[:, t]``."""
    model = model.double()
    model.train()  # the stack trains in train mode; a dropout model is not row-separable (its residual says so)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    columns: list[Tensor | None] = []
    sums: list[float] = []
    for i in range(batch.rows):
        mb = batch.microbatch([i])
        ell = losses_fn(model, mb)[0].double()
        units = [u for u in batch.units if u.row == i]
        for j, u in enumerate(units):
            s_u = ell[u.start : u.end].sum()
            sums.append(float(s_u.detach()))
            if u.n == 0:
                columns.append(None)
                continue
            gs = torch.autograd.grad(s_u, [p for _, p in params], retain_graph=j < len(units) - 1, allow_unused=True)
            columns.append(
                torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, (_, p) in zip(gs, params)])
            )
    total = sum(p.numel() for _, p in params)
    grads = torch.stack([torch.zeros(total, dtype=torch.float64) if c is None else c for c in columns], dim=1)
    return Basis(
        [n for n, _ in params], [p.shape for _, p in params], grads, torch.tensor(sums, dtype=torch.float64), batch
    )


@dataclass
class AuxBasis:
    """The router aux losses of one configuration's microbatches at the initial parameters: their
    gradients ``grads [P, M]``, values ``values [M]`` and ``keys[m] = (rank, microbatch)``."""

    grads: Tensor
    values: Tensor
    keys: list[tuple[int, int]]


def aux_basis(
    model: nn.Module,
    basis: Basis,
    assignment: Mapping[int, tuple[int, int]],
    aux_fn: Callable[[nn.Module, Mapping[str, Tensor]], Tensor],
) -> AuxBasis:
    """``∇A_m`` of every microbatch ``m`` of a configuration (its rows together, as the stack ran them)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for row, key in sorted(assignment.items()):
        groups.setdefault(key, []).append(row)
    params = dict(model.named_parameters())
    columns, values = [], []
    for key in sorted(groups):
        a = aux_fn(model, basis.batch.microbatch(groups[key])).double()
        ps = [params[n] for n in basis.names]
        gs = torch.autograd.grad(a, ps, allow_unused=True)
        columns.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(gs, ps)]))
        values.append(float(a.detach()))
    return AuxBasis(torch.stack(columns, dim=1), torch.tensor(values, dtype=torch.float64), sorted(groups))


def mode_weights(
    mode: str, batch: AuditBatch, assignment: Mapping[int, tuple[int, int]], dp: int, ga: int
) -> Tensor | None:
    """The coefficient ``c_u`` that ``mode`` gives each document (``None`` for a mode the audit cannot
    predict). ``assignment[row] = (rank, microbatch)``; ``dp·ga`` microbatches in the step."""
    n = torch.tensor([u.n for u in batch.units], dtype=torch.float64)
    row_n: dict[int, float] = {}
    mb_n: dict[tuple[int, int], float] = {}
    rank_n: dict[int, float] = {}
    for u in batch.units:
        row_n[u.row] = row_n.get(u.row, 0.0) + u.n
        key = assignment[u.row]
        mb_n[key] = mb_n.get(key, 0.0) + u.n
        rank_n[key[0]] = rank_n.get(key[0], 0.0) + u.n
    if mode == PER_RANK:  # not a lossparity mode: the signature of a normalizer counted on each rank alone
        return (
            torch.tensor([1.0 / max(rank_n[assignment[u.row][0]], 1.0) for u in batch.units], dtype=torch.float64) / dp
        )
    spec = MODE_TABLE.get(mode)  # type: ignore[call-overload]
    if spec is None:
        return None
    counts = {
        "tokens": float(n.sum()),
        "samples": float(batch.rows),
        "documents": float(len(batch.units)),
        "microbatches": float(dp * ga),
    }
    if spec.count not in counts:
        return None
    if spec.reduction == "sum":
        r = torch.ones_like(n)
    elif spec.reduction == "sum_over_length":
        r = torch.full_like(n, 1.0 / batch.input_ids.shape[1])
    elif spec.unit == "sample":
        r = torch.tensor([1.0 / max(row_n[u.row], 1.0) for u in batch.units], dtype=torch.float64)
    elif spec.unit == "document":
        r = 1.0 / n.clamp(min=1.0)
    elif spec.unit == "microbatch":
        r = torch.tensor([1.0 / max(mb_n[assignment[u.row]], 1.0) for u in batch.units], dtype=torch.float64)
    else:
        return None
    return r / max(counts[spec.count], 1.0)


def fmt_factor(alpha: float) -> str:
    """``α`` as a short fraction when it is one (``8/7``, ``1/4``, ``2``), else 4 significant digits."""
    if not math.isfinite(alpha):
        return str(alpha)
    frac = Fraction(alpha).limit_denominator(16)
    if frac != 0 and abs(float(frac) - alpha) <= 1e-4 * abs(alpha):
        return str(frac)
    return f"{alpha:.4g}"


@dataclass
class Identification:
    """What a step computed: ``mode`` and ``factor`` (``None`` when no mode fits), the readable ``name``
    (``per_token``, ``per_sample × 8/7``, ``per_token; rank 1's rows × 2``), the fit's ``residual``
    ``‖G − Bc‖/‖G‖``, the ``misfit`` of the named mode, the fitted ``coefficients``, the weights ``β_m``
    of the microbatches' router aux losses (``aux_weights``; empty without MoE), and the optimized objective
    ``Σ_u c_u s_u + Σ_m β_m A_m`` at the initial parameters."""

    mode: str | None
    factor: float | None
    name: str
    residual: float
    misfit: float
    separable: bool
    objective: float
    coefficients: list[float]
    aux_weights: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The identification as JSON-ready data."""
        return dict(self.__dict__)


def _distance_from_one(alpha: float) -> float:
    """``|log α|``: among modes that fit equally well, the one whose factor is nearest 1 is named."""
    return abs(math.log(abs(alpha) or 1e-300))


def _fit(c: Tensor, p: Tensor, scale: Tensor | None = None) -> tuple[float, float]:
    """``α`` minimizing ``‖c − α p‖`` and the misfit ``‖c − α p‖ / scale`` (default ``‖c‖``; a group of
    documents is measured against all of ``c``, so that a group the stack dropped fits ``α = 0``)."""
    alpha = float(c @ p / (p @ p))
    ref = c.norm() if scale is None else scale
    return alpha, float((c - alpha * p).norm() / ref.clamp(min=1e-300))


def identify(
    basis: Basis,
    grads: Mapping[str, Tensor],
    assignment: Mapping[int, tuple[int, int]],
    dp: int,
    ga: int,
    *,
    separable_tol: float,
    aux: AuxBasis | None = None,
) -> Identification:
    """Fit ``grads = Σ_u c_u ∇s_u`` (``+ Σ_m β_m ∇A_m`` with ``aux``: the router aux losses ``A_m`` of the
    configuration's microbatches) and name the mode whose weights are parallel to ``c`` (module doc)."""
    g = basis.flatten(grads)
    if not bool(torch.isfinite(g).all()):
        raise ValueError("the step's gradient has NaN or inf entries (a microbatch without targets divided by 0?)")
    gnorm = float(g.norm())
    if gnorm == 0.0:
        raise ValueError("audit: the step left no gradient in the model's parameters (did it call backward?)")
    live = [i for i, u in enumerate(basis.batch.units) if u.n > 0]
    b = basis.grads[:, live]
    if aux is not None:
        b = torch.cat([b, aux.grads], dim=1)
    full = torch.linalg.lstsq(b, g.unsqueeze(1), driver="gelsd").solution.squeeze(1)
    residual = float((g - b @ full).norm()) / gnorm
    sol = full[: len(live)]
    c_full = torch.zeros(len(basis.batch.units), dtype=torch.float64)
    c_full[live] = sol
    objective = float(c_full @ basis.sums)
    aux_weights: list[float] = []
    if aux is not None:
        beta = full[len(live) :]
        aux_weights = [float(x) for x in beta]
        objective += float(beta @ aux.values)
    separable = residual <= separable_tol
    best: tuple[float, float, str] | None = None
    for mode in _PREFERENCE + tuple(m for m in MODE_TABLE if m not in _PREFERENCE):
        p_full = mode_weights(mode, basis.batch, assignment, dp, ga)
        if p_full is None:
            continue
        alpha, misfit = _fit(sol, p_full[live])
        if (
            best is None
            or misfit < best[1] - NAME_TOL
            or (
                abs(misfit - best[1]) <= NAME_TOL
                and abs(math.log(abs(alpha) or 1e-300)) < abs(math.log(abs(best[0]) or 1e-300))
            )
        ):
            best = (alpha, misfit, mode)
    assert best is not None
    alpha, misfit, mode = best
    coeffs = [float(x) for x in c_full]
    if misfit <= NAME_TOL:
        name = mode if abs(alpha - 1.0) <= NAME_TOL else f"{mode} × {fmt_factor(alpha)}"
        return Identification(mode, alpha, name, residual, misfit, separable, objective, coeffs, aux_weights)
    grouped = _grouped_name(sol, live, basis, assignment, dp, ga)
    if grouped is not None:
        gname, gmisfit = grouped
        return Identification(None, None, gname, residual, gmisfit, separable, objective, coeffs, aux_weights)
    return Identification(
        None,
        None,
        f"no named mode (closest {mode}, misfit {misfit:.2g})",
        residual,
        misfit,
        separable,
        objective,
        coeffs,
        aux_weights,
    )


def _grouped_name(
    sol: Tensor,
    live: list[int],
    basis: Basis,
    assignment: Mapping[int, tuple[int, int]],
    dp: int,
    ga: int,
) -> tuple[str, float] | None:
    """A mode whose weights fit ``c`` with one factor per rank or per microbatch, e.g. ``per_token; rank
    1's rows × 2``: the signature of a reduction that sums (or drops) one rank's gradient. Among the modes
    that fit, the one with the fewest factors other than 1 is named (``per_microbatch; microbatch 0's rows ×
    0, ...`` rather than ``per_token`` with a factor on every microbatch); a step that kept only the last
    micro-step of every rank is said so."""
    units = [basis.batch.units[i] for i in live]
    for label, key in (
        ("rank", lambda r: assignment[r][0]),
        ("microbatch", lambda r: assignment[r][1] * dp + assignment[r][0]),
    ):
        groups: dict[int, list[int]] = {}
        for j, u in enumerate(units):
            groups.setdefault(key(u.row), []).append(j)
        if len(groups) < 2:
            continue
        fits: list[tuple[int, int, str, dict[int, float], float]] = []
        for rank_, mode in enumerate(_PREFERENCE):
            p_full = mode_weights(mode, basis.batch, assignment, dp, ga)
            if p_full is None:
                continue
            p = p_full[live]
            factors, ok, worst = {}, True, 0.0
            for gid, idx in sorted(groups.items()):
                ix = torch.tensor(idx)
                alpha, misfit = _fit(sol[ix], p[ix], sol.norm())
                factors[gid], worst = (alpha if abs(alpha) > NAME_TOL else 0.0), max(worst, misfit)
                ok = ok and misfit <= NAME_TOL
            if ok:
                off_one = sum(abs(a - 1.0) > NAME_TOL for a in factors.values())
                fits.append((off_one, rank_, mode, factors, worst))
        if fits:
            _, _, mode, factors, worst = min(fits, key=lambda f: (f[0], f[1]))
            parts = [f"{label} {gid}'s rows × {fmt_factor(a)}" for gid, a in factors.items()]
            name = f"{mode}; " + ", ".join(parts)
            last = {gid for gid in factors if gid // dp == ga - 1}
            if label == "microbatch" and ga > 1 and all((a != 0.0) == (gid in last) for gid, a in factors.items()):
                name += " (only the last micro-step of each rank)"
            return name, worst
    return None
