"""Pipelined speculation: drafts ride ahead of a lone request's token and change nothing.

The bar (node_agent/speculation.py): with drafts on, a llama.cpp plant answers
greedy requests token for token as llama.cpp whole does, through 1, 2 and 3
stages, on every repeat; seeded sampled requests give the same tokens as with
drafts off; and no rolled-back or cancelled position stays in any stage's KV.
Drafts are taken (the speedup) and some are rejected (the rollback); each test
asserts that both happened, so it cannot pass on a plant that never drafted.

Exactness under drafts is a property of the code path (a draft's frame, a
rollback's truncation, a superseded frame dropped), so the plants run a tiny
random Llama whose weights make its answers repeat phrases of their own
(`drafting_llama`): prompt lookup then drafts as it does on a real answer that
quotes its input, some drafts taken, some not. The speedup on real text is the
bench's (`edgebus bench`), not a test's.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from signal import SIGKILL

import aiomqtt
import gguf
import numpy as np
import pytest
from brokers import BrokerHandle, MosquittoBroker
from gguf_models import requantize
from pipeline import ask_all, plant_for, plant_reference, prompt_ids, running
from plant_gateway import assert_exact, gateway, mid_generation, send
from test_pipeline import TINY_SPLITS
from tiny_models import historyless_tokens

from edgebus.ask import ask
from edgebus.core import frames
from edgebus.core.frames import Frame, Header, Kind
from edgebus.core.messages import ChatMessage, GenerateRequest, GenerateResponse
from edgebus.core.paths import GGUF_FILE
from edgebus.launcher import PlantProcesses
from node_agent.engines import ContextShape, load_engine
from node_agent.ngram_cache import NgramCache
from node_agent.speculation import JUDGE_DRAFTS, PAUSE_TOKENS, Draft, Drafts
from node_agent.stage import StageAgent
from plant_config import (
    BrokerSettings,
    CoordinatorSpec,
    Liveness,
    Plant,
    StageSpec,
    make_plant,
    write_plant,
)
from plant_config.schema import Speculation

SPLITS = TINY_SPLITS
# Its logits are nearly flat (small weights): at this temperature a seeded sampled answer
# still departs from the greedy one on most tokens (the draws decide), while its repeats
# keep drafts being taken.
SAMPLING_TEMPERATURE = 0.05
LIMITS = {"max_prompt_tokens": 256, "max_tokens_limit": 64}
KV_BUDGET_MB = 64
# The stages of a plant in the test process share its cores: one thread each
# (pipeline.plant_for).
STAGE_THREADS = 1
DRAFTS = Speculation(drafts=3)
ALARM = ("ALARM 4711 press line 2: hydraulic oil temperature 71 C above limit 65 C, "
         "pump P2 stopped at 14:02, operator acknowledged at 14:05.")
CODE = "def total(items):\n    s = 0\n    for x in items:\n        s = s + x\n    return s\n"


def quoting() -> list[GenerateRequest]:
    """Requests whose answers quote their prompts: an alarm to repeat, code to edit."""
    ask_ = [f"Repeat this alarm text word for word: {ALARM}",
            f"Rename the variable s to acc in this code and show all of it:\n{CODE}",
            f"Summarise this alarm, quoting its numbers: {ALARM}"]
    return [GenerateRequest(id=f"quote-{i}", max_tokens=48,
                            messages=[ChatMessage(role="user", content=text)])
            for i, text in enumerate(ask_)]


def _drafted(responses: list[GenerateResponse]) -> tuple[int, int]:
    """Drafts accepted and rejected over the answers."""
    usage = [r.speculation for r in responses]
    assert all(u is not None for u in usage)
    return (sum(u.accepted for u in usage if u is not None),
            sum(u.rejected for u in usage if u is not None))


def test_init_writes_the_drafts_into_the_plant_file(
        tmp_path: Path, tiny_llama_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from edgebus.cli import main
    from plant_config import load_plant

    path = tmp_path / "plant.yaml"
    main(["init", str(path), "--model", str(tiny_llama_gguf), "--stages", "2", "--drafts", "1",
          "--insecure"])
    assert load_plant(path).coordinator.speculation.drafts == 1
    with pytest.raises(SystemExit) as exited:
        main(["init", str(tmp_path / "other.yaml"), "--model", str(tiny_llama_gguf),
              "--drafts", "99", "--insecure"])
    assert exited.value.code == 2
    assert "--drafts 99: give 0 (off) to 16" in capsys.readouterr().err
    assert not (tmp_path / "other.yaml").exists()


# -- prompt lookup ----------------------------------------------------------------


def test_drafts_are_what_followed_the_last_tokens_earlier_in_the_text() -> None:
    drafts = Drafts(Speculation(drafts=3, min_ngram=2, max_ngram=3))
    text = [7, 1, 2, 3, 4, 5, 9, 8, 1, 2, 3]
    assert drafts.propose(text, room=10) == [4, 5, 9]  # after the 3-gram 1 2 3
    assert drafts.proposed == 3
    # No room left in the request's KV reservation: no draft.
    assert Drafts(Speculation(drafts=3)).propose(text, room=0) == []
    # The last tokens never came before: nothing to quote.
    assert Drafts(Speculation(drafts=3)).propose([1, 2, 3, 4, 5, 6], room=10) == []


def test_a_request_drafts_from_its_own_text_first_and_from_the_plants_where_that_has_none(
        ) -> None:
    cache = NgramCache(100, min_ngram=2, max_ngram=4)
    cache.add([1, 2, 3, 90, 91, 92])
    quoting = Drafts(Speculation(drafts=3), cache=cache)
    # Its own text quotes 2 3 earlier: prompt lookup, as without a cache.
    assert quoting.propose([2, 3, 5, 6, 1, 2, 3], room=10) == [5, 6, 1]
    assert (quoting.proposed, quoting.from_cache) == (3, 0)
    # Its own text has no earlier 2 3: the plant's.
    fresh = Drafts(Speculation(drafts=3), cache=cache)
    assert fresh.propose([7, 8, 1, 2, 3], room=10) == [90, 91, 92]
    assert (fresh.proposed, fresh.from_cache) == (3, 3)
    assert Drafts(Speculation(drafts=3)).propose([7, 8, 1, 2, 3], room=10) == []


def test_the_window_grows_with_taken_drafts_and_halves_with_a_miss() -> None:
    drafts = Drafts(Speculation(drafts=4))
    drafts.window = 2
    drafts.ahead = [Draft(10, 5), Draft(11, 6)]
    assert drafts.settle(5) == Draft(10, 5)  # taken: its frame is already on its way
    assert drafts.window == 3
    assert drafts.settle(7) is None  # missed: the rest is rolled back
    assert (drafts.window, drafts.ahead, drafts.accepted, drafts.rejected) == (1, [], 1, 1)


def test_drafting_pauses_where_drafts_keep_missing() -> None:
    drafts = Drafts(Speculation(drafts=2))
    text = [1, 2, 3, 1, 2]
    for _ in range(JUDGE_DRAFTS):
        assert drafts.propose(text, room=100)
        drafts.ahead = [Draft(0, 3)]
        drafts.settle(99)
    assert drafts.propose(text, room=100) == []
    longer = text + [1, 2] * (PAUSE_TOKENS // 2)
    assert drafts.propose(longer, room=100)  # probes again once the text has moved on


def _taken(drafts: Drafts, taken: int, missed: int) -> Drafts:
    """`drafts` after `taken` drafts were taken and `missed` were not."""
    for draft in range(taken + missed):
        drafts.ahead = [Draft(draft, 5)]
        drafts.settle(5 if draft < taken else 6)
    return drafts


def test_a_frame_carries_the_positions_that_bring_most_tokens_for_their_cost() -> None:
    """Positions per frame: the window over a frame per stage, at most what every stage
    verifies in one call, then as many as pay for what the stages measured them to cost
    at the acceptance seen lately."""
    cheap = (1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7)
    drafts = _taken(Drafts(Speculation(drafts=16)), taken=JUDGE_DRAFTS, missed=0)
    drafts.window = 16
    assert drafts.positions_per_frame(2, cheap) == 8
    assert drafts.positions_per_frame(4, cheap) == 4  # a frame for every stage
    assert drafts.positions_per_frame(2, cheap[:3]) == 3  # what every stage verifies
    # k positions costing k steps: no frame of several pays, whatever is taken.
    assert drafts.positions_per_frame(2, (1.0, 2.0, 3.0, 4.0)) == 1
    # SmolLM2's stages on the Intel Xeon VM (docs/row-exactness.md): 4 positions 2.0x one.
    smollm2 = (1.0, 1.45, 1.75, 2.0)
    assert drafts.positions_per_frame(1, smollm2) == 4
    rarely = _taken(Drafts(Speculation(drafts=16)), taken=4, missed=12)
    rarely.window = 16
    assert rarely.positions_per_frame(1, smollm2) == 1
    pinned = Drafts(Speculation(drafts=16, positions_per_frame=3))
    pinned.window = 16
    assert pinned.positions_per_frame(1, (1.0, 2.0, 3.0, 4.0)) == 3
    assert pinned.positions_per_frame(1, (1.0, 2.0)) == 2  # never past exact_rows


# -- rollback in the engine ------------------------------------------------------


@pytest.mark.parametrize("layers", [(0, 3), (0, 6)], ids=["first-stage", "whole"])
def test_a_rolled_back_position_is_computed_bitwise_as_the_first_time(
        tiny_llama_gguf: Path, layers: tuple[int, int]) -> None:
    """Positions computed, dropped and computed again with other tokens give what a
    sequence fed those tokens from the start gives, bit for bit."""
    shape = ContextShape(kv_budget_bytes=16 * 2**20, positions=256, batch_positions=64)
    engine = load_engine(tiny_llama_gguf, *layers, engine="llamacpp", weights="gguf",
                         shape=shape)
    try:
        prompt = np.array([[1, 504, 3570, 314, 253, 1789, 28, 504]])
        drafted, kept = [700, 701, 702], [700, 42, 43]
        rolled, straight = engine.new_cache(0), engine.new_cache(0)
        for cache in (rolled, straight):
            engine.run([prompt], [cache], [0])
        start = prompt.shape[1]
        for i, token in enumerate(drafted):
            engine.run([np.array([[token]])], [rolled], [start + i])
        engine.truncate(rolled, start + 1)
        assert rolled.get_seq_length() == start + 1
        # llama.cpp itself holds nothing past the kept positions.
        lowlevel = engine._llama  # type: ignore[attr-defined]
        assert lowlevel.llama_memory_seq_pos_max(engine._memory, rolled.seq_id) == start
        assert rolled.nbytes == (start + 1) * engine.kv_bytes_per_token()
        again = [engine.run([np.array([[t]])], [rolled], [start + i])[0]
                 for i, t in enumerate(kept) if i >= 1]
        engine.run([np.array([[kept[0]]])], [straight], [start])
        fresh = [engine.run([np.array([[t]])], [straight], [start + i])[0]
                 for i, t in enumerate(kept) if i >= 1]
        for a, b in zip(again, fresh, strict=True):
            assert a is not None and b is not None
            assert np.array_equal(a, b)
        engine.free_cache(rolled)
        engine.free_cache(straight)
    finally:
        engine.close()


# -- the stage's side: rollback and early cancellation ---------------------------


def _stage_plant(model: Path) -> Plant:
    return Plant(plant_id="spec", topic_root=f"edgebus-test/{secrets.token_hex(4)}",
                 broker=BrokerSettings(url="mqtt://127.0.0.1:1"), model=model,
                 stages=[StageSpec(node="stage-0", layers=(0, 3), weights="gguf",
                                   kv_budget_mb=8),
                         StageSpec(node="stage-1", layers=(3, 6), weights="gguf",
                                   kv_budget_mb=8)],
                 coordinator=CoordinatorSpec(max_prompt_tokens=64, max_tokens_limit=16))


def _tokens(request: int, step: int, start: int, ids: list[int], *, prefill: bool = False,
            rollback: bool = False) -> bytes:
    return frames.encode(Kind.TOKENS, np.array([ids]), Header(request, 1, step, (0, 0)),
                         start=start, prefill=prefill, rollback=rollback)


def _message(plant: Plant, payload: bytes) -> aiomqtt.Message:
    return aiomqtt.Message(plant.topics.activations("stage-0"), payload, 1, False, 1, None)


async def _run_inbox(agent: StageAgent) -> list[Frame]:
    """Compute every message waiting in the stage's inbox, in order; return its outputs."""
    out: list[Frame] = []
    while not agent.inbox.empty():
        batch = await agent._open(agent.inbox.get_nowait())
        sent, errors = agent._forward(batch)
        agent._done(batch)
        assert not errors, errors
        for message in sent.values():
            out += frames.decode_all(message, frames.SINGLE_FRAME)
    return out


