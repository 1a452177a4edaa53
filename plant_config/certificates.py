"""The plant's own certificate authority, and the certificates it issues (`cryptography`).

`edgebus init` makes them, so that every link of a default plant speaks TLS
with nothing made by hand: the CA's key and certificate, a server certificate
for the broker naming every host name and address the plant file gives it,
and, where the plant asks for mutual TLS, a client certificate per identity.
`edgebus certs renew` issues the server and client certificates again from
the same CA; `edgebus status` says how many days each has left.

Where they live, in the plant's credentials directory (mode 0700), beside the
passwords:

- `tls/ca.crt`, `tls/ca.key`: the plant's CA. The key signs every certificate
  of the plant; it never leaves the box `init` ran on unless you move it.
- `tls/broker.crt`, `tls/broker.key`: the broker's (embedded or Mosquitto).
- `<identity>.crt`, `<identity>.key`: a client's, with mutual TLS (where
  `Plant.endpoint_for` looks for them).

Keys are EC P-256: made in milliseconds, and a handshake costs a Pi little.
Every key is written mode 0600; certificates 0644.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from edgebus.core.errors import PlantConfigError
from plant_config.credentials import SECRET_DIR_MODE, SECRET_MODE
from plant_config.schema import Plant

TLS_DIR = "tls"
CA_CERT = "ca.crt"
CA_KEY = "ca.key"
SERVER_CERT = "broker.crt"
SERVER_KEY = "broker.key"
CLIENT_CERT_SUFFIX = ".crt"
CLIENT_KEY_SUFFIX = ".key"
# The CA outlives the plant's boxes; what it issues is renewed (`edgebus certs renew`). 825
# days is what browsers and Apple's TLS stack accept at most for a leaf certificate.
CA_DAYS = 3650
LEAF_DAYS = 825
# `edgebus status` warns this many days before a certificate expires.
WARN_DAYS = 30
CERT_MODE = 0o644
# What the embedded broker's certificate always names: the box itself.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_ORGANIZATION = "edgebus"


def tls_dir(credentials: Path) -> Path:
    return credentials / TLS_DIR


def ca_key_path(ca_cert: Path) -> Path:
    """Where the CA's key lies: beside its certificate (tls/ca.crt: tls/ca.key)."""
    return ca_cert.with_suffix(".key")


def client_paths(credentials: Path, identity: str) -> tuple[Path, Path]:
    return (credentials / f"{identity}{CLIENT_CERT_SUFFIX}",
            credentials / f"{identity}{CLIENT_KEY_SUFFIX}")


def ca_common_name(plant_id: str) -> str:
    """The CA's subject, which says whose CA it is: a second `init` checks it."""
    return f"edgebus CA of plant {plant_id}"


@dataclass(frozen=True)
class CertificateInfo:
    """What `edgebus status` shows of one certificate."""

    path: Path
    subject: str
    not_after: dt.datetime

    def days_left(self, now: dt.datetime | None = None) -> int:
        now = now or dt.datetime.now(dt.UTC)
        return (self.not_after - now) // dt.timedelta(days=1)


def certificate_info(path: Path) -> CertificateInfo:
    """The subject and end of validity of the PEM certificate at `path`."""
    cert = _read_cert(path)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    subject = str(names[0].value) if names else cert.subject.rfc4514_string()
    return CertificateInfo(path, subject, cert.not_valid_after_utc)


def ensure_ca(cert_path: Path, plant_id: str) -> bool:
    """The plant's CA at `cert_path` (its key beside it), made unless there; whether it was made.

    An existing CA is kept, never overwritten: the plant's own is reused (a second `init` in
    the same folder), another plant's is refused, since replacing it would cut that plant's
    boxes off their broker.
    """
    if existing_ca(cert_path, plant_id):
        return False
    key_path = ca_key_path(cert_path)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, _ORGANIZATION),
                      x509.NameAttribute(NameOID.COMMON_NAME, ca_common_name(plant_id))])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True, crl_sign=True,
                                         encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path.parent.mkdir(mode=SECRET_DIR_MODE, parents=True, exist_ok=True)
    # The key first, created exclusively: two `init`s racing never both make a CA.
    _write_new(key_path, _key_pem(key), SECRET_MODE)
    _write_new(cert_path, cert.public_bytes(serialization.Encoding.PEM), CERT_MODE)
    return True


