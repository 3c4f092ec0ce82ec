"""Per-sample dumps and the ``gap`` tool: hand-worked values, the gap decomposition, the bootstrap and the drift
verdict. Expected numbers come from hand computation or naive float64 formulas written here."""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from lossparity.cli.parity import add_gap_arguments
from lossparity.cli.parity import cmd_gap as run_gap
from lossparity.parity.gap import (
    NOT_COMPUTABLE,
    bootstrap_gaps,
    compute_gap,
    covariance_gap,
    format_table,
    step_mode_values,
    summarize,
)
from lossparity.parity.sample_dump import (
    SampleDumpError,
    SampleDumpWriter,
    read_sample_dump,
    read_sample_meta,
    write_sample_meta,
)


def _write_records(path: Path, records: list[tuple[float, float, float, float]]) -> None:
    """The binary format written by hand: little-endian float64 (step, row, n, s) per record."""
    path.write_bytes(b"".join(struct.pack("<4d", *r) for r in records))


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_gap_arguments(p)
    return p.parse_args(argv)


# Hand-worked step: rows 0..3 with n = [2, 4, 0, 2], s = [2, 12, 0, 1] (row 2 has no loss token).
#   l = [1, 3, 0, 0.5]; Ntok = 8; S = 15
#   per_token = 15/8 = 1.875; per_sample = 4.5/4 = 1.125; gap = 0.75
#   Cov(n, l) = mean([0·(-0.125), 2·1.875, (-2)·(-1.125), 0·(-0.625)]) = 6/4 = 1.5; / mean(n) = 2 -> 0.75
#   per_microbatch (b=2): (14/6 + 1/2) / 2 = 17/12; sample_sum = 15/4; sample_sum_norm (L=4) = 15/16
HAND = {0: (2.0, 2.0), 1: (4.0, 12.0), 2: (0.0, 0.0), 3: (2.0, 1.0)}


def _hand_dump(tmp_path: Path) -> Path:
    d = tmp_path / "dump"
    d.mkdir()
    # rank 0 holds rows 0-1, rank 1 rows 2-3; records deliberately out of order
    _write_records(d / "samples_rank0.bin", [(1, 1, *HAND[1]), (1, 0, *HAND[0])])
    _write_records(d / "samples_rank1.bin", [(1, 3, *HAND[3]), (1, 2, *HAND[2])])
    write_sample_meta(d, global_batch=4, microbatch_size=2, seq_len=8, mode="per_token", fixed_length=4, world_size=2)
    return d


def test_hand_written_two_rank_dump_round_trip(tmp_path: Path) -> None:
    d = _hand_dump(tmp_path)
    dump = read_sample_dump(d)
    assert list(dump) == [1]
    rows, n, s = dump[1]
    assert rows.tolist() == [0, 1, 2, 3]
    assert n.tolist() == [2.0, 4.0, 0.0, 2.0]
    assert s.tolist() == [2.0, 12.0, 0.0, 1.0]
    assert read_sample_meta(d)["microbatch_size"] == 2
    # a run directory with a samples/ subdirectory resolves to the same dump
    run = tmp_path / "run"
    run.mkdir()
    d.rename(run / "samples")
    assert read_sample_dump(run)[1][2].tolist() == [2.0, 12.0, 0.0, 1.0]


