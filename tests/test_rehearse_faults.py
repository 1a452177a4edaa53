"""Pulled cables and out-of-memory kills, on boxes rehearsed as namespaces and control groups.

The plant runs as `edgebus rehearse` runs it: each box a network namespace on
a bridge with a CPU quota and a memory limit, every agent a real OS process
inside, Mosquitto on the box the plant's broker URL names. A cable pulled
(`ip link set ... down` on the box's end of the bridge) sends no FIN and no
RST: the connections stay half-open, as on a plant. A box whose memory limit
its stage's KV cache outgrows has that stage killed by the kernel's OOM
killer, as a box without swap would. Every request must be answered exactly
as the whole model answers it, or, where no node of a stage is left, with
`unavailable`.

Two rehearsals, one for each class of tests (each leaves every link up and every
agent it needs online, in the order written). The cables are cut on llama.cpp
stages of the tiny Llama GGUF: a cut is a matter of liveness and replay, not of
the engine, and such an agent starts in a fraction of a torch agent's CPU; their
answers are llama.cpp's for the GGUF whole. The memory limits squeeze torch
stages of a tiny wide-KV Llama, whose cache grows as requests generate (a
llama.cpp stage reserves its whole KV at start, so its memory never grows);
their answers are `generate`'s, computed beside the plant from the module's start
on: the cable tests' waits leave the CPU idle.
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
from gguf_models import with_kv_budget
from pipeline import plant_reference, reference_tokens
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

# Box names. Cable cuts: stage 0 and the coordinator; stage 1; stage 1's standby and the
# broker. Memory limits: the stage; its standby, the broker and the coordinator.
HEAD, TAIL, STANDBY = "box-a", "box-b", "box-c"
# A dead node is seen within a second; a stage with no live node is waited for far
# longer than the broker's box is cut off and its agents' connections take to carry
# again (TCP's retransmission backoff, up to about half the cut once more), so that
# outage fails no request.
CUT_LIVENESS = Liveness(heartbeat_s=0.25, timeout_s=1.0, stage_wait_s=10.0)
# The broker's and the coordinator's boxes are cut off this long: twice the liveness
# timeout, so every agent misses its heartbeats and is taken for dead, as in a longer cut.
CUT_S = 2 * CUT_LIVENESS.timeout_s
# The memory tests' plant has no cable cut to outlast: the test without a standby
# waits all of stage_wait_s before its requests are answered `unavailable`.
OOM_LIVENESS = Liveness(heartbeat_s=0.5, timeout_s=2.0, stage_wait_s=2.0)
# Tokens per request of a cable cut: enough that the cut lands while every request
# is generating (the tests check that none was answered before it).
TOKENS = 48
REQUESTS = 8
PROMPTS = ["The hydraulic press on line 3 reports a pressure drop. Likely causes are",
           "Summarise the lockout-tagout procedure for a conveyor motor:",
           "List three ways to reduce compressed-air leaks in a plant:",
           "Give two reasons a torque wrench reading may be wrong:"]
ANSWER_S = 90.0
# What a box may use: far more than the tiny models need, until a memory test lowers it.
BOX_MB = 2048
MIB = 1 << 20
# The tiny Llama's heads made wide: 4 KV heads of 1024 put 192 KiB per position
# into the cache of a stage of all 6 layers, which grows it 64 positions (12 MiB) at
# a time per request, while its weights (~50 MB in all) and its forward passes
# stay tiny.
KV_HEADS, HEAD_DIM = 4, 1024
# A memory test lowers a stage box's limit to what it uses now plus this:
# room for a decode step's scratch.
SQUEEZE_MB = 8
# Tokens per request of a memory test. The limit is lowered while the first
# requests stream their first tokens (at 13-18 prompt positions, under 64):
# up to OOM_TOKENS every request then crosses 64 and 128 (13 + 120 > 128), each
# growing its cache by 12 MiB on the squeezed stage, so its share of the batch
# (4 of the 8 requests, or all 8 when it is the stage's only node) adds
# 4 x 2 x 12 = 96 MiB after the squeeze, 12 times SQUEEZE_MB; still 6 times it on
# a CPU so fast that every request had crossed 64 before the squeeze landed.
# Here the stage died at its first crossing, near 64 positions; the tokens after
# that are the standby's to generate, and `generate`'s to repeat (its cost grows
# with their square), so no more of them than these margins need. With fewer, a
# request crosses 64 at most once, and not at all from a short prompt: on a Xeon
# the stage missed heartbeats (`unavailable` was answered) but lived on.
OOM_TOKENS = 120
# How long a stage over its limit may take to be killed: the kernel reclaims
# before it kills. The test needs the death, so it waits for it, this long at most.
OOM_DEATH_S = ANSWER_S


def cut_plant(model: Path) -> Plant:
    return with_kv_budget(Plant(
        plant_id="rehearse", topic_root=f"edgebus-test/{secrets.token_hex(4)}",
        broker=BrokerSettings(url=f"mqtt://{STANDBY}:1883"), model=model,
        boxes=[BoxSpec(name=name, memory_mb=BOX_MB) for name in (HEAD, TAIL, STANDBY)],
        stages=[StageSpec(node=HEAD, layers=(0, 3), weights="gguf"),
                StageSpec(node=TAIL, layers=(3, 6), weights="gguf"),
                StageSpec(node=STANDBY, layers=(3, 6), weights="gguf")],
        coordinator=CoordinatorSpec(request_timeout_s=60.0), liveness=CUT_LIVENESS))


def oom_plant(model: Path) -> Plant:
    """One stage of every layer on two nodes: the whole cache of a request on each."""
    return Plant(
        plant_id="rehearse", topic_root=f"edgebus-test/{secrets.token_hex(4)}",
        broker=BrokerSettings(url=f"mqtt://{STANDBY}:1883"), model=model,
        boxes=[BoxSpec(name=name, memory_mb=BOX_MB) for name in (TAIL, STANDBY)],
        stages=[StageSpec(node=TAIL, layers=(0, 6)), StageSpec(node=STANDBY, layers=(0, 6))],
        coordinator=CoordinatorSpec(request_timeout_s=60.0), liveness=OOM_LIVENESS)


@pytest.fixture(scope="module")
def wide_kv_llama(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
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


def rehearsing(plant: Plant, workdir: Path, coordinator_box: str) -> Iterator[Rehearsal]:
    with Rehearsal(plant, workdir, Options(coordinator_box=coordinator_box,
                                           cpu_total=float(cores())),
                   progress=print) as running:
        running.start()
        # No CPU quotas: they are not what these tests are about. Agents starting on a
        # fraction of a core each are slow to start, and a stage box left alone in its
        # stage (after its peer's death) would idle half the machine.
        for group in running.groups.values():
            group.set_cpu(None)
        yield running


# Prompt -> its greedy tokens at the length the tests ask for.
Answers = dict[str, list[int]]


@pytest.fixture(scope="module")
def whole_answers(tiny_llama_gguf: Path) -> Answers:
    """llama.cpp's answer for the GGUF whole to each prompt at TOKENS (its prompt in the
    plant's chunks), computed before anything else runs: its two threads spin-wait for
    each other, and beside the `generate` process and the agents on 2 cores a token cost
    7 times its own time."""
    plant = cut_plant(tiny_llama_gguf)
    return {prompt: plant_reference(plant, GenerateRequest(
                id="reference", prompt=prompt, max_tokens=TOKENS, ignore_eos=True))
            for prompt in PROMPTS}


@pytest.fixture(scope="module")
def generated(wide_kv_llama: Path) -> Iterator[dict[str, concurrent.futures.Future[list[int]]]]:
    """`generate`'s answer to each prompt at OOM_TOKENS, computed in a process of its own
    (a thread loading transformers beside the test's made the test's own imports fail), on
    one torch thread: beside the agents on 2 cores, two took 30 s for what one did in 6.
    The cable tests start it (TestCableCuts.rehearsal): their waits leave the CPU idle."""
    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn"),
            initializer=torch.set_num_threads, initargs=(1,)) as pool:
        futures = {prompt: pool.submit(reference_tokens, wide_kv_llama, GenerateRequest(
                       id="reference", prompt=prompt, max_tokens=OOM_TOKENS, ignore_eos=True))
                   for prompt in PROMPTS}
        yield futures
        for future in futures.values():
            future.cancel()


def batch(prefix: str, tokens: int) -> list[GenerateRequest]:
    return [GenerateRequest(id=f"{prefix}{i}", prompt=PROMPTS[i % len(PROMPTS)],
                            max_tokens=tokens, ignore_eos=True, stream=True)
            for i in range(REQUESTS)]


async def generating(rehearsal: Rehearsal, prefix: str, tokens: int,
                     offline: tuple[str, ...] = ()) -> tuple[Client, list[GenerateRequest]]:
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


def assert_exact(expected: Answers, client: Client, requests: list[GenerateRequest]) -> None:
    for request in requests:
        response = client.observer.responses[request.id]
        assert response.error is None, (request.id, response.error)
        assert response.tokens == expected[str(request.prompt)], request.id


async def back_online(rehearsal: Rehearsal, client: Client) -> None:
    """Every stage has published a status since now: its link works again."""
    await fresh_statuses(client, [s.node for s in rehearsal.plant.stages], 60)


async def failovers(rehearsal: Rehearsal, client: Client) -> float:
    """The coordinator's count of replayed requests, as of a status published since now."""
    coordinator = rehearsal.plant.coordinator.id
    await fresh_statuses(client, [coordinator], 60)
    return client.observer.metric(coordinator, "failovers")


