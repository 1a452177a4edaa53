"""What a decode message costs in CPU, measured through a real broker.

Every decode step crosses the broker once per hop, and the CPU that costs
(the sending agent encoding and publishing BATCH_ROWS rows' frames, Mosquitto
routing it, the receiving agent reading and decoding it) is spent on the
boxes' shares like a forward pass. `measure_message` measures it on loopback
with a Mosquitto child and two `BusClient`s, as CPU time (not wall time: on a
box with a CPU quota the CPU is what the quota rations). Both profiles
(node_agent/profile.py, node_agent/gguf_profile.py) call it; without Mosquitto
installed they leave it unmeasured (`Measured.message` None).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from broker.mosquitto import MosquittoProcess
from edgebus.core import frames
from edgebus.core.client import BusClient
from edgebus.core.endpoint import BrokerEndpoint
from edgebus.core.errors import EdgebusError
from plant_config.planner import BATCH_ROWS

# Decode messages timed through the broker, after MESSAGE_WARMUP untimed ones
# (connection buffers, paho's first allocations). ~0.5 ms of wall time each
# here, and the CPU clocks tick in ns (schedstat) or 10 ms (stat): 400 give
# the coarser one a resolution of ~3 %.
MESSAGES = 400
MESSAGE_WARMUP = 20
# A message the receiver does not get within this long means the broker lost
# it (it never does on loopback at QoS 1): ~1000x a message's time here.
MESSAGE_TIMEOUT_S = 10.0
# The broker connection of the two profile clients: comes up within ~50 ms
# here; the margin is for a loaded box.
CONNECT_TIMEOUT_S = 10.0
_TOPIC = "edgebus/profile/frame"


def measure_message(hidden: int) -> tuple[float, float]:
    """CPU ms per decode message of BATCH_ROWS `hidden`-wide fp32 rows: of the sending and
    the receiving agent together (encode, publish, read, decode), and of Mosquitto."""
    with tempfile.TemporaryDirectory(prefix="edgebus-profile-") as workdir, \
            MosquittoProcess(Path(workdir)) as broker:
        assert broker.pid is not None
        endpoint = BrokerEndpoint(host=broker.host, port=broker.port, tls=False, username=None,
                                  password=None, protocol="5", ca_file=None, keepalive_s=30)
        return asyncio.run(_messages(endpoint, hidden, broker.pid))


async def _messages(endpoint: BrokerEndpoint, hidden: int, broker_pid: int
                    ) -> tuple[float, float]:
    limits = frames.stage_limits(prefill_chunk=1, hidden=hidden, max_in_flight=BATCH_ROWS,
                                 stages=1)
    arrived: asyncio.Queue[int] = asyncio.Queue()
    sender = BusClient(endpoint, "profile-sender")
    receiver = BusClient(endpoint, "profile-receiver", subscriptions=[(_TOPIC, 1)])
    tasks = [asyncio.create_task(sender.run(lambda _: None)),
             asyncio.create_task(receiver.run(
                 lambda message: arrived.put_nowait(len(frames.decode_all(
                     bytes(message.payload), limits)))))]
    try:
        await sender.wait_connected(CONNECT_TIMEOUT_S)
        await receiver.wait_connected(CONNECT_TIMEOUT_S)
        rows = np.random.default_rng(0).standard_normal((BATCH_ROWS, 1, 1, hidden),
                                                        dtype=np.float32)
        agent_s = broker_s = 0.0
        for index in range(MESSAGE_WARMUP + MESSAGES):
            if index == MESSAGE_WARMUP:
                agent_s, broker_s = time.process_time(), _cpu_s(broker_pid)
            header = frames.Header(request=0, epoch=0, step=index)
            sender.send(_TOPIC, b"".join(frames.encode(frames.Kind.HIDDEN, row, header, start=0)
                                         for row in rows))
            async with asyncio.timeout(MESSAGE_TIMEOUT_S):
                got = await arrived.get()
            if got != BATCH_ROWS:
                raise EdgebusError("the profile's decode message lost frames on the way "
                                   "through Mosquitto")
        return ((time.process_time() - agent_s) * 1e3 / MESSAGES,
                (_cpu_s(broker_pid) - broker_s) * 1e3 / MESSAGES)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _cpu_s(pid: int) -> float:
    """CPU seconds process `pid` has used: schedstat's nanoseconds where the kernel keeps
    them, else stat's clock ticks."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        # utime and stime, fields 14 and 15 of proc(5), counted after the ")" from field 3.
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
