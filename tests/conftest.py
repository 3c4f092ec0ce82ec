"""The quick loop's selection: tests that start processes are marked ``multiprocess`` at collection.

``./dev.sh test --fast`` runs ``pytest -m "not slow and not multiprocess and not frameworks"``: the
single-process tests of the library (``frameworks``: the JAX and integration suites, see below).
A test is ``multiprocess`` when its source, a fixture of its module it uses, or a function of its module it
calls (one level) starts ranks or programs: :data:`PROCESS_MARKS` below. CI runs every test regardless.
"""

from __future__ import annotations

import inspect
import pathlib
import re

import pytest
from _ci_skips import pytest_collectreport, pytest_runtest_makereport, pytest_sessionfinish, terminal_summary

# the hooks of _ci_skips (CI=true: a skip for a missing dependency or missing data fails), registered here
__all__ = ["pytest_collectreport", "pytest_runtest_makereport", "pytest_sessionfinish"]

# What starts another process in these tests: the launcher, subprocesses, the CLI's multi-rank runs.
PROCESS_MARKS = re.compile(
    r"\bspawn\(|\bsubprocess\b|\bPopen\b|torchrun|run_training\(|\"--dp\"|\"--cp\"|\"--tp\"|\"--pp\"|\"--ep\""
    r"|\bdp=[2-9]|\bcp=[2-9]|\btp=[2-9]|\bpp=[2-9]|\"verify\"|run_verify|\b[DCTPE][2-9]\b"
)


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _starts_processes(item: pytest.Item) -> bool:
    function = getattr(item, "function", None)
    module = getattr(item, "module", None)
    if function is None or module is None:
        return False
    text = _source(function)
    names = set(getattr(item, "fixturenames", ())) | set(re.findall(r"\b(\w+)\(", text))
    for name in names:
        helper = getattr(module, name, None)
        helper = getattr(helper, "__wrapped__", helper)  # a fixture's function
        if inspect.isfunction(helper) and getattr(helper, "__module__", None) == module.__name__:
            text += _source(helper)
    return bool(PROCESS_MARKS.search(text))


# The framework-oracle suites: JAX compilations and Hugging Face Trainer runs, seconds per test.
FRAMEWORK_DIRS = ("jax", "integrations")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "multiprocess: starts ranks or programs (left out by ./dev.sh test --fast)")
    config.addinivalue_line(
        "markers", "frameworks: tests/jax and tests/integrations, the framework oracles (left out by --fast)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = pathlib.Path(__file__).resolve().parent
    for item in items:
        if _starts_processes(item):
            item.add_marker(pytest.mark.multiprocess)
        parts = pathlib.Path(str(item.path)).resolve().relative_to(tests).parts
        if len(parts) > 1 and parts[0] in FRAMEWORK_DIRS:
            item.add_marker(pytest.mark.frameworks)


_FAST_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Sum the time (setup, call, teardown) of the tests ``--fast`` selects, for the summary line."""
    if not {"slow", "multiprocess", "frameworks"} & set(report.keywords):
        _FAST_SECONDS[report.nodeid] = _FAST_SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line: how long the quick loop's tests took in this run (CI's full run measures the quick loop);
    under CI=true, the module-level skips that are failures."""
    terminal_summary(terminalreporter)
    if _FAST_SECONDS:
        terminalreporter.write_line(
            f"single-process tests (./dev.sh test --fast): {len(_FAST_SECONDS)} ran, "
            f"{sum(_FAST_SECONDS.values()):.0f} s of test time"
        )