async def cut_off(rehearsal: Rehearsal, box: str) -> None:
    """`box`'s cable out for CUT_S, then back in."""
    rehearsal.set_link(box, up=False)
    try:
        await asyncio.sleep(CUT_S)  # the fault's length, not a wait for anything
    finally:
        rehearsal.set_link(box, up=True)


class TestCableCuts:
    """llama.cpp stages: the answers are llama.cpp's for the GGUF whole."""

    @pytest.fixture(scope="class")
    def rehearsal(self, tiny_llama_gguf: Path, whole_answers: Answers,
                  generated: dict[str, concurrent.futures.Future[list[int]]],
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rehearsal]:
        yield from rehearsing(cut_plant(tiny_llama_gguf), tmp_path_factory.mktemp("cuts"), HEAD)

    async def test_a_stage_box_cut_off_fails_over_to_its_standby(
            self, rehearsal: Rehearsal, whole_answers: Answers) -> None:
        client, requests = await generating(rehearsal, "stage-", TOKENS)
        replayed = client.observer.metric(rehearsal.plant.coordinator.id, "failovers")
        rehearsal.set_link(TAIL, up=False)
        try:
            await client.until_answered(requests, ANSWER_S)
        finally:
            # Back as soon as the replays are answered: the longer a cut, the longer TCP's
            # retransmission backoff keeps the stage's connection silent once it is over.
            rehearsal.set_link(TAIL, up=True)
        assert_exact(whole_answers, client, requests)
        # The cut stage's requests were replayed on its standby, not waited out.
        assert await failovers(rehearsal, client) > replayed, "nothing was replayed"
        await back_online(rehearsal, client)
        await client.__aexit__()

    async def test_the_broker_box_cut_off_past_the_liveness_timeout_loses_no_request(
            self, rehearsal: Rehearsal, whole_answers: Answers) -> None:
        client, requests = await generating(rehearsal, "broker-", TOKENS)
        await cut_off(rehearsal, STANDBY)
        await client.until_answered(requests, ANSWER_S)
        assert_exact(whole_answers, client, requests)
        await back_online(rehearsal, client)
        await client.__aexit__()

    async def test_the_coordinator_box_cut_off_answers_every_request_once_back(
            self, rehearsal: Rehearsal, whole_answers: Answers) -> None:
        # The class's last test: it leaves the coordinator stopped.
        client, requests = await generating(rehearsal, "coordinator-", TOKENS)
        cut = time.monotonic()
        open_ = [r for r in requests if r.id not in client.observer.responses]
        await cut_off(rehearsal, HEAD)
        await client.until_answered(requests, ANSWER_S)
        assert_exact(whole_answers, client, requests)
        # Those open at the cut were answered after the cable was back: the cut did stall them.
        assert min(client.observer.done[r.id] for r in open_) > cut + CUT_S
        # Once each. The coordinator publishes its "offline" status after all its answers, on
        # one connection that the broker passes on in order: once that is in, so is any
        # second answer.
        coordinator = rehearsal.plant.coordinator.id
        rehearsal.stop_agent(coordinator)
        seen = client.observer
        await seen.until(lambda: seen.statuses[coordinator].state == "offline", 60,
                         "the coordinator's offline status")
        twice = {rid: n for rid, n in seen.answers.items() if n != 1}
        assert not twice, f"answered more than once: {twice}"
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


