"""The MQTT topic tree, in one place.

    {root}/llm/request/{client_id}            gateway -> coordinator (JSON, QoS 1)
    {root}/llm/response/{client_id}/{id}      coordinator -> gateway (JSON)
    {root}/llm/response/{client_id}/{id}/stream   per-token deltas
    {root}/llm/cancel/{client_id}             gateway -> coordinator: end request {"id"}
    {root}/act/{node_id}                      binary activation frames into one agent
    {root}/status/{agent_id}                  retained JSON status, Last Will
    {root}/events                             joins, leaves, errors (JSON)
    {root}/plan                               retained JSON: the active partition

Activations live under their own `act/` branch so an operator can subscribe to
`{root}/status/#` and `{root}/events` in MQTT Explorer without binary noise.
"""

from __future__ import annotations

from dataclasses import dataclass

# MQTT forbids these in a topic level we build from user data: wildcards would
# widen a subscription and "/" would add a level.
_FORBIDDEN_IN_LEVEL = ("+", "#", "/", "\x00")


def check_level(value: str, what: str) -> str:
    """Return `value` if it can be a single topic level, else raise ValueError naming `what`."""
    if not value or any(ch in value for ch in _FORBIDDEN_IN_LEVEL):
        raise ValueError(f"{what} {value!r} cannot be an MQTT topic level: it must be non-empty "
                         "and contain none of '+', '#', '/' or NUL")
    return value


@dataclass(frozen=True)
class Topics:
    """Builds every topic edgebus uses from the plant's topic root."""

    root: str

    def request(self, client_id: str) -> str:
        return f"{self.root}/llm/request/{check_level(client_id, 'client id')}"

    @property
    def request_filter(self) -> str:
        return f"{self.root}/llm/request/+"

    def client_of_request_topic(self, topic: str) -> str | None:
        """The client id in a request topic, or None if `topic` is not one."""
        return self._client_of("request", topic)

    def cancel(self, client_id: str) -> str:
        return f"{self.root}/llm/cancel/{check_level(client_id, 'client id')}"

    @property
    def cancel_filter(self) -> str:
        return f"{self.root}/llm/cancel/+"

    def client_of_cancel_topic(self, topic: str) -> str | None:
        """The client id in a cancel topic, or None if `topic` is not one."""
        return self._client_of("cancel", topic)

    def _client_of(self, kind: str, topic: str) -> str | None:
        prefix = f"{self.root}/llm/{kind}/"
        client = topic.removeprefix(prefix)
        return client if topic.startswith(prefix) and client and "/" not in client else None

    def response(self, client_id: str, request_id: str) -> str:
        return (f"{self.root}/llm/response/{check_level(client_id, 'client id')}/"
                f"{check_level(request_id, 'request id')}")

    def response_filter(self, client_id: str) -> str:
        """Every response and stream topic of one gateway client."""
        return f"{self.root}/llm/response/{check_level(client_id, 'client id')}/#"

    def stream(self, client_id: str, request_id: str) -> str:
        return self.response(client_id, request_id) + "/stream"

    def activations(self, agent_id: str) -> str:
        return f"{self.root}/act/{check_level(agent_id, 'agent id')}"

    def status(self, agent_id: str) -> str:
        return f"{self.root}/status/{check_level(agent_id, 'agent id')}"

    @property
    def status_filter(self) -> str:
        return f"{self.root}/status/+"

    def agent_of_status_topic(self, topic: str) -> str | None:
        """The agent id in a status topic, or None if `topic` is not one.

        Whose status a message is comes from here, never from its payload: the
        broker lets each identity publish only on its own status topic, while
        the JSON says whatever its sender wrote.
        """
        prefix = f"{self.root}/status/"
        agent = topic.removeprefix(prefix)
        return agent if topic.startswith(prefix) and agent and "/" not in agent else None

    @property
    def events(self) -> str:
        return f"{self.root}/events"

    @property
    def plan(self) -> str:
        return f"{self.root}/plan"
