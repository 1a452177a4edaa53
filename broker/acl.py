"""What each MQTT identity of a plant may read and write: one rule set for both brokers.

`broker.mosquitto_config` writes it as a Mosquitto ACL file; `broker.embedded`
hands it to amqtt's topic-ACL plugin. Rules name exact topics wherever the
plant knows them, so a node reaches only its own stage's topics.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from plant_config import Plant

# Sparkplug B's topic namespace: spBv1.0/{group}/{message type}/{edge node}[/{device}].
SPARKPLUG = "spBv1.0"


@dataclass(frozen=True)
class Access:
    """Topic filters an identity may read (subscribe to, receive) and write (publish to)."""

    read: tuple[str, ...]
    write: tuple[str, ...]


def client_id_owner(plant_id: str, identities: Iterable[str], client_id: str) -> str | None:
    """The identity that may connect with `client_id`, or None when none may.

    An identity owns `<plant_id>.<identity>` and `<plant_id>.<identity>.<suffix>`
    (several clients of one identity, e.g. `edgebus ask`, add a random suffix).
    Identities may contain dots, so `sec.a.b` fits both `a` and `a.b`: the
    longest identity wins, else identity `a` could take over `a.b`'s session.
    """
    prefix = f"{plant_id}."
    if not client_id.startswith(prefix):
        return None
    rest = client_id.removeprefix(prefix)
    fitting = [identity for identity in identities
               if rest == identity or rest.startswith(f"{identity}.")]
    return max(fitting, key=len, default=None)


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def _act_targets(plant: Plant, node: str) -> list[str]:
    """The agents whose activation topic `node` publishes to."""
    stages = plant.pipeline
    index = plant.stage_index(node)
    downstream = stages[index + 1].node_ids if index + 1 < len(stages) else []
    # Every stage may send an ERROR frame to the coordinator; the last one sends candidates.
    return [*downstream, plant.coordinator.id]


def _edge_nodes(access: Access, group: str, nodes: list[str], *,
                devices: bool = False) -> Access:
    """`access` plus the Sparkplug topics of edge nodes `nodes` (node_agent/sparkplug.py):
    their births, data and deaths (the Will too), their devices' with `devices`, and the
    commands a host application sends them."""
    kinds = ["NBIRTH", "NDATA", "NDEATH"]
    write = [f"{SPARKPLUG}/{group}/{kind}/{node}" for node in nodes for kind in kinds]
    if devices:
        write += [f"{SPARKPLUG}/{group}/{kind}/{node}/+" for node in nodes
                  for kind in ("DBIRTH", "DDATA")]
    return Access(read=(*access.read, *(f"{SPARKPLUG}/{group}/NCMD/{node}" for node in nodes)),
                  write=(*access.write, *write))


def access_rules(plant: Plant) -> dict[str, Access]:
    """What every identity of `plant` may read and write; anything else is denied."""
    topics = plant.topics
    root, coordinator = topics.root, plant.coordinator.id
    rules: dict[str, Access] = {}
    for stage in plant.stages:
        rules[stage.node] = Access(
            read=(topics.activations(stage.node),),
            write=_unique([*(topics.activations(t) for t in _act_targets(plant, stage.node)),
                           topics.status(stage.node), topics.events]))
    # Several coordinators (coordinator.instances) log in as the coordinator, each with a
    # status and a Will of its own: the others watch it to drain its session when it dies.
    instances = [f"{coordinator}.{name}" for name in plant.coordinator.instances]
    rules[coordinator] = Access(
        read=(topics.request_filter, topics.cancel_filter, topics.status_filter,
              topics.activations(coordinator)),
        # It sends RELEASE frames to every node of a route, so to every node.
        write=(*(topics.activations(s.node) for s in plant.stages), f"{root}/llm/response/#",
               *(topics.status(agent) for agent in [coordinator, *instances]), topics.events,
               topics.plan))
    security = plant.security
    for gateway in security.gateways if security else []:
        rules[gateway] = Access(
            # The coordinator's status tells a gateway whether a request will be served
            # (`edgebus ask` waits for it); it holds nothing a gateway could misuse.
            read=(topics.response_filter(gateway), topics.status(coordinator)),
            write=(topics.request(gateway), topics.cancel(gateway)))
    group = plant.ops.sparkplug.group if plant.ops and plant.ops.sparkplug else None
    # With Sparkplug, an ops identity may also be a Sparkplug host application: it reads the
    # group, asks nodes for a rebirth (NCMD; nothing else is honoured) and says whether it
    # is online (STATE, its Will: a broker may refuse a connection whose Will it denies).
    host_read = [f"{SPARKPLUG}/{group}/#"] if group else []
    host_write = [f"{SPARKPLUG}/{group}/NCMD/+", f"{SPARKPLUG}/STATE/+"] if group else []
    for ops in security.ops if security else []:
        rules[ops] = Access(read=(f"{root}/status/#", topics.events, topics.plan, *host_read),
                            write=tuple(host_write))
    if group is not None:
        for stage in plant.stages:
            rules[stage.node] = _edge_nodes(rules[stage.node], group, [stage.node])
        rules[coordinator] = _edge_nodes(rules[coordinator], group, [coordinator, *instances],
                                         devices=True)
    for name in plant.brokers:
        bridge = bridge_topics(plant, name)
        # Seen from the site broker: the bridge publishes what leaves the line
        # and subscribes to what enters it.
        rules[plant.bridge_identity(name)] = Access(read=bridge.inbound, write=bridge.outbound)
    return rules


@dataclass(frozen=True)
class BridgeTopics:
    """The topics a line broker's bridge carries, each way."""

    outbound: tuple[str, ...]  # line -> site
    inbound: tuple[str, ...]  # site -> line


def bridge_topics(plant: Plant, name: str) -> BridgeTopics:
    """Exactly the topics the nodes on line broker `name` exchange with the rest of the plant.

    Only these cross: activations between two nodes on the same side stay on
    that side's broker, so the bridge carries no frame that nobody across needs.
    """
    topics = plant.topics
    local = [s.node for s in plant.stages if s.broker == name]
    on_line = set(local)
    outbound = [topics.activations(target) for node in local
                for target in _act_targets(plant, node) if target not in on_line]
    outbound += [topics.status(node) for node in local]
    if local:
        outbound.append(topics.events)
    inbound = [topics.activations(node) for node in local]
    if local and plant.ops and plant.ops.sparkplug:
        edge = _edge_nodes(Access((), ()), plant.ops.sparkplug.group, local)
        outbound += edge.write
        inbound += edge.read
    return BridgeTopics(outbound=_unique(outbound), inbound=tuple(inbound))
