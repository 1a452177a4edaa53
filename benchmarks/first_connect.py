r"""How long an agent's first MQTT connect takes, TLS or plain: what a box pays at start.

    python benchmarks/first_connect.py PLANT.yaml [--identity plc-1] [--times 6]

Connects as `identity` with the plant file's endpoint (TLS and credentials as the agents use
them, `edgebus.core.client.BusClient`), `--times` times in one process, and prints the first
connect (which also builds the TLS context and reads the CA) and the median of the others.
Run it inside a CPU quota to stand for a slow box, as docs/benchmarks.md does for a Pi's
share of the rehearsal (0.12 of a core):

    S=/sys/fs/cgroup/cpu/slow; mkdir $S && echo 12000 > $S/cpu.cfs_quota_us
    sh -c "echo \$\$ > $S/tasks; exec python benchmarks/first_connect.py plant.yaml"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from pathlib import Path

from edgebus.core.client import BusClient
from plant_config import Plant, load_plant

# A connect that takes longer is a broker that is not there, not a measurement.
CONNECT_TIMEOUT_S = 30.0


async def connect_once(plant: Plant, identity: str, attempt: int) -> float:
    """Seconds from starting the client to its CONNACK."""
    bus = BusClient(plant.endpoint_for(identity), f"{plant.plant_id}.{identity}.c{attempt}",
                    subscriptions=[])
    started = time.perf_counter()
    task = asyncio.create_task(bus.run(lambda message: None))
    await bus.wait_connected(CONNECT_TIMEOUT_S)
    took = time.perf_counter() - started
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return took


async def main(args: argparse.Namespace) -> None:
    plant = load_plant(args.plant)
    times = [await connect_once(plant, args.identity, i) for i in range(args.times)]
    print(f"{args.plant}: first connect {times[0] * 1000:.0f} ms, then median "
          f"{statistics.median(times[1:]) * 1000:.0f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plant", type=Path)
    parser.add_argument("--identity", default="plc-1")
    parser.add_argument("--times", type=int, default=6)
    asyncio.run(main(parser.parse_args()))