async def test_a_stage_drops_rejected_drafts_and_never_computes_superseded_ones(
        tiny_llama_gguf: Path) -> None:
    plant = _stage_plant(tiny_llama_gguf)
    agent = StageAgent(plant, "stage-0")
    try:
        prompt = [5, 6, 7, 8]
        # Request 1: two drafts computed, then rejected: the rollback truncates.
        # Request 2: two drafts still queued when the rollback comes: never computed.
        for request in (1, 2):
            agent._on_message(_message(plant, _tokens(request, 0, 0, prompt, prefill=True)))
            agent._on_message(_message(plant, _tokens(request, 1, 4, [9])))
        await _run_inbox(agent)
        for request in (1, 2):
            for step, token in ((2, 20), (3, 21)):
                agent._on_message(_message(plant, _tokens(request, step, 4 + step - 1, [token])))
            if request == 1:
                drafts = await _run_inbox(agent)
                assert [f.start for f in drafts] == [5, 6]
            agent._on_message(_message(plant, _tokens(request, 4, 5, [30], rollback=True)))
        outputs = await _run_inbox(agent)
        assert [(f.request, f.start, f.rollback) for f in outputs] == [(1, 5, True),
                                                                       (2, 5, True)]
        assert agent.metrics["rollbacks"] == 1
        assert agent.metrics["cancelled_frames"] == 2
        assert agent.caches[1].get_seq_length() == agent.caches[2].get_seq_length() == 6
        # What a request fed 5 6 7 8 9 30 from the start computes at position 5.
        agent._on_message(_message(plant, _tokens(3, 0, 0, prompt, prefill=True)))
        agent._on_message(_message(plant, _tokens(3, 1, 4, [9])))
        agent._on_message(_message(plant, _tokens(3, 2, 5, [30])))
        straight = (await _run_inbox(agent))[-1]
        for rolled in outputs:
            assert np.array_equal(rolled.array(), straight.array())
        # A duplicate of a draft a rollback replaced is not computed either.
        agent._on_message(_message(plant, _tokens(1, 3, 6, [21])))
        assert await _run_inbox(agent) == []
    finally:
        agent.model.close()


