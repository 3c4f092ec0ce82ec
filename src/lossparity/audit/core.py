"""``audit``: run the user's training step under configurations that must give the same update, and say
which normalization mode each one computed (docs/audit.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..distributed.launch import free_port
from ..options import MODES
from .batch import DEFAULT_CLASSES, AuditBatch, Config, configs_for, craft_batch
from .deepspeed import DeepSpeedStep
from .identify import (
    NAME_TOL,
    Basis,
    Identification,
    aux_basis,
    basis_gradients,
    default_logits,
    fmt_factor,
    identify,
    logits_losses,
)
from .megatron import MegatronStep
from .stack import (
    HandLoop,
    RunResult,
    TrainerContext,
    TrainerFactory,
    basis_model,
    build_model,
    resolve,
    run_config,
    spec_of,
    trainer_overrides,
)
from .torchtitan import TitanStep, titan_logits, uses_float32_loss
from .worker import user_frame

__all__ = ["audit", "AuditError", "AuditReport", "ConfigRow", "Stack"]

Stack = HandLoop | TrainerFactory | MegatronStep | DeepSpeedStep | TitanStep

SEPARABLE_TOL = 1e-4  # a float32 stack's gradient is fitted to ~1e-6; a non-separable term leaves far more
LOG_TOL = 1e-4  # the logged loss against the optimized objective (float32 values)


class AuditError(Exception):
    """The audit could not run (bad spec, a stack that raised): the CLI's exit 2. ``where`` is the place in
    the user's code that raised, when one did."""

    def __init__(self, message: str, where: str | None = None) -> None:
        super().__init__(message + (f" (raised at {where})" if where else ""))
        self.where = where


@dataclass
class ConfigRow:
    """One configuration's line of the report (``skipped``: why it did not run)."""

    config: str
    klass: str
    layout: str
    found: Identification | None = None
    vs_reference: float | None = None
    logged: float | None = None
    invariant: bool | None = None
    log_matches: bool | None = None
    skipped: str = ""
    note: str = ""
    aux: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The row as JSON-ready data."""
        d = {k: v for k, v in self.__dict__.items() if k != "found"}
        d["found"] = None if self.found is None else self.found.as_dict()
        return d


@dataclass
class AuditReport:
    """The audit's result: one row per configuration, the tolerance, the first class that broke, whether
    the stack matched ``expect``, the exit code (0 invariant and as expected, 1 otherwise, 2 when a
    configuration could not run)."""

    stack: str
    rows: list[ConfigRow]
    tol: float
    expect: str | None
    first_broken: str | None
    separable: bool
    wall_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def invariant(self) -> bool:
        """No configuration's gradient differs from the reference's by more than ``tol``."""
        return all(r.invariant is not False for r in self.rows)

    @property
    def as_expected(self) -> bool:
        """Every configuration computes exactly ``expect`` (factor 1); true without ``expect``."""
        if self.expect is None:
            return True
        return all(
            r.found is not None and r.found.mode == self.expect and abs((r.found.factor or 0.0) - 1.0) <= NAME_TOL
            for r in self.rows
            if not r.skipped
        )

    @property
    def incomplete(self) -> list[ConfigRow]:
        """The configurations that could not run (exit 2: the audit is not a verdict on them)."""
        return [r for r in self.rows if r.skipped]

    @property
    def exit_code(self) -> int:
        """2 when a configuration could not run, else 0 invariant and as expected, else 1."""
        if self.incomplete:
            return 2
        return 0 if self.invariant and self.as_expected else 1

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (``--json``)."""
        return {
            "stack": self.stack,
            "rows": [r.as_dict() for r in self.rows],
            "tol": self.tol,
            "expect": self.expect,
            "first_broken": self.first_broken,
            "separable": self.separable,
            "invariant": self.invariant,
            "as_expected": self.as_expected,
            "exit_code": self.exit_code,
            "incomplete": [r.config for r in self.incomplete],
            "wall_s": self.wall_s,
            "notes": self.notes,
        }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a − b| / max|b|``: the worst difference of a gradient, relative to the largest entry."""
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _logits_fn(stack: Any) -> Any:
    if isinstance(stack, TitanStep):
        return titan_logits
    logits = getattr(stack, "logits", None)
    if logits is None:
        return default_logits
    return resolve(logits) if isinstance(logits, str) else logits


def _losses_fn(stack: Any) -> Any:
    """The per-token losses the documents' gradients are taken of: your Megatron ``forward_step``'s output
    tensor, or the cross-entropy of the model's logits."""
    if not isinstance(stack, MegatronStep):
        return logits_losses(_logits_fn(stack))
    from .megatron import megatron_token_losses

    return megatron_token_losses(stack)


