"""The bottom floor: the protocol and the plain helpers every other floor builds on.

Frames, messages and topics (the wire), the bus client and the endpoint it
connects to, errors, agent statuses, and the small helpers agents and brokers
share: sd_notify, file locks, memory limits, child processes, where edgebus
keeps its files. Nothing here imports the agents (`node_agent`, `broker`,
`plant_config`) or the operator's tools (the rest of `edgebus`);
tests/test_floors.py checks it (docs/architecture.md, "The floors").
"""
