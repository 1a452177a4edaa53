"""The coordinator's journal: what a restarted coordinator finds, and what it does with it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from brokers import BrokerHandle
from pipeline import plant_for, running
from plant_gateway import gateway
from test_broker_security import secured_plant, start_secured

from edgebus.ask import ask
from edgebus.core.client import BusClient
from edgebus.core.errors import EdgebusError
from edgebus.core.messages import GenerateRequest, GenerateResponse
from edgebus.core.processes import LOOPBACK, free_port
from node_agent.cancel import cancel_all
from node_agent.journal import (
    MAX_BAD,
    Entry,
    Journal,
    JournalLock,
    default_directory,
    key_name,
)


def test_what_was_added_and_not_removed_is_what_the_next_run_finds(tmp_path: Path) -> None:
    directory = tmp_path / "plant" / "coordinator"
    journal = Journal(directory)
    assert journal.open() == []  # a first run: nothing, and no directory made for it
    kept = Entry("plc-1", "job-7", b'{"id": "job-7", "prompt": "x"}', "replies/7", b"\x00\xff")
    done = Entry("plc-1", "..", b'{"id": "..", "prompt": "y"}')  # an id that names no path
    journal.add(kept)
    journal.add(done)
    journal.remove("plc-1", "..")
    assert Journal(directory).open() == [kept]
    assert sorted(p.name for p in directory.iterdir()) == [key_name("plc-1", "job-7")]
    journal.remove("plc-1", "job-7")
    assert not (tmp_path / "plant").exists()  # an empty journal leaves nothing behind


def test_an_unreadable_entry_is_set_aside_not_fatal(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    good = Entry("plc", "a", b"{}")
    journal.add(good)
    (tmp_path / "0bad.json").write_text("{not json")
    (tmp_path / ".cut-short.tmp").write_text("{")  # a write a crash interrupted
    assert Journal(tmp_path).open() == [good]
    assert (tmp_path / "0bad.bad").exists() and not (tmp_path / ".cut-short.tmp").exists()


def test_an_entry_keeps_its_seed_and_unreadable_ones_are_bounded(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    sampled = Entry("plc", "s", b"{}", seed=2**63 - 1)
    journal.add(sampled)
    assert Journal(tmp_path).open() == [sampled]
    # Restart after restart on a disk that goes on losing blocks: the newest are kept.
    for run in range(MAX_BAD + 5):
        broken = tmp_path / f"{run:04d}.json"
        broken.write_text("{not json")
        os.utime(broken, ns=(run * 10**9, run * 10**9))
        Journal(tmp_path).open()
    kept = sorted(p.name for p in tmp_path.glob("*.bad"))
    assert kept == [f"{run:04d}.bad" for run in range(5, MAX_BAD + 5)]


async def test_a_resumed_entry_is_answered_once_and_a_sampled_one_draws_the_same_tokens(
        tiny_llama: Path, amqtt_broker: BrokerHandle, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEBUS_HOME", str(tmp_path))
    plant = plant_for(tiny_llama, amqtt_broker, [(0, 6)])
    journal = Journal(default_directory(plant.plant_id, plant.topic_root, plant.coordinator.id))
    # What a previous run left: a request for a task renamed since, one whose
    # id cannot even be read, and one that samples with no seed of its own.
    renamed = GenerateRequest.model_validate({"id": "renamed", "task": "old_name", "vars": {}})
    sampled = GenerateRequest(id="sampled", prompt="The press on line 3", max_tokens=16,
                              temperature=1.0, stream=True)
    journal.add(Entry("plc", "renamed", renamed.model_dump_json(exclude_none=True).encode()))
    journal.add(Entry("plc", "garbled", b"\x00not a request"))
    journal.add(Entry("plc", "sampled", sampled.model_dump_json(exclude_none=True).encode(),
                      seed=1234))
    async with gateway(plant) as (gw, _), running(plant):
        await gw.until(lambda: {"renamed", "sampled"} <= set(gw.responses), 120)
        await gw.until(journal.is_empty, 60)
        again = await ask(plant, sampled.model_copy(update={"id": "again", "seed": 1234}),
                          client_id="other")
    error = gw.responses["renamed"].error
    assert error is not None and error.code == "unknown_task", gw.responses["renamed"]
    # Answered, then gone from the journal: the next start finds nothing to refuse again.
    assert gw.answers["renamed"] == 1 and Journal(journal.directory).open() == []
    # The journaled seed, not a new one: the tokens the first run streamed come again.
    resumed = gw.responses["sampled"]
    assert resumed.error is None and again.error is None
    assert resumed.tokens == again.tokens and len(resumed.tokens) > 1


async def test_a_request_journaled_before_security_was_turned_on_is_answered_once(
        tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEBUS_HOME", str(tmp_path / "home"))
    plant = secured_plant(tmp_path, f"mqtt://{LOOPBACK}:{free_port(LOOPBACK)}",
                          model=tiny_llama)
    journal = Journal(default_directory(plant.plant_id, plant.topic_root, plant.coordinator.id))
    # Journaled without security, with a reply topic that security now refuses.
    elsewhere = GenerateRequest(id="before", prompt="p", max_tokens=2,
                                reply_to=f"{plant.topic_root}/llm/response/plc-2/x")
    journal.add(Entry("plc-1", "before", elsewhere.model_dump_json(exclude_none=True).encode()))
    broker = start_secured("mosquitto", plant, tmp_path)
    answers: list[GenerateResponse] = []
    gateway = BusClient(plant.endpoint_for("plc-1"), f"{plant.plant_id}.plc-1",
                        subscriptions=[(plant.topics.response_filter("plc-1"), 1)])
    runner = asyncio.create_task(gateway.run(
        lambda m: answers.append(GenerateResponse.model_validate_json(bytes(m.payload)))))
    try:
        await gateway.wait_connected(10)
        async with running(plant):
            for _ in range(600):  # the coordinator's start, on a busy machine: up to a minute
                if answers and journal.is_empty():
                    break
                await asyncio.sleep(0.1)
    finally:
        await cancel_all([runner])
        broker.stop()
    # On the gateway's own topic, once, and gone from the journal.
    assert [(a.id, a.error.code if a.error else None) for a in answers] == [("before", "reply_to")]
    assert Journal(journal.directory).open() == []


def test_a_second_holder_of_a_journal_is_told_both_ways_out(tmp_path: Path) -> None:
    """Another plant's coordinator with the default plant_id and topic_root takes the same
    journal: the refusal names those, not only coordinator.instances (a plant's standbys)."""
    first = JournalLock(tmp_path / "journal" / "plant-0123abcd" / "coordinator")
    first.acquire()
    try:
        with pytest.raises(EdgebusError, match=f"pid {os.getpid()}") as refused:
            JournalLock(first.directory).acquire()
    finally:
        first.release()
    assert "coordinator.instances" in str(refused.value)
    assert "a plant_id and a topic_root of its own" in str(refused.value)
