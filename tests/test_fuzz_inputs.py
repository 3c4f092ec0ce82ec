"""Issue 39: mutation fuzzing of the log readers and the run-folder loader with a fixed budget (derandomized:
the same inputs on every run). Seeds: the project's own test logs and a run folder built from them; the
mutations (``tests/_fuzz.py``): byte flips, truncation, duplicated / swapped / deleted lines, inserted huge
numbers, NaN/inf, deep nesting, long runs, invalid UTF-8, lone carriage returns. Every input must end in a
result or the module's own one-line error. ``scripts/fuzz_inputs.py`` runs the same engine for longer.
"""

from __future__ import annotations

import pathlib
import random
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _fuzz  # noqa: E402

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# hypothesis draws a seed per input and the mutations come from random.Random(seed): hypothesis's own draws
# shrink towards small values, which left positions and payloads at their first choices
_MUTATIONS = st.integers(0, 2**32).map(lambda seed: _fuzz.random_mutations(random.Random(seed)))
_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


def test_fuzz_log_readers(tmp_path):
    seeds = _fuzz.seeds_with_formats(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    escapes: list[str] = []

    @settings(max_examples=2000, **_SETTINGS)
    @given(st.integers(0, len(seeds) - 1), _MUTATIONS, st.booleans())
    def read(index: int, mutations: list, detect: bool) -> None:
        seed, fmt = seeds[index]
        path = _fuzz.write_case(work, seed, _fuzz.mutate(seed.read_bytes(), mutations))
        escape = _fuzz.check_log(path, None if detect or fmt is None else fmt)
        if escape is not None:
            escapes.append(f"{seed.name} {mutations}: {escape}")

    read()
    assert not escapes, "\n".join(escapes[:10])


def test_fuzz_run_folder_loader(tmp_path):
    base = tmp_path / "base"
    _fuzz.make_run_folder(base)
    assert _fuzz.check_run_folder(base, _fuzz.json_config(base)) is None  # the intact folder passes
    escapes: list[str] = []

    @settings(max_examples=200, **_SETTINGS)
    @given(st.sampled_from(_fuzz.RUN_FILES), _MUTATIONS)
    def load(name: str, mutations: list) -> None:
        escape = _fuzz.fuzz_run_file(base, tmp_path / "work", name, mutations)
        if escape is not None:
            escapes.append(f"{name} {mutations}: {escape}")

    load()
    assert not escapes, "\n".join(escapes[:10])


# ---------------------------------------------------------------------------------------------- issue 50
@pytest.mark.parametrize("engine", ["dump", "gap"])
def test_fuzz_sample_dumps_and_gap(tmp_path, engine):
    """Mutations of a 2-rank dump, its description, an ``.npz`` (and, for ``gap``, the run's ``metrics.jsonl``):
    reading and truncating end in a result or ``SampleDumpError`` naming a file; ``gap`` exits 0, 1 or 2 with
    one line naming a file (``tests/_fuzz_dumps.py``)."""
    import _fuzz_dumps

    base = tmp_path / "base"
    _fuzz_dumps.make_dump_folder(base)
    check = _fuzz_dumps.fuzz_dump if engine == "dump" else _fuzz_dumps.fuzz_gap
    files = _fuzz_dumps.DUMP_FILES if engine == "dump" else _fuzz_dumps.GAP_FILES
    assert check(base, tmp_path / "work", files[0], []) is None  # the intact dump passes
    escapes: list[str] = []

    @settings(max_examples=150 if engine == "dump" else 100, **_SETTINGS)
    @given(st.sampled_from(files), _MUTATIONS)
    def load(name: str, mutations: list) -> None:
        escape = check(base, tmp_path / "work", name, mutations)
        if escape is not None:
            escapes.append(f"{name} {mutations}: {escape}")

    load()
    assert not escapes, "\n".join(escapes[:10])


def test_fuzz_sharded_checkpoints():
    """40 mutations of the newest of two DCP checkpoints (``.metadata``, a shard, ``extra_rank0.pt``), each
    loaded in a one-rank gloo group on 127.0.0.1 (in a subprocess of ``scripts/fuzz_inputs.py``, so the
    process group never outlives it): every load ends with one of the two checkpoints."""
    import subprocess

    script = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "fuzz_inputs.py"
    argv = [sys.executable, str(script), "--engines", "sharded", "--count", "40", "--seconds", "240", "--seed", "0"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "inputs tried: 40 (40 sharded)" in out.stdout, (
        out.stdout[-3000:] + out.stderr[-3000:]
    )
    assert "escapes: 0" in out.stdout
