"""The systemd units in systemd/: systemd itself accepts them, and they run real edgebus commands.

`systemd-analyze verify` checks a unit's syntax, directive values and that
its ExecStart binary exists. The units name /opt/edgebus/bin/edgebus, where
docs/deploy.md installs edgebus; the test verifies copies that point at this
virtual environment's `edgebus` instead, which is the only change it makes.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgebus.cli import build_parser
from edgebus.launcher import STAGE_SPINCOUNT

UNIT_DIR = Path(__file__).resolve().parent.parent / "systemd"
UNITS = sorted(UNIT_DIR.glob("*.service"))
INSTALLED_EDGEBUS = "/opt/edgebus/bin/edgebus"
# The hardening every unit must carry, with the same value in each, so that
# one unit cannot drift weaker than the others.
HARDENING = ("User", "Group", "UMask", "NoNewPrivileges", "CapabilityBoundingSet",
             "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices",
             "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs",
             "ProtectControlGroups", "ProtectClock", "ProtectHostname", "ProtectProc",
             "RestrictAddressFamilies", "RestrictNamespaces", "RestrictRealtime",
             "RestrictSUIDSGID", "LockPersonality", "RemoveIPC", "SystemCallArchitectures",
             "SystemCallFilter")
ANALYZE_INSTALL_HINT = "install it with: apt-get install systemd"


def service_settings(unit: Path) -> dict[str, str]:
    """The [Service] section's key=value lines (each key appears once in these units)."""
    settings: dict[str, str] = {}
    section = ""
    for line in unit.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            assert key not in settings, f"{unit.name}: {key} set twice"
            settings[key] = value
    return settings


def test_the_three_units_exist() -> None:
    assert [u.name for u in UNITS] == ["edgebus-broker.service", "edgebus-coordinator.service",
                                       "edgebus-node@.service"]


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_systemd_analyze_verify_passes(unit: Path, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail(f"systemd-analyze is not installed: {ANALYZE_INSTALL_HINT}")
    edgebus = Path(sys.executable).parent / "edgebus"
    assert edgebus.exists(), f"{edgebus} missing: install edgebus into this environment first"
    text = unit.read_text()
    assert INSTALLED_EDGEBUS in text
    copy = tmp_path / unit.name
    copy.write_text(text.replace(INSTALLED_EDGEBUS, str(edgebus)))
    result = subprocess.run([analyze, "verify", "--man=no", str(copy)], capture_output=True,
                            text=True, timeout=60, check=False)
    # verify exits 0 on a warning such as an unknown key or a bad value (which
    # systemd then ignores), so any output at all is a failure.
    assert result.returncode == 0 and not result.stdout and not result.stderr, (
        f"systemd-analyze verify {unit.name}:\n{result.stdout}{result.stderr}")


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_unit_is_a_hardened_notify_service_with_a_watchdog(unit: Path) -> None:
    settings = service_settings(unit)
    assert settings["Type"] == "notify"
    assert settings["NotifyAccess"] == "main"
    assert settings["Restart"] == "on-failure"
    assert settings["WatchdogSec"].endswith("s")
    reference = service_settings(UNIT_DIR / "edgebus-node@.service")
    assert {k: settings.get(k) for k in HARDENING} == {k: reference[k] for k in HARDENING}
    assert settings["ProtectSystem"] == "strict" and settings["NoNewPrivileges"] == "yes"


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_exec_start_is_a_valid_edgebus_command_line(unit: Path) -> None:
    # Catches a unit left behind by a renamed subcommand or option.
    argv = shlex.split(service_settings(unit)["ExecStart"].replace("%i", "stage-0"))
    assert argv[0] == INSTALLED_EDGEBUS
    args = build_parser().parse_args(argv[1:])
    assert args.plant == "/etc/edgebus/plant.yaml"


def test_agents_keep_the_model_cache_in_their_state_directory() -> None:
    for name in ("edgebus-node@.service", "edgebus-coordinator.service"):
        settings = service_settings(UNIT_DIR / name)
        assert settings["StateDirectory"] == "edgebus"
        assert "EDGEBUS_HOME=%S/edgebus" in settings["Environment"].split()


def test_a_stage_unit_spins_as_edgebus_up_starts_a_stage() -> None:
    environment = service_settings(UNIT_DIR / "edgebus-node@.service")["Environment"].split()
    assert f"GOMP_SPINCOUNT={STAGE_SPINCOUNT}" in environment
