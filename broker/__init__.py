"""The MQTT broker edgebus can run itself, for plants without a Mosquitto of their own."""

from broker.embedded import EmbeddedBroker, run_broker_forever

__all__ = ["EmbeddedBroker", "run_broker_forever"]
