"""Hugging Face ``Trainer`` / TRL: stop a run at the first step whose logged loss leaves the reference's band.

``ParityCallback(reference)`` is a ``transformers.TrainerCallback`` holding a
:class:`~lossparity.parity.guard.ParityGuard`: every training log (``on_log``: ``loss``, ``grad_norm``,
``learning_rate``, and with :class:`~lossparity.integrations.hf.LossParityTrainer` also ``lm_loss`` and
``objective``) is compared at ``state.global_step`` against the reference log (any format ``lossparity
compare`` reads, e.g. the ``trainer_state.json`` of an earlier run, Megatron's log, golden values). On the
first violation it writes ``parity_report.md``/``parity_report.json`` (into ``args.output_dir`` unless
``report_dir`` is given), prints one line on stderr and, with ``on_violation="stop"``, sets
``control.should_training_stop`` so the Trainer ends after this step (``save_checkpoint=True`` also asks it to
save a checkpoint of that step first).

Usage::

    from lossparity.integrations.hf import ParityCallback
    trainer = Trainer(..., callbacks=[ParityCallback("golden/trainer_state.json")])

Multi-process: ``Trainer.log`` runs the callbacks on every process with the same logs (the loss is gathered
over the processes before logging), so every process decides the same at the same step and they all stop
together; only the main process writes the report.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from ..parity.guard import ParityGuard, Verdict
from ..parity.names import canonical_name
from . import require

__all__ = ["ParityCallback"]

_SUMMARY = ("train_runtime", "train_loss", "total_flos")  # the end-of-training summary log is not a step
_EVAL = ("eval_", "predict_", "test_")


class ParityCallback:
    """A ``transformers.TrainerCallback`` comparing each training log with a reference log (module docstring).

    ``reference`` and the keyword arguments are those of :class:`~lossparity.parity.guard.ParityGuard`
    (``metrics``, ``tol``, ``rule``, ``missing_steps``, ``on_violation``, ``smooth``, ``name_map``,
    ``ref_format``, ``step_base``); ``report_dir`` defaults to the Trainer's ``output_dir``;
    ``save_checkpoint``: on a stop, also ask the Trainer to save a checkpoint of the stopping step.
    The instance is a subclass of ``transformers.TrainerCallback`` (created on first use, so that importing
    this module needs no transformers). Attributes after training: ``guard``, ``verdicts`` (one per
    compared log), ``stopped_at`` (the step it stopped at, or ``None``).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> ParityCallback:
        return object.__new__(_with_trainer_callback(cls))

    def __init__(
        self,
        reference: Any,
        *,
        report_dir: str | os.PathLike[str] | None = None,
        save_checkpoint: bool = False,
        **guard_kwargs: Any,
    ) -> None:
        self._report_dir_given = report_dir is not None
        self.guard = ParityGuard(reference, report_dir=report_dir, source="Trainer log_history", **guard_kwargs)
        self.save_checkpoint = save_checkpoint
        self.verdicts: list[Verdict] = []
        self.stopped_at: int | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Only the main process writes the report, by default into ``args.output_dir``."""
        self.guard.write_report = bool(getattr(state, "is_world_process_zero", True))
        if not self._report_dir_given:
            self.guard.report_dir = getattr(args, "output_dir", None) or "."
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        """Compare this training log at ``state.global_step``; on a stop set ``control.should_training_stop``."""
        if not logs or any(k in logs for k in _SUMMARY):
            return control
        values = _one_name_per_metric(logs, self.guard.name_map)
        if not any(not k.startswith(_EVAL) and k != "epoch" for k in values):
            return control  # an evaluation log (eval_loss, ...) is not a training step
        verdict = self.guard.update(int(state.global_step), values)
        self.verdicts.append(verdict)
        if verdict.new and self.guard.write_report:
            where = f"; report in {self.guard.report_files[0]}" if self.guard.report_files else ""
            action = "stopping the run" if verdict.stop else "continuing (on_violation='warn')"
            print(f"lossparity ParityCallback: {verdict.line()}; {action}{where}", file=sys.stderr)
        if verdict.stop:
            control.should_training_stop = True
            if self.stopped_at is None:
                self.stopped_at = int(state.global_step)
                control.should_save = control.should_save or self.save_checkpoint
        return control


def _one_name_per_metric(logs: dict[str, Any], name_map: Mapping[str, str] | None) -> dict[str, Any]:
    """The log entries with one log name per canonical metric: ``LossParityTrainer`` logs ``loss`` and
    ``objective``, both ``J`` (the objective): the first one logged is kept."""
    out: dict[str, Any] = {}
    seen: set[str] = set()
    for key, value in logs.items():
        name = canonical_name(key, name_map)
        if name is None or name in seen:  # dropped by the name map, or a second name of one metric
            continue
        seen.add(name)
        out[key] = value
    return out


_SUBCLASSES: dict[type, type] = {}


def _with_trainer_callback(cls: type) -> type:
    """``cls`` combined with ``transformers.TrainerCallback`` (its no-op handlers for the other events)."""
    if cls not in _SUBCLASSES:
        base = require("transformers", "hf").TrainerCallback
        _SUBCLASSES[cls] = type(cls.__name__, (cls, base), {"__module__": cls.__module__, "__doc__": cls.__doc__})
    return _SUBCLASSES[cls]