def test_writer_round_trip_with_tensors(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    expected: dict[int, dict[int, tuple[float, float]]] = {}
    for rank in range(2):
        with SampleDumpWriter(tmp_path, rank, meta={"global_batch": 8, "microbatch_size": 2}) as w:
            for step in (1, 2):
                for k in range(2):
                    rows = torch.arange(rank * 4 + 2 * k, rank * 4 + 2 * k + 2)
                    n = torch.tensor(rng.integers(0, 9, size=2), dtype=torch.float32)
                    s = torch.tensor(rng.uniform(0, 5, size=2), dtype=torch.float64) * n.double()
                    w.write(step, rows, n, s)
                    for r, ni, si in zip(rows.tolist(), n.tolist(), s.tolist()):
                        expected.setdefault(step, {})[r] = (ni, si)
    dump = read_sample_dump(tmp_path)
    for step, by_row in expected.items():
        rows, n, s = dump[step]
        assert rows.tolist() == sorted(by_row)
        assert n.tolist() == [by_row[r][0] for r in sorted(by_row)]
        assert s.tolist() == [by_row[r][1] for r in sorted(by_row)]  # float64 is stored exactly


def test_writer_resume_drops_later_steps(tmp_path: Path) -> None:
    with SampleDumpWriter(tmp_path, 0) as w:
        for step in (1, 2, 3):
            w.write(step, np.array([0]), np.array([1.0]), np.array([float(step)]))
    with SampleDumpWriter(tmp_path, 0, resume_step=2) as w:
        w.write(3, np.array([0]), np.array([1.0]), np.array([30.0]))
    dump = read_sample_dump(tmp_path)
    assert sorted(dump) == [1, 2, 3]
    assert dump[3][2].tolist() == [30.0]


def test_writer_rejects_bad_input(tmp_path: Path) -> None:
    w = SampleDumpWriter(tmp_path, 0)
    with pytest.raises(ValueError, match="same shape"):
        w.write(1, np.array([0, 1]), np.array([1.0]), np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="counts must be non-negative integers"):
        w.write(1, np.array([0]), np.array([1.5]), np.array([1.0]))
    with pytest.raises(ValueError, match="global_rows must be 1-D"):
        w.write(1, np.zeros((2, 2)), np.zeros(4), np.zeros(4))
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.write(1, np.array([0]), np.array([1.0]), np.array([1.0]))


def test_torn_last_record_is_ignored_with_a_note(tmp_path: Path) -> None:
    # a crash while appending leaves half a record at the end of a rank file (issue 18.3)
    path = tmp_path / "samples_rank1.bin"
    _write_records(path, [(1, 0, 3, 1.5)])
    with open(path, "ab") as f:
        f.write(struct.pack("<2d", 1, 1))  # half of record 1
    _write_records(tmp_path / "samples_rank0.bin", [(1, 2, 3, 1.5)])
    notes: list[str] = []
    dump = read_sample_dump(tmp_path, notes)
    assert dump[1][0].tolist() == [0, 2]
    assert len(notes) == 1 and "samples_rank1.bin" in notes[0] and "16 of 32 bytes" in notes[0]


def test_incomplete_last_step_is_ignored_but_an_earlier_one_is_an_error(tmp_path: Path) -> None:
    write_sample_meta(tmp_path, global_batch=2)
    _write_records(tmp_path / "samples_rank0.bin", [(1, 0, 1, 1.0), (1, 1, 1, 1.0), (2, 0, 1, 1.0)])
    notes: list[str] = []
    assert sorted(read_sample_dump(tmp_path, notes)) == [1]
    assert "last step 2 ignored" in notes[0]
    _write_records(tmp_path / "samples_rank0.bin", [(1, 0, 1, 1.0), (2, 0, 1, 1.0), (2, 1, 1, 1.0)])
    with pytest.raises(SampleDumpError, match="step 1 has 1 samples"):
        read_sample_dump(tmp_path)


def test_gap_fails_naming_the_missing_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    d = run / "samples"
    d.mkdir(parents=True)
    write_sample_meta(d, global_batch=1, step_base=1)
    # steps 1, 2, 5 dumped; the run's metrics.jsonl goes on to step 7: steps 3-4 and 6-7 are missing
    _write_records(d / "samples_rank0.bin", [(st, 0, 2, 1.0) for st in (1, 2, 5)])
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": st, "objective": 0.5}) + "\n" for st in range(1, 8)))
    assert run_gap(_parse([str(run), "--bootstrap", "0"])) == 1
    captured = capsys.readouterr()
    assert "MISSING STEPS: the dump lacks step(s) 3-4, 6-7" in captured.out
    assert "lacks step(s) 3-4, 6-7" in captured.err
    assert run_gap(_parse([str(run), "--bootstrap", "0", "--json"])) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["missing_steps"] == [[3, 4], [6, 7]] and report["missing_step_count"] == 4
    (run / "metrics.jsonl").unlink()
    _write_records(d / "samples_rank0.bin", [(st, 0, 2, 1.0) for st in (1, 2, 3)])
    assert run_gap(_parse([str(run), "--bootstrap", "0"])) == 0


def test_duplicate_and_missing_rows_are_errors(tmp_path: Path) -> None:
    _write_records(tmp_path / "samples_rank0.bin", [(1, 0, 1, 1.0), (1, 1, 1, 1.0)])
    _write_records(tmp_path / "samples_rank1.bin", [(1, 1, 2, 2.0)])
    with pytest.raises(SampleDumpError, match=r"duplicate sample \(step 1, row 1\)") as e:
        read_sample_dump(tmp_path)
    assert "samples_rank0.bin record 1" in str(e.value) and "samples_rank1.bin record 0" in str(e.value)
    (tmp_path / "samples_rank1.bin").unlink()
    write_sample_meta(tmp_path, global_batch=4)
    with pytest.raises(SampleDumpError, match="global_batch=4"):
        read_sample_dump(tmp_path)


def test_npz_input(tmp_path: Path) -> None:
    path = tmp_path / "mine.npz"
    np.savez(
        path,
        step=np.array([2, 2, 1]),
        row=np.array([1, 0, 0]),
        n=np.array([3, 0, 5]),
        s=np.array([1.5, 0.0, 2.0]),
        microbatch_size=np.array(1),
    )
    dump = read_sample_dump(path)
    assert sorted(dump) == [1, 2]
    assert dump[2][0].tolist() == [0, 1] and dump[2][1].tolist() == [0.0, 3.0]
    assert read_sample_meta(path) == {"microbatch_size": 1}
    np.savez(tmp_path / "bad.npz", step=np.array([1]), row=np.array([0]), n=np.array([1]))
    with pytest.raises(SampleDumpError, match="missing arrays"):
        read_sample_dump(tmp_path / "bad.npz")


def test_gap_on_hand_worked_dump(tmp_path: Path) -> None:
    d = _hand_dump(tmp_path)
    rep = compute_gap(read_sample_dump(d), microbatch_size=2, fixed_length=4, bootstrap=0)
    st = rep.steps[0]
    assert (st.samples, st.tokens) == (4, 8)
    assert st.per_token == pytest.approx(1.875, abs=1e-15)
    assert st.per_sample == pytest.approx(1.125, abs=1e-15)
    assert st.per_microbatch == pytest.approx(17 / 12, abs=1e-15)
    assert st.sample_sum == pytest.approx(3.75, abs=1e-15)
    assert st.sample_sum_norm == pytest.approx(0.9375, abs=1e-15)
    assert st.gap == pytest.approx(0.75, abs=1e-15)
    assert st.cov == pytest.approx(1.5, abs=1e-15)
    assert st.mean_count == pytest.approx(2.0, abs=1e-15)
    assert st.cov_term == pytest.approx(0.75, abs=1e-15)
    assert st.ci_low is None and rep.replicates is None


def _random_dump(seed: int, steps: int = 6, n_rows: int = 16) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = {}
    for step in range(1, steps + 1):
        n = rng.integers(0, 40, size=n_rows).astype(np.float64)
        n[rng.integers(0, n_rows)] = 0.0  # at least one zero-token sample
        mean_l = 1.0 + 0.05 * n + rng.normal(0, 0.3, size=n_rows)  # longer samples have a higher mean loss
        out[step] = (np.arange(n_rows), n, np.where(n > 0, n * mean_l, 0.0))
    return out


def test_decomposition_equals_direct_difference() -> None:
    dump = _random_dump(0)
    rep = compute_gap(dump, microbatch_size=4, fixed_length=64, bootstrap=0)
    for st in rep.steps:
        _, n, s = dump[st.step]
        l = np.where(n > 0, s / np.maximum(n, 1), 0.0)
        direct = s.sum() / n.sum() - l.mean()  # naive, independent of the code under test
        assert abs(st.gap - direct) <= 1e-12
        assert abs(st.cov_term - direct) <= 1e-12
        cov = np.mean((n - n.mean()) * (l - l.mean()))
        assert abs(st.cov_term - cov / n.mean()) <= 1e-12
        mb = np.mean([s[i : i + 4].sum() / max(n[i : i + 4].sum(), 1) for i in range(0, 16, 4)])
        assert abs(st.per_microbatch - mb) <= 1e-12
        assert abs(st.sample_sum_norm - s.sum() / (16 * 64)) <= 1e-12
    assert rep.overall()["max_decomposition_error"] <= 1e-12


def test_bootstrap_ci_contains_point_and_is_deterministic() -> None:
    dump = _random_dump(1)
    a = compute_gap(dump, bootstrap=400, seed=7)
    b = compute_gap(dump, bootstrap=400, seed=7)
    c = compute_gap(dump, bootstrap=400, seed=8)
    for st in a.steps:
        assert st.ci_low <= st.gap <= st.ci_high
    ov = a.overall()
    assert ov["ci_low"] <= ov["mean_gap"] <= ov["ci_high"]
    assert [(s.ci_low, s.ci_high) for s in a.steps] == [(s.ci_low, s.ci_high) for s in b.steps]
    assert np.array_equal(a.replicates, b.replicates)
    assert not np.array_equal(a.replicates, c.replicates)


def test_bootstrap_replicates_match_naive_resampling() -> None:
    _, n, s = _random_dump(2, steps=1)[1]
    got = bootstrap_gaps(n, s, 50, np.random.default_rng(11))
    rng = np.random.default_rng(11)
    idx = rng.integers(0, n.size, size=(50, n.size))
    for r in range(50):
        nn, ss = n[idx[r]], s[idx[r]]
        want = ss.sum() / max(nn.sum(), 1) - np.mean([si / max(ni, 1) for si, ni in zip(ss, nn)])
        assert abs(got[r] - want) <= 1e-12


def test_summary_blocks_are_means_of_steps() -> None:
    rep = compute_gap(_random_dump(4, steps=5), bootstrap=100, seed=0)
    blocks = summarize(rep, 2)
    assert [(b["first_step"], b["last_step"]) for b in blocks] == [(1, 2), (3, 4), (5, 5)]
    assert blocks[0]["gap"] == pytest.approx((rep.steps[0].gap + rep.steps[1].gap) / 2, abs=1e-15)
    assert blocks[2]["ci_low"] == pytest.approx(rep.steps[4].ci_low, abs=1e-15)
    assert blocks[0]["samples"] == 32


def test_table_says_why_gap_and_covariance_columns_agree() -> None:
    text = format_table(compute_gap(_random_dump(1, steps=2), bootstrap=0))
    assert "agree by the identity per_token − per_sample = Cov(n,l)/mean(n)" in text


def _write_dump(d: Path, dump: dict) -> None:
    with SampleDumpWriter(d, 0, meta={"global_batch": 16, "microbatch_size": 4, "seq_len": 64}) as w:
        for step, (rows, n, s) in dump.items():
            w.write(step, rows, n, s)


def _write_logs(tmp_path: Path, dump: dict, drift: float) -> tuple[Path, Path]:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    with open(a, "w") as fa, open(b, "w") as fb:
        for step, (_, n, s) in dump.items():
            per_token = s.sum() / max(n.sum(), 1)
            per_sample = np.mean([si / max(ni, 1) for si, ni in zip(s, n)])
            fa.write(json.dumps({"step": step, "objective": per_token + drift}) + "\n")
            fb.write(json.dumps({"step": step, "objective": per_sample}) + "\n")
    return a, b


def test_compare_drift_verdicts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dump = _random_dump(5, steps=8)
    _write_dump(tmp_path / "run" / "samples", dump)
    a, b = _write_logs(tmp_path, dump, drift=0.0)
    rc = run_gap(_parse([str(tmp_path / "run"), "--bootstrap", "300", "--compare-drift", str(a), str(b)]))
    out = capsys.readouterr().out
    assert rc == 0
    assert "verdict: explained" in out
    a2, b2 = _write_logs(tmp_path, dump, drift=0.5)
    rc = run_gap(_parse([str(tmp_path / "run"), "--bootstrap", "300", "--json", "--compare-drift", str(a2), str(b2)]))
    report = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert report["compare_drift"]["explained"] is False
    assert "not explained" in report["compare_drift"]["verdict"]
    assert len(report["compare_drift"]["steps"]) == 8
    assert report["compare_drift"]["observed_mean"] == pytest.approx(
        np.mean([st["gap"] for st in report["steps"]]) + 0.5, abs=1e-12
    )


def test_cli_table_json_plot_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _hand_dump(tmp_path)
    png = tmp_path / "gap.png"
    assert run_gap(_parse([str(d), "--bootstrap", "50", "--plot", str(png)])) == 0
    out = capsys.readouterr().out
    assert "per_document: not computable" in out
    assert "1.41667" in out  # per_microbatch with the meta's b = 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert run_gap(_parse([str(d), "--json", "--bootstrap", "0"])) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"][0]["gap"] == pytest.approx(0.75, abs=1e-15)
    assert report["not_computable"] == NOT_COMPUTABLE
    assert report["fixed_length"] == 4
    assert run_gap(_parse([str(tmp_path / "nowhere")])) == 2
    assert "does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_gap(_parse([str(empty)])) == 2
    assert "no sample dump" in capsys.readouterr().err
    a, b = _write_logs(tmp_path, read_sample_dump(d), drift=0.0)
    assert run_gap(_parse([str(d), "--bootstrap", "0", "--compare-drift", str(a), str(b)])) == 2
    assert "--bootstrap > 0" in capsys.readouterr().err
    assert run_gap(_parse([str(d), "--compare-drift", str(a), str(b), "--drift-metric", "lm_loss"])) == 2
    assert "no 'lm_loss' values" in capsys.readouterr().err


def test_batched_steps_equal_the_per_step_functions() -> None:
    """compute_gap works on blocks of steps with one sample count ([G, N] arrays): every value equals the
    per-step functions (step_mode_values, covariance_gap), for steps of several sizes; the replicates of a
    block are the naive resampling of indices drawn in one call for the block."""
    rng = np.random.default_rng(3)
    dump = {}
    for step, size in enumerate([4, 4, 6, 6, 6, 4, 2], start=1):
        n = rng.integers(0, 9, size).astype(np.float64)
        dump[step] = (np.arange(size), n, rng.random(size) * n)
    rep = compute_gap(dump, microbatch_size=2, fixed_length=8, bootstrap=30, seed=5)
    for st in rep.steps:
        _, n, s = dump[st.step]
        want = step_mode_values(n, s, microbatch_size=2, fixed_length=8)
        for mode, value in want.items():
            assert getattr(st, mode) == pytest.approx(value, rel=1e-14, abs=1e-15), (st.step, mode)
        cov, mean_n, cov_term = covariance_gap(n, s)
        assert (st.cov, st.mean_count, st.cov_term) == pytest.approx((cov, mean_n, cov_term), rel=1e-14, abs=1e-15)
    draws = np.random.default_rng(5)
    for first, last in ((1, 2), (3, 5), (6, 6), (7, 7)):  # the blocks: consecutive steps of one size
        steps = list(range(first, last + 1))
        size = dump[first][1].size
        idx = draws.integers(0, size, size=(len(steps), 30, size))
        for g, step in enumerate(steps):
            _, n, s = dump[step]
            for r in range(30):
                nn, ss = n[idx[g, r]], s[idx[g, r]]
                naive = ss.sum() / max(nn.sum(), 1) - np.mean([si / max(ni, 1) for si, ni in zip(ss, nn)])
                assert abs(rep.replicates[step - 1, r] - naive) <= 1e-12
