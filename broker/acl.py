"""What each MQTT identity of a plant may read and write: one rule set for both brokers.

`broker.mosquitto_config` writes it as a Mosquitto ACL file; `broker.embedded`
hands it to amqtt's topic-ACL plugin. Rules name exact topics wherever the
plant knows them, so a node reaches only its own stage's topics.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from plant_config import Plant


@dataclass(frozen=True)
class Access:
    """Topic filters an identity may read (subscribe to, receive) and write (publish to)."""

    read: tuple[str, ...]
    write: tuple[str, ...]


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def _act_targets(plant: Plant, node: str) -> list[str]:
    """The agents whose activation topic `node` publishes to."""
    stages = plant.pipeline
    index = plant.stage_index(node)
    downstream = stages[index + 1].node_ids if index + 1 < len(stages) else []
    # Every stage may send an ERROR frame to the coordinator; the last one sends candidates.
    return [*downstream, plant.coordinator.id]


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
    rules[coordinator] = Access(
        read=(topics.request_filter, topics.cancel_filter, topics.status_filter,
              topics.activations(coordinator)),
        # It sends RELEASE frames to every node of a route, so to every node.
        write=(*(topics.activations(s.node) for s in plant.stages), f"{root}/llm/response/#",
               topics.status(coordinator), topics.events, topics.plan))
    security = plant.security
    for gateway in security.gateways if security else []:
        rules[gateway] = Access(
            # The coordinator's status tells a gateway whether a request will be served
            # (`edgebus ask` waits for it); it holds nothing a gateway could misuse.
            read=(topics.response_filter(gateway), topics.status(coordinator)),
            write=(topics.request(gateway), topics.cancel(gateway)))
    for ops in security.ops if security else []:
        rules[ops] = Access(read=(f"{root}/status/#", topics.events, topics.plan), write=())
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
    return BridgeTopics(outbound=_unique(outbound),
                        inbound=tuple(topics.activations(node) for node in local))
