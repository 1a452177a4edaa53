"""`edgebus rehearse`'s sizing (each box's share of this machine, where the broker goes) and
the prediction it prints beside what it measures.

The rehearsal itself (namespaces, control groups, agents) is exercised by
tests/test_rehearse_faults.py.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import optional
import pytest

from edgebus.core.errors import EdgebusError
from edgebus.rehearse import Options, even_variant, netns, one_box_variant
from edgebus.rehearse.cgroups import DiskBytes
from edgebus.rehearse.rehearsal import Online
from edgebus.rehearse.report import Prediction, cycle_time, first_start_table, predict
from edgebus.rehearse.sizing import BoxShare, box_shares, broker_box, coordinator_box
from edgebus.rehearse.workload import ROWS_PER_GROUP
from plant_config import BrokerSettings, Plant, StageSpec
from plant_config.coordinator_section import Speculation
from plant_config.planner import (
    BATCH_ROWS,
    PREFILL_POSITIONS,
    MessageCost,
    ModelCosts,
    PartBytes,
    PartCost,
)
from plant_config.schema import BoxSpec, DiskSpec


def seed_plant(model: Path, url: str = "mqtt://jetson:1883") -> Plant:
    boxes = [BoxSpec(name="pi-1", memory_mb=6144, speed=1.0),
             BoxSpec(name="pi-2", memory_mb=6144, speed=1.0, link_mbit=20),
             BoxSpec(name="jetson", memory_mb=6144, speed=3.0)]
    return Plant(plant_id="p", topic_root="edgebus/p", broker=BrokerSettings(url=url),
                 model=model, boxes=boxes,
                 stages=[StageSpec(node="pi-1", layers=(0, 4)),
                         StageSpec(node="pi-2", layers=(4, 8)),
                         StageSpec(node="jetson", layers=(8, 30))])


def test_cpu_goes_by_speed_and_memory_by_memory_mb(tmp_path: Path) -> None:
    shares = {s.box: s for s in box_shares(seed_plant(tmp_path), cpu_total=1.5,
                                           memory_scale=0.25)}
    assert shares["pi-1"].cpu_cores == pytest.approx(0.3)
    assert shares["jetson"].cpu_cores == pytest.approx(0.9)
    assert shares["pi-1"].memory_bytes == 1536 << 20
    assert shares["pi-2"].link_mbit == 20 and shares["pi-1"].link_mbit is None


def test_more_cores_than_the_machine_has_is_refused(tmp_path: Path) -> None:
    with pytest.raises(EdgebusError, match="more than the"):
        box_shares(seed_plant(tmp_path), cpu_total=10_000)


def test_the_broker_runs_on_the_box_its_url_names(tmp_path: Path) -> None:
    plant = seed_plant(tmp_path)
    shares = box_shares(plant, cpu_total=1.0)
    assert broker_box(plant, shares) == "jetson"
    assert broker_box(plant, shares, "pi-1") == "pi-1"
    assert coordinator_box(shares, "jetson") == "jetson"
    # An address names no box: the fastest box takes it, as a plant would choose.
    assert broker_box(seed_plant(tmp_path, "mqtt://192.0.2.7:1883"), shares) == "jetson"
    with pytest.raises(EdgebusError, match="not a box of the plant"):
        broker_box(seed_plant(tmp_path, "mqtt://scada-server:1883"), shares)
    with pytest.raises(EdgebusError, match="--coordinator-box 'nas' is not a box"):
        coordinator_box(shares, "jetson", "nas")


def test_the_even_variant_keeps_boxes_and_splits_layers_evenly(tmp_path: Path) -> None:
    even = even_variant(seed_plant(tmp_path))
    assert [s.layers for s in even.stages] == [(0, 10), (10, 20), (20, 30)]
    assert [s.node for s in even.stages] == ["pi-1", "pi-2", "jetson"]


def test_the_one_box_variant_runs_every_layer_with_the_share_that_box_had(
        tmp_path: Path) -> None:
    plant = seed_plant(tmp_path)
    alone, options = one_box_variant(plant, "jetson", Options(cpu_total=1.5, memory_scale=0.5))
    assert [(s.node, s.layers) for s in alone.stages] == [("jetson", (0, 30))]
    [share] = box_shares(alone, cpu_total=options.cpu_total, memory_scale=options.memory_scale)
    assert share.cpu_cores == pytest.approx(0.9)  # as in the plant's rehearsal, not 1.5
    assert share.memory_bytes == 3072 << 20
    with pytest.raises(EdgebusError, match="'nas' is not a box of the plant"):
        one_box_variant(plant, "nas", Options())


def decode_only(plant: Plant, costs: ModelCosts, shares: list[BoxShare], requests: int,
                groups: int) -> Prediction:
    """The prediction with the broker and coordinator on the Jetson, for a test that reads
    its decode rate only (a one-token prompt and answer)."""
    return predict(plant, costs, shares, requests, groups, "jetson", "jetson",
                   prompt_tokens=1, tokens=1)


def made_up_costs(message: MessageCost | None) -> ModelCosts:
    """30 layers of 1 ms per step of 4 rows, 0.5 ms per row alone and 0.25 ms per prompt
    position past the first; a free embedding and head."""
    nothing = PartBytes(fp32=0, bf16=0, int8=0, int4=0)
    prefill = 0.5 + (PREFILL_POSITIONS - 1) * 0.25
    return ModelCosts(layers=(PartCost(prefill, 0.5, 1.0),) * 30,
                      embedding=PartCost(0.0, 0.0, 0.0),
                      head=PartCost(0.0, 0.0, 0.0), layer_bytes=(nothing,) * 30,
                      embedding_bytes=nothing, head_bytes=nothing, tied=False,
                      baseline_bytes=0, message=message)


def test_the_profile_times_the_batch_the_rehearsal_forms() -> None:
    assert ROWS_PER_GROUP == BATCH_ROWS


def test_the_prediction_counts_batch_steps_messages_and_each_boxs_cpu(tmp_path: Path) -> None:
    plant = seed_plant(tmp_path)  # 4 / 4 / 22 layers on 0.3 / 0.3 / 0.9 cores
    shares = box_shares(plant, cpu_total=1.5)
    message = MessageCost(agent_ms=0.6, broker_ms=0.09)
    one_group = decode_only(plant, made_up_costs(message), shares, 4, 1)
    # Batch steps on the shares: 4 / 0.3, 4 / 0.3, 22 / 0.9.
    assert one_group.step_ms == pytest.approx({"pi-1": 40 / 3, "pi-2": 40 / 3, "jetson": 220 / 9})
    # One group goes around alone: every step, every agent's message in and out (the Jetson
    # has its stage's and the coordinator's) and Mosquitto's four, each on its box's share.
    messages = 0.6 / 0.3 + 0.6 / 0.3 + (0.6 + 0.6 + 4 * 0.09) / 0.9
    assert one_group.tok_s == pytest.approx(4 * 1000 / (40 / 3 + 40 / 3 + 220 / 9 + messages))
    assert one_group.hop_ms == pytest.approx(messages / 4)
    # Three groups: faster than one, slower than the Jetson's CPU alone allows, and a hop
    # now also waits behind the other groups.
    three = decode_only(plant, made_up_costs(message), shares, 12, 3)
    jetson_ms = (22 + 0.6 + 0.6 + 4 * 0.09) / 0.9
    assert one_group.tok_s < three.tok_s <= 12 * 1000 / (3 * jetson_ms) * (1 + 1e-9)
    assert three.hop_ms > one_group.hop_ms
    # Without a measured message cost only the forward passes are predicted, and said to be.
    unprofiled = decode_only(plant, made_up_costs(None), shares, 4, 1)
    assert not unprofiled.hops_profiled and one_group.hops_profiled
    assert unprofiled.tok_s == pytest.approx(4 * 1000 / (40 / 3 + 40 / 3 + 220 / 9))
    # Groups of fewer rows step on the line through the profiled 1-row and 4-row steps.
    for requests, per_layer in ((1, 0.5), (2, 0.5 + 0.5 / 3)):
        small = decode_only(plant, made_up_costs(None), shares, requests, 1)
        assert small.step_ms["pi-1"] == pytest.approx(4 * per_layer / 0.3)


def test_the_prediction_counts_every_prompt_in_chunks_then_every_decode_step(
        tmp_path: Path) -> None:
    plant = seed_plant(tmp_path)  # 4 / 4 / 22 layers on 0.3 / 0.3 / 0.9 cores
    chunked = plant.model_copy(update={"coordinator": plant.coordinator.model_copy(
        update={"prefill_chunk": 8})})
    shares = box_shares(plant, cpu_total=1.5)
    # A 9-position prompt in chunks of 4 and 5 (the coordinator's prefill_chunks):
    # 0.5 ms a layer for a chunk's first position, 0.25 for each of the others.
    per_layer = (0.5 + 3 * 0.25) + (0.5 + 4 * 0.25)
    prompt = [4 * per_layer / 0.3, 4 * per_layer / 0.3, 22 * per_layer / 0.9]
    lone = predict(chunked, made_up_costs(None), shares, 1, 1, "jetson", "jetson",
                   prompt_tokens=9, tokens=5)
    assert lone.ttft_s * 1000 == pytest.approx(sum(prompt))
    # Then 4 decode steps, each a pass of every stage.
    assert lone.wall_s * 1000 == pytest.approx(sum(prompt) + 4 * 1000 / lone.tok_s)
    assert lone.answered_tok_s == pytest.approx(5 / lone.wall_s)
    # Eight prompts sent together follow each other through the boxes, the slowest pacing.
    eight = predict(chunked, made_up_costs(None), shares, 8, 2, "jetson", "jetson",
                    prompt_tokens=9, tokens=5)
    assert eight.wall_s * 1000 == pytest.approx(
        sum(prompt) + 7 * max(prompt) + 4 * 8 * 1000 / eight.tok_s)


def test_a_drafting_plant_is_predicted_with_every_draft_taken_as_its_ceiling(
        tmp_path: Path) -> None:
    plant = seed_plant(tmp_path)
    drafting = plant.model_copy(update={"coordinator": plant.coordinator.model_copy(
        update={"speculation": Speculation(drafts=2)})})
    shares = box_shares(plant, cpu_total=1.5)
    message = MessageCost(agent_ms=0.6, broker_ms=0.09)
    lone = decode_only(drafting, made_up_costs(message), shares, 1, 1)
    plain = decode_only(plant, made_up_costs(message), shares, 1, 1)
    assert plain.drafted_tok_s is None and lone.tok_s == pytest.approx(plain.tok_s)
    # Three positions in flight, each a row alone: faster than one, never past the busiest
    # box's rate.
    jetson_ms = (22 * 0.5 + 0.6 + 0.6 + 4 * 0.09) / 0.9
    assert lone.drafted_tok_s is not None
    assert plain.tok_s < lone.drafted_tok_s <= 1000 / jetson_ms * (1 + 1e-9)
    # With more requests in flight than speculation.max_in_flight nobody drafts.
    assert decode_only(drafting, made_up_costs(message), shares, 4, 1).drafted_tok_s is None


def test_cycle_time_is_the_period_of_a_regular_pipeline() -> None:
    # K equal queues of service time d and N customers: no customer waits while N <= K
    # (one box each), and past that the boxes are never idle: max(K, N) d.
    for queues, customers in [(1, 1), (3, 1), (3, 3), (4, 7)]:
        assert cycle_time([2.0] * queues, customers) == pytest.approx(
            2.0 * max(queues, customers))
    # Many customers: the slowest queue sets the pace, one customer each 5.
    assert cycle_time([5.0, 1.0], 200) == pytest.approx(200 * 5.0)
    # Few: once around, the sum.
    assert cycle_time([5.0, 1.0, 3.0], 1) == pytest.approx(9.0)


@optional.needs(netns.missing(), "a rehearsal's network")
@optional.HOST_NETWORK
def test_a_link_rate_changes_while_the_box_runs() -> None:
    network = netns.Network(secrets.token_hex(3))
    try:
        network.create()
        link = network.add_box("pi", None)
        inside = ("ip", "netns", "exec", link.namespace)
        for mbit in (20.0, 100.0):
            network.set_rate("pi", mbit)
            for shown in (netns.run("tc", "qdisc", "show", "dev", link.host_end),
                          netns.run(*inside, "tc", "qdisc", "show", "dev", "eth0")):
                assert f"rate {mbit:g}Mbit" in shown, shown
        network.set_rate("pi", None)
        assert "tbf" not in netns.run("tc", "qdisc", "show", "dev", link.host_end)
        assert network.links["pi"].mbit is None
    finally:
        network.remove()


def test_the_subnet_avoids_every_route_gateway_and_address_but_the_default() -> None:
    routes = ("default via 10.64.7.1 dev wg0 onlink\n"  # a gateway with no route of its own
              "0.0.0.0/1 via 10.70.0.1 dev tun0\n128.0.0.0/1 via 10.70.0.1 dev tun0\n"
              "10.80.0.0/16 dev eth1 proto kernel scope link src 10.80.0.5\n"
              "local 10.80.0.5 dev eth1 table local proto kernel scope host src 10.80.0.5\n"
              "unreachable 10.90.3.0/24\n")
    addresses = "3: wg0    inet 10.100.9.9/32 scope global wg0\\       valid_lft forever\n"
    blocked = netns.blocked_networks(routes, addresses)
    assert {str(net) for net in blocked} == {
        "10.64.7.1/32", "10.70.0.1/32", "10.80.0.0/16", "10.80.0.5/32", "10.90.3.0/24",
        "10.100.9.9/32"}


def test_the_first_start_table_sets_each_box_beside_its_share_at_its_rate(
        tmp_path: Path) -> None:
    """pi-1 (a 100 MB/s card) took 30 s to start, where its 2,000 MB share reads in 20 s and
    the cut reads and writes 2,000 MB each: 1.5x, an estimate of 40 s."""
    layer = PartBytes(0, 0, 0, 0, gguf=500_000_000)
    nothing = PartBytes(0, 0, 0, 0)
    costs = ModelCosts(layers=(PartCost(1.0, 1.0, 1.0),) * 8, embedding=PartCost(0.0, 0.0, 0.0),
                       head=PartCost(0.0, 0.0, 0.0), layer_bytes=(layer,) * 8,
                       embedding_bytes=nothing, head_bytes=nothing, tied=False, baseline_bytes=0)
    card = DiskSpec(read_mb_s=100, write_mb_s=100)
    plant = Plant(plant_id="p", topic_root="edgebus/p",
                  broker=BrokerSettings(url="mqtt://pi-1:1883"), model=tmp_path,
                  boxes=[BoxSpec(name="pi-1", memory_mb=4096, disk=card),
                         BoxSpec(name="pi-2", memory_mb=4096)],
                  stages=[StageSpec(node="pi-1", layers=(0, 4), weights="gguf"),
                          StageSpec(node="pi-2", layers=(4, 8), weights="gguf")])
    table = first_start_table(plant, costs, {"pi-1": Online(
        seconds=30.0, cpu_s=12.0, disk=DiskBytes(read=2000 << 20, written=2001 << 20))})
    header, pi_1, pi_2 = (line.split("  ") for line in table.splitlines())
    cells = [[cell.strip() for cell in row if cell.strip()] for row in (header, pi_1, pi_2)]
    assert cells[0][:4] == ["box", "disk MB/s r/w", "first start", "CPU"]
    assert cells[1] == ["pi-1", "100 / 100", "30 s", "12 s", "20 s", "1.50x", "40 s", "2000",
                        "2001"]
    assert cells[2] == ["pi-2", "-", "-", "-", "-", "-", "-", "-", "-"]
    # A box that read its share from the page cache did not start at its disk's rate.
    cached = first_start_table(plant, costs, {"pi-1": Online(3.0, 2.0, DiskBytes(0, 2001 << 20))})
    assert cached.splitlines()[-1].startswith(
        "warning: box pi-1 read 0 of the 1907 MiB its cut reads from its disk; the rest was "
        "in the page cache"), cached