@pytest.mark.parametrize("qtype", ["Q4_1", "F16"])
async def test_a_stage_verifies_a_token_and_its_drafts_as_one_position_steps(
        tiny_llama_in: Callable[[str], Path], qtype: str) -> None:
    """A decode frame of a token and three drafts computes what four one-position frames
    do, bit for bit: in one call where the stage's rows stay exact (its engine's
    `exact_rows`, measured at load on this CPU; on x86, Q4_1 up to 8 and F16 only 1), else
    a call a position, which its status counts (`verify_split`)."""
    plant = _stage_plant(tiny_llama_in(qtype))
    agent = StageAgent(plant, "stage-0")
    try:
        prompt, ids = [5, 6, 7, 8], [9, 20, 21, 22]
        for request in (1, 2):
            agent._on_message(_message(plant, _tokens(request, 0, 0, prompt, prefill=True)))
        await _run_inbox(agent)
        agent._on_message(_message(plant, _tokens(1, 1, 4, ids)))
        verified = await _run_inbox(agent)
        for step, token in enumerate(ids):
            agent._on_message(_message(plant, _tokens(2, 1 + step, 4 + step, [token])))
        stepped = await _run_inbox(agent)
        assert [(f.start, f.count) for f in verified] == [(4, len(ids))]
        assert np.array_equal(verified[0].array(),
                              np.concatenate([f.array() for f in stepped], axis=1))
        rows = agent.model.describe()["exact_rows"]
        metrics = agent._metrics()
        assert (metrics["verify_frames"], metrics["verify_positions"]) == (1, len(ids))
        assert metrics["verify_split"] == (len(ids) > int(rows))
    finally:
        agent.model.close()