def existing_ca(cert_path: Path, plant_id: str) -> bool:
    """Whether plant `plant_id`'s CA is at `cert_path`, its key beside it; False if nothing is
    there. PlantConfigError for half a CA, or another plant's, which must be left alone."""
    key_path = ca_key_path(cert_path)
    if not (cert_path.exists() or key_path.exists()):
        return False
    if not (cert_path.is_file() and key_path.is_file()):
        missing = key_path if cert_path.exists() else cert_path
        raise PlantConfigError(f"{missing} is missing beside the CA's other file: not making "
                               f"a new CA over half of one — restore it, or move "
                               f"{cert_path.parent} away to start a new CA")
    owner = certificate_info(cert_path).subject
    if owner != ca_common_name(plant_id):
        raise PlantConfigError(
            f"{cert_path} is another plant's CA ({owner!r}), not plant {plant_id!r}'s: not "
            "overwriting it, its plant's boxes trust it. Give this plant a folder of its own "
            "(its credentials/ go beside its plant file)")
    return True


def own_ca(cert_path: Path, plant_id: str) -> bool:
    """Whether `cert_path` is plant `plant_id`'s CA as `init` makes it, its key beside it (not
    a CA made by hand, whose certificates edgebus leaves alone)."""
    try:
        return ca_key_path(cert_path).is_file() and existing_ca(cert_path, plant_id)
    except PlantConfigError:
        return False


def issue(ca_cert: Path, cert_path: Path, key_path: Path, *, common_name: str,
          hosts: list[str] | None = None, days: int = LEAF_DAYS,
          issued: dt.datetime | None = None) -> Path:
    """A certificate and key from the CA at `ca_cert`: a server's naming `hosts` (names and
    addresses), or without hosts a client's, whose common name is its identity; valid from
    `issued` (default: now) for `days`."""
    ca_key_file = ca_key_path(ca_cert)
    if not (ca_cert.is_file() and ca_key_file.is_file()):
        raise PlantConfigError(f"no CA at {ca_cert} with its key {ca_key_file} to issue "
                               "certificates from: `edgebus init` makes it; renew on the box "
                               "that holds the CA's key")
    authority = _read_cert(ca_cert)
    try:
        ca_key = serialization.load_pem_private_key(ca_key_file.read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise PlantConfigError(f"cannot read the CA's key {ca_key_file}: {exc}") from None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise PlantConfigError(f"{ca_key_file} is not the EC key `edgebus init` makes")
    key = ec.generate_private_key(ec.SECP256R1())
    now = issued or _now()
    usage = ExtendedKeyUsageOID.SERVER_AUTH if hosts else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([
                   x509.NameAttribute(NameOID.ORGANIZATION_NAME, _ORGANIZATION),
                   x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])]))
               .issuer_name(authority.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5))
               .not_valid_after(min(now + dt.timedelta(days=days),
                                    authority.not_valid_after_utc))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                   ca_key.public_key()), critical=False))
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [_general_name(host) for host in dict.fromkeys(hosts)]), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    # Replaced whole, never rewritten in place: a broker or agent reading them meanwhile
    # sees the old pair or the new one. The key first: a new certificate beside the old key
    # would not load.
    _replace(key_path, _key_pem(key), SECRET_MODE)
    _replace(cert_path, cert.public_bytes(serialization.Encoding.PEM), CERT_MODE)
    return cert_path


def names_in(path: Path) -> set[str]:
    """The host names and addresses a certificate names (its subject alternative names)."""
    try:
        san = _read_cert(path).extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return ({str(name) for name in san.get_values_for_type(x509.DNSName)}
            | {str(address) for address in san.get_values_for_type(x509.IPAddress)})


