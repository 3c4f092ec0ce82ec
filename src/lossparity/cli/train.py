"""CLI glue of the reference trainer: ``train`` and ``verify``."""

from __future__ import annotations

import argparse
import json

from ..options import LOSS_IMPLS
from ._common import UsageError

__all__ = ["cmd_train", "cmd_verify", "add_train_args"]


def _train_config(args: argparse.Namespace):
    from ..training.trainer import TrainConfig

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
        from ..parity.presets import resolve_preset

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
        dump_samples=args.dump_samples, loss_impl=args.loss_impl,
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


def cmd_train(args: argparse.Namespace) -> int:
    from ..training.trainer import run_training

    cfg = _train_config(args)
    try:
        from ..model import get_config

        get_config(cfg.model, **cfg.model_overrides)
    except ValueError as e:
        raise UsageError(str(e)) from None
    history = run_training(cfg)
    if history:
        last = history[-1]
        print(f"done: {len(history)} steps, last lm_loss {last.get('lm_loss')}, objective {last.get('objective')}"
              + (f"; logs in {cfg.out}" if cfg.out else ""))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from ..losses.modes import MODES
    from ..training.verify import DEFAULT_LAYOUTS, QUICK_LAYOUTS, format_table, run_verify, write_json

    modes = tuple(args.modes.split(",")) if args.modes else MODES
    for m in modes:
        if m not in MODES:
            raise UsageError(f"unknown mode {m!r}; valid modes: {', '.join(MODES)}")
    layouts = QUICK_LAYOUTS if args.quick else DEFAULT_LAYOUTS
    if args.quick and args.full:
        raise UsageError("--quick and --full exclude each other")
    steps = args.steps if args.steps else (2 if args.quick else 5 if args.full else 3)
    overrides = {"aux_scope": args.aux_scope, "loss_impl": args.loss_impl}
    print(f"lossparity verify: tiny MoE+MTP model, {len(layouts)} layouts x {len(modes)} modes, {steps} steps, "
          f"float64, {args.loss_impl} output head, reference = 1x1 run")
    report = run_verify(layouts, modes, steps=steps, overrides=overrides)
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
    return 0 if all(r["pass"] for r in report["rows"]) else 1


def add_train_args(t: argparse.ArgumentParser) -> None:
    from ..distributed.moe_accounting import SCOPES
    from ..losses.modes import MODES
    from ..losses.mtp import CONVENTIONS

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
    t.add_argument("--loss-impl", default="fused", choices=list(LOSS_IMPLS),
                   help="output-layer cross-entropy: fused (gradients formed in the forward from the accountant's "
                   "per-token weights, default) or chunked (logits recomputed in the backward)")
    t.add_argument("--dump-samples", action="store_true",
                   help="write per-sample (n_i, s_i) of every step to OUT/samples for `lossparity gap`")