def _vocab(stack: Stack) -> int:
    """The model's vocabulary size: the last dimension of its logits on a two-token row (the hand loop),
    or the Trainer's model's output embedding."""
    if not isinstance(stack, TrainerFactory):
        if isinstance(stack, MegatronStep):  # its output tensor holds losses, not logits: the user says
            return stack.vocab_size
        model = build_model(stack)
        with torch.no_grad():
            mb = {"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.ones(1, 2, dtype=torch.long)}
            mb["position_ids"] = torch.arange(2)[None]
            return int(_logits_fn(stack)(model, mb).shape[-1])
    factory = resolve(stack.factory) if isinstance(stack.factory, str) else stack.factory
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        trainer = factory(TrainerContext(trainer_overrides(Config("probe", "probe"), tmp), craft_batch(8)))
        emb = trainer.model.get_output_embeddings()
        return int(emb.weight.shape[0])


def _spec(stack: Stack) -> tuple[dict[str, Any] | None, str]:
    """The JSON spec of a worker process, or ``None`` and the reason (a callable a process cannot import)."""
    if isinstance(stack, HandLoop):
        parts: dict[str, Any] = {"model": stack.model, "step": stack.step, "logits": stack.logits}
        spec: dict[str, Any] = {"kind": "hand loop", "wrap_ddp": stack.wrap_ddp}
    elif isinstance(stack, DeepSpeedStep):
        parts = {"model": stack.model, "loss": stack.loss}
        spec = {"kind": stack.kind, "zero_stage": stack.zero_stage, "offload": stack.offload, "config": stack.config}
    elif isinstance(stack, MegatronStep):
        parts = {"model": stack.model, "forward_step": stack.forward_step}
        spec = {"kind": stack.kind}
    elif isinstance(stack, TitanStep):
        if stack.model_config is not None:
            return None, "a torchtitan model_config does not travel to a worker process (leave it None for 2 ranks)"
        parts = {"model": stack.model, "loss": stack.loss, "trainer": stack.trainer, "parallelize": stack.parallelize}
        spec = {"kind": stack.kind}
    else:
        parts = {"factory": stack.factory, "logits": stack.logits}
        spec = {"kind": "trainer"}
    for key, obj in parts.items():
        if obj is None:
            spec[key] = None
            continue
        s = spec_of(obj)
        if s is None:
            return None, f"the {key} callable is not importable by a worker process (define it at module level)"
        spec[key] = s
    return spec, ""


def _run_workers(
    stack: Stack, cfgs: list[Config], vocab: int, timeout_s: float, nproc: int = 2
) -> dict[str, RunResult | AuditError]:
    """Run the ``nproc``-rank configurations in one ``torchrun`` of :mod:`.worker`; every rank's results read
    back."""
    spec, why = _spec(stack)
    if spec is None:
        return {c.name: AuditError(why) for c in cfgs}
    spec.update(
        # every field, ``extra`` too: it carries the ZeRO stage and offload of the class ``zero``'s configurations
        vocab=vocab,
        configs=[{k: getattr(c, k) for k in Config.__dataclass_fields__} for c in cfgs],
    )
    spec["timeout_s"] = 60
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *sys.path[1:], env.get("PYTHONPATH", "")])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}"]
        cmd += ["--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "lossparity.audit.worker"]
        cmd += [str(Path(tmp) / "spec.json"), tmp]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {c.name: AuditError(f"the {nproc}-rank run did not finish in {timeout_s:.0f} s") for c in cfgs}
        files = [Path(tmp) / f"rank{r}.pt" for r in range(nproc)]
        if not all(f.exists() for f in files):
            why = _last_error_line(proc.stderr or "")
            return {c.name: AuditError(f"the {nproc}-rank run failed: {why}") for c in cfgs}
        ranks = [torch.load(f, weights_only=True) for f in files]
    out: dict[str, RunResult | AuditError] = {}
    for c in cfgs:
        errs = [r[c.name] for r in ranks if c.name in r and "error" in r[c.name]]
        if errs or c.name not in ranks[0]:
            e = errs[0] if errs else {"error": "not run (an earlier configuration failed)", "where": None}
            out[c.name] = AuditError(str(e["error"]), e["where"])
            continue
        r0 = ranks[0][c.name]
        assignment = {int(k): (int(v[0]), int(v[1])) for k, v in r0["assignment"].items()}
        out[c.name] = RunResult(r0["grads"], r0["logged"], assignment, r0["initial"], r0["note"])
    return out


def _last_error_line(stderr: str) -> str:
    """The last line of a failed ``torchrun``'s output that names an exception (its banner lines are not)."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ("Error" in ln or "Exception" in ln) and not ln.startswith(("File ", "torch.distributed.elastic")):
            return ln
    return lines[-1] if lines else "no output"


def _run_local(stack: Stack, cfg: Config, batch: AuditBatch) -> RunResult:
    try:
        return run_config(stack, cfg, batch, 0, 1)
    except (AuditError, KeyboardInterrupt):
        raise
    except Exception as e:  # the user's code raised: name the file and line (CLI exit 2)
        raise AuditError(f"{cfg.name}: {type(e).__name__}: {e}", user_frame(e)) from e


def audit(
    stack: Stack,
    *,
    classes: Sequence[str] = DEFAULT_CLASSES,
    expect: str | None = None,
    tol: float | None = None,
    timeout_s: float = 600.0,
) -> AuditReport:
    """Audit ``stack``: run its step in the reference configuration (1 rank, GA 1, the 8 crafted rows in
    one microbatch) and in every configuration of ``classes`` (``ga``, ``microbatch``, ``dp``,
    ``recompute``, ``packing``), identify each step's gradient as a named mode
    (:func:`lossparity.audit.identify.identify`), and compare it with the reference's:

        vs_reference = max|G_config − G_reference| / max|G_reference|   (invariant when ≤ tol)

    ``tol`` defaults to 1e-5 for a float32 model and 1e-10 for a float64 one. ``expect`` (a mode of
    ``lossparity modes``) turns any configuration computing another mode, or the same with a factor, into a
    failure. Raises :class:`AuditError` when the stack cannot run."""
    if "zero" in classes and not isinstance(stack, DeepSpeedStep):
        raise AuditError("the class 'zero' (ZeRO stages and offload) needs a DeepSpeed stack (--deepspeed)")
    if expect is not None and expect not in MODES:
        raise AuditError(f"--expect {expect!r} is not a mode; valid modes: {', '.join(MODES)}")
    t0 = time.perf_counter()
    try:
        vocab = _vocab(stack)
    except AuditError:
        raise
    except Exception as e:
        raise AuditError(f"building the model: {type(e).__name__}: {e}", user_frame(e)) from e
    cfgs = configs_for(list(classes))
    batches = {False: craft_batch(vocab), True: craft_batch(vocab, packed=True)}
    ref_cfg = cfgs[0]
    results: dict[str, RunResult | AuditError] = {}
    if isinstance(stack, DeepSpeedStep):  # DeepSpeed keeps its process groups: one process per launch
        results.update(_run_workers(stack, [c for c in cfgs if c.dp == 1], vocab, timeout_s, nproc=1))
        ref_res = results[ref_cfg.name]
        if isinstance(ref_res, AuditError):
            raise ref_res
        ref = ref_res
    else:
        ref = _run_local(stack, ref_cfg, batches[False])
        results[ref_cfg.name] = ref
    for c in cfgs[1:]:
        if c.dp == 1 and c.name not in results:
            try:
                results[c.name] = _run_local(stack, c, batches[c.packed])
            except AuditError as e:
                results[c.name] = e
    multi = [c for c in cfgs if c.dp > 1]
    if multi:
        results.update(_run_workers(stack, multi, vocab, timeout_s))
    model = basis_model(stack, ref)
    dtype = _param_dtype(stack, ref)
    tol = tol if tol is not None else (1e-10 if dtype == torch.float64 else 1e-5)
    losses = _losses_fn(stack)
    model64 = _copy(model).double()
    bases: dict[bool, Basis] = {p: basis_gradients(model64, batches[p], losses) for p in {c.packed for c in cfgs}}
    aux_fn = _aux_fn(stack, model64, batches[False])
    rows = [_row(c, results[c.name], bases[c.packed], ref, tol, aux_fn, model64) for c in cfgs]
    _describe_aux(rows, cfgs)
    broken = next((r.klass for r in rows if r.invariant is False), None)
    separable = all(r.found is None or r.found.separable for r in rows)
    report = AuditReport(stack.kind, rows, tol, expect, broken, separable, time.perf_counter() - t0)
    if not separable:
        report.notes.append(
            "the step's gradient is not a combination of the documents' own gradients (residual above "
            f"{SEPARABLE_TOL:g}): a term that is not row-separable (MoE aux loss, batch-dependent layers, "
            "randomness), or a stack that trains on other tokens than the crafted labels (a collator that "
            "ignores the completion mask); the named modes are approximate, invariance is judged alone"
        )
    return report


def _hf_aux(model: nn.Module, mb: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A Hugging Face MoE model's router aux loss of one microbatch (``output_router_logits=True``)."""
    out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], output_router_logits=True)
    return out.aux_loss


