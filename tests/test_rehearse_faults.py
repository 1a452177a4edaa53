"""Pulled cables and out-of-memory kills, on boxes rehearsed as namespaces and control groups.

The plant runs as `edgebus rehearse` runs it: each box a network namespace on
a bridge with a CPU quota and a memory limit, every agent a real OS process
inside, Mosquitto on the box the plant's broker URL names. A cable pulled
(`ip link set ... down` on the box's end of the bridge) sends no FIN and no
RST: the connections stay half-open, as on a plant. A box whose memory limit
its stage's KV cache outgrows has that stage killed by the kernel's OOM
killer, as a box without swap would. Every request must be answered with
exactly what transformers' `generate` answers, or, where no node of a stage
is left, with `unavailable`.

One rehearsal serves the whole module (starting one costs ~15 CPU-seconds of
torch imports and kernel tuning); each test leaves every link up and every
agent it needs online, in the order written; the memory tests kill stage 1's
nodes, so they come last. The expected answers, `generate`'s, are computed once
for each prompt and length, beside the plant from the module's start on: the
plant's waits leave the CPU idle, and a memory test's answers cost `generate`
as long as the test's own run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import optional
import pytest
import torch
from pipeline import reference_tokens
from tiny_models import TOKENIZER_FILES, configs
from transformers import AutoModelForCausalLM, LlamaConfig

from edgebus.core.messages import GenerateRequest
from edgebus.core.processes import cores
from edgebus.rehearse import Options, Rehearsal
from edgebus.rehearse.rehearsal import missing
from edgebus.rehearse.workload import Client, fresh_statuses, wait_online
from plant_config import BrokerSettings, CoordinatorSpec, Liveness, Plant, StageSpec
from plant_config.schema import BoxSpec

MISSING = missing()
pytestmark = [optional.needs(MISSING, "a rehearsal"), optional.HOST_NETWORK]

# Box names: stage 0 and the coordinator; stage 1; stage 1's standby and the broker.
HEAD, TAIL, STANDBY = "box-a", "box-b", "box-c"
# A dead node is seen within seconds; a stage with no live node is waited for
# longer than the broker's box is cut off and its agents' connections take to carry
# again (TCP's retransmission backoff, up to about half the cut once more), so that
# outage fails no request. Short, because the test without a standby waits all of it.
LIVENESS = Liveness(heartbeat_s=0.5, timeout_s=2.0, stage_wait_s=10.0)
# The broker's and the coordinator's boxes are cut off this long: twice the liveness
# timeout, so every agent misses its heartbeats and is taken for dead, as in a longer cut.
CUT_S = 2 * LIVENESS.timeout_s
# Tokens per request: enough that a fault lands while every request is generating
# (the first token comes in well under a second, the last ~2 s later); each token
# costs every test time, the reference's `generate` most.
TOKENS = 48
REQUESTS = 8
PROMPTS = ["The hydraulic press on line 3 reports a pressure drop. Likely causes are",
           "Summarise the lockout-tagout procedure for a conveyor motor:",
           "List three ways to reduce compressed-air leaks in a plant:",
           "Give two reasons a torque wrench reading may be wrong:"]
ANSWER_S = 90.0
# What a box may use: far more than the tiny model needs, until a memory test lowers it.
BOX_MB = 2048
MIB = 1 << 20
# The tiny Llama's heads made wide: 4 KV heads of 1024 put 96 KiB per position
# into the cache of a 3-layer stage, which grows it 64 positions (6 MiB) at a
# time per request, while its weights (~50 MB in all) and its forward passes
# stay tiny.
KV_HEADS, HEAD_DIM = 4, 1024
# A memory test lowers a stage box's limit to what it uses now plus this:
# room for a decode step's scratch.
SQUEEZE_MB = 8
# Tokens per request of a memory test. The limit is lowered while the first
# requests stream their first tokens (at 13-18 prompt positions, under 64):
# up to OOM_TOKENS every request then crosses 64, 128 and 192 (13 + 180 > 192),
# each growing its cache by 6 MiB on the squeezed stage, so its share of the
# batch (4 of the 8 requests, or all 8 when it is the stage's only node) adds
# 4 x 3 x 6 = 72 MiB after the squeeze, 9 times SQUEEZE_MB; still 6 times it on
# a CPU so fast that every request had crossed 64 before the squeeze landed.
# Here the stage died at its first crossing, near 64 positions; the tokens after
# that are the standby's to generate, and `generate`'s to repeat (its cost grows
# with their square), so no more of them than these margins need. With TOKENS,
# a request crosses 64 at most once, and not at all from a short prompt: on a
# Xeon the stage missed heartbeats (`unavailable` was answered) but lived on.
OOM_TOKENS = 180
# How long a stage over its limit may take to be killed: the kernel reclaims
# before it kills. The test needs the death, so it waits for it, this long at most.
OOM_DEATH_S = ANSWER_S


def fault_plant(model: Path) -> Plant:
    return Plant(
        plant_id="rehearse", topic_root=f"edgebus-test/{secrets.token_hex(4)}",
        broker=BrokerSettings(url=f"mqtt://{STANDBY}:1883"), model=model,
        boxes=[BoxSpec(name=name, memory_mb=BOX_MB)
               for name in (HEAD, TAIL, STANDBY)],
        stages=[StageSpec(node=HEAD, layers=(0, 3)), StageSpec(node=TAIL, layers=(3, 6)),
                StageSpec(node=STANDBY, layers=(3, 6))],
        coordinator=CoordinatorSpec(request_timeout_s=60.0), liveness=LIVENESS)


@pytest.fixture(scope="module")
def model(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with wide attention heads (KV_HEADS x HEAD_DIM)."""
    dest = tmp_path_factory.mktemp("wide-kv-llama")
    config = LlamaConfig(**{**configs()["llama"].to_dict(), "num_key_value_heads": KV_HEADS,
                            "num_attention_heads": KV_HEADS, "head_dim": HEAD_DIM})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(dest)  # type: ignore[no-untyped-call]
    for name in TOKENIZER_FILES:
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def rehearsal(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rehearsal]:
    workdir = tmp_path_factory.mktemp("rehearse")
    with Rehearsal(fault_plant(model), workdir,
                   Options(coordinator_box=HEAD, cpu_total=float(cores())),
                   progress=print) as running:
        running.start()
        # No CPU quotas: they are not what these tests are about. Four agents importing
        # torch on a fraction of a core each are slow to start, and a stage box left
        # alone in its stage (after its peer's death) would idle half the machine.
        for group in running.groups.values():
            group.set_cpu(None)
        yield running


