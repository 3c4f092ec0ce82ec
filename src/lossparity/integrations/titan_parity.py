"""torchtitan: stop a run at the first step whose logged loss leaves the reference log's band.

:class:`ParityTitanMixin` mixes first into torchtitan's ``Trainer`` (before
:class:`~lossparity.integrations.torchtitan.LossParityTitanMixin` when both are used)::

    class MyTrainer(ParityTitanMixin, LossParityTitanMixin, Trainer): ...
    trainer.parity_guard = ParityGuard("golden_losses.txt")   # any format `lossparity compare` reads

During ``train_step`` every call of ``metrics_processor.log(step, global_avg_loss, global_max_loss,
grad_norm, ...)`` (torchtitan's logging steps) also goes to ``parity_guard.update(step, {"loss":
global_avg_loss, "grad_norm": grad_norm})``; torchtitan's ``loss`` is the objective (``compare`` pairs it
with a Megatron ``lm loss`` as it does offline). On a stop, ``should_continue_training()`` returns False, so
torchtitan's own loop ends after the checkpointer's save of that step; with ``parity_save_on_stop`` (default
True) the checkpointer is asked for a checkpoint of that step (``save(step, last_step=True)``) first.

Multi-rank: ``global_avg_loss`` is the sum over the loss mesh (an all-reduce) and the gradient norm is the
global norm, both identical on every rank, so every rank stops at the same step without another collective;
``parity_guard`` should be built with ``write_report=(rank == 0)``. Under pipeline parallelism only the last
stage computes the loss: there the guard needs the stop flag shared by the caller (not supported here).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["ParityTitanMixin"]


class ParityTitanMixin:
    """Mix first into torchtitan's ``Trainer``; set ``parity_guard`` (module docstring). After training,
    ``parity_stop_step`` is the step it stopped at (``None``: it did not) and ``parity_verdicts`` the verdicts."""

    parity_guard: Any = None
    parity_save_on_stop: bool = True
    parity_stop_step: int | None = None

    def train_step(self, data_iterator: Iterator[Any]) -> Any:
        """torchtitan's ``train_step``, with its metrics log also compared by ``parity_guard``."""
        guard = self.parity_guard
        if guard is None:
            return super().train_step(data_iterator)  # type: ignore[misc]
        processor = self.metrics_processor  # type: ignore[attr-defined]
        original = processor.log

        def log(step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float, *a: Any, **kw: Any) -> Any:
            out = original(step, global_avg_loss, global_max_loss, grad_norm, *a, **kw)
            verdict = guard.update(int(step), {"loss": global_avg_loss, "grad_norm": grad_norm})
            self.parity_verdicts = [*getattr(self, "parity_verdicts", []), verdict]
            if verdict.stop and self.parity_stop_step is None:
                self.parity_stop_step = int(step)
            return out

        processor.log = log
        try:
            return super().train_step(data_iterator)  # type: ignore[misc]
        finally:
            processor.log = original

    def should_continue_training(self) -> bool:
        """False once the guard said stop (after asking the checkpointer for that step's checkpoint)."""
        if self.parity_stop_step is not None:
            if self.parity_save_on_stop and not getattr(self, "_lp_parity_saved", False):
                self._lp_parity_saved = True
                self.checkpointer.save(self.parity_stop_step, last_step=True)  # type: ignore[attr-defined]
            return False
        return super().should_continue_training()  # type: ignore[misc]