def _aux_fn(stack: Stack, model64: nn.Module, batch: AuditBatch) -> Any:
    """The router aux loss of a microbatch when the stack's model has one (a Hugging Face MoE model that
    returns ``aux_loss``), else ``None``: the fit then has one column per microbatch for it."""
    if isinstance(stack, MegatronStep):
        return None
    try:
        aux = _hf_aux(model64, batch.microbatch([0, 1]))
    except Exception:  # a model without router outputs (or without the keyword): no aux term to fit
        return None
    return _hf_aux if isinstance(aux, torch.Tensor) and aux.requires_grad else None


def _describe_aux(rows: list[ConfigRow], cfgs: list[Config]) -> None:
    """Each configuration's aux weights relative to the reference's: ``f_m = β_m · D·K / β_ref`` (1 when
    the aux term is the mean over the step's microbatches with the reference's coefficient; ``D·K`` when
    every microbatch's term is added whole, ``D`` when the data-parallel reduction multiplies it)."""
    ref = rows[0].found
    if ref is None or len(ref.aux_weights) != 1 or ref.aux_weights[0] == 0.0:
        return
    beta_ref = ref.aux_weights[0]
    for row, cfg in zip(rows, cfgs):
        if row.found is None or not row.found.aux_weights:
            continue
        f = [b * cfg.dp * cfg.ga / beta_ref for b in row.found.aux_weights]
        if max(f) - min(f) <= 1e-3 * max(abs(x) for x in f):
            row.aux = f"aux × {fmt_factor(sum(f) / len(f))}"
        else:
            row.aux = "aux × [" + ", ".join(fmt_factor(x) for x in f) + "]"


