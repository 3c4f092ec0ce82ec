"""The ``lossparity`` command line: ``modes``, ``train``, ``verify``, ``compare``, ``gap``, ``bench``.

Exit codes: 0 success / parity, 1 a check failed (FAIL in a table, parity violation), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .losses.modes import MODE_INFO

__all__ = ["main"]


class UsageError(Exception):
    """Bad command-line input: reported on stderr with exit code 2."""


def _cmd_modes(args: argparse.Namespace) -> int:
    from .parity.presets import modes_translation_requested, preset_table, run_modes_translation

    if modes_translation_requested(args):
        return run_modes_translation(args)
    print("| mode | objective J | matches |")
    print("|---|---|---|")
    for mode, (formula, who) in MODE_INFO.items():
        print(f"| `{mode}` | `{formula}` | {who} |")
    print("\nframework presets (`--preset` of `lossparity train`, `--from/--to` of this command):\n")
    print(preset_table())
    if args.no_check:
        return 0
    from .selfcheck import run_selfcheck

    print("\nself-check: every mode through the Accountant (K=4, b=2) vs a naive float64 formula")
    rows = run_selfcheck()
    print("| mode | accountant | naive | result |")
    print("|---|---|---|---|")
    for mode, got, ref, ok in rows:
        print(f"| {mode} | {got:.15g} | {ref:.15g} | {'PASS' if ok else 'FAIL'} |")
    return 0 if all(r[3] for r in rows) else 1


def _train_config(args: argparse.Namespace):
    from .training.trainer import TrainConfig

    overrides = {}
    for item in args.model_set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--set expects FIELD=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    preset_fields: dict = {}
    if args.preset:
        from .parity.presets import resolve_preset

        try:
            preset = resolve_preset(args.preset)
        except ValueError as e:
            raise UsageError(str(e)) from None
        preset_fields = {**preset.train_config_fields(),
                         "mtp_log_estimator": preset.accountant_kwargs().get("mtp_log_estimator", "token_mean")}
    cfg = TrainConfig(
        model=args.model, model_overrides=overrides, mode=args.mode, normalization=args.normalization,
        dp=args.dp, cp=args.cp, tp=args.tp, sp=args.sp, pp=args.pp, pp_virtual=args.pp_virtual, ga=args.ga,
        global_batch=args.global_batch, seq_len=args.seq_len, packed=args.packed,
        data=args.data, steps=args.steps, lr=args.lr, seed=args.seed, dtype=args.dtype, recompute=args.recompute,
        engine=args.engine, mtp_convention=args.mtp_convention, mtp_weight=args.mtp_weight,
        mtp_weight_after=args.mtp_weight_after, mtp_switch_step=args.mtp_switch_step,
        bias_freeze_step=args.bias_freeze_step, aux_scope=args.aux_scope, aux_coeff=args.aux_coeff,
        z_coeff=args.z_coeff, bias_rate=args.bias_rate, out=args.out, log_interval=args.log_interval,
        ckpt_interval=args.ckpt_interval, resume=args.resume, progress=not args.no_progress,
        dump_samples=args.dump_samples,
    )
    for key, value in preset_fields.items():
        # An explicit command-line value wins over the preset for the fields it names.
        if key in ("mode", "aux_scope", "mtp_convention", "normalization") and args._explicit.get(key):
            continue
        setattr(cfg, key, value)
    try:
        cfg.validate()
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    return cfg


def _cmd_train(args: argparse.Namespace) -> int:
    from .training.trainer import run_training

    cfg = _train_config(args)
    try:
        from .model import get_config

        get_config(cfg.model, **cfg.model_overrides)
    except ValueError as e:
        raise UsageError(str(e)) from None
    history = run_training(cfg)
    if history:
        last = history[-1]
        print(f"done: {len(history)} steps, last lm_loss {last.get('lm_loss')}, objective {last.get('objective')}"
              + (f"; logs in {cfg.out}" if cfg.out else ""))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from .losses.modes import MODES
    from .training.verify import DEFAULT_LAYOUTS, QUICK_LAYOUTS, format_table, run_verify, write_json

    modes = tuple(args.modes.split(",")) if args.modes else MODES
    for m in modes:
        if m not in MODES:
            raise UsageError(f"unknown mode {m!r}; valid modes: {', '.join(MODES)}")
    layouts = QUICK_LAYOUTS if args.quick else DEFAULT_LAYOUTS
    if args.quick and args.full:
        raise UsageError("--quick and --full exclude each other")
    steps = args.steps if args.steps else (2 if args.quick else 5 if args.full else 3)
    overrides = {"aux_scope": args.aux_scope}
    print(f"lossparity verify: tiny MoE+MTP model, {len(layouts)} layouts x {len(modes)} modes, {steps} steps, "
          f"float64, reference = 1x1 run")
    report = run_verify(layouts, modes, steps=steps, overrides=overrides)
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
    return 0 if all(r["pass"] for r in report["rows"]) else 1


def _cmd_compare(args: argparse.Namespace) -> int:
    from .parity.compare import run_compare

    return run_compare(args)


def _add_train_args(t: argparse.ArgumentParser) -> None:
    from .distributed.moe_accounting import SCOPES
    from .losses.modes import MODES
    from .losses.mtp import CONVENTIONS

    t.add_argument("--model", default="tiny", help="model preset: tiny, small, medium, 100m")
    t.add_argument("--set", dest="model_set", action="append", metavar="FIELD=VALUE",
                   help="override a ModelConfig field (repeatable), e.g. --set mtp_depths=0")
    t.add_argument("--preset", default=None,
                   help="framework preset, e.g. megatron:calculate_per_token_loss=false, maxtext, torchtitan, "
                        "hf-trainer, verl:seq-mean-token-mean, lossparity (see `lossparity modes`)")
    t.add_argument("--mode", default="per_token", help=f"objective mode: {', '.join(MODES)}")
    t.add_argument("--normalization", default="precount", choices=["precount", "deferred"])
    t.add_argument("--dp", type=int, default=1, help="data-parallel ranks (started here unless under torchrun)")
    t.add_argument("--cp", type=int, default=1, help="context-parallel ranks per data-parallel rank (zig-zag shards)")
    t.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (vocabulary-parallel head)")
    t.add_argument("--sp", action="store_true", help="sequence parallelism with --tp (Megatron SP)")
    t.add_argument("--pp", type=int, default=1, help="pipeline stages (1F1B; needs --ga >= --pp)")
    t.add_argument("--pp-virtual", type=int, default=1, help="virtual chunks per stage (interleaved 1F1B)")
    t.add_argument("--ga", type=int, default=1, help="gradient-accumulation microbatches per rank")
    t.add_argument("--global-batch", type=int, default=8, help="rows per optimizer step")
    t.add_argument("--seq-len", type=int, default=64)
    t.add_argument("--packed", action="store_true", help="pack documents into rows (segment ids)")
    t.add_argument("--data", default="synthetic", help="'synthetic' or a .txt / .jsonl file")
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dtype", default="float32", choices=["float32", "float64", "bf16"])
    t.add_argument("--recompute", action="store_true", help="activation recompute of every block")
    t.add_argument("--engine", default="ddp", choices=["ddp", "fsdp", "plain"],
                   help="data-parallel gradient engine: DDP, FSDP2 fully_shard, or the accountant's all-reduce")
    t.add_argument("--mtp-convention", default="own", choices=list(CONVENTIONS))
    t.add_argument("--mtp-weight", type=float, default=0.3, help="MTP lambda until --mtp-switch-step")
    t.add_argument("--mtp-weight-after", type=float, default=0.1, help="MTP lambda from --mtp-switch-step on")
    t.add_argument("--mtp-switch-step", type=int, default=None, help="step at which lambda switches (DeepSeek-V3)")
    t.add_argument("--bias-freeze-step", type=int, default=None, help="expert-bias rate becomes 0 from this step")
    t.add_argument("--aux-scope", default="global_lagged", choices=list(SCOPES))
    t.add_argument("--aux-coeff", type=float, default=1e-2)
    t.add_argument("--z-coeff", type=float, default=1e-3)
    t.add_argument("--bias-rate", type=float, default=1e-3)
    t.add_argument("--out", default=None, help="run directory: metrics.jsonl, tensorboard/, checkpoints/")
    t.add_argument("--log-interval", type=int, default=1)
    t.add_argument("--ckpt-interval", type=int, default=0)
    t.add_argument("--resume", action="store_true", help="resume from OUT/checkpoints/latest if present")
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("--dump-samples", action="store_true",
                   help="write per-sample (n_i, s_i) of every step to OUT/samples for `lossparity gap`")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="lossparity", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("modes", help="print the normalization modes and run the built-in self-check")
    m.add_argument("--no-check", action="store_true", help="only print the table")
    from .parity.gap import add_gap_arguments, run_gap
    from .parity.presets import add_modes_translation_arguments

    add_modes_translation_arguments(m)
    m.set_defaults(func=_cmd_modes)

    g = sub.add_parser("gap", help="every mode per step from a --dump-samples run; per_token - per_sample gap")
    add_gap_arguments(g)
    g.set_defaults(func=run_gap)

    t = sub.add_parser("train", help="train the reference MoE+MTP model (JSONL metrics, checkpoints)")
    _add_train_args(t)
    t.set_defaults(func=_cmd_train)

    v = sub.add_parser("verify", help="prove layout invariance of objective, logs, gradients, parameters")
    v.add_argument("--quick", action="store_true", help="5 layouts, 2 steps (CI)")
    v.add_argument("--full", action="store_true", help="every layout for 5 steps (by hand; the default runs 3)")
    v.add_argument("--steps", type=int, default=0, help="steps per run (default 3, --quick 2, --full 5)")
    v.add_argument("--modes", default="", help="comma-separated modes (default: all)")
    v.add_argument("--aux-scope", default="global_lagged", help="MoE aux-loss scope of the runs")
    v.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON")
    v.set_defaults(func=_cmd_verify)

    c = sub.add_parser("compare", help="compare two training logs for loss parity")
    from .parity.compare import add_compare_arguments

    add_compare_arguments(c)
    c.set_defaults(func=_cmd_compare)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lossparity`` console script; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits with 2 on bad usage already
        return int(e.code or 0)
    # Which options were given explicitly (a preset must not override them).
    argv_list = list(sys.argv[1:] if argv is None else argv)
    args._explicit = {k: any(a == "--" + k.replace("_", "-") or a.startswith("--" + k.replace("_", "-") + "=")
                             for a in argv_list) for k in ("mode", "aux_scope", "mtp_convention", "normalization")}
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"lossparity {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
