"""The versions a plant's boxes must agree on, and what this release knows of the others.

Three numbers tell whether two boxes can work together: the edgebus release
(EDGEBUS), the activation frame format it speaks (edgebus/core/frames.py,
VERSION) and the format of the stage files it cuts from the model's GGUF
(node_agent/engines/llamacpp/stage_gguf.py, CUT_FORMAT). Every agent's status
says all three (node_agent/status_payload.py), `edgebus status` shows them per
box and warns about a plant that runs mixed releases, and the coordinator
routes a request only through stage nodes that speak its own frame version
(node_agent/coordinator/routing.py). docs/upgrades.md says in what order to
upgrade a plant box by box.

EDGEBUS is the one place the release is written: pyproject.toml reads it from
here (setuptools' dynamic version), so the wheel's metadata and what a running
agent says are the same, installed or run from a checkout (an editable
install's metadata keeps the number it was installed with).
"""

from __future__ import annotations

import re

EDGEBUS = "0.2.0"

# The frame version an agent speaks whose status does not say: edgebus 0.1.0 said only its
# release. Every 0.1.0 tree since 2026-11-30 (commit f61a686, failover by replay: the first
# with standby replicas, so the first a plant could upgrade box by box) speaks frame version 2.
UNSAID_FRAME_VERSION = 2

# Which releases spoke each frame version this one does not, for a refusal to name the
# sender's release: a frame carries its format's version, not its sender's release.
OLDER_FRAME_VERSIONS = {1: "edgebus 0.1.0 of before 2026-11-30"}


def frame_sender(version: int, own: int) -> str:
    """Which edgebus sends frames of `version`, as far as this release can know (`own`: the
    frame version it speaks)."""
    if version in OLDER_FRAME_VERSIONS:
        return OLDER_FRAME_VERSIONS[version]
    if version > own:
        return f"an edgebus newer than {EDGEBUS}"
    return "no edgebus release"


def release_key(release: str) -> tuple[int, ...]:
    """A release's numbers, to find the newest ("0.10.0" after "0.9.1")."""
    return tuple(int(n) for n in re.findall(r"\d+", release))