# Max tokens -> prompt -> `generate`'s greedy tokens.
References = dict[int, dict[str, concurrent.futures.Future[list[int]]]]


@pytest.fixture(scope="module")
def references(model: Path) -> Iterator[References]:
    """`generate`'s answer to each prompt at each length the tests ask for, the first
    tests' length first, computed from the module's start on in a process of its own (a
    thread loading transformers beside the test's made the test's own imports fail), on
    one torch thread: beside four agents on 2 cores, two took 30 s for what one did in 6."""
    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn"),
            initializer=torch.set_num_threads, initargs=(1,)) as pool:
        futures = {tokens: {prompt: pool.submit(reference_tokens, model, GenerateRequest(
                                id="reference", prompt=prompt, max_tokens=tokens,
                                ignore_eos=True))
                            for prompt in PROMPTS}
                   for tokens in (TOKENS, OOM_TOKENS)}
        yield futures
        for future in (f for by_prompt in futures.values() for f in by_prompt.values()):
            future.cancel()


def batch(prefix: str, tokens: int = TOKENS) -> list[GenerateRequest]:
    return [GenerateRequest(id=f"{prefix}{i}", prompt=PROMPTS[i % len(PROMPTS)],
                            max_tokens=tokens, ignore_eos=True, stream=True)
            for i in range(REQUESTS)]


async def generating(rehearsal: Rehearsal, prefix: str, offline: tuple[str, ...] = (),
                     tokens: int = TOKENS) -> tuple[Client, list[GenerateRequest]]:
    """A client, every agent but `offline` online, and a batch sent and streaming (none
    answered yet)."""
    client = await Client(rehearsal.plant).__aenter__()
    agents = [s.node for s in rehearsal.plant.stages] + [rehearsal.plant.coordinator.id]
    await wait_online(rehearsal, client, timeout=120,
                      agents=[agent for agent in agents if agent not in offline])
    requests = batch(prefix, tokens)
    await client.send(requests)
    seen = client.observer
    # Requests that join a group later start later; half of them streaming is mid-generation.
    await seen.until(lambda: sum(r.id in seen.first_delta for r in requests) >= REQUESTS // 2,
                     ANSWER_S, "half the requests' first tokens")
    early = {r.id: seen.responses[r.id] for r in requests if r.id in seen.responses}
    assert not early, f"answered before the fault: {early}"
    return client, requests


async def assert_exact(references: References, client: Client,
                       requests: list[GenerateRequest]) -> None:
    for request in requests:
        expected = await asyncio.wrap_future(references[request.max_tokens][request.prompt])
        response = client.observer.responses[request.id]
        assert response.error is None, (request.id, response.error)
        assert response.tokens == expected, request.id


async def back_online(rehearsal: Rehearsal, client: Client) -> None:
    """Every stage has published a status since now: its link works again."""
    await fresh_statuses(client, [s.node for s in rehearsal.plant.stages], 60)


async def test_a_stage_box_cut_off_fails_over_to_its_standby(
        rehearsal: Rehearsal, references: References) -> None:
    client, requests = await generating(rehearsal, "stage-")
    try:
        rehearsal.set_link(TAIL, up=False)
        await client.until_answered(requests, ANSWER_S)
        await assert_exact(references, client, requests)
    finally:
        rehearsal.set_link(TAIL, up=True)
    await back_online(rehearsal, client)
    await client.__aexit__()


