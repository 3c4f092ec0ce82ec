"""CLI glue of the reference trainer: ``train`` (generated from ``TrainConfig``) and ``verify``.

``lossparity train`` has one flag per :class:`~lossparity.training.config.TrainConfig` field
(``--field-name``; booleans also as ``--no-field-name``), whose default is "not given", plus ``--set``
(model overrides), ``--preset``, ``--config FILE`` and ``--debug``. The configuration is assembled in
this order, each source overriding the previous one for the fields it names:

    dataclass defaults < preset (--preset, else the file's ``preset``) < config file < explicit flags

so an explicit flag (or a unique prefix of it, as argparse allows) always wins over a preset. Every input
error (bad value, bad file, a run folder that refuses, a rank's invalid input) is one line on stderr with
exit code 2 (``file:line`` for config files); ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from typing import Any

from ._common import UsageError

__all__ = [
    "cmd_train",
    "cmd_verify",
    "add_train_args",
    "train_config_from_args",
    "load_config_file",
    "verify_legend",
    "print_note",
]

_SKIP_FLAGS = ("model_overrides",)  # given as --set FIELD=VALUE


def _none_or(convert):
    """argparse ``type``: ``none``/``null`` gives ``None`` (an optional field set explicitly to nothing)."""

    def parse(text: str) -> Any:
        return None if text.lower() in ("none", "null") else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def add_train_args(t: argparse.ArgumentParser) -> None:
    """One flag per ``TrainConfig`` field (default ``None`` = not given), plus ``--set``, ``--preset``,
    ``--config`` and ``--debug``."""
    from ..training.config import OPTION_CHOICES, TrainConfig, field_type

    for f in dataclasses.fields(TrainConfig):
        if f.name in _SKIP_FLAGS:
            continue
        flag, (base, optional) = "--" + f.name.replace("_", "-"), field_type(f.name)
        help_text = f.metadata["help"]
        if "(default" not in help_text:
            help_text += f" (default: {_default_text(f)})"
        if f.name in OPTION_CHOICES:
            t.add_argument(flag, dest=f.name, default=None, metavar="|".join(OPTION_CHOICES[f.name]), help=help_text)
        elif base is bool:
            t.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            convert = base if base in (int, float) else str
            kind = _none_or(convert) if optional else convert
            t.add_argument(flag, dest=f.name, default=None, help=help_text, type=kind)
    t.add_argument(
        "--set",
        dest="model_set",
        action="append",
        metavar="FIELD=VALUE",
        help="override a ModelConfig field (repeatable), e.g. --set mtp_depths=0",
    )
    t.add_argument(
        "--preset",
        default=None,
        help="framework preset, e.g. megatron:calculate_per_token_loss=false, maxtext, torchtitan, "
        "hf-trainer, verl:seq-mean-token-mean, lossparity (see `lossparity modes`); explicit flags "
        "and config-file fields win over it",
    )
    t.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="YAML or JSON mapping of TrainConfig fields (and optionally 'preset'); flags win over it",
    )
    t.add_argument("--debug", action="store_true", help="show the traceback of an error")


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "none" if f.default is None else str(f.default)
    return "{}"


def _parse_set(items: list[str] | None) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--set expects FIELD=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


def load_config_file(path: str) -> tuple[dict[str, Any], dict[str, int]]:
    """Read a ``--config`` file: a YAML (``.yaml``/``.yml``, needs PyYAML) or JSON mapping. Returns the
    mapping and the line of each key; raises :class:`UsageError` with ``file:line`` for a syntax error or
    a top level that is not a mapping."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--config {path}: cannot be read ({e})") from None
    if path.endswith((".yaml", ".yml")):
        return _load_yaml(path, text)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(
            f"{path}:{e.lineno}: invalid JSON ({e.msg}); --config takes a .json, .yaml or .yml file"
        ) from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}:1: expected a JSON object of TrainConfig fields, got {type(data).__name__}")
    lines = {}
    for key in data:
        m = re.search(r'"' + re.escape(key) + r'"\s*:', text)
        lines[key] = text.count("\n", 0, m.start()) + 1 if m else 1
    return data, lines