# -- plants ------------------------------------------------------------------------


def _plant(model: Path, broker: BrokerHandle, split: list[tuple[int, int]],
           speculation: Speculation) -> Plant:
    return plant_for(model, broker, split, weights="gguf", kv_budget_mb=KV_BUDGET_MB,
                     threads=STAGE_THREADS, speculation=speculation, **LIMITS)


@pytest.mark.parametrize("split", SPLITS.values(), ids=SPLITS.keys())
async def test_drafts_change_no_token_through_any_split(
        drafting_llama: Path, amqtt_broker: BrokerHandle, split: list[tuple[int, int]]) -> None:
    plant = _plant(drafting_llama, amqtt_broker, split, DRAFTS)
    reqs = quoting()
    async with running(plant) as stages:
        runs = []
        for _ in range(2):  # the same answers on every repeat
            runs.append([await ask(plant, r, client_id="gw") for r in reqs])
        for stage in stages:  # rolled-back and cancelled drafts leave no KV behind
            await _until(lambda s=stage: not s.caches and s._metrics()["kv_bytes"] == 0)
        rollbacks = sum(s.metrics["rollbacks"] + s.metrics["cancelled_frames"] for s in stages)
    for responses in runs:
        for request, response in zip(reqs, responses, strict=True):
            assert response.error is None, response.error
            assert response.tokens == plant_reference(plant, request), request.id
    assert [r.tokens for r in runs[0]] == [r.tokens for r in runs[1]]
    accepted, rejected = _drafted(runs[0])
    assert accepted > 0 and rejected > 0, (accepted, rejected)
    assert rollbacks > 0


