"""A client's TLS: the context it connects with, and its failures said in one line.

A TLS failure at connect is not a network hiccup that a retry fixes: the
broker's certificate is expired, names another host or comes from another CA,
or the broker refused this client's certificate. Each is said as one line that
names the certificate file to look at and the broker's host (`BusError`), never
as OpenSSL's traceback.
"""

from __future__ import annotations

import datetime as dt
import ssl
from pathlib import Path

from edgebus.core.endpoint import BrokerEndpoint
from edgebus.core.errors import BusError

_RENEW = "`edgebus certs renew PLANT` issues new ones from the plant's CA"
# What edgebus.core.client says of a TLS connection closed before the broker's CONNACK.
CLOSED_BEFORE_CONNACK = "the broker closed the connection before its CONNACK"
# OpenSSL's words (in the SSLError's text) for a broker that refused this client's
# certificate, by what to say of it.
_REFUSED_OURS = {"alert certificate expired": "has expired",
                 "alert unknown ca": "is not from the CA the broker trusts",
                 "alert bad certificate": "was refused",
                 "alert certificate unknown": "was refused",
                 "alert certificate revoked": "was revoked",
                 "alert certificate required": "is required (mutual TLS), and none was sent"}


def client_context(endpoint: BrokerEndpoint) -> ssl.SSLContext:
    """The TLS context a client of `endpoint` connects with: the broker's certificate checked
    against `ca_file` (else the system's store) and its host name, TLS 1.2 at least, and with
    mutual TLS this client's own certificate."""
    try:
        context = ssl.create_default_context(
            cafile=str(endpoint.ca_file) if endpoint.ca_file else None)
    except (OSError, ssl.SSLError) as exc:
        raise BusError(f"cannot load the CA certificate {endpoint.ca_file} to check the broker "
                       f"{endpoint.host}:{endpoint.port} with: {_reason(exc)}") from None
    if endpoint.cert_file is not None:
        check_not_expired(endpoint.cert_file, endpoint)
        try:
            context.load_cert_chain(endpoint.cert_file, endpoint.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise BusError(f"cannot load this client's certificate {endpoint.cert_file} (key "
                           f"{endpoint.key_file}) for the broker {endpoint.host}:"
                           f"{endpoint.port}: {_reason(exc)}") from None
    return context


def check_not_expired(cert_file: Path, endpoint: BrokerEndpoint) -> None:
    """BusError if the certificate at `cert_file`, this client's own, is out of its dates."""
    # Here, not at the top: every agent imports this module, and only mutual TLS reads a
    # certificate (cryptography's x509 takes ~0.1 s to import on a loaded 2-core box).
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    except (OSError, ValueError):
        return  # load_cert_chain says what is wrong with it
    now = dt.datetime.now(dt.UTC)
    if now > cert.not_valid_after_utc:
        raise BusError(f"this client's certificate {cert_file} expired on "
                       f"{cert.not_valid_after_utc:%Y-%m-%d}, so the broker {endpoint.host}:"
                       f"{endpoint.port} would refuse it: {_RENEW}")
    if now < cert.not_valid_before_utc:
        raise BusError(f"this client's certificate {cert_file} is valid only from "
                       f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (is this box's clock "
                       f"right?), so the broker {endpoint.host}:{endpoint.port} would refuse it")


def explain(exc: BaseException | str, endpoint: BrokerEndpoint) -> str | None:
    """A TLS failure connecting to `endpoint` as one line naming the file and the host; None
    if `exc` is no TLS failure that a retry cannot fix."""
    text = str(exc)
    where = f"{endpoint.host}:{endpoint.port}"
    ca = endpoint.ca_file or "the system's trust store"
    if "certificate verify failed" in text:
        reason = text.split("certificate verify failed:", 1)[-1].split("(_ssl", 1)[0].strip()
        if "expired" in reason:
            what = "has expired"
        elif "mismatch" in reason or "not valid for" in reason:
            what = f"does not name {endpoint.host!r}"
        elif "issuer" in reason or "self-signed" in reason or "self signed" in reason:
            what = f"is not signed by the CA in {ca}"
        else:
            what = f"was refused ({reason})"
        checked = "" if str(ca) in what else f" (checked against {ca})"
        return (f"TLS: the broker {where} presented a certificate that {what}{checked}: the "
                f"broker's certificate (security.tls.certfile) or the plant's CA file is "
                f"wrong; {_RENEW}")
    lowered = text.lower()
    for alert, what in _REFUSED_OURS.items():
        if alert in lowered:
            mine = endpoint.cert_file or "(none: security.tls.require_certificate is off here)"
            return (f"TLS: the broker {where} refused this client's certificate {mine}: it "
                    f"{what}; {_RENEW}")
    if "wrong version number" in lowered or "record layer failure" in lowered:
        return (f"TLS: the broker {where} does not speak TLS on that port (plain MQTT?): "
                "check the plant file's broker url and security.tls")
    return None


def closed_at_handshake(exc: BaseException) -> bool:
    """Whether the broker ended a TLS connection at its handshake or before the CONNACK."""
    text = str(exc)
    return CLOSED_BEFORE_CONNACK in text or "EOF occurred in violation of protocol" in text


def closed_silently(endpoint: BrokerEndpoint) -> str:
    """What a broker that keeps closing TLS connections before its CONNACK means, in a line."""
    where = f"{endpoint.host}:{endpoint.port}"
    if endpoint.cert_file is None:
        return (f"TLS: the broker {where} closes this client's connections right after the TLS "
                "handshake: it asks for a client certificate (mutual TLS), and the plant file "
                "gives none (security.tls.require_certificate is off here)")
    return (f"TLS: the broker {where} closes this client's connections right after the TLS "
            f"handshake: it refuses this client's certificate {endpoint.cert_file} (from "
            f"another CA than the one it trusts?); {_RENEW}")


def _reason(exc: BaseException) -> str:
    """OpenSSL's reason without its source location."""
    return str(exc).split(" (_ssl.c", 1)[0]