async def test_the_broker_box_cut_off_past_the_liveness_timeout_loses_no_request(
        rehearsal: Rehearsal, references: References) -> None:
    client, requests = await generating(rehearsal, "broker-")
    rehearsal.set_link(STANDBY, up=False)
    try:
        await asyncio.sleep(CUT_S)  # the fault's length, not a wait for anything
    finally:
        rehearsal.set_link(STANDBY, up=True)
    await client.until_answered(requests, ANSWER_S)
    await assert_exact(references, client, requests)
    await back_online(rehearsal, client)
    await client.__aexit__()


async def test_the_coordinator_box_cut_off_answers_every_request_once_back(
        rehearsal: Rehearsal, references: References) -> None:
    client, requests = await generating(rehearsal, "coordinator-")
    cut = time.monotonic()
    open_ = [r for r in requests if r.id not in client.observer.responses]
    rehearsal.set_link(HEAD, up=False)
    try:
        await asyncio.sleep(CUT_S)  # the fault's length, not a wait for anything
    finally:
        rehearsal.set_link(HEAD, up=True)
    await client.until_answered(requests, ANSWER_S)
    await assert_exact(references, client, requests)
    # Those open at the cut were answered after the cable was back: the cut did stall them.
    assert min(client.observer.done[r.id] for r in open_) > cut + CUT_S
    # Once each. The coordinator publishes its "offline" status after all its answers, on
    # one connection that the broker passes on in order: once that is in, so is any
    # second answer. It is started again for the tests that follow.
    coordinator = rehearsal.plant.coordinator.id
    rehearsal.stop_agent(coordinator)
    seen = client.observer
    await seen.until(lambda: seen.statuses[coordinator].state == "offline", 60,
                     "the coordinator's offline status")
    twice = {rid: n for rid, n in seen.answers.items() if n != 1}
    assert not twice, f"answered more than once: {twice}"
    rehearsal.start_agent(coordinator)
    await wait_online(rehearsal, client, agents=[coordinator], timeout=120)
    await back_online(rehearsal, client)
    await client.__aexit__()



def squeeze(rehearsal: Rehearsal, box: str) -> int:
    """Lower `box`'s memory limit to its use plus SQUEEZE_MB; its OOM kills so far."""
    group = rehearsal.groups[box]
    kills = group.oom_kills()
    group.set_memory(group.memory_bytes() + SQUEEZE_MB * MIB)
    return kills


def assert_oom_killed(rehearsal: Rehearsal, box: str, kills_before: int) -> None:
    """`box`'s stage was killed (SIGKILL) by the OOM killer of its own control group."""
    # Dead already: its requests were replayed, or failed, because it died.
    group = rehearsal.groups[box]
    try:
        code = rehearsal.procs[box].wait(OOM_DEATH_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{box} still runs {OOM_DEATH_S:.0f} s after its answers, at "
                             f"{group.memory_bytes() >> 20} MiB; OOM kills "
                             f"{group.oom_kills()}: {rehearsal.log_tail(box)}") from None
    assert code == -signal.SIGKILL, f"{box} exited with {code}: {rehearsal.log_tail(box)}"
    assert rehearsal.groups[box].oom_kills() > kills_before, f"{box} died, not by the OOM killer"
    rehearsal.groups[box].set_memory(BOX_MB * MIB)


async def test_a_stage_killed_by_its_memory_limit_fails_over_to_its_standby(
        rehearsal: Rehearsal, references: References) -> None:
    client, requests = await generating(rehearsal, "oom-", tokens=OOM_TOKENS)
    coordinator = rehearsal.plant.coordinator.id
    failovers = client.observer.metric(coordinator, "failovers")
    kills = squeeze(rehearsal, TAIL)
    await client.until_answered(requests, ANSWER_S)
    assert_oom_killed(rehearsal, TAIL, kills)
    await assert_exact(references, client, requests)
    await fresh_statuses(client, [coordinator], 10 * LIVENESS.heartbeat_s)
    assert client.observer.metric(coordinator, "failovers") > failovers, "nothing was replayed"
    await client.__aexit__()


async def test_a_stage_killed_by_its_memory_limit_with_no_standby_answers_unavailable(
        rehearsal: Rehearsal) -> None:
    # Stage 1 with one node, the standby: the test above killed the other (stopped here
    # when this test runs on its own).
    rehearsal.stop_agent(TAIL)
    client, requests = await generating(rehearsal, "alone-", offline=(TAIL,),
                                        tokens=OOM_TOKENS)
    kills = squeeze(rehearsal, STANDBY)
    await client.until_answered(requests, LIVENESS.stage_wait_s + ANSWER_S)
    assert_oom_killed(rehearsal, STANDBY, kills)
    for request in requests:
        error = client.observer.responses[request.id].error
        assert error is not None and error.code == "unavailable", (request.id, error)
        assert "stage 1" in error.message, error.message
    # The OOM killer took the stage, not Mosquitto, which shares its box.
    assert "broker" not in rehearsal.dead()
    await client.__aexit__()
