"""Tests that need a tool the README's install does not bring: skipped on a developer's
machine without it, a failure in CI.

.ci/run installs every such tool (Mosquitto's clients, Node-RED, pysparkplug)
and runs as root, and sets EDGEBUS_CI=1: there, a missing tool is a broken
CI machine, and a skip would hide a whole file's tests behind a green run.
"""

from __future__ import annotations

import os
import re
from importlib.util import find_spec

import pytest

# Set by .ci/run; the README's test command stays `python -m pytest -q`.
IN_CI = os.environ.get("EDGEBUS_CI") == "1"


def missing(what: str) -> None:
    """Skip the test (or, at module level, the module) for lack of `what`; fail in CI."""
    if IN_CI:
        pytest.fail(f"CI must have {what} (EDGEBUS_CI=1)", pytrace=False)
    pytest.skip(what, allow_module_level=True)


# A base install (`pip install edgebus`, what a llama.cpp box has: docs/deploy.md) lacks
# these; the README's `.[test]` install brings them (pyproject.toml, the `torch` extra).
TORCH_PACKAGES = ("torch", "transformers")
TORCH_MISSING = ("torch and transformers (the `torch` extra, which README.md's install brings): "
                 "this test needs the torch reference, a torch or onnxruntime engine, or a "
                 "model imported or built through transformers")


def require_torch() -> None:
    """Skip the test (or, at module level, the module) on a base install; fail in CI.

    Called where a test or fixture first needs torch, before it imports it, so that
    the suite's llama.cpp tests run on a box without torch."""
    if any(find_spec(name) is None for name in TORCH_PACKAGES):
        missing(TORCH_MISSING)


# The packages of the `torch` extra (pyproject.toml) that test files import.
TORCH_EXTRA_PACKAGES = frozenset({*TORCH_PACKAGES, "onnx", "onnxruntime", "onnxscript",
                                  "safetensors", "accelerate"})
# How pytest reports a test file whose import failed (its CollectError's text).
_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '([\w]+)")


def skip_torch_modules(report: pytest.CollectReport) -> None:
    """A test file that imports torch (or another package of the `torch` extra) at its
    top is skipped on a base install, saying so, instead of failing to import
    (conftest.py's `pytest_make_collect_report`; CI then fails it, `fail_skipped_modules`)."""
    if not report.failed:
        return
    found = _NO_MODULE.search(str(report.longrepr))
    if found and found.group(1) in TORCH_EXTRA_PACKAGES:
        report.outcome = "skipped"
        report.longrepr = (str(report.fspath), 0,
                           f"Skipped: no module {found.group(1)}: {TORCH_MISSING}")


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
    module level) fails the run instead (conftest.py's `pytest_make_collect_report`)."""
    if IN_CI and report.skipped:
        report.outcome = "failed"
        report.longrepr = f"CI must run every test file, and this one was skipped: " \
                          f"{report.longrepr} (EDGEBUS_CI=1)"


# Tests that change the host itself (network namespaces, bridges, cgroups,
# /run/edgebus-rehearse) run on one pytest-xdist worker, one after another
# (`--dist loadgroup` in pyproject.toml): test_rehearse_cleanup.py checks that the
# host is left as it was, which a rehearsal on another worker would break.
HOST_NETWORK = pytest.mark.xdist_group("host-network")
