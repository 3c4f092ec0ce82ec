"""CLI glue of ``lossparity audit``: the user's own training stack (``--step``/``--model``, ``--trainer``,
``--megatron``, ``--deepspeed``, ``--torchtitan``) or
cross-entropy kernel (``--kernel``). Exit 0 invariant (and as ``--expect``ed), 1 not, 2 could not run."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ._common import UsageError

__all__ = ["add_audit_arguments", "cmd_audit"]


def add_audit_arguments(a: argparse.ArgumentParser) -> None:
    """The options of ``lossparity audit``."""
    a.add_argument("--step", default=None, metavar="MODULE:FN", help="a hand loop's step(model, microbatches, ctx)")
    a.add_argument(
        "--model", default=None, metavar="MODULE:FN", help="with --step/--megatron: build() -> torch.nn.Module"
    )
    a.add_argument(
        "--megatron",
        default=None,
        metavar="MODULE:FN",
        help="a megatron-core forward_step(data_iterator, model) (with --model and --vocab-size)",
    )
    a.add_argument("--vocab-size", type=int, default=None, help="with --megatron: the model's vocabulary size")
    a.add_argument(
        "--deepspeed",
        default=None,
        metavar="MODULE:FN",
        help="loss(engine, microbatch) of a DeepSpeed loop (with --model; --zero-stage, --offload)",
    )
    a.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0, help="with --deepspeed: your stage")
    a.add_argument("--offload", action="store_true", help="with --deepspeed: optimizer offload to the CPU")
    a.add_argument(
        "--torchtitan",
        default=None,
        metavar="MODULE:FN",
        help="build() -> a torchtitan model (model(tokens, positions=) -> logits) run by torchtitan's train_step",
    )
    a.add_argument(
        "--loss", default=None, metavar="MODULE:NAME", help="with --torchtitan: your loss (default: torchtitan's)"
    )
    a.add_argument(
        "--trainer-class",
        default=None,
        metavar="MODULE:NAME",
        help="with --torchtitan: your Trainer subclass (default: torchtitan.trainer.Trainer)",
    )
    a.add_argument("--no-ddp", action="store_true", help="with --step: hand 2-rank steps the bare model, not DDP")
    a.add_argument(
        "--trainer", default=None, metavar="MODULE:FN", help="factory(ctx) -> transformers.Trainer (TRL's too)"
    )
    a.add_argument("--kernel", default=None, metavar="MODULE:FN", help="a cross-entropy kernel to check")
    a.add_argument(
        "--kernel-kind", choices=("logits", "linear"), default="logits", help="fn(logits, labels, ...) or fused linear"
    )
    a.add_argument(
        "--classes",
        default="",
        metavar="NAME[,NAME...]",
        help="equivalence classes: ga, microbatch, dp, recompute, packing, zero (DeepSpeed) "
        "(default: ga,microbatch,dp,recompute)",
    )
    a.add_argument("--expect", default=None, metavar="MODE", help="fail unless every configuration computes MODE")
    a.add_argument("--tol", type=float, default=None, help="invariance tolerance (default 1e-5 float32, 1e-10 float64)")
    a.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON ('-': stdout)")


def _write_json(path: str | None, data: dict[str, Any]) -> None:
    if path is None:
        return
    text = json.dumps(data, indent=1)
    if path == "-":
        print(text)
    else:
        from ..atomic_io import atomic_write_bytes

        atomic_write_bytes(path, (text + "\n").encode())


def _stack(args: argparse.Namespace) -> Any:
    """The adapter the options name (``UsageError`` for a missing companion option)."""
    from ..audit import HandLoop, TrainerFactory
    from ..audit.deepspeed import DeepSpeedStep
    from ..audit.megatron import MegatronStep
    from ..audit.torchtitan import TitanStep

    if args.torchtitan is not None:
        return TitanStep(model=args.torchtitan, loss=args.loss, trainer=args.trainer_class)
    if (args.step or args.megatron or args.deepspeed) and args.model is None:
        raise UsageError("--step/--megatron/--deepspeed need --model MODULE:FN (the model the step trains)")
    if args.step is not None:
        return HandLoop(model=args.model, step=args.step, wrap_ddp=not args.no_ddp)
    if args.deepspeed is not None:
        if args.offload and args.zero_stage == 0:
            raise UsageError("--offload needs --zero-stage 1, 2 or 3")
        return DeepSpeedStep(args.model, args.deepspeed, zero_stage=args.zero_stage, offload=args.offload)
    if args.megatron is not None:
        if args.vocab_size is None or args.vocab_size < 8:
            raise UsageError("--megatron needs --vocab-size N (N >= 8): the model's vocabulary")
        return MegatronStep(model=args.model, forward_step=args.megatron, vocab_size=args.vocab_size)
    return TrainerFactory(args.trainer)


def cmd_audit(args: argparse.Namespace) -> int:
    """Run the audit the options name and print its table; the exit code of the report."""
    from ..audit import AuditError, audit, audit_kernel, render
    from ..audit.batch import CLASSES, DEFAULT_CLASSES
    from ..audit.kernel import render_kernel
    from ..audit.stack import resolve
    from ..audit.worker import user_frame

    stacks = (args.step, args.trainer, args.kernel, args.megatron, args.deepspeed, args.torchtitan)
    chosen = [x for x in stacks if x is not None]
    if len(chosen) != 1:
        raise UsageError(
            "name exactly one of --step (with --model), --trainer, --megatron, --deepspeed, --torchtitan, --kernel"
        )
    if args.torchtitan is None and (args.loss is not None or args.trainer_class is not None):
        raise UsageError("--loss and --trainer-class go with --torchtitan")
    if args.tol is not None and not (0 < args.tol < 1):
        raise UsageError(f"--tol must be in (0, 1), got {args.tol}")
    classes = [c for c in args.classes.split(",") if c] or list(DEFAULT_CLASSES)
    bad = [c for c in classes if c not in CLASSES]
    if bad:
        raise UsageError(f"--classes: unknown class {bad[0]!r}; valid classes: {', '.join(CLASSES)}")
    try:
        if args.kernel is not None:
            try:
                fn = resolve(args.kernel)
            except Exception as e:
                raise AuditError(f"--kernel {args.kernel}: {e}", user_frame(e)) from e
            kreport = audit_kernel(fn, kind=args.kernel_kind, tol=args.tol)
            print(render_kernel(kreport))
            _write_json(args.json, kreport.as_dict())
            return kreport.exit_code
        stack = _stack(args)
        report = audit(stack, classes=classes, expect=args.expect, tol=args.tol)
    except AuditError as e:
        text = str(e).replace("\n", "\\n")
        print(f"lossparity audit: could not run: {text}", file=sys.stderr)
        return 2
    print(render(report))
    _write_json(args.json, report.as_dict())
    if report.incomplete:
        first = report.incomplete[0]
        print(f"lossparity audit: could not run: {first.config}: {first.skipped}", file=sys.stderr)
    return report.exit_code