def _param_dtype(stack: Stack, ref: RunResult) -> torch.dtype:
    """The dtype the stack computes in: its reference run's model's parameters (float32 if unknown; float32
    for torchtitan's own cross-entropy, which casts the logits to float32)."""
    if isinstance(stack, TitanStep) and uses_float32_loss(stack):
        return torch.float32
    if ref.model is not None:
        return next(ref.model.parameters()).dtype
    if not isinstance(stack, TrainerFactory):
        return next(build_model(stack).parameters()).dtype
    return torch.float32  # a Trainer whose run kept no model (not reached: run_trainer always keeps it)


def _copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def _row(
    cfg: Config,
    res: RunResult | AuditError,
    basis: Basis,
    ref: RunResult,
    tol: float,
    aux_fn: Any = None,
    model64: nn.Module | None = None,
) -> ConfigRow:
    layout = (
        f"D{cfg.dp} K{cfg.ga} b{cfg.micro}"
        + (" recompute" if cfg.recompute else "")
        + (" packed" if cfg.packed else "")
    )
    row = ConfigRow(cfg.name, cfg.klass, layout)
    if isinstance(res, AuditError):
        row.skipped = str(res)
        return row
    row.note = res.note
    try:
        aux = None if aux_fn is None or model64 is None else aux_basis(model64, basis, res.assignment, aux_fn)
        found = identify(basis, res.grads, res.assignment, cfg.dp, cfg.ga, separable_tol=SEPARABLE_TOL, aux=aux)
    except ValueError as e:  # no gradient, or a non-finite one: this configuration breaks
        row.note, row.invariant = str(e), False
        return row
    row.found = found
    g, g_ref = basis.flatten(res.grads), basis.flatten(ref.grads)
    row.vs_reference = 0.0 if res is ref else _rel(g, g_ref)
    row.invariant = row.vs_reference <= tol
    row.logged = res.logged
    if res.logged is not None and found.separable:
        row.log_matches = abs(res.logged - found.objective) <= LOG_TOL * max(abs(found.objective), 1e-12)
    return row
