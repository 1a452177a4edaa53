"""A throwaway certificate authority's files for TLS tests (trustme makes the certificates)."""

from __future__ import annotations

from pathlib import Path

import trustme

from edgebus.core.processes import LOOPBACK
from plant_config.broker_section import BrokerTls


def broker_tls(directory: Path, ca: trustme.CA) -> BrokerTls:
    """The CA and a broker certificate for the loopback address, as `security.tls` names them."""
    server = ca.issue_cert(LOOPBACK)
    directory.mkdir(parents=True, exist_ok=True)
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    server.cert_chain_pems[0].write_to_path(str(directory / "broker.pem"))
    server.private_key_pem.write_to_path(str(directory / "broker.key"))
    return BrokerTls(cafile=directory / "ca.pem", certfile=directory / "broker.pem",
                     keyfile=directory / "broker.key")
