"""The plant file's broker sections: where each broker is (`broker:`, `brokers:`), and who
may connect to it and how (`security:`).

An agent's connection (`BrokerEndpoint`, edgebus/core/endpoint.py) is made of
these; the Mosquitto and amqtt configurations (broker/) of `security:`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator

from edgebus.core.endpoint import BrokerEndpoint, MqttProtocol
from edgebus.core.topics import check_level
from plant_config.problems import Problem, Problems
from plant_config.section import SECTION_CONFIG, ResolvedPath

EMBEDDED = "embedded"
# scheme -> (TLS, default port): the IANA ports for MQTT and MQTT over TLS.
_SCHEMES = {"mqtt": (False, 1883), "mqtts": (True, 8883)}
_URL_FORMS = "'embedded', mqtt://[user[:password]@]host[:port] or mqtts://..."


class _Section(BaseModel):
    model_config = SECTION_CONFIG


class BrokerSettings(_Section):
    """Where the broker is: the embedded one that the coordinator starts, or an external URL."""

    # Only meaningful with url: embedded; an external broker's address is in its URL.
    EMBEDDED_ONLY: ClassVar[tuple[str, ...]] = ("host", "port", "bind")

    url: str = EMBEDDED
    host: str = "127.0.0.1"
    port: int = Field(default=1883, ge=1, le=65535)
    bind: str | None = None
    protocol: MqttProtocol | None = None
    username: str | None = None
    password: SecretStr | None = None
    ca_file: ResolvedPath | None = None
    # MQTT encodes the keepalive in 16 bits; 0 would disable dead-peer detection.
    keepalive_s: int = Field(default=30, ge=1, le=65535)

    @model_validator(mode="before")
    @classmethod
    def _take_credentials_from_url(cls, data: Any) -> Any:
        # Kept in their own fields, credentials never show up in a repr or a
        # log line that prints the URL.
        if not isinstance(data, dict) or not isinstance(data.get("url"), str):
            return data
        try:
            parts = urlsplit(data["url"])
        except ValueError:
            return data  # the url validator explains what is wrong with it
        if parts.username is None:
            return data
        if data.get("username") is not None or data.get("password") is not None:
            raise Problems([Problem(("url",), "has credentials, and so do username/password — "
                                              "give them in one place only")])
        host_port = parts.netloc.rpartition("@")[2]
        password = parts.password
        return {**data, "url": urlunsplit(parts._replace(netloc=host_port)),
                "username": unquote(parts.username),
                "password": None if password is None else unquote(password)}

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        if url != EMBEDDED:
            _parse_url(url)
        return url

    @field_validator("protocol", mode="before")
    @classmethod
    def _protocol_as_text(cls, value: Any) -> Any:
        # YAML reads `protocol: 5` as an int.
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _check_combination(self) -> BrokerSettings:
        problems: list[Problem] = []
        if self.embedded and self.protocol == "5":
            problems.append(Problem(("protocol",), "'5' needs an external broker: the embedded "
                                    "broker (amqtt 0.12) speaks only MQTT 3.1.1 — remove protocol "
                                    "or set url to an MQTT 5 broker"))
        if not self.embedded:
            problems.extend(Problem((name,), "only used with url: embedded — an external "
                                             "broker's host and port go in url")
                            for name in self.EMBEDDED_ONLY if name in self.model_fields_set)
        if self.ca_file is not None and not self.embedded and not self.endpoint().tls:
            problems.append(Problem(("ca_file",), "only used with an mqtts:// url, or the "
                                    "embedded broker with security.tls"))
        if problems:
            raise Problems(problems)
        return self

    @property
    def embedded(self) -> bool:
        return self.url == EMBEDDED

    def endpoint(self) -> BrokerEndpoint:
        if self.embedded:
            host, port, tls = self.host, self.port, False
        else:
            host, port, tls = _parse_url(self.url)
        # amqtt, the embedded broker, speaks only 3.1.1; external brokers get MQTT 5.
        protocol = self.protocol or ("3.1.1" if self.embedded else "5")
        password = self.password.get_secret_value() if self.password else None
        return BrokerEndpoint(host=host, port=port, tls=tls, username=self.username,
                              password=password, protocol=protocol, ca_file=self.ca_file,
                              keepalive_s=self.keepalive_s)


def _parse_url(url: str) -> tuple[str, int, bool]:
    """(host, port, tls) of a broker URL without credentials; ValueError if it is not one."""
    # The messages never quote the URL: a malformed one may still hold a password.
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"is not a broker URL ({exc}) — use {_URL_FORMS}") from None
    if parts.scheme not in _SCHEMES:
        raise ValueError(f"scheme {parts.scheme!r} is not supported — use {_URL_FORMS}")
    if not parts.hostname:
        raise ValueError(f"has no host — use {_URL_FORMS}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"must not have a path, query or fragment — use {_URL_FORMS}")
    tls, default_port = _SCHEMES[parts.scheme]
    return parts.hostname, port or default_port, tls


class BrokerTls(_Section):
    """The broker's TLS listener: files on the broker's box, for `broker mosquitto-config` and
    the embedded broker (which then serves TLS, and its clients verify `cafile`)."""

    cafile: ResolvedPath  # the CA that signed certfile (and, with mutual TLS, every client's)
    certfile: ResolvedPath
    keyfile: ResolvedPath
    # Mutual TLS: every client must also present a certificate signed by cafile,
    # read from the credentials directory as <identity>.crt and <identity>.key.
    require_certificate: bool = False


class Security(_Section):
    """Who may connect and what each identity may do; switches anonymous access off.

    Every agent connects as its own id (stage nodes, the coordinator), with the
    password in `credentials/<id>.password`. The plant file is shared by every
    box, so it names the identities and where their secrets are, never the secrets.
    """

    credentials: ResolvedPath  # directory of <identity>.password files, mode 0600
    gateways: list[str] = []  # PLC/SCADA clients: request/<id> out, response/<id>/# in
    ops: list[str] = []  # read-only: status, events, plan (MQTT Explorer, `edgebus status`)
    # Names of the HTTP gateway's API keys (`edgebus http`), each key in
    # credentials/<name>.api-key, mode 0600 (edgebus/gateways/api_keys.py).
    api_keys: list[str] = []
    # The broker's password file in mosquitto_passwd format: only the embedded
    # broker reads it (Mosquitto has password_file in its own config).
    password_file: ResolvedPath | None = None
    # The broker's TLS listener (`edgebus init` makes the plant's CA and writes it). `off`
    # (YAML's false): plain MQTT, said so on purpose; every agent warns at start, as it does
    # for a plant file without tls: (one written before TLS was the default).
    tls: BrokerTls | Literal[False] | None = None

    @property
    def listener_tls(self) -> BrokerTls | None:
        """The TLS listener's files, or None where the broker speaks plain MQTT."""
        return self.tls or None

    @field_validator("tls", mode="before")
    @classmethod
    def _tls_off(cls, value: Any) -> Any:
        # `tls: off` is False to YAML 1.1 already; "off" in quotes means the same.
        if isinstance(value, str) and value.strip().lower() in ("off", "false", "no"):
            return False
        if value is True:
            raise ValueError("give the listener's cafile, certfile and keyfile (`edgebus "
                             "init` writes them), or off for plain MQTT")
        return value

    @field_validator("gateways", "ops")
    @classmethod
    def _check_ids(cls, ids: list[str]) -> list[str]:
        for identity in ids:
            check_level(identity, "identity")
        return ids

    @field_validator("api_keys")
    @classmethod
    def _check_key_names(cls, names: list[str]) -> list[str]:
        for name in names:  # a file name: no "/" (what a topic level forbids is enough)
            check_level(name, "API key name")
        return names