def _load_yaml(path: str, text: str) -> tuple[dict[str, Any], dict[str, int]]:
    try:
        import yaml
    except ImportError:
        raise UsageError(
            f"--config {path}: YAML needs PyYAML (pip install 'lossparity[config]'), or give a .json file"
        ) from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        raise UsageError(f"{path}:{line}: invalid YAML ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(data, dict) or not isinstance(node, yaml.MappingNode):
        raise UsageError(f"{path}:1: expected a mapping of TrainConfig fields, got {type(data).__name__}")
    return data, {k.value: k.start_mark.line + 1 for k, _ in node.value}


def _file_fields(path: str) -> tuple[dict[str, Any], str | None]:
    """The checked TrainConfig fields of a config file and its ``preset`` (every error names file:line)."""
    from ..training.config import check_field

    data, lines = load_config_file(path)
    fields: dict[str, Any] = {}
    preset = data.pop("preset", None)
    if preset is not None and not isinstance(preset, str):
        raise UsageError(f"{path}:{lines.get('preset', 1)}: preset must be a string, got {preset!r}")
    for key, value in data.items():
        where = f"{path}:{lines.get(key, 1)}"
        if key == "model_overrides":
            if not isinstance(value, dict):
                raise UsageError(f"{where}: model_overrides must be a mapping of ModelConfig fields")
        else:
            try:
                check_field(str(key), value)
            except (TypeError, ValueError) as e:
                raise UsageError(f"{where}: {e}") from None
        fields[str(key)] = value
    return fields, preset


def _preset_fields(name: str) -> dict[str, Any]:
    from ..parity.presets import resolve_preset

    try:
        preset = resolve_preset(name)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return {
        **preset.train_config_fields(),
        "mtp_log_estimator": preset.accountant_kwargs().get("mtp_log_estimator", "token_mean"),
    }


def train_config_from_args(args: argparse.Namespace):
    """The validated ``TrainConfig`` of ``lossparity train``: defaults < preset < config file < flags (see
    the module docstring). Raises :class:`UsageError` (``file:line`` of a config file) or the ``ValueError``/
    ``TypeError`` of :meth:`TrainConfig.validate` naming the field."""
    from ..training.config import TrainConfig

    file_fields, file_preset = _file_fields(args.config) if args.config else ({}, None)
    preset = args.preset or file_preset
    values: dict[str, Any] = _preset_fields(preset) if preset else {}
    values.update(file_fields)
    flags = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TrainConfig)
        if f.name not in _SKIP_FLAGS and getattr(args, f.name) is not None
    }
    values.update(flags)
    values["model_overrides"] = {**file_fields.get("model_overrides", {}), **_parse_set(args.model_set)}
    cfg = TrainConfig(**values)
    cfg.validate()  # ValueError/TypeError/FileNotFoundError naming the field: cmd_train reports them (exit 2)
    return cfg


def _preflight(cfg) -> None:
    """Input errors that would otherwise surface in every rank: the model configuration and the data file
    (read once here, e.g. a binary file names its path)."""
    from ..model import get_config
    from ..training.parity_stop import make_guard
    from ..training.rundir import check_run_dir
    from ..training.trainer import build_corpus

    resolved = cfg.resolved()
    make_guard(resolved)  # --reference: read once here, so a bad log or tolerance is one input error
    model_config = get_config(resolved.model, **resolved.model_overrides)
    if cfg.data != "synthetic":
        build_corpus(resolved, model_config.vocab_size)
    check_run_dir(resolved)


_INPUT_ERRORS = (UsageError, ValueError, TypeError, FileNotFoundError, IsADirectoryError, PermissionError)


def cmd_train(args: argparse.Namespace) -> int:
    """``lossparity train``: exit 0 done, 2 an input error, 1 a failure of the run (one line each; the
    traceback with ``--debug``), 3 stopped by ``--reference`` at a parity violation (checkpoint written)."""
    from ..distributed.launch import RankError
    from ..training.parity_stop import PARITY_STOP_EXIT, ParityStop
    from ..training.trainer import run_training

    try:
        cfg = train_config_from_args(args)
        _preflight(cfg)
        history = run_training(cfg, notify=print_note)
    except ParityStop as e:  # --reference: stopped at the first violation, after its checkpoint
        print(f"lossparity train: {e}", file=sys.stderr)
        return PARITY_STOP_EXIT
    except RankError as e:
        if e.failures and all(f.kind == "ParityStop" for f in e.failures):  # every rank stopped at the same step
            print(f"lossparity train: {' '.join(e.failures[0].message.split())}", file=sys.stderr)
            return PARITY_STOP_EXIT
        if args.debug:
            raise
        for line in e.summary_lines():
            print(f"lossparity train: error: {line}", file=sys.stderr)
        return 2 if e.input_error else 1
    except (*_INPUT_ERRORS, FloatingPointError, OSError) as e:
        # Input errors exit 2; a failure of the run itself (a non-finite gradient, a full disk) exits 1.
        if args.debug:
            raise
        print(f"lossparity train: error: {_one_line(e)}", file=sys.stderr)
        return 2 if isinstance(e, _INPUT_ERRORS) else 1
    if history:
        from ..training.trainer import objective_parts

        last = history[-1]
        lm, obj = last.get("lm_loss"), last.get("objective")
        print(
            f"done: {len(history)} steps, last lm_loss {'-' if lm is None else f'{lm:.6g}'}, objective "
            f"{'-' if obj is None else f'{obj:.6g}'}{objective_parts(last)}"
            + (f"; logs in {cfg.out}" if cfg.out else "")
        )
    return 0


