"""Under CI=true a skip for a missing dependency or missing data fails (tests/_ci_skips.py): a pytest run of three
small test files, with and without CI=true, in a subprocess."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

TESTS = pathlib.Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from _ci_skips import pytest_collectreport, pytest_runtest_makereport, pytest_sessionfinish  # noqa: F401
"""
FILES = {
    "test_a.py": "import pytest\n"
    "def test_import():\n    pytest.importorskip('no_such_module_for_issue_49')\n"
    "def test_plain_skip():\n    pytest.skip('not this platform')\n"
    "def test_ok():\n    pass\n",
    "test_b.py": "import pytest\npytest.importorskip('no_such_module_for_issue_49')\ndef test_never():\n    pass\n",
    "test_c.py": "import pytest\n"
    "@pytest.mark.skipif(True, reason='../shared/reallogs is not present in this checkout')\n"
    "def test_real():\n    pass\n",
}


def _run(tmp_path: pathlib.Path, ci: str, shared: bool = True, workers: int = 0) -> tuple[int, dict]:
    for name, text in {"conftest.py": CONFTEST, **FILES}.items():
        (tmp_path / name).write_text(text)
    summary = tmp_path / f"summary{ci}.json"
    env = {**os.environ, "CI": ci, "LOSSPARITY_TEST_SUMMARY": str(summary), "LOSSPARITY_REQUIRE_DEPS": ""}
    (tmp_path / "shared").mkdir(exist_ok=True)  # the developers' shared folder: present, or named but absent
    env["LOSSPARITY_SHARED_DIR"] = str(tmp_path / ("shared" if shared else "no_shared_folder"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)]
    if workers:  # ./dev.sh's main part runs under pytest-xdist
        cmd += ["-n", str(workers), "--dist", "loadfile"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return out.returncode, json.loads(summary.read_text())


def test_skips_for_missing_dependencies_or_data_fail_only_under_ci(tmp_path):
    code, counts = _run(tmp_path, "")
    assert code == 0 and counts == {**counts, "passed": 1, "failed": 0, "skipped": 4, "ran": 1}
    # CI=true: the test-level import skip fails, the real-logs skipif fails at set-up (an error: the test did not
    # run), the module-level skip fails the run; the plain skip stays a skip
    code, counts = _run(tmp_path, "true")
    assert code == 1 and counts == {**counts, "passed": 1, "failed": 3, "skipped": 1, "ran": 2}


def test_real_log_skips_stay_skips_in_a_clone_without_the_shared_folder(tmp_path):
    # a user's clone has no ../shared: the real-log tests cannot run there, and CI=true does not fail them;
    # the import skips still fail
    code, counts = _run(tmp_path, "true", shared=False)
    assert code == 1 and counts == {**counts, "passed": 1, "failed": 2, "skipped": 2, "ran": 2}


def test_under_xdist_workers_the_counts_and_the_exit_status_are_the_same(tmp_path):
    # the main part runs with two pytest-xdist workers: the skips happen in the workers, the counts and the exit
    # status come from the controller (a module-level skip reaches it as a collection report)
    code, counts = _run(tmp_path, "true", workers=2)
    assert code == 1 and counts == {**counts, "passed": 1, "failed": 3, "skipped": 1, "ran": 2}
    code, counts = _run(tmp_path, "", workers=2)
    assert code == 0 and counts == {**counts, "passed": 1, "failed": 0, "skipped": 4, "ran": 1}
