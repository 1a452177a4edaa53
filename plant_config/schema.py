"""The plant file's schema: which node runs which layers of which model, and the broker
(whose sections are in plant_config/broker_section.py).

Every agent of a plant reads the same plant file. The models here check
everything that can be checked without touching the disk; `loader` adds the
checks against the model directory. Unknown keys are errors, so a typo never
silently falls back to a default.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import (
    BaseModel,
    Field,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from edgebus.core.endpoint import BrokerEndpoint
from edgebus.core.errors import PlantConfigError
from edgebus.core.frames import MAX_DECODE_POSITIONS
from edgebus.core.messages import MAX_WAIT_S
from edgebus.core.topics import Topics, check_level
from plant_config.broker_section import BrokerSettings, Security
from plant_config.credentials import read_password
from plant_config.layout import layout_problems
from plant_config.problems import Problem, Problems
from plant_config.section import SECTION_CONFIG, ResolvedPath
from plant_config.tasks import TaskTemplate

# How a stage keeps its weights: docs/weight-modes.md.
# gguf: the model's GGUF blocks as shipped (Q4_0, Q4_K_M, Q8_0, F16, ...), run by llama.cpp.
WeightMode = Literal["fp32", "bf16", "int8", "int4", "gguf"]
# What runs a stage's layers (node_agent/engines/); "auto" picks by weight mode.
EngineName = Literal["auto", "torch", "onnxruntime", "llamacpp"]
# Where a stage computes. cuda: ONNX Runtime's CUDA execution provider.
Device = Literal["cpu", "cuda"]
# The weight modes each engine runs. torch has no 4-bit kernel worth running
# (docs/weight-modes.md); ONNX Runtime has no fast bf16 one on CPUs.
ENGINE_MODES: dict[str, tuple[WeightMode, ...]] = {
    "torch": ("fp32", "bf16", "int8"),
    "onnxruntime": ("fp32", "int8", "int4"),
    "llamacpp": ("gguf",),
}


def resolve_engine(engine: EngineName, weights: WeightMode) -> str:
    """The engine `engine: auto` means for `weights`: torch keeps fp32 token-exact against
    transformers' generate; 4- and 8-bit weights run fastest in onnxruntime.

    Per weight mode, not per box: two engines quantize and sum differently, so
    replicas of a stage on different boxes must not pick differently, or a
    replayed request could answer differently (docs/failover.md).
    """
    if engine != "auto":
        return engine
    if weights == "gguf":
        return "llamacpp"
    return "torch" if weights in ("fp32", "bf16") else "onnxruntime"

# A plant's model: naming a file with this suffix names a GGUF (node_agent/gguf_model.py).
GGUF_SUFFIX = ".gguf"

class _Section(BaseModel):
    model_config = SECTION_CONFIG


class StageSpec(_Section):
    """One stage node and the layers it runs.

    Nodes listed one after another with the same layers are replicas of one
    stage: standbys that a request fails over to when its node dies.
    """

    node: str
    layers: tuple[int, int]  # [first, last + 1)
    # The engine's threads (llama.cpp, torch, onnxruntime). None: all cores for llama.cpp, the
    # count measured fastest on the box for the others (node_agent/engines/tuning.py).
    threads: PositiveInt | None = None
    # KV caches this node may hold. 512 MiB holds ~35k positions of a 10-layer
    # SmolLM2 stage (15 KiB each): 64 requests of 512 tokens with room to spare,
    # and a Pi 5 with 8 GB keeps most of its memory for weights.
    kv_budget_mb: PositiveInt = 512
    # fp32 by default: only fp32 is token-exact against transformers' generate
    # (docs/weight-modes.md has what bf16, int8 and int4 save and cost).
    weights: WeightMode = "fp32"
    # auto: torch for fp32 and bf16 (the exact reference), onnxruntime for int8
    # and int4 (its 4- and 8-bit kernels are 2-4x torch's): node_agent/engines/.
    engine: EngineName = "auto"
    device: Device = "cpu"
    # A name from the plant's `brokers:` (a line broker bridged to `broker`);
    # None: the node connects to the plant's `broker`.
    broker: str | None = None

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

    @model_validator(mode="after")
    def _check_engine(self) -> StageSpec:
        engine = resolve_engine(self.engine, self.weights)
        if self.weights not in ENGINE_MODES[engine]:
            runs = [name for name, modes in ENGINE_MODES.items() if self.weights in modes]
            raise ValueError(f"engine {engine} does not run {self.weights} weights: use "
                             f"`engine: {runs[0]}` (or `auto`), or weights "
                             f"{' / '.join(ENGINE_MODES[engine])}")
        if self.device == "cuda" and engine != "onnxruntime":
            raise ValueError("device cuda runs on engine onnxruntime (its CUDA execution "
                             "provider); the torch engine runs on the CPU only")
        return self


# Above this a "MB/s" is not one: the fastest PCIe 5 NVMe drives read at ~14,000 MB/s, so
# a larger figure is bytes/s or KB/s written into a field counted in MB/s.
MAX_DISK_MB_S = 20_000


class DiskSpec(_Section):
    """A box's storage as its agent reads and writes a model: sequential MB/s (10^6 bytes a
    second, as cards and drives are rated), measured on the box (docs/plant-file.md)."""

    read_mb_s: PositiveFloat
    write_mb_s: PositiveFloat

    @field_validator("read_mb_s", "write_mb_s")
    @classmethod
    def _check_rate(cls, rate: float) -> float:
        if rate > MAX_DISK_MB_S:
            raise ValueError(f"{rate:g} MB/s is faster than any drive (the fastest NVMe read "
                             f"~14,000): the rate is in MB/s — a Raspberry Pi's SD card reads "
                             "at 50-90, writes at 20-60")
        return rate

    def read_s(self, n_bytes: int) -> float:
        """Seconds to read `n_bytes` at this rate."""
        return n_bytes / (self.read_mb_s * 1e6)

    def write_s(self, n_bytes: int) -> float:
        """Seconds to write `n_bytes` at this rate."""
        return n_bytes / (self.write_mb_s * 1e6)


class BoxSpec(_Section):
    """One box of the plant as `edgebus plan` sees it; `name` is the node id of its stage.

    The node's weight mode and KV budget stay on its stage entry (`weights`,
    `kv_budget_mb`): one place for each, which the planner reads from there.
    """

    name: str
    # MiB edgebus may use on this box: the node's weights, its KV budget and
    # the agent process. What the OS and other services need is not in it.
    memory_mb: PositiveInt
    device: str | None = None  # free text for people: "jetson-orin-nano", "rpi5"
    # Compute relative to the machine `edgebus plan` profiles on; only the
    # ratios between boxes change the plan.
    speed: PositiveFloat = 1.0
    # The box's network link in Mbit/s, for `edgebus rehearse` (docs/rehearse.md);
    # None: as fast as the machine it is rehearsed on.
    link_mbit: PositiveFloat | None = None
    # The box's storage, which sets how long a first start reads and writes: `edgebus plan`
    # estimates it and `edgebus rehearse` holds the box's disk to it; None: unknown (plan
    # states no estimate) and, rehearsed, as fast as the machine's disk.
    disk: DiskSpec | None = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        return check_level(name, "box name")


class Liveness(_Section):
    """How agents show they are alive, and how soon a silent one counts as dead."""

    # Status refresh period: often enough for a live chart, rare enough to cost nothing.
    heartbeat_s: PositiveFloat = 2.0
    # A node silent this long is dead and its requests fail over. Three missed
    # heartbeats: one late message on a busy broker is not a failure.
    timeout_s: PositiveFloat = 6.0
    # How long a request waits for a stage with no live node to get one back
    # before it fails: a systemd restart reloads a stage in seconds, and at
    # plant start-up big stages may still be loading their layers.
    stage_wait_s: PositiveFloat = 30.0

    @model_validator(mode="after")
    def _timeout_above_heartbeat(self) -> Liveness:
        if self.timeout_s <= self.heartbeat_s:
            raise Problems([Problem(("timeout_s",), f"{self.timeout_s} s is not longer than "
                                    f"heartbeat_s ({self.heartbeat_s} s): every node would count "
                                    "as dead between heartbeats — use at least 3x heartbeat_s")])
        return self


class Speculation(_Section):
    """Drafts sent down the pipeline ahead of a lone request's token
    (node_agent/speculation.py): exact, they fill stages that would idle."""

    # Drafts a request keeps in flight ahead of its token; 0 turns speculation off. A
    # plant of S stages has S - 1 stages idle with one request: S - 1 drafts fill them.
    drafts: int = Field(default=0, ge=0, le=16)
    # Speculate only while at most this many requests are in flight: with more, the
    # coordinator's groups already keep every stage busy, and drafts would take turns
    # from other requests' tokens.
    max_in_flight: PositiveInt = 1
    # Lengths of the n-grams looked up in the request's text, longest first: one token
    # matches too often to be a quote, past 4 a match is rarely missed by a shorter one.
    min_ngram: PositiveInt = 2
    max_ngram: PositiveInt = 4
    # N-grams of the plant's recent prompts and answers kept to draft from where a
    # request's own text has no match (node_agent/ngram_cache.py); 0 turns it off. About
    # 250 bytes each: the default holds ~8 MiB, the n-grams of some 11000 tokens of text,
    # tens of recent requests; the most allowed ~250 MiB.
    answer_cache: int = Field(default=32768, ge=0, le=1_000_000)
    # Positions a decode frame carries, the token's and drafts: unset, chosen per frame
    # from the stages' measured cost of k positions in one call and the drafts taken lately
    # (node_agent/speculation.py); set, that many wherever the window and the stages'
    # `exact_rows` allow, for a plant whose boxes were benchmarked (docs/benchmarks.md).
    positions_per_frame: int | None = Field(default=None, ge=1, le=MAX_DECODE_POSITIONS)

    @model_validator(mode="after")
    def _ngrams_in_order(self) -> Speculation:
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram {self.min_ngram} exceeds max_ngram {self.max_ngram}")
        return self


class CoordinatorSpec(_Section):
    """The agent that admits requests and drives the token loop."""

    id: str = "coordinator"
    max_tokens_limit: PositiveInt = 1024  # requests asking for more get an error response
    max_prompt_tokens: PositiveInt = 4096
    max_in_flight: PositiveInt = 64  # admission limit
    # What one gateway (client id) may hold of max_in_flight; past it its requests get
    # `busy`. Default: three quarters, so a gateway that floods the plant (a retry loop,
    # an HTTP gateway under load) leaves a quarter for the PLC bridges.
    max_in_flight_per_client: PositiveInt | None = None
    # Requests that may wait for a slot past max_in_flight (node_agent/coordinator/
    # waiting_room.py), fair across gateways; past it a request is answered `busy` at once,
    # with a retry time. 512 holds an alarm storm of 16 PLCs x 25 requests beside a full
    # plant (docs/benchmarks.md), and bounds the journal a storm leaves on disk and in
    # memory to 512 requests of at most 256 KiB each; 0: nothing waits (busy at once).
    max_queue: int = Field(default=512, ge=0, le=100_000)
    # Seconds a request waits for a slot at most (a request may ask for less, max_wait_s);
    # past it, `busy` with a retry time. The storm of 16 PLCs x 25 requests of 16 tokens
    # on the bundled SmolLM2 (3 llama.cpp stages, 2-core Xeon VM at load 9-13) had its
    # last answer 169-201 s after it began (docs/benchmarks.md): 600 s serves it 3 times
    # over, and a PLC still waiting for alarm advice after 10 minutes has moved on.
    max_wait_s: float = Field(default=600.0, ge=0.0, le=MAX_WAIT_S)
    candidates: PositiveInt = 64  # top-k (id, logit) pairs the last stage returns per token
    request_timeout_s: PositiveFloat = 120.0
    # Prompt positions per prefill frame. Other requests' decode steps wait
    # for at most one chunk's compute; stages work on successive chunks at the
    # same time, which cuts time to first token; and frames stay far under a
    # broker's packet limit (64 x 4096 fp32 = 1 MiB). On the rehearsed seed plant
    # (Jetson and two Pis, docs/benchmarks.md) 64 took a 1,000-token prompt to its
    # first token in 0.84x the Jetson alone's time and a 3,000-token one in 0.80x,
    # where 128 took 0.94x and 0.85x: smaller chunks keep the stages busier sooner.
    prefill_chunk: PositiveInt = 64
    # More coordinators serving the plant at once, by instance name (each runs
    # as `EDGEBUS_INSTANCE=NAME edgebus coordinator PLANT`, status `<id>.NAME`).
    # With any listed, every coordinator takes requests from one MQTT 5 shared
    # subscription; docs/failover.md says what that keeps and what it cannot.
    instances: list[str] = []
    speculation: Speculation = Field(default_factory=Speculation)

    @field_validator("id")
    @classmethod
    def _check_id(cls, agent_id: str) -> str:
        return check_level(agent_id, "coordinator id")

    @model_validator(mode="after")
    def _share_within_limit(self) -> CoordinatorSpec:
        share = self.max_in_flight_per_client
        if share is not None and share > self.max_in_flight:
            raise ValueError(f"max_in_flight_per_client {share} exceeds max_in_flight "
                             f"{self.max_in_flight}: a gateway's share is part of the whole")
        return self

    @property
    def client_limit(self) -> int:
        """Requests one gateway may have in flight (max_in_flight_per_client)."""
        return self.max_in_flight_per_client or max(1, self.max_in_flight * 3 // 4)

    @field_validator("instances")
    @classmethod
    def _check_instances(cls, names: list[str]) -> list[str]:
        for name in names:
            check_level(name, "coordinator instance")
        if len(set(names)) != len(names):
            raise ValueError("instance names must be distinct")
        return names


class Sparkplug(_Section):
    """Sparkplug B: every agent is an edge node of `group` (docs/sparkplug.md)."""

    group: str  # the Sparkplug group id: spBv1.0/{group}/NBIRTH/{agent id}

    @field_validator("group")
    @classmethod
    def _check_group(cls, group: str) -> str:
        return check_level(group, "Sparkplug group id")


class Ops(_Section):
    """What the plant tells operations tools beyond its own status topics."""

    sparkplug: Sparkplug | None = None


class Plant(_Section):
    """A whole plant file."""

    plant_id: str
    topic_root: str
    broker: BrokerSettings = Field(default_factory=BrokerSettings)
    # A model directory in HF layout (edgebus model import-gguf makes one), or a .gguf file,
    # which only llama.cpp stages run (every stage weights: gguf).
    model: ResolvedPath
    # Activations between stages. float32 by default: a float16 hop rounds the hidden
    # state, which flipped a greedy near-tie of SmolLM2 in int8 at a 2- and 3-stage
    # split (tests/test_engines.py); float16 halves the bytes (1.2 instead of 2.3 KB
    # a decode hop for SmolLM2) where a link is that slow.
    wire_dtype: Literal["float16", "float32"] = "float32"
    # The hardware each stage node runs on, for `edgebus plan`; None: not described.
    boxes: list[BoxSpec] | None = None
    # In pipeline order: stage 0 also owns the token embedding, the last one
    # also the final norm and the LM head.
    stages: list[StageSpec]
    coordinator: CoordinatorSpec = Field(default_factory=CoordinatorSpec)
    liveness: Liveness = Field(default_factory=Liveness)
    # Line brokers by name, each bridged to `broker` (the site broker); a stage
    # node with `broker: NAME` connects to that one.
    brokers: dict[str, BrokerSettings] = {}
    security: Security | None = None
    ops: Ops | None = None
    # PLC task templates by name (plant_config/tasks.py): a PLC sends a name and tag values.
    tasks: dict[str, TaskTemplate] = {}

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

    @model_validator(mode="after")
    def _check_gguf_model(self) -> Plant:
        # Only llama.cpp runs a GGUF's blocks; the other engines load the safetensors an
        # import writes, fp32 values dequantized from those blocks.
        if self.model.suffix.lower() != GGUF_SUFFIX:
            return self
        problems = [
            Problem(("stages", index, "weights"),
                    f"{stage.weights} runs on the {engine} engine, which cannot run the GGUF "
                    f"file model: names ({self.model.name}) — set weights: gguf (llama.cpp runs "
                    "the file's own blocks), or import it for the torch and onnxruntime "
                    f"engines with `edgebus model import-gguf {self.model} DIR` and set model: "
                    "DIR")
            for index, stage in enumerate(self.stages)
            if (engine := resolve_engine(stage.engine, stage.weights)) != "llamacpp"]
        if problems:
            raise Problems(problems)
        return self

    @model_validator(mode="after")
    def _check_boxes(self) -> Plant:
        # One box per stage node and one node per box: the planner gives each box a place
        # in the pipeline through its stage entry.
        if self.boxes is None:
            return self
        problems: list[Problem] = []
        seen: set[str] = set()
        nodes = [stage.node for stage in self.stages]
        for index, box in enumerate(self.boxes):
            if box.name in seen:
                problems.append(Problem(("boxes", index, "name"), f"{box.name!r} is listed "
                                        "twice — box names must be distinct"))
            elif box.name not in nodes:
                problems.append(Problem(("boxes", index, "name"), f"{box.name!r} runs no stage "
                                        f"— add a stage with node: {box.name} or remove the box"))
            seen.add(box.name)
        problems.extend(Problem(("stages", index, "node"), f"{node!r} has no box — add one to "
                                "boxes: (name, memory_mb, speed) or remove boxes:")
                        for index, node in enumerate(nodes) if node not in seen)
        if problems:
            raise Problems(problems)
        return self

    @model_validator(mode="after")
    def _check_brokers_and_security(self) -> Plant:
        problems: list[Problem] = []
        for name, settings in self.brokers.items():
            try:
                # It becomes part of an identity, which is a topic level.
                check_level(name, "broker name")
            except ValueError as exc:
                problems.append(Problem(("brokers", name), str(exc)))
            if settings.embedded:
                problems.append(Problem(("brokers", name, "url"), "a line broker must be an "
                                        "mqtt:// or mqtts:// URL: bridging to the site broker is "
                                        "Mosquitto's (`edgebus broker mosquitto-config --broker "
                                        f"{name}`)"))
        for index, stage in enumerate(self.stages):
            if stage.broker is not None and stage.broker not in self.brokers:
                known = ", ".join(repr(n) for n in self.brokers) or "none"
                problems.append(Problem(("stages", index, "broker"), f"{stage.broker!r} is not "
                                        f"in brokers: (names there: {known}) — add it there or "
                                        "remove broker: to use the plant's broker"))
        if self.security is not None:
            problems.extend(self._security_problems(self.security))
        if problems:
            raise Problems(problems)
        return self

    def _security_problems(self, security: Security) -> list[Problem]:
        problems: list[Problem] = []
        seen: dict[str, str] = {}
        for identity, what in self._identity_list():
            if identity in seen:
                problems.append(Problem(("security",), f"{identity!r} is both {seen[identity]} "
                                        f"and {what} — every identity needs a name of its own"))
            seen.setdefault(identity, what)
        if self.broker.embedded and security.password_file is None:
            problems.append(Problem(("security", "password_file"), "required with the embedded "
                                    "broker, which checks passwords against it — write it with "
                                    "`edgebus broker mosquitto-config PLANT OUTDIR` and name "
                                    "OUTDIR/passwd here"))
        for loc, settings in [(("broker",), self.broker),
                              *((("brokers", name), b) for name, b in self.brokers.items())]:
            if settings.username is not None or settings.password is not None:
                problems.append(Problem((*loc, "username"), "security: gives every identity "
                                        "its own user name and password — remove the shared "
                                        "ones (also from the url)"))
        # The embedded broker serves TLS with security.tls; an external one where its url
        # says mqtts://, which its listener must then serve.
        if security.tls and not self.broker.embedded and not self.broker.endpoint().tls:
            problems.append(Problem(("security", "tls"), "the broker's url is not mqtts:// — "
                                    "use mqtts://host:8883 so agents connect over TLS, or "
                                    "set tls: off for plain MQTT"))
        if security.tls is False and self.broker.endpoint().tls:
            problems.append(Problem(("security", "tls"), "is off, but the broker's url is "
                                    "mqtts:// — use mqtt:// for plain MQTT, or give the "
                                    "listener's files"))
        return problems

    def identities(self) -> dict[str, str]:
        """Every MQTT identity of the plant, by id, with what it is ("a stage node", ...)."""
        return dict(self._identity_list())

    def _identity_list(self) -> list[tuple[str, str]]:
        # A list, not a dict: validation must see an id given twice.
        security = self.security
        return [*((stage.node, "a stage node") for stage in self.stages),
                (self.coordinator.id, "the coordinator"),
                *((g, "a gateway") for g in (security.gateways if security else [])),
                *((o, "an ops identity") for o in (security.ops if security else [])),
                *((self.bridge_identity(name), f"the bridge of broker {name!r}")
                  for name in self.brokers)]

    @staticmethod
    def bridge_identity(broker_name: str) -> str:
        """The identity a line broker's bridge logs into the site broker with."""
        return f"bridge-{broker_name}"

    def broker_of(self, identity: str) -> BrokerSettings:
        """The broker `identity` connects to: a stage node's `broker:`, else the plant's."""
        for stage in self.stages:
            if stage.node == identity and stage.broker is not None:
                return self.brokers[stage.broker]
        return self.broker

    def endpoint_for(self, identity: str) -> BrokerEndpoint:
        """How `identity` (an agent, gateway or ops id) connects: its broker and credentials.

        Without `security:` every identity uses the broker section's shared
        credentials; with it, its own user name (= its id) and the password in
        `security.credentials/<id>.password` (and, for mutual TLS, its
        certificate and key beside it).
        """
        endpoint = self.broker_endpoint(self.broker_of(identity))
        if self.security is None:
            return endpoint
        if identity not in self.identities():
            raise PlantConfigError(
                f"{identity!r} is not an identity of plant {self.plant_id!r} "
                f"(known: {', '.join(sorted(self.identities()))}) — add it to security.gateways "
                "or security.ops")
        credentials, tls = self.security.credentials, self.security.listener_tls
        cert_file, key_file = credentials / f"{identity}.crt", credentials / f"{identity}.key"
        mutual = tls is not None and tls.require_certificate
        if tls is not None and mutual and not (cert_file.is_file() and key_file.is_file()):
            raise PlantConfigError(
                f"security.tls.require_certificate is on, but {identity!r} has no client "
                f"certificate: {cert_file} and {key_file} must exist — issue them from "
                f"{tls.cafile} (docs/securing-the-broker.md, 'Mutual TLS')")
        # A password is never logged: BrokerEndpoint leaves it out of its repr.
        return replace(endpoint, username=identity, password=read_password(credentials, identity),
                       cert_file=cert_file if mutual else None,
                       key_file=key_file if mutual else None)

    def broker_endpoint(self, settings: BrokerSettings | None = None) -> BrokerEndpoint:
        """The address of `settings` (default: the plant's broker) as the plant's clients
        reach it, before any identity's credentials: over TLS, verifying the plant's CA,
        where the embedded broker serves TLS (security.tls); an external broker's URL says
        itself whether it does."""
        settings = settings or self.broker
        endpoint = settings.endpoint()
        tls = self.security.listener_tls if self.security is not None else None
        if settings.embedded and tls is not None:
            return replace(endpoint, tls=True, ca_file=settings.ca_file or tls.cafile)
        return endpoint

    def speaks_plain(self, identity: str | None = None) -> bool:
        """Whether `identity`'s link (default: the plant's broker) is plain MQTT, in clear."""
        settings = self.broker if identity is None else self.broker_of(identity)
        return not self.broker_endpoint(settings).tls

    def ops_endpoint(self) -> BrokerEndpoint:
        """How a tool that only watches statuses and the plan (`up`, `status`) connects."""
        if self.security is None:
            return self.broker.endpoint()
        if not self.security.ops:
            raise PlantConfigError("security.ops is empty, and watching the plant's statuses "
                                   "needs an ops identity — add one, e.g. `ops: [ops]`, and run "
                                   "`edgebus broker mosquitto-config` again")
        return self.endpoint_for(self.security.ops[0])

    def ops_client_id(self, tool: str) -> str:
        """A client id of its own for `tool` connecting through `ops_endpoint`.

        With security on, a client id must be `<plant_id>.<identity>` or
        `<plant_id>.<identity>.<suffix>` (broker.acl.client_id_owner); the
        random part lets several tools watch at once.
        """
        ops = self.security.ops[0] if self.security is not None and self.security.ops else "ops"
        return f"{self.plant_id}.{ops}.{tool}-{secrets.token_hex(4)}"

    @property
    def topics(self) -> Topics:
        return Topics(self.topic_root)

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layers[1]

    @property
    def pipeline(self) -> list[PipelineStage]:
        """The stages in order, each with its replica nodes (adjacent entries, same layers)."""
        result: list[PipelineStage] = []
        for spec in self.stages:
            if result and result[-1].layers == spec.layers:
                result[-1].nodes.append(spec)
            else:
                result.append(PipelineStage(len(result), spec.layers, [spec]))
        return result

    def node(self, node_id: str) -> StageSpec:
        for spec in self.stages:
            if spec.node == node_id:
                return spec
        known = ", ".join(repr(stage.node) for stage in self.stages)
        raise PlantConfigError(f"{node_id!r} is not a stage node of plant {self.plant_id!r}; "
                               f"its stage nodes are {known}")

    def stage_index(self, node_id: str) -> int:
        """The pipeline position of the stage `node_id` is a node of."""
        layers = self.node(node_id).layers
        return next(stage.index for stage in self.pipeline if stage.layers == layers)


@dataclass(frozen=True)
class PipelineStage:
    """One stage of the pipeline: a layer range and the nodes (replicas) that can run it."""

    index: int
    layers: tuple[int, int]
    nodes: list[StageSpec]

    @property
    def node_ids(self) -> list[str]:
        return [spec.node for spec in self.nodes]

