"""Certificates for TLS tests: a throwaway CA (trustme), or the plant's own as `init` makes it."""

from __future__ import annotations

import ssl
from pathlib import Path

import trustme

from edgebus.core import tls
from edgebus.core.endpoint import BrokerEndpoint
from edgebus.core.processes import LOOPBACK
from plant_config.broker_section import BrokerTls
from plant_config.certificates import default_files, ensure_ca, issue


def broker_tls(directory: Path, ca: trustme.CA) -> BrokerTls:
    """The CA and a broker certificate for the loopback address, as `security.tls` names them."""
    server = ca.issue_cert(LOOPBACK)
    directory.mkdir(parents=True, exist_ok=True)
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    server.cert_chain_pems[0].write_to_path(str(directory / "broker.pem"))
    server.private_key_pem.write_to_path(str(directory / "broker.key"))
    return BrokerTls(cafile=directory / "ca.pem", certfile=directory / "broker.pem",
                     keyfile=directory / "broker.key")


def tls_context(endpoint: BrokerEndpoint) -> ssl.SSLContext | None:
    """What a bare aiomqtt client of a test passes to reach `endpoint` as edgebus's clients do:
    over TLS, checking the plant's CA, where the plant's broker serves TLS (`init`'s default)."""
    return tls.client_context(endpoint) if endpoint.tls else None


def plant_tls(credentials: Path, hosts: tuple[str, ...] = (LOOPBACK, "localhost"), *,
              require_certificate: bool = False) -> BrokerTls:
    """The plant's own CA and broker certificate as `edgebus init` makes them (in
    `credentials/tls/`), as `security.tls` names them."""
    files = default_files(credentials)
    ensure_ca(files["cafile"], "test")
    issue(files["cafile"], files["certfile"], files["keyfile"], common_name=hosts[0],
          hosts=list(hosts))
    return BrokerTls(**files, require_certificate=require_certificate)
