"""No open door: a broker that admits anyone listens on the loopback only.

Without a `security:` section anyone who reaches the broker can read every
prompt and answer, forge activation frames (and so the tokens of someone
else's answer), fake statuses and pre-empt request ids. On one box that is
the box's own users; beyond the loopback it is the whole plant network,
which is flatter than anyone admits. Mosquitto 2 made the same call for its
own default. So every broker edgebus starts or configures refuses a listener
beyond the loopback unless it checks identities: the embedded broker
(`EmbeddedBroker`, `edgebus broker`, `edgebus up`) and the Mosquitto that
`broker.mosquitto` starts for benches and tests; `edgebus broker
mosquitto-config` writes only secured configs.
"""

from __future__ import annotations

import ipaddress
import socket

from edgebus.core.errors import EdgebusError

FIX = ("give the plant file a security: section (`edgebus init` writes one unless it is "
       "given --insecure; docs/plant-file.md, 'Security and line brokers'), or listen on "
       "the loopback only (broker.bind: 127.0.0.1)")


def is_loopback(host: str) -> bool:
    """Whether listening on `host` reaches this box only: an IP or name of the loopback.

    "" and 0.0.0.0 / :: (every interface), other addresses and names that do
    not resolve count as beyond the loopback.
    """
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass  # a name: it listens wherever the name resolves
    if not host:
        return False
    try:
        addresses = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(str(info[4][0])).is_loopback
                                   for info in addresses)


def refuse_open_listener(host: str, port: int, *, secured: bool, what: str) -> None:
    """Raise EdgebusError, saying how to fix it, when an unsecured broker would listen beyond
    the loopback. `what` names the broker for the message ("the embedded broker")."""
    if secured or is_loopback(host):
        return
    where = f"{host or '*'}:{port}"
    raise EdgebusError(
        f"{what} would listen on {where}, beyond this box's loopback, and admit anyone: no "
        "security is configured, so any client that reaches it could read every prompt and "
        "answer and forge activation frames and answers. Refusing to start. To fix it, "
        f"{FIX}")
