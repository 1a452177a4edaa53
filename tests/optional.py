"""Tests that need a tool the README's install does not bring: skipped on a developer's
machine without it, a failure in CI.

.ci/run installs every such tool (Mosquitto's clients, Node-RED, pysparkplug)
and runs as root, and sets EDGEBUS_CI=1: there, a missing tool is a broken
CI machine, and a skip would hide a whole file's tests behind a green run.
"""

from __future__ import annotations

import os

import pytest

# Set by .ci/run; the README's test command stays `python -m pytest -q`.
IN_CI = os.environ.get("EDGEBUS_CI") == "1"


def missing(what: str) -> None:
    """Skip the test (or, at module level, the module) for lack of `what`; fail in CI."""
    if IN_CI:
        pytest.fail(f"CI must have {what} (EDGEBUS_CI=1)", pytrace=False)
    pytest.skip(what, allow_module_level=True)


def needs(problems: list[str], what: str) -> pytest.MarkDecorator:
    """A mark that skips while `problems` (what this machine lacks) is not empty; in CI,
    a failure of the module's collection instead."""
    if problems and IN_CI:
        pytest.fail(f"CI must be able to run {what}, and lacks: " + "; ".join(problems)
                    + " (EDGEBUS_CI=1)", pytrace=False)
    return pytest.mark.skipif(bool(problems), reason=f"cannot run {what} here: "
                              + "; ".join(problems))


def fail_skipped_modules(report: pytest.CollectReport) -> None:
    """In CI, a test file skipped whole when it is collected (`pytest.importorskip` at
    module level) fails the run instead (conftest.py's `pytest_collectreport`)."""
    if IN_CI and report.skipped:
        report.outcome = "failed"
        report.longrepr = f"CI must run every test file, and this one was skipped: " \
                          f"{report.longrepr} (EDGEBUS_CI=1)"


# Tests that change the host itself (network namespaces, bridges, cgroups,
# /run/edgebus-rehearse) run on one pytest-xdist worker, one after another
# (`--dist loadgroup` in pyproject.toml): test_rehearse_cleanup.py checks that the
# host is left as it was, which a rehearsal on another worker would break.
HOST_NETWORK = pytest.mark.xdist_group("host-network")
