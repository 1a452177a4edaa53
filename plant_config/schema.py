"""The plant file's schema: which node runs which layers of which model, and the broker.

Every agent of a plant reads the same plant file. The models here check
everything that can be checked without touching the disk; `loader` adds the
checks against the model directory. Unknown keys are errors, so a typo never
silently falls back to a default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from edgebus.errors import PlantConfigError
from edgebus.topics import Topics, check_level
from plant_config.layout import layout_problems
from plant_config.problems import Problem, Problems

MqttProtocol = Literal["3.1.1", "5"]

EMBEDDED = "embedded"
# scheme -> (TLS, default port): the IANA ports for MQTT and MQTT over TLS.
_SCHEMES = {"mqtt": (False, 1883), "mqtts": (True, 8883)}
_URL_FORMS = "'embedded', mqtt://[user[:password]@]host[:port] or mqtts://..."

# Validation context key: the directory relative paths in the file are relative
# to. Without it they resolve against the current directory.
RELATIVE_TO = "relative_to"


def _resolve_path(path: Path, info: ValidationInfo) -> Path:
    base = (info.context or {}).get(RELATIVE_TO, Path.cwd())
    return (Path(base) / path.expanduser()).resolve()


# A path stored absolute, so a Plant means the same thing from any working directory.
ResolvedPath = Annotated[Path, AfterValidator(_resolve_path)]


class _Section(BaseModel):
    # frozen: a Plant is validated once, mutation would bypass the checks.
    # hide_input_in_errors: the input of a broker section may contain a password.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


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
        if self.ca_file is not None and not self.endpoint().tls:
            problems.append(Problem(("ca_file",), "only used with an mqtts:// url"))
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


class StageSpec(_Section):
    """One stage node and the layers it runs."""

    node: str
    layers: tuple[int, int]  # [first, last + 1)
    threads: PositiveInt | None = None  # torch intra-op threads; None: all cores

    @field_validator("node")
    @classmethod
    def _check_node(cls, node: str) -> str:
        return check_level(node, "node id")

    @field_validator("layers")
    @classmethod
    def _check_layers(cls, layers: tuple[int, int]) -> tuple[int, int]:
        first, stop = layers
        if first < 0:
            raise ValueError(f"[{first}, {stop}]: layer numbers start at 0")
        if stop <= first:
            raise ValueError(f"[{first}, {stop}] holds no layer — write [first, last + 1], "
                             "e.g. [0, 10] for layers 0-9")
        return layers


class CoordinatorSpec(_Section):
    """The agent that admits requests and drives the token loop."""

    id: str = "coordinator"
    max_tokens_limit: PositiveInt = 1024  # requests asking for more get an error response
    max_prompt_tokens: PositiveInt = 4096
    max_in_flight: PositiveInt = 64  # admission limit
    candidates: PositiveInt = 64  # top-k (id, logit) pairs the last stage returns per token
    request_timeout_s: PositiveFloat = 120.0
    # Prompt positions per prefill frame. Other requests' decode steps wait
    # for at most one chunk's compute; stages work on successive chunks at the
    # same time, which cuts time to first token; and frames stay far under a
    # broker's packet limit (128 x 4096 fp16 = 1 MiB).
    prefill_chunk: PositiveInt = 128

    @field_validator("id")
    @classmethod
    def _check_id(cls, agent_id: str) -> str:
        return check_level(agent_id, "coordinator id")


class Plant(_Section):
    """A whole plant file."""

    plant_id: str
    topic_root: str
    broker: BrokerSettings = Field(default_factory=BrokerSettings)
    model: ResolvedPath  # model directory in HF layout
    wire_dtype: Literal["float16", "float32"] = "float16"  # activations between stages
    # In pipeline order: stage 0 also owns the token embedding, the last one
    # also the final norm and the LM head.
    stages: list[StageSpec]
    coordinator: CoordinatorSpec = Field(default_factory=CoordinatorSpec)

    @field_validator("plant_id")
    @classmethod
    def _check_plant_id(cls, plant_id: str) -> str:
        return check_level(plant_id, "plant id")

    @field_validator("topic_root")
    @classmethod
    def _check_topic_root(cls, root: str) -> str:
        if root.startswith("$"):
            # Brokers reserve $-topics ($SYS) and keep them out of wildcard subscriptions.
            raise ValueError(f"{root!r} starts with '$', which brokers reserve for themselves")
        try:
            for level in root.split("/"):
                check_level(level, "topic root level")
        except ValueError:
            raise ValueError(f"{root!r} cannot be a topic root: it needs non-empty levels "
                             "separated by single '/', no leading or trailing '/', and none of "
                             "'+', '#' or NUL — e.g. 'edgebus/plant-a'") from None
        return root

    @field_validator("stages")
    @classmethod
    def _check_stages(cls, stages: list[StageSpec]) -> list[StageSpec]:
        if not stages:
            raise ValueError("no stages — list at least one, e.g. "
                             "- {node: stage-0, layers: [0, 30]}")
        problems = layout_problems([stage.layers for stage in stages])
        first_index: dict[str, int] = {}
        for index, stage in enumerate(stages):
            owner = first_index.setdefault(stage.node, index)
            if owner != index:
                problems.append(Problem((index, "node"), f"{stage.node!r} is already the node of "
                                                         f"stages[{owner}] — node ids must be "
                                                         "distinct"))
        if problems:
            raise Problems(problems)
        return stages

    @model_validator(mode="after")
    def _check_coordinator_id(self) -> Plant:
        if any(stage.node == self.coordinator.id for stage in self.stages):
            raise Problems([Problem(("coordinator", "id"),
                                    f"{self.coordinator.id!r} is also a stage node id — the "
                                    "coordinator needs an id of its own")])
        return self

    @property
    def topics(self) -> Topics:
        return Topics(self.topic_root)

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layers[1]

    def stage_index(self, node_id: str) -> int:
        for index, stage in enumerate(self.stages):
            if stage.node == node_id:
                return index
        known = ", ".join(repr(stage.node) for stage in self.stages)
        raise PlantConfigError(f"{node_id!r} is not a stage node of plant {self.plant_id!r}; "
                               f"its stage nodes are {known}")

