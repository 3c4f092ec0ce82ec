"""CLI glue of ``lossparity verify --hf MODEL`` and ``lossparity verify --model pkg.module:build`` (the user's
own model; see :mod:`lossparity.verify.hf`). Bad input is one line with exit code 2."""

from __future__ import annotations

import argparse
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


def _router_width(model: Any) -> int | None:
    """The number of columns of the router logits the built model records on 2 tokens (``None`` when its
    forward does not give them here; the layouts' runs then report what fails)."""
    import torch

    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([[1, 2]]), output_router_logits=True)
    except Exception:  # the runs of the layouts name any failure of the model's forward
        return None
    router = getattr(out, "router_logits", None)
    if not router or not hasattr(router[0], "shape"):
        return None
    return int(router[0].shape[-1])


def _hf_spec(args: argparse.Namespace, common: dict[str, Any], notes: list[str]) -> Any:
    """The ``--hf`` model: its configuration, built once here (a configuration transformers cannot build a
    model from is bad input, one line), MoE recognised from the built model (:mod:`..integrations.hf_moe`)."""
    import torch

    from ..integrations.hf_moe import COEF_FIELDS, moe_info
    from ..verify.hf import ModelSpec
    from ..verify.user_models import build_hf_model, hf_config, parse_sets

    config = hf_config(args.hf, parse_sets(args.hf_set))
    try:
        model = build_hf_model(config, args.seed, torch.float64 if args.dtype == "float64" else torch.float32)
    except ValueError:
        raise
    except Exception as e:  # transformers' own constructor: the configuration's values, named by its message
        what = f"{type(e).__name__}: " + " ".join(str(e).split())[:300]
        raise ValueError(
            f"--hf {args.hf}: transformers cannot build a model from this configuration ({what})"
        ) from None
    info = moe_info(config, model)
    if info is not None:
        config.output_router_logits = True
        notes.append("MoE: " + info.describe())
        if info.coef is None:
            notes.append(
                f"MoE without a load-balancing coefficient (none of {', '.join(COEF_FIELDS)}): no aux term is "
                "added, as the model's own forward adds none"
            )
    zeroed = getattr(config, "lossparity_zeroed", None)
    if zeroed:
        notes.append("set to 0 (no randomness in training mode): " + ", ".join(zeroed))
    moe = (info.experts, info.top_k) if info is not None else None
    if info is not None:
        width = _router_width(model)
        if width is not None and width != info.experts:
            notes.append(
                f"MoE: the router logits have {width} columns for {info.experts} routed experts (the others are "
                "experts of the model's own kind, e.g. zero-computation experts): the aux terms count all "
                f"{width}, as the routing does"
            )
            moe = (width, info.top_k)
    coef = (info.coef or 0.0) if info is not None else 0.0
    return ModelSpec(args.hf, hf_config=config, vocab=config.vocab_size, moe=moe, aux_coef=coef, **common)


def _spec(args: argparse.Namespace, notes: list[str]) -> Any:
    from ..verify.hf import ModelSpec, probe_model
    from ..verify.user_models import import_target

    common = dict(seed=args.seed, dtype=args.dtype, packed=args.packed, aux_scope=args.aux_scope)
    if args.hf is not None:
        if args.parallelize:
            raise ValueError("--parallelize: only with --model (an --hf model brings its own tensor-parallel plan)")
        return _hf_spec(args, common, notes)
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
    notes: list[str] = []
    try:
        spec = _spec(args, notes)
        layouts = parse_hf_layouts(args.layouts or DEFAULT_HF_LAYOUTS, spec, notes)
        modes = tuple((args.modes or _DEFAULT_MODES).split(","))
        steps = args.steps or 2
        title = (
            f"lossparity verify: {spec.name}, {len(layouts)} layouts x {len(modes)} modes, {steps} steps, "
            f"{spec.dtype}, {'packed' if spec.packed else 'padded'} rows"
            + (f", MoE aux_scope {spec.aux_scope}" if spec.moe else "")
        )
        print(title, flush=True)
        for note in notes:
            print(f"  note: {note}", flush=True)
        report = _run(spec, layouts, modes, steps)
    except ValueError as e:
        raise UsageError(" ".join(str(e).split())) from None
    print(format_hf_table(report, ""))
    if args.json:
        write_json(report, args.json)
    return verdict_code(report["rows"])


def verdict_code(rows: list[dict[str, Any]]) -> int:
    """Exit code of a report: 1 when a row FAILs (a layout-dependent difference), else 2 when a row could
    not run (ERROR), else 0."""
    if any(not r["pass"] and "error" not in r for r in rows):
        return 1
    return 2 if any("error" in r for r in rows) else 0
