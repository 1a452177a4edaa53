"""What an MQTT client needs to connect: the broker's address, TLS and credentials.

The plant file (plant_config/broker_section.py) says it for each agent; the bus client
(edgebus/core/client.py) connects with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

MqttProtocol = Literal["3.1.1", "5"]


@dataclass(frozen=True)
class BrokerEndpoint:
    """What an MQTT client needs to connect."""

    host: str
    port: int
    tls: bool
    username: str | None
    password: str | None = field(repr=False)
    protocol: MqttProtocol
    ca_file: Path | None  # None: the system trust store
    keepalive_s: int
    # Mutual TLS: the certificate and key this client presents (security.tls.require_certificate).
    cert_file: Path | None = None
    key_file: Path | None = None