def verify_legend(report: dict[str, Any]) -> str:
    """What the verify table's columns and its ``vs`` references mean (printed after the table)."""
    refs = {r["reference"] for r in report["rows"]}
    lines = [
        "columns: each cell is the largest relative difference, over all steps, between the layout's run and its "
        "reference run (vs): objective and lm_loss as logged; logs = every other logged metric (MTP, aux and "
        "z-losses, counts); grad_norm; params = every parameter after the last step; bias = the expert biases "
        f"(aux-loss-free balancing). PASS: every cell <= {report['tolerance']:g}.",
        "vs: 1x1 = the same model in one process without gradient accumulation",
    ]
    ks = sorted({r.split("/")[0] for r in refs if r.startswith("K=")})
    if ks:
        lines[-1] += (
            f"; {', '.join(ks)} = one process accumulating that many microbatches of the layout's microbatch size "
            "(per_microbatch and the microbatch-dependent MoE scopes depend on it, so the layout is compared "
            "with the same microbatch size)"
        )
    if any(r.endswith("/no-indexer") for r in refs):
        lines[-1] += "; /no-indexer = the reference without the DeepSeek indexer, as the layout"
    return "\n".join(lines)


def print_note(text: str) -> None:
    """The ``notify`` of ``lossparity train``: each operational note of the run (a checkpoint skipped on
    resume, metrics lines dropped...) as one line on stderr, whatever the warning filters. Module-level:
    it travels to the ranks the launcher starts."""
    print(f"lossparity train: note: {' '.join(text.split())}", file=sys.stderr, flush=True)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, OSError) and e.filename and str(e.filename) not in text:
        text = f"{e.filename}: {text}"
    return text


def cmd_verify(args: argparse.Namespace) -> int:
    """``lossparity verify``: the layout-invariance table; exit 1 on any FAIL."""
    from ..losses.modes import MODES
    from ..options import ACCOUNTANT_MODES
    from ..verify.reference import (
        DEFAULT_LAYOUTS,
        FULL_LAYOUTS,
        QUICK_LAYOUTS,
        format_table,
        parse_layouts,
        run_verify,
        write_json,
    )

    modes = tuple(args.modes.split(",")) if args.modes else ACCOUNTANT_MODES
    for m in modes:
        if m not in MODES:
            raise UsageError(f"unknown mode {m!r}; valid modes: {', '.join(ACCOUNTANT_MODES)}")
    if sum(map(bool, (args.quick, args.full, args.layouts))) > 1:
        raise UsageError("--quick, --full and --layouts exclude each other")
    try:
        layouts = (
            parse_layouts(args.layouts)
            if args.layouts
            else QUICK_LAYOUTS
            if args.quick
            else FULL_LAYOUTS
            if args.full
            else DEFAULT_LAYOUTS
        )
    except ValueError as e:
        raise UsageError(f"--layouts: {e}") from None
    steps = args.steps if args.steps else (2 if args.quick else 5 if args.full else 3)
    overrides = {"aux_scope": args.aux_scope, "loss_impl": args.loss_impl}
    print(
        f"lossparity verify: tiny MoE+MTP model, {len(layouts)} layouts x {len(modes)} modes, {steps} steps, "
        f"float64, {args.loss_impl} output head, reference = 1x1 run"
    )
    report = run_verify(layouts, modes, steps=steps, overrides=overrides)
    print(format_table(report))
    print(verify_legend(report))
    if args.json:
        write_json(report, args.json)
    return 0 if all(r["pass"] for r in report["rows"]) else 1