async def test_a_token_and_its_drafts_leave_as_one_frame_where_stages_verify_rows(
        drafting_llama: Path, amqtt_broker: BrokerHandle, tmp_path: Path) -> None:
    """With every stage verifying several positions in one call (Q4_1, on a CPU where its
    rows stay exact), the token and the drafts behind it leave as frames of several
    positions, and the answers are still llama.cpp's, token for token. Where a stage's rows
    do not stay exact (`exact_rows` 1), no such frame leaves at all. The count is pinned:
    chosen from costs timed at load, it would depend on what else the box runs."""
    model = requantize(drafting_llama / GGUF_FILE, tmp_path / "drafting-Q4_1.gguf",
                       gguf.GGMLQuantizationType.Q4_1)
    plant = _plant(model, amqtt_broker, SPLITS["2-stages"],
                   Speculation(drafts=4, positions_per_frame=4))
    reqs = quoting()
    async with running(plant) as stages:
        responses = [await ask(plant, r, client_id="gw") for r in reqs]
        rows = min(s.model.exact_rows for s in stages)
        verified = sum(s.metrics["verify_frames"] for s in stages)
        split = sum(s.metrics["verify_split"] for s in stages)
    for request, response in zip(reqs, responses, strict=True):
        assert response.error is None, response.error
        assert response.tokens == plant_reference(plant, request), request.id
    accepted, rejected = _drafted(responses)
    assert accepted > 0 and rejected > 0, (accepted, rejected)
    assert (verified > 0) == (rows > 1) and split == 0, (rows, verified, split)


async def test_torch_stages_roll_back_drafts_exactly_too(
        drafting_llama: Path, amqtt_broker: BrokerHandle) -> None:
    """A torch stage's KVCache truncates as llama.cpp's sequence does: held to transformers'
    `generate` on the fp32 checkpoint."""
    plant = plant_for(drafting_llama, amqtt_broker, SPLITS["2-stages"], speculation=DRAFTS,
                      **LIMITS)
    reqs = quoting()[:2]
    async with running(plant) as stages:
        responses = [await ask(plant, r, client_id="gw") for r in reqs]
        rollbacks = sum(s.metrics["rollbacks"] + s.metrics["cancelled_frames"] for s in stages)
    for request, response in zip(reqs, responses, strict=True):
        assert response.error is None, response.error
        assert response.tokens == plant_reference(plant, request), request.id
    accepted, rejected = _drafted(responses)
    assert accepted > 0 and rejected > 0 and rollbacks > 0
    # The answers depend on their history: a rollback that left a wrong position in the
    # KV cache would change them.
    assert any(r.tokens != historyless_tokens(drafting_llama, prompt_ids(drafting_llama, q),
                                              q.max_tokens)
               for q, r in zip(reqs, responses, strict=True))


async def test_requests_in_flight_together_draft_exactly(
        drafting_llama: Path, amqtt_broker: BrokerHandle) -> None:
    plant = _plant(drafting_llama, amqtt_broker, SPLITS["3-stages-uneven"],
                   Speculation(drafts=2, max_in_flight=3))
    reqs = quoting()
    async with running(plant):
        responses = await ask_all(plant, reqs)
    for request, response in zip(reqs, responses, strict=True):
        assert response.error is None, response.error
        assert response.tokens == plant_reference(plant, request), request.id
    accepted, _ = _drafted(responses)
    assert accepted > 0


