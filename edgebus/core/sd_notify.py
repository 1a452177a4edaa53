"""systemd's service notification protocol (sd_notify(3)), without libsystemd.

A `Type=notify` unit gets `$NOTIFY_SOCKET`, a datagram socket to which the
service sends newline-separated assignments: `READY=1`, `WATCHDOG=1`,
`STATUS=...`, `STOPPING=1`. With `WatchdogSec=`, systemd also sets
`$WATCHDOG_USEC` and kills the service when no `WATCHDOG=1` arrives in time.
Outside systemd the variables are unset and every call here does nothing, so
agents run unchanged from a shell, `edgebus up` or a test.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

log = logging.getLogger(__name__)


def notify(*assignments: str) -> None:
    """Send e.g. `notify("READY=1", "STATUS=serving")` to systemd; a no-op outside it."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):  # Linux abstract namespace: '@' stands for a leading NUL
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(assignments).encode(), address)
    except OSError as exc:
        # Never fatal: a lost READY or WATCHDOG shows up in systemd as a timeout,
        # which names the unit; the agent's work must not stop over it.
        log.warning("cannot notify systemd at %s: %s", os.environ["NOTIFY_SOCKET"], exc)


def watchdog_period() -> float | None:
    """Seconds between WATCHDOG=1 pings (half the timeout, as sd_watchdog_enabled(3) advises).

    None when systemd runs no watchdog for this process.
    """
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    # WATCHDOG_PID names the process the watchdog is for; a child that inherited
    # the environment must not ping on its parent's behalf.
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6


async def watchdog(healthy: Callable[[], bool], *, healthy_status: str = "",
                   unhealthy_status: str = "") -> None:
    """Ping systemd's watchdog while `healthy()`; send the matching STATUS= when that changes.

    Call it once ready: it takes the service as healthy to begin with. Runs
    until cancelled. Without a watchdog it only waits, so a service can keep
    it among the tasks it watches whether or not systemd runs one.
    """
    period = watchdog_period()
    if period is None:
        await asyncio.get_running_loop().create_future()
        return
    was_healthy = True
    while True:
        is_healthy = healthy()
        assignments = ["WATCHDOG=1"] if is_healthy else []
        if is_healthy != was_healthy and (status := healthy_status if is_healthy
                                          else unhealthy_status):
            assignments.append(f"STATUS={status}")
        if assignments:
            notify(*assignments)
        was_healthy = is_healthy
        await asyncio.sleep(period)
