"""Under ``CI=true`` a test cannot pass by skipping: a skip caused by a missing dependency or missing data fails.

Every environment of ``./dev.sh test`` installs what its tests import, so in CI a skip from
``pytest.importorskip`` (the framework's own import failed: a missing ``triton`` under megatron-core, a broken
``transformers``) or from the real logs folder ``../shared/reallogs`` being absent means the tests did not run:
it is a failure, not a pass. A test-level skip becomes a failed test; a module-level one (``importorskip`` at
import, before any test exists) is listed and makes the session exit 1 — turning it into a collection error
would stop pytest before the other tests run. ``LOSSPARITY_REQUIRE_DEPS=1`` asks for the same outside CI.

The session's counts go to the JSON file ``LOSSPARITY_TEST_SUMMARY`` names (``./dev.sh test`` prints one line
per environment from them): ``ran`` (tests executed), ``passed``, ``failed`` (failed tests, errors and the
module-level required skips), ``skipped`` (the remaining skips), ``exitstatus``.
"""

from __future__ import annotations

import json
import os
import pathlib
import re

import pytest

# the reason pytest.importorskip gives ("could not import 'x': ..."), and the real-log tests' skipif reason
IMPORT = re.compile(r"could not import ")
REALLOGS = re.compile(r"reallogs is not present")
# The developers' shared folder beside the checkout (the real third-party logs live in its reallogs/). A clone
# without it (a user's) cannot run the real-log tests: they stay skips there, and fail only where the folder is.
SHARED = pathlib.Path(os.environ.get("LOSSPARITY_SHARED_DIR") or pathlib.Path(__file__).resolve().parents[2] / "shared")


def _is_required(reason: str) -> bool:
    return bool(IMPORT.search(reason)) or (bool(REALLOGS.search(reason)) and SHARED.is_dir())


def required() -> bool:
    """Whether skips for a missing dependency or missing data are failures in this run."""
    return os.environ.get("CI", "").lower() in ("true", "1", "yes") or os.environ.get("LOSSPARITY_REQUIRE_DEPS") == "1"


def _reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


_MODULE_SKIPS: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if report.skipped and required() and not hasattr(report, "wasxfail") and _is_required(_reason(report)):
        report.outcome = "failed"
        report.longrepr = (
            f"CI=true: this skip is a failure (a dependency or data of the test is missing): {_reason(report)}"
        )


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped and required() and _is_required(_reason(report)):
        _MODULE_SKIPS.append(f"{report.nodeid}: {_reason(report)}")


def terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The module-level required skips, listed (called by conftest's ``pytest_terminal_summary``)."""
    if _MODULE_SKIPS:
        terminalreporter.section("CI=true: module-level skips that are failures", red=True)
        for line in _MODULE_SKIPS:
            terminalreporter.write_line(line)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _MODULE_SKIPS and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    path = os.environ.get("LOSSPARITY_TEST_SUMMARY")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    # under pytest-xdist the controller writes the counts (its reports are every worker's); a worker does not
    if not path or reporter is None or hasattr(session.config, "workerinput"):
        return
    stats = {k: len(v) for k, v in reporter.stats.items() if k}
    counts = {
        "passed": stats.get("passed", 0),
        "failed": stats.get("failed", 0) + stats.get("error", 0) + len(_MODULE_SKIPS),
        "skipped": stats.get("skipped", 0) - len(_MODULE_SKIPS),
        "xfailed": stats.get("xfailed", 0),
        "xpassed": stats.get("xpassed", 0),
    }
    counts["ran"] = counts["passed"] + stats.get("failed", 0) + counts["xfailed"] + counts["xpassed"]
    with open(path, "w") as f:
        json.dump({**counts, "exitstatus": int(session.exitstatus)}, f)