async def test_a_request_asked_again_drafts_from_the_plants_recent_answers_exactly(
        drafting_llama: Path, amqtt_broker: BrokerHandle) -> None:
    """The coordinator keeps the n-grams of every finished request's prompt and answer
    (node_agent/ngram_cache.py): the same request asked again drafts from them where its
    own text has no match, and its tokens are still llama.cpp's."""
    plant = _plant(drafting_llama, amqtt_broker, SPLITS["2-stages"], DRAFTS)
    request = GenerateRequest(id="first", max_tokens=48, messages=[
        ChatMessage(role="user", content="Status of press line 2?")])
    async with running(plant):
        first = await ask(plant, request, client_id="gw")
        # Another id: the same one would be answered from the coordinator's answers.
        second = await ask(plant, request.model_copy(update={"id": "second"}),
                           client_id="gw")
    for response in (first, second):
        assert response.error is None, response.error
        assert response.tokens == plant_reference(plant, request)
    assert first.speculation is not None and second.speculation is not None
    assert first.speculation.from_cache == 0  # a new coordinator's cache is empty
    assert second.speculation.from_cache > 0, second.speculation
    assert second.speculation.accepted > first.speculation.accepted, (first, second)


async def test_seeded_sampling_draws_the_same_tokens_with_drafts_on(
        drafting_llama: Path, amqtt_broker: BrokerHandle) -> None:
    """A sampled token is drawn from the same logits with the same random draw, drafts or
    not, so a seed gives the same text: the target distribution, exactly."""
    reqs = [r.model_copy(update={"temperature": SAMPLING_TEMPERATURE, "seed": 1})
            for r in quoting()[:2]]
    answers = []
    for speculation in (Speculation(), DRAFTS):
        plant = _plant(drafting_llama, amqtt_broker, SPLITS["3-stages-uneven"], speculation)
        async with running(plant):
            answers.append([await ask(plant, r, client_id="gw") for r in reqs])
    off, on = answers
    assert all(r.speculation is None for r in off)
    assert [r.tokens for r in on] == [r.tokens for r in off]
    assert all(r.error is None for r in on)
    accepted, _ = _drafted(on)
    assert accepted > 0
    # The draws decide (plant_reference is the greedy answer): a plant that sampled
    # greedily would pass the above.
    assert [r.tokens for r in on] != [plant_reference(plant, r) for r in reqs]


async def test_a_stage_killed_while_drafts_are_in_flight_is_replayed_exactly(
        drafting_llama: Path, mosquitto_broker: MosquittoBroker, tmp_path: Path) -> None:
    """kill -9 of a stage node under `edgebus up`'s process manager while requests draft:
    their replays down the standby answer what llama.cpp whole answers."""
    plant = make_plant(drafting_llama, stages=2, broker=mosquitto_broker.url,
                       plant_id="spec-failover", replicas=2, weights="gguf")
    plant = plant.model_copy(update={
        "stages": [s.model_copy(update={"kv_budget_mb": KV_BUDGET_MB, "threads": STAGE_THREADS})
                   for s in plant.stages],
        "liveness": Liveness(heartbeat_s=0.5, timeout_s=2.0, stage_wait_s=10.0),
        "coordinator": plant.coordinator.model_copy(update={
            **LIMITS, "request_timeout_s": 30.0,
            "speculation": Speculation(drafts=2, max_in_flight=8)})})
    path = tmp_path / "plant.yaml"
    write_plant(plant, path)
    batch = [r.model_copy(update={"stream": True}) for r in quoting()]
    victim = plant.pipeline[1].node_ids[0]
    with PlantProcesses(path, log_dir=tmp_path / "logs") as processes:
        processes.start()
        await processes.wait_online(120.0)
        async with gateway(plant) as (gw, bus):
            await send(bus, plant, batch)
            await mid_generation(gw, batch, 4)
            os.kill(processes.pids[victim], SIGKILL)
            await gw.until(lambda: len(gw.responses) == len(batch), 120)
    assert [m for m in gw.messages("replaying") if victim in m]
    assert_exact(plant, gw, batch)
    accepted, _ = _drafted([gw.responses[r.id] for r in batch])
    assert accepted > 0


async def _until(condition: object, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.05)
