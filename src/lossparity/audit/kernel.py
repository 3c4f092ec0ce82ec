"""Audit of a cross-entropy kernel: per-token losses and gradients against float64 autograd.

A kernel is called as ``fn(logits [T, V], labels [T], reduction=..., ignore_index=-100)`` (``kind="logits"``)
or, for a fused linear cross-entropy, ``fn(hidden [T, H], weight [V, H], labels [T], reduction=...,
ignore_index=-100)`` (``kind="linear"``, logits = ``hidden @ weight.T``). Each check compares the kernel
with the float64 reference ``ℓ_t = −log softmax(z_t)[y_t]`` (0 where ``y_t = ignore_index``):

- ``none``: the vector ``ℓ`` and the gradient of ``Σ_t w_t ℓ_t`` for random per-token upstream weights
  ``w`` (a kernel that scales every token's gradient by one token's upstream gradient fails here: the
  class of Liger-Kernel #968);
- ``sum``: ``Σ_t ℓ_t`` and its gradient under an upstream gradient of 2.5;
- ``mean``: ``Σ_t ℓ_t / n`` (``n`` the tokens not ignored) and its gradient under an upstream 0.7;
- ``all ignored``: ``sum`` over a batch whose every label is ignored is 0 with a zero gradient.

The error of a check is ``max|kernel − reference| / max|reference|`` over the value and every input's
gradient; it passes at ``≤ tol`` (1e-4 for float32 inputs, 2e-2 for bfloat16/float16).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["KernelCheck", "KernelReport", "audit_kernel", "render_kernel"]

IGNORE = -100


@dataclass
class KernelCheck:
    """One check: its ``name``, the worst relative error of the value and of the gradients, ``passed``
    (``error``: the kernel raised)."""

    name: str
    value_err: float | None
    grad_err: float | None
    passed: bool
    error: str = ""


@dataclass
class KernelReport:
    """The checks of one kernel, the tolerance, the exit code (0 every check passed, 1 otherwise)."""

    kind: str
    tol: float
    checks: list[KernelCheck] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """0 when every check passed, else 1."""
        return 0 if all(c.passed for c in self.checks) else 1

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (``--json``)."""
        return {
            "kind": self.kind,
            "tol": self.tol,
            "exit_code": self.exit_code,
            "checks": [c.__dict__ for c in self.checks],
        }


def _rel(a: Tensor, r: Tensor) -> float:
    if a.shape != r.shape:
        return float("inf")
    scale = float(r.abs().max()) if r.numel() else 0.0
    diff = float((a.double() - r).abs().max()) if r.numel() else 0.0
    return diff / scale if scale > 0 else diff


def _reference(
    inputs: list[Tensor], labels: Tensor, kind: str, reduction: str, upstream: Tensor
) -> tuple[Tensor, list[Tensor]]:
    xs = [x.detach().double().requires_grad_(True) for x in inputs]
    logits = xs[0] if kind == "logits" else xs[0] @ xs[1].T
    out = F.cross_entropy(logits, labels, reduction=reduction, ignore_index=IGNORE)
    if reduction == "mean" and int((labels != IGNORE).sum()) == 0:
        out = logits.sum() * 0.0  # torch gives NaN for an empty mean; the convention checked is 0
    grads = torch.autograd.grad(out, xs, grad_outputs=upstream.double())
    return out.detach(), [g.detach() for g in grads]


def _check(
    fn: Callable[..., Tensor],
    name: str,
    inputs: list[Tensor],
    labels: Tensor,
    kind: str,
    reduction: str,
    upstream: Tensor,
    tol: float,
) -> KernelCheck:
    ref, ref_grads = _reference(inputs, labels, kind, reduction, upstream)
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    try:
        out = fn(*xs, labels, reduction=reduction, ignore_index=IGNORE)
        out = out if isinstance(out, Tensor) else out[0]
        grads = torch.autograd.grad(out, xs, grad_outputs=upstream.to(out.dtype).reshape(out.shape), allow_unused=True)
    except Exception as e:  # a kernel that raises fails its check, with the kernel's message
        return KernelCheck(name, None, None, False, f"{type(e).__name__}: {e}")
    value_err = _rel(out.detach().reshape(ref.shape), ref)
    grad_err = max(_rel(torch.zeros_like(r) if g is None else g, r) for g, r in zip(grads, ref_grads))
    return KernelCheck(name, value_err, grad_err, value_err <= tol and grad_err <= tol)


def audit_kernel(
    fn: Callable[..., Tensor],
    *,
    kind: str = "logits",
    tokens: int = 64,
    vocab: int = 96,
    hidden: int = 32,
    dtype: torch.dtype = torch.float32,
    tol: float | None = None,
    seed: int = 0,
) -> KernelReport:
    """Run the checks of the module docstring on ``fn`` with ``tokens`` random tokens (a quarter of them
    ignored), ``vocab`` classes (and ``hidden`` features for ``kind="linear"``) in ``dtype``."""
    if kind not in ("logits", "linear"):
        raise ValueError(f"audit_kernel: kind must be 'logits' or 'linear', got {kind!r}")
    if tokens < 4 or vocab < 2:
        raise ValueError(f"audit_kernel: tokens must be >= 4 and vocab >= 2, got {tokens} and {vocab}")
    tol = tol if tol is not None else (1e-4 if dtype in (torch.float32, torch.float64) else 2e-2)
    g = torch.Generator().manual_seed(seed)
    if kind == "logits":
        inputs = [(3 * torch.randn(tokens, vocab, generator=g)).to(dtype)]
    else:
        inputs = [
            torch.randn(tokens, hidden, generator=g).to(dtype),
            (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(dtype),
        ]
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[torch.randperm(tokens, generator=g)[: tokens // 4]] = IGNORE
    w = torch.rand(tokens, generator=g) * 2 + 0.1
    w[0] = 1.0  # a kernel that applies token 0's upstream gradient to every token is then visibly wrong
    report = KernelReport(kind, tol)
    one = torch.tensor(1.0)
    report.checks += [
        _check(fn, "reduction=none: losses, per-token upstream weights", inputs, labels, kind, "none", w, tol),
        _check(fn, "reduction=sum, upstream 2.5", inputs, labels, kind, "sum", 2.5 * one, tol),
        _check(fn, "reduction=mean, upstream 0.7", inputs, labels, kind, "mean", 0.7 * one, tol),
        _check(fn, "all labels ignored, reduction=sum", inputs, torch.full_like(labels, IGNORE), kind, "sum", one, tol),
    ]
    return report


def render_kernel(report: KernelReport) -> str:
    """The kernel report as a Markdown table and a verdict line."""
    lines = ["| check | value error | gradient error | result |", "|---|---|---|---|"]
    for c in report.checks:
        if c.error:
            lines.append(f"| {c.name} | raised: {c.error} | | FAIL |")
            continue
        lines.append(f"| {c.name} | {c.value_err:.1e} | {c.grad_err:.1e} | {'PASS' if c.passed else 'FAIL'} |")
    n_ok = sum(c.passed for c in report.checks)
    lines.append(
        f"{n_ok}/{len(report.checks)} checks pass (tolerance {report.tol:g} relative, float64 autograd reference)"
    )
    return "\n".join(lines)