class TestMemoryLimits:
    """torch stages of the wide-KV Llama: the answers are `generate`'s. The first test
    kills the stage's first node, the second its standby."""

    @pytest.fixture(scope="class")
    def rehearsal(self, wide_kv_llama: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rehearsal]:
        yield from rehearsing(oom_plant(wide_kv_llama), tmp_path_factory.mktemp("oom"),
                              STANDBY)

    async def test_a_stage_killed_by_its_memory_limit_fails_over_to_its_standby(
            self, rehearsal: Rehearsal,
            generated: dict[str, concurrent.futures.Future[list[int]]]) -> None:
        client, requests = await generating(rehearsal, "oom-", OOM_TOKENS)
        replayed = client.observer.metric(rehearsal.plant.coordinator.id, "failovers")
        kills = squeeze(rehearsal, TAIL)
        await client.until_answered(requests, ANSWER_S)
        assert_oom_killed(rehearsal, TAIL, kills)
        assert_exact({prompt: await asyncio.wrap_future(future)
                      for prompt, future in generated.items()}, client, requests)
        assert await failovers(rehearsal, client) > replayed, "nothing was replayed"
        await client.__aexit__()

    async def test_a_stage_killed_by_its_memory_limit_with_no_standby_answers_unavailable(
            self, rehearsal: Rehearsal) -> None:
        # The stage with one node, the standby: the test above killed the other (stopped
        # here when this test runs on its own).
        rehearsal.stop_agent(TAIL)
        client, requests = await generating(rehearsal, "alone-", OOM_TOKENS, offline=(TAIL,))
        kills = squeeze(rehearsal, STANDBY)
        await client.until_answered(requests, OOM_LIVENESS.stage_wait_s + ANSWER_S)
        assert_oom_killed(rehearsal, STANDBY, kills)
        for request in requests:
            error = client.observer.responses[request.id].error
            assert error is not None and error.code == "unavailable", (request.id, error)
            assert "stage 0" in error.message, error.message
        # The OOM killer took the stage, not Mosquitto nor the coordinator, which share its box.
        assert not {"broker", rehearsal.plant.coordinator.id} & set(rehearsal.dead())
        await client.__aexit__()
