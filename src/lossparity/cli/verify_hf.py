"""CLI glue of ``lossparity verify --hf MODEL`` and ``lossparity verify --model pkg.module:build`` (the user's
own model; see :mod:`lossparity.verify.hf`). Bad input is one line with exit code 2."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ._common import UsageError

__all__ = ["add_verify_hf_arguments", "cmd_verify_hf", "DEFAULT_HF_LAYOUTS"]

DEFAULT_HF_LAYOUTS = "K=4,D2xK2,T2,D2+fsdp,K=2+recompute"
_DEFAULT_MODES = "per_token,per_sample,per_document"


def add_verify_hf_arguments(v: argparse.ArgumentParser) -> None:
    """The options of ``verify`` that select and shape the user's own model."""
    g = v.add_argument_group("your own model (instead of the tiny reference model)")
    g.add_argument(
        "--hf",
        default=None,
        metavar="MODEL",
        help="a Hugging Face model_type (llama, mixtral, qwen3_moe, olmoe, ...: a tiny configuration), or a "
        "config.json or model directory (its config only); random initialization, nothing downloaded",
    )
    g.add_argument("--hf-set", action="append", default=[], metavar="FIELD=VALUE", help="override a config field")
    g.add_argument(
        "--model",
        default=None,
        metavar="PKG.MODULE:BUILD",
        help="build(seed, dtype) -> torch.nn.Module whose forward(input_ids[, position_ids]) returns [b, S, V] "
        "logits or an object with .logits",
    )
    g.add_argument("--parallelize", default=None, metavar="PKG.MODULE:FN", help="fn(model, tp_mesh): enables T")
    g.add_argument("--seed", type=int, default=0, help="random initialization and corpus seed (default 0)")
    g.add_argument("--dtype", choices=("float64", "float32"), default="float64", help="tolerance 1e-10 / 1e-5")
    g.add_argument("--packed", action="store_true", help="packed documents with restarting position_ids")


def _spec(args: argparse.Namespace) -> Any:
    from ..verify.hf import ModelSpec, probe_model
    from ..verify.user_models import hf_config, import_target, moe_shape, parse_sets

    common = dict(seed=args.seed, dtype=args.dtype, packed=args.packed, aux_scope=args.aux_scope)
    if args.hf is not None:
        if args.parallelize:
            raise ValueError("--parallelize: only with --model (an --hf model brings its own tensor-parallel plan)")
        config = hf_config(args.hf, parse_sets(args.hf_set))
        coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
        moe = moe_shape(config)
        return ModelSpec(args.hf, hf_config=config, vocab=config.vocab_size, moe=moe, aux_coef=coef, **common)
    if args.hf_set:
        raise ValueError("--hf-set: only with --hf")
    import_target(args.model, "--model")
    if args.parallelize:
        import_target(args.parallelize, "--parallelize")
    spec = ModelSpec(args.model, build=args.model, parallelize=args.parallelize, **common)
    return probe_model(spec)


def _run(spec: Any, layouts: Any, modes: tuple[str, ...], steps: int) -> Any:
    """:func:`run_verify_hf`; a run that fails on a rank (the model cannot run a layout: its forward or
    backward raised there) becomes one line naming the rank and the error."""
    from ..distributed.launch import RankError
    from ..verify.hf import run_verify_hf

    try:
        return run_verify_hf(spec, layouts, modes, steps=steps)
    except RankError as e:
        first = e.failures[0] if e.failures else None
        what = f"rank {first.rank}: {first.kind}: {first.message}" if first else str(e).splitlines()[0]
        raise ValueError(f"{spec.name} could not run every layout ({what})") from None


def cmd_verify_hf(args: argparse.Namespace) -> int:
    """``verify --hf`` / ``--model``: the layout-invariance table of the user's model; exit 1 on any FAIL."""
    from ..options import ALIASES
    from ..verify.hf import HF_AUX_SCOPES, parse_hf_layouts
    from ..verify.hf_compare import format_hf_table
    from ..verify.reference import write_json

    if args.hf is not None and args.model is not None:
        raise UsageError("--hf and --model exclude each other")
    if args.quick or args.full:
        raise UsageError("--quick/--full choose layouts of the tiny reference model; with --hf/--model use --layouts")
    args.aux_scope = ALIASES["aux_scope"].get(args.aux_scope, args.aux_scope)  # micro_batch: the old spelling
    if args.aux_scope not in HF_AUX_SCOPES:
        raise UsageError(f"--aux-scope: {args.aux_scope!r} is not one of {', '.join(HF_AUX_SCOPES)} for --hf/--model")
    try:
        spec = _spec(args)
        default = DEFAULT_HF_LAYOUTS
        if not args.layouts and spec.hf_config is None and spec.parallelize is None:
            default = default.replace("T2,", "")
            print("lossparity verify: note: no --parallelize, so the default layouts skip T2", file=sys.stderr)
        layouts = parse_hf_layouts(args.layouts or default, spec)
        modes = tuple((args.modes or _DEFAULT_MODES).split(","))
        steps = args.steps or 2
        title = (
            f"lossparity verify: {spec.name}, {len(layouts)} layouts x {len(modes)} modes, {steps} steps, "
            f"{spec.dtype}, {'packed' if spec.packed else 'padded'} rows"
            + (f", MoE aux_scope {spec.aux_scope}" if spec.moe else "")
        )
        print(title, flush=True)
        report = _run(spec, layouts, modes, steps)
    except ValueError as e:
        raise UsageError(" ".join(str(e).split())) from None
    print(format_hf_table(report, ""))
    if args.json:
        write_json(report, args.json)
    return 0 if all(r["pass"] for r in report["rows"]) else 1