def signed_by(path: Path, ca_cert: Path) -> bool:
    """Whether the certificate at `path` was issued by the CA at `ca_cert`."""
    ca = _read_cert(ca_cert)
    try:
        _read_cert(path).verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _read_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except FileNotFoundError:
        raise PlantConfigError(f"no certificate at {path}") from None
    except (OSError, ValueError) as exc:
        raise PlantConfigError(f"cannot read the certificate {path}: {exc}") from None


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create `path` with `mode` from the start; PlantConfigError if it already exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise PlantConfigError(f"{path} appeared meanwhile: not overwriting it") from None
    with os.fdopen(fd, "wb") as file:
        file.write(data)


def _replace(path: Path, data: bytes, mode: int) -> None:
    """Write `path` whole through a temporary file in its folder, with `mode` from the start."""
    path.parent.mkdir(mode=SECRET_DIR_MODE, parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


# -- a plant's certificates ----------------------------------------------------------------


def default_files(credentials: Path) -> dict[str, Path]:
    """security.tls as `edgebus init` writes it: the CA and the broker's pair, in tls/."""
    folder = tls_dir(credentials)
    return {"cafile": folder / CA_CERT, "certfile": folder / SERVER_CERT,
            "keyfile": folder / SERVER_KEY}


def broker_hosts(plant: Plant) -> list[str]:
    """Every host name and address the plant file gives its brokers, for the broker's
    certificate: the URL's host of each external broker, and for the embedded one its host,
    its bind address and the loopback's names (the box's own clients: `ask`, `status`)."""
    hosts: list[str] = []
    for settings in [plant.broker, *plant.brokers.values()]:
        if settings.embedded:
            hosts += [settings.host, *([settings.bind] if settings.bind else [])]
        else:
            hosts.append(settings.endpoint().host)
    if plant.broker.embedded:
        hosts += LOOPBACK_NAMES
    # A wildcard bind is no name a client connects to.
    return [host for host in dict.fromkeys(hosts) if host not in ("", "0.0.0.0", "::")]


def plant_certificates(plant: Plant) -> list[CertificateInfo]:
    """The plant's certificates that this box holds: the CA, the broker's, and each identity's
    client certificate (mutual TLS), for `edgebus status`."""
    security = plant.security
    tls = security.listener_tls if security is not None else None
    if security is None or tls is None:
        return []
    paths = [tls.cafile, tls.certfile,
             *(client_paths(security.credentials, identity)[0]
               for identity in plant.identities())]
    return [certificate_info(path) for path in dict.fromkeys(paths) if path.is_file()]


def ensure_certificates(plant: Plant, *, renew: bool = False) -> list[Path]:
    """Make what the plant's TLS needs and is missing: the CA (ensure_ca), the broker's
    certificate, and with mutual TLS each identity's; `renew`: issue the broker's and the
    clients' again whatever their state. A certificate is also issued again when it no longer
    names every host of the plant file, is not the CA's, or expires within WARN_DAYS.
    Returns the certificates it wrote."""
    security = plant.security
    tls = security.listener_tls if security is not None else None
    if security is None or tls is None:
        return []
    made = [tls.cafile] if ensure_ca(tls.cafile, plant.plant_id) else []
    hosts = broker_hosts(plant)

    def stale(path: Path, names: list[str]) -> bool:
        return (renew or not path.is_file() or not set(names) <= names_in(path)
                or not signed_by(path, tls.cafile)
                or certificate_info(path).days_left() < WARN_DAYS)

    if stale(tls.certfile, hosts):
        made.append(issue(tls.cafile, tls.certfile, tls.keyfile, common_name=hosts[0],
                          hosts=hosts))
    if tls.require_certificate:
        for identity in plant.identities():
            cert_path, key_path = client_paths(security.credentials, identity)
            if stale(cert_path, []):
                made.append(issue(tls.cafile, cert_path, key_path, common_name=identity))
    return made
