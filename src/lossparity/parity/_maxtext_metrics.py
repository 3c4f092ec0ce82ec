"""Reader of MaxText's ``metrics_file`` (``metrics_file=PATH`` in a MaxText config): one JSON object per
training step, ``{"learning/loss": ..., "learning/lm_loss": ..., ..., "step": 0.0, "run_name": "..."}``.

MaxText numbers its steps from 0 (``step_base`` 0). Its names map to lossparity's canonical ones through
:mod:`lossparity.parity.names` (``learning/loss`` = ``objective``, ``learning/lm_loss`` = ``lm_loss``,
``learning/raw_grad_norm`` = ``grad_norm``, ``learning/total_weights`` = ``tokens``); the keys that
``lossparity.maxtext`` adds (``lossparity/lm_objective``, ``lossparity/units``) keep their names.
Auto-detection reads such a file as ``jsonl``, which gives the same series; ``--format maxtext_metrics``
also checks that every line is a MaxText metrics line (a ``step`` and ``learning/`` keys).
"""

from __future__ import annotations

from ..input_files import capped_lines, loads_json
from ._record import LogParseError, Recorder
from ._structured import MAXTEXT_KEY_PREFIXES, read_jsonl

__all__ = ["read_maxtext_metrics"]


def read_maxtext_metrics(path: str, rec: Recorder) -> None:
    """Read a MaxText ``metrics_file`` into ``rec``: step base 0; a line without ``step`` or without any
    ``learning/`` / ``perf/`` key raises :class:`LogParseError` naming the line."""

    # regular file, capped lines, bounded JSON (lossparity.input_files): the same rules as every reader
    for ln, line in capped_lines(path):
        if not line.strip():
            continue
        try:
            obj = loads_json(line)
        except ValueError:
            continue  # read_jsonl reports a broken (or torn last) line with its own message
        if (
            not isinstance(obj, dict)
            or "step" not in obj
            or not any(isinstance(k, str) and k.startswith(MAXTEXT_KEY_PREFIXES) for k in obj)
        ):
            raise LogParseError(path, ln, "a MaxText metrics line: an object with 'step' and 'learning/' keys")
    rec.step_base = 0
    read_jsonl(path, rec)
