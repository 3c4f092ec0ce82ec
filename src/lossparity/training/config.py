"""``TrainConfig``: the typed description of a reference-trainer run, and its validation.

Every field has a type (option fields use the ``Literal`` aliases of :mod:`lossparity.options`), a help
text and a *kind* in its metadata, which the rest of the project reads instead of re-declaring fields:

- ``numbers``: the field defines the numbers of the run (mode, seed, model, data, hyper-parameters).
  ``--resume`` refuses a checkpoint written with another value (:func:`numbers_mismatch`).
- ``layout``: the parallel layout (``dp``, ``ga``, ``recompute``...). By the invariance contract
  (docs/semantics.md §3) it does not change the numbers, so a run may resume into another layout.
- ``run``: where and how the run reports (``out``, ``resume``, logging intervals...), no effect on numbers.

The ``train`` command line is generated from these fields (``cli/train.py``). :meth:`TrainConfig.validate`
only checks; :meth:`TrainConfig.resolved` returns a validated copy with the derived values filled in.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from ..options import (
    ACCOUNTANT_MODES,
    AUX_SCOPES,
    DTYPES,
    ENGINES,
    LOSS_IMPLS,
    MTP_CONVENTIONS,
    MTP_LOG_ESTIMATORS,
    NORMALIZATIONS,
    Z_FORMS,
    AuxScope,
    DType,
    Engine,
    LossImpl,
    Mode,
    MTPConvention,
    MTPLogEstimator,
    Normalization,
    ZForm,
    check_cp_seq_len,
    check_option,
    check_sharded_moe,
)

__all__ = [
    "TrainConfig",
    "FieldKind",
    "check_field",
    "field_kind",
    "field_type",
    "numbers_mismatch",
    "OPTION_CHOICES",
    "BYTE_VOCAB",
]

FieldKind = Literal["numbers", "layout", "run"]

# The option fields and their valid spellings (the CLI's choices, validate()'s check).
OPTION_CHOICES: dict[str, tuple[str, ...]] = {
    "mode": ACCOUNTANT_MODES,
    "normalization": NORMALIZATIONS,
    "mtp_convention": MTP_CONVENTIONS,
    "mtp_log_estimator": MTP_LOG_ESTIMATORS,
    "aux_scope": AUX_SCOPES,
    "z_form": Z_FORMS,
    "dtype": DTYPES,
    "engine": ENGINES,
    "loss_impl": LOSS_IMPLS,
    "on_violation": ("stop", "warn"),
}

# The byte-level tokenizer's vocabulary: 256 bytes + 3 special ids (training/data.py ByteTokenizer).
BYTE_VOCAB = 259

# Weights and rates that must be finite and >= 0 (NaN is never a valid weight).
_NON_NEGATIVE = (
    "lr",
    "min_lr",
    "weight_decay",
    "mtp_weight",
    "mtp_weight_after",
    "aux_coeff",
    "z_coeff",
    "bias_rate",
    "indexer_coeff",
)
_POSITIVE_INTS = ("dp", "cp", "pp", "pp_virtual", "tp", "ga", "global_batch", "seq_len", "steps", "log_interval")
_OPTIONAL_NON_NEGATIVE_INTS = ("mtp_switch_step", "bias_freeze_step")


def _f(default: Any, help: str, kind: FieldKind = "numbers", **kw: Any) -> Any:
    """A dataclass field with its help text and kind in the metadata."""
    if callable(default) and not isinstance(default, (int, float, str, bool)):
        return field(default_factory=default, metadata={"help": help, "kind": kind, **kw})
    return field(default=default, metadata={"help": help, "kind": kind, **kw})


@dataclass
class TrainConfig:
    """Everything that defines a run. ``layout`` fields must not change the numbers (docs/semantics.md §3),
    ``numbers`` fields may; see the module docstring."""

    model: str = _f("tiny", "model preset: tiny, small, medium, 100m")
    model_overrides: dict[str, Any] = _f(dict, "ModelConfig field overrides (CLI: --set FIELD=VALUE)")
    mode: Mode = _f("per_token", "objective mode (the table: lossparity modes)")
    normalization: Normalization = _f(
        "precount",
        "precount: normalizers counted before the step; deferred: "
        "gradients divided by the all-reduced count at the end",
    )
    fixed_length: int | None = _f(None, "L of sample_sum_norm (default: seq_len)")
    group_size: int | None = _f(
        None,
        "per_group: rows per prompt group (GRPO's num_generations): row r of the global batch is in group "
        "r // group_size (a last group of fewer rows when it does not divide global_batch)",
    )
    dp: int = _f(1, "data-parallel ranks (started here unless under torchrun)", "layout")
    cp: int = _f(1, "context-parallel ranks per data-parallel rank (zig-zag shards)", "layout")
    pp: int = _f(1, "pipeline stages (1F1B; needs --ga >= --pp)", "layout")
    pp_virtual: int = _f(1, "virtual chunks per stage (interleaved 1F1B)", "layout")
    tp: int = _f(1, "tensor-parallel ranks (vocabulary-parallel head)", "layout")
    sp: bool = _f(False, "sequence parallelism with --tp (Megatron SP)", "layout")
    ep: int = _f(1, "expert-parallel ranks, carved out of the dp x cp ranks", "layout")
    cp_zigzag: bool = _f(True, "zig-zag context-parallel shards (load balance of causal attention)", "layout")
    ga: int = _f(1, "gradient-accumulation microbatches per rank", "layout")
    global_batch: int = _f(8, "rows per optimizer step")
    seq_len: int = _f(64, "tokens per row")
    packed: bool = _f(False, "pack documents into rows (segment ids)")
    data: str = _f("synthetic", "'synthetic' or a .txt / .jsonl file (byte-level tokenizer)")
    data_field: str = _f("text", "the string field of a .jsonl corpus")
    steps: int = _f(20, "optimizer steps of the run (the learning-rate schedule ends there)")
    lr: float = _f(3e-3, "peak learning rate")
    min_lr: float = _f(3e-4, "learning rate at the last step (cosine decay)")
    warmup: int = _f(2, "linear warm-up steps")
    decay_steps: int | None = _f(
        None,
        "step at which the cosine decay reaches min_lr, held after it (default: --steps; a resumed run keeps "
        "the saved one: extending a run holds min_lr over the added steps)",
    )
    weight_decay: float = _f(0.1, "AdamW weight decay of matrices")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this value (<= 0: no clipping)")
    seed: int = _f(0, "seed of the initialization and the synthetic data")
    dtype: DType = _f("float32", "parameter dtype (bf16: float32 weights, bf16 autocast)")
    recompute: bool = _f(False, "activation recompute of every block", "layout")
    engine: Engine = _f(
        "ddp", "data-parallel gradient engine: DDP, FSDP2 fully_shard, or the accountant's all-reduce", "layout"
    )
    mtp_weight: float = _f(0.3, "MTP lambda until --mtp-switch-step")
    mtp_weight_after: float = _f(0.1, "MTP lambda from --mtp-switch-step on")
    mtp_switch_step: int | None = _f(None, "step at which lambda switches (DeepSeek-V3)")
    mtp_convention: MTPConvention = _f("own", "MTP denominator convention (semantics of multi-token prediction)")
    mtp_log_estimator: MTPLogEstimator = _f("token_mean", "estimator of the logged MTP losses")
    aux_scope: AuxScope = _f("global_lagged", "MoE load-balancing loss scope (semantics of MoE aux losses)")
    aux_coeff: float = _f(1e-2, "load-balancing loss coefficient alpha")
    z_coeff: float = _f(1e-3, "router z-loss coefficient beta")
    z_form: ZForm = _f("global", "router z-loss form")
    megatron_quirks: bool = _f(False, "reproduce Megatron-LM's MoE gradient and logging quirks")
    bias_rate: float = _f(1e-3, "expert-bias update rate u (aux-loss-free balancing)")
    bias_freeze_step: int | None = _f(None, "expert-bias rate becomes 0 from this step")
    bias_zero_mean: bool = _f(False, "zero-mean correction of the expert-bias update (torchtitan)")
    indexer_coeff: float = _f(1e-2, "DSA indexer loss coefficient")
    out: str | None = _f(None, "run directory: metrics.jsonl, tensorboard/, checkpoints/, samples/", "run")
    log_interval: int = _f(1, "console line every N steps (mean over the interval)", "run")
    ckpt_interval: int = _f(0, "checkpoint every N steps and at the last step (0: never)", "run")
    resume: bool = _f(False, "resume from OUT/checkpoints (the newest intact checkpoint)", "run")
    overwrite: bool = _f(
        False, "start a new run in a non-empty OUT: deletes its metrics, samples, tensorboard and checkpoints", "run"
    )
    tensorboard: bool = _f(True, "write TensorBoard scalars to OUT/tensorboard when tensorboard is installed", "run")
    progress: bool = _f(True, "print a progress line", "run")
    dump_samples: bool = _f(
        False, "write per-sample (n_i, s_i) of every step to OUT/samples for `lossparity gap`", "run"
    )
    loss_impl: LossImpl = _f(
        "fused",
        "output-layer cross-entropy: fused (gradients formed in the forward from the accountant's per-token "
        "weights) or chunked (logits recomputed in the backward)",
        "layout",
    )
    device: str = _f(
        "cpu", "cpu, or cuda for single-process runs on the current GPU (multi-rank runs use NCCL's device)", "layout"
    )
    # the live parity guard (training/parity_stop.py)
    reference: str | None = _f(None, "reference log to compare every step with (any `compare` format)", "run")
    tol: str = _f("", "tolerances of --reference, as compare --tol: NAME=REL[,NAME=rel:x+abs:y]", "run")
    on_violation: str = _f("stop", "--reference violation: stop (checkpoint, exit 3) or warn", "run")

    # ------------------------------------------------------------------ checks (never mutate)
    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming the offending field for any invalid or inconsistent
        setting, ``FileNotFoundError`` for a missing data file. Never changes the config."""
        self._check_values()
        self._check_layout()
        self._check_indexer()
        self._check_features()

    def _check_values(self) -> None:
        for f in dataclasses.fields(self):
            check_field(f.name, getattr(self, f.name))
        if self.global_batch % (self.dp * self.ga):
            raise ValueError(
                f"global_batch={self.global_batch} is not divisible by dp*ga={self.dp}*{self.ga}: every rank "
                "needs the same number of whole rows per microbatch"
            )
        if self.resume and self.overwrite:
            raise ValueError("resume and overwrite exclude each other")
        self._check_groups()

    def _check_groups(self) -> None:
        """``per_group`` numbers the rows' groups by ``group_size``; its group counts span ranks, so they are
        pre-counted (``deferred`` knows them only after the backward) and each MTP depth counts its own."""
        if self.mode != "per_group":
            return
        if self.group_size is None:
            raise ValueError(
                "mode 'per_group' needs group_size (rows per prompt group, GRPO's num_generations: row r of "
                "the global batch is in group r // group_size)"
            )
        if self.group_size > self.global_batch:
            raise ValueError(f"group_size={self.group_size} is larger than global_batch={self.global_batch}")
        if self.normalization == "deferred":
            raise ValueError(
                "mode 'per_group' needs normalization='precount': a group's token count n_g spans ranks and "
                "microbatches, and every share divides by it before the backward"
            )
        if self.mtp_convention == "pooled":
            raise ValueError("mode 'per_group' is not combined with mtp_convention='pooled' (use 'own' or 'main')")
        if self.dump_samples:
            raise ValueError("mode 'per_group' is not combined with dump_samples (lossparity gap has no groups)")

    def parallel_dims(self, dims: Any = None) -> Any:
        """The layout of this config as a (not yet built) ``ParallelDims``; with ``dims`` (a caller's own
        ``ParallelDims``), ``dims`` itself once it describes that layout, else ``ValueError`` naming the fields
        that differ (the config is the run's record in ``config.json``: it must not say another layout than
        the one run)."""
        from ..distributed.parallel_dims import ParallelDims

        want = ParallelDims(
            dp=self.dp,
            cp=self.cp,
            tp=self.tp,
            pp=self.pp,
            ep=self.ep,
            sp=self.sp,
            pp_virtual=self.pp_virtual,
            engine=self.engine,
        )
        if dims is None:
            return want
        names = ("dp", "cp", "tp", "pp", "ep", "sp", "pp_virtual", "engine")
        bad = [
            f"{n}: config {getattr(want, n)!r}, dims {getattr(dims, n)!r}"
            for n in names
            if getattr(want, n) != getattr(dims, n)
        ]
        if bad:
            raise ValueError(f"Trainer(cfg, dims): dims does not describe the layout of cfg ({'; '.join(bad)})")
        return dims

    def _check_layout(self) -> None:
        self.parallel_dims().validate()  # sizes, ep | dp*cp, sp needs tp, engine combinations
        self._check_expert_parallel()
        if self.cp > 1:
            check_cp_seq_len(self.seq_len, self.cp, self.cp_zigzag)
        check_sharded_moe(
            self.cp,
            self.sp,
            megatron_quirks=self.megatron_quirks,
            aux_on=self.aux_scope != "none" and self.aux_coeff > 0,
            z_on=self.z_coeff > 0,
            aux_scope=self.aux_scope,
            mode=self.mode,
        )
        if self.sp and (self.seq_len // self.cp) % self.tp:
            raise ValueError(
                f"seq_len/cp={self.seq_len}/{self.cp} must be divisible by tp={self.tp} for sequence parallelism"
            )
        if self.pp > 1:
            if self.dump_samples:
                raise ValueError(f"pp={self.pp} is not combined with dump_samples yet")
            if self.ga < self.pp:
                raise ValueError(
                    f"pp={self.pp} needs ga >= pp microbatches per step (got ga={self.ga}) to fill the pipeline"
                )
            if self.pp_virtual > 1 and self.ga % self.pp:
                raise ValueError(
                    f"interleaved pipelining (pp_virtual={self.pp_virtual}) needs ga divisible by "
                    f"pp={self.pp}, got ga={self.ga}"
                )

    def _check_expert_parallel(self) -> None:
        """Expert parallelism beyond what ``ParallelDims`` checks: the routed experts split evenly over the
        ``ep`` ranks; EP is not combined with sequence parallelism (under SP the experts see tokens gathered
        over TP, EP keeps each rank's own tokens)."""
        if self.ep == 1:
            return
        if self.sp:
            raise ValueError(
                f"--ep={self.ep} is not combined with --sp yet (under SP the experts see tokens gathered "
                "over TP; EP keeps each rank's own tokens)"
            )
        from ..model import get_config

        experts = get_config(self.model, **self.model_overrides).num_experts
        if experts == 0 or experts % self.ep:
            raise ValueError(
                f"--ep={self.ep} must divide the number of routed experts num_experts={experts} of model {self.model!r}"
            )

    def _check_indexer(self) -> None:
        """The DSA indexer loss share ``c·Σ KL / Tq`` needs the step's global query-token count before the
        backward, which ``normalization='deferred'`` knows only after it."""
        if self.normalization != "deferred" or self.indexer_coeff <= 0:
            return
        from ..model import get_config

        layer = get_config(self.model, **self.model_overrides).indexer_layer
        if layer is not None:
            raise ValueError(
                f"the DSA indexer loss (model indexer_layer={layer}, indexer_coeff={self.indexer_coeff}) is "
                "normalized by the step's global query-token count, which normalization='deferred' knows only "
                "after the backward: use normalization='precount', or indexer_coeff=0"
            )

    def _check_features(self) -> None:
        if self.dump_samples and (self.out is None or self.cp > 1):
            raise ValueError(
                "dump_samples needs out= (the dump goes to OUT/samples) and cp=1 (a context-parallel "
                "shard holds only part of a sample's sum)"
            )
        if self.data != "synthetic" and not os.path.isfile(self.data):
            raise FileNotFoundError(f"data file not found: {self.data}")
        vocab = self.model_overrides.get("vocab_size")
        if self.data != "synthetic" and isinstance(vocab, int) and vocab < BYTE_VOCAB:
            raise ValueError(
                f"--set vocab_size={vocab} is smaller than the byte tokenizer's {BYTE_VOCAB} needed by "
                f"--data {self.data}: drop the override (the vocabulary then follows the tokenizer)"
            )

    # ------------------------------------------------------------------ derived values
    def resolved(self) -> TrainConfig:
        """A validated copy with canonical option spellings and the derived values filled in:
        ``fixed_length = seq_len`` for ``sample_sum_norm``; with a data file, the model's
        ``vocab_size`` = the byte tokenizer's 259 rounded up to a multiple of ``tp`` unless ``--set`` gives it."""
        self.validate()
        changes: dict[str, Any] = {
            name: check_option(name, getattr(self, name), valid) for name, valid in OPTION_CHOICES.items()
        }
        if self.mode == "sample_sum_norm" and self.fixed_length is None:
            changes["fixed_length"] = self.seq_len
        if self.data != "synthetic" and "vocab_size" not in self.model_overrides:
            vocab = -(-BYTE_VOCAB // self.tp) * self.tp
            changes["model_overrides"] = {**self.model_overrides, "vocab_size": vocab}
        else:
            changes["model_overrides"] = dict(self.model_overrides)
        return dataclasses.replace(self, **changes)

    @property
    def microbatch_size(self) -> int:
        """``b = N / (D·K)``."""
        return self.global_batch // (self.dp * self.ga)

    @property
    def depends_on_microbatch_size(self) -> bool:
        """Whether the numbers depend on ``b`` by definition (``per_microbatch``, the ``microbatch`` and
        ``global_running`` aux scopes, the per-microbatch z form): then ``b`` is part of the numbers."""
        return (
            self.mode == "per_microbatch"
            or self.aux_scope in ("microbatch", "global_running")
            or self.z_form == "microbatch"
        )


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def check_field(name: str, value: Any) -> None:
    """Check one field on its own: its type, an option's spelling (aliases accepted), finiteness and range
    (weights, coefficients and rates are finite and ``>= 0``; sizes ``>= 1``). Raises ``ValueError`` (or
    ``TypeError``) whose message starts with the field name; an unknown name raises ``ValueError``."""
    if name not in _FIELDS:
        close = difflib.get_close_matches(name, list(_FIELDS), n=1)
        raise ValueError(f"unknown field {name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    if name in OPTION_CHOICES:
        check_option(name, value, OPTION_CHOICES[name])
        return
    if not _type_ok(name, value):
        raise TypeError(f"{name} must be {_type_text(name)}, got {value!r} ({type(value).__name__})")
    if name in _NON_NEGATIVE and not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if name == "grad_clip" and not math.isfinite(value):
        raise ValueError(f"grad_clip must be finite (<= 0 disables clipping), got {value!r}")
    low = {
        **dict.fromkeys(_POSITIVE_INTS, 1),
        "warmup": 0,
        "ckpt_interval": 0,
        "fixed_length": 1,
        "group_size": 1,
        "decay_steps": 1,
        **dict.fromkeys(_OPTIONAL_NON_NEGATIVE_INTS, 0),
    }.get(name)
    if low is not None and value is not None and value < low:
        raise ValueError(f"{name} must be >= {low}{' or None' if field_type(name)[1] else ''}, got {value}")


def field_kind(name: str) -> FieldKind:
    """The kind (``numbers``/``layout``/``run``) of the ``TrainConfig`` field ``name``."""
    for f in dataclasses.fields(TrainConfig):
        if f.name == name:
            return f.metadata["kind"]
    raise KeyError(f"TrainConfig has no field {name!r}")


def numbers_mismatch(saved: dict[str, Any], new: TrainConfig) -> list[str]:
    """The ``numbers`` fields in which the saved configuration (``dataclasses.asdict`` of a resolved
    config) differs from ``new``, as ``"field: saved -> new"`` strings; ``microbatch_size`` is compared too
    when either side depends on it. Fields absent from ``saved`` (older checkpoints) are not compared."""
    new_d = dataclasses.asdict(new)
    diffs = [
        f"{name}: {saved[name]!r} -> {new_d[name]!r}"
        for name in new_d
        if field_kind(name) == "numbers" and name in saved and saved[name] != new_d[name]
    ]
    try:
        old = TrainConfig(**{k: v for k, v in saved.items() if k in new_d})
    except TypeError:
        return diffs
    if (
        old.depends_on_microbatch_size or new.depends_on_microbatch_size
    ) and old.microbatch_size != new.microbatch_size:
        diffs.append(
            f"microbatch_size (global_batch/(dp*ga)): {old.microbatch_size} -> {new.microbatch_size} "
            f"(mode {new.mode!r}, aux_scope {new.aux_scope!r} and z_form {new.z_form!r} depend on it)"
        )
    return diffs


def field_type(name: str) -> tuple[type, bool]:
    """``(base, optional)`` of the ``TrainConfig`` field ``name`` from its resolved type hint
    (``typing.get_type_hints``): ``int | None`` is ``(int, True)``, a ``Literal`` option ``(str, False)``,
    ``dict[str, Any]`` ``(dict, False)``. The CLI builds its flags from it; :func:`check_field` checks values."""
    hint = _HINTS[name]
    optional = False
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        optional = len(args) < len(get_args(hint))
        hint = args[0]
    if get_origin(hint) is Literal:
        return type(get_args(hint)[0]), optional
    origin = get_origin(hint)
    return (origin if isinstance(origin, type) else hint), optional


def _type_text(name: str) -> str:
    base, optional = field_type(name)
    return base.__name__ + (" | None" if optional else "")


def _type_ok(name: str, value: Any) -> bool:
    """Whether ``value`` fits the type of field ``name`` (bools are not numbers; ints are floats)."""
    base, optional = field_type(name)
    if value is None:
        return optional
    if base is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if base is float:
        return isinstance(value, (int, float))
    return isinstance(value, base)


_HINTS = get_type_hints(TrainConfig)
