"""A line broker bridged to the site broker, with a pipeline on both sides of the bridge.

Two Mosquitto processes run the configs `edgebus broker mosquitto-config`
writes for the site broker and for the line broker (with `--broker line`),
secured as in production. Stages 0 and 2 connect to the line broker, stage 1
and the coordinator to the site broker, so every token crosses the bridge
four times; the gateways ask on the site broker. With a TLS site broker the
bridge and the site's clients connect over TLS, the line's in clear text.
"""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import pytest
import trustme
from brokers import MosquittoBroker
from certs import broker_tls
from pipeline import reference_tokens, running

from broker.acl import bridge_topics
from broker.mosquitto_config import write_mosquitto_config
from edgebus.ask import ask
from edgebus.core.messages import GenerateRequest
from edgebus.core.processes import LOOPBACK, free_port
from plant_config import BrokerSettings, Plant, StageSpec
from plant_config.broker_section import BrokerTls, Security

WAIT_S = 60.0


def bridged_plant(model: Path, tmp_path: Path, site_port: int, line_port: int,
                  tls: BrokerTls | None = None) -> Plant:
    """Stages 0 and 2 on the line broker; with `tls`, the site broker listens on mqtts."""
    scheme = "mqtts" if tls else "mqtt"
    return Plant(
        plant_id="br", topic_root=f"edgebus-test/{secrets.token_hex(4)}",
        broker=BrokerSettings(url=f"{scheme}://{LOOPBACK}:{site_port}", protocol="5",
                              ca_file=tls.cafile if tls else None),
        brokers={"line": BrokerSettings(url=f"mqtt://{LOOPBACK}:{line_port}", protocol="5")},
        model=model,
        stages=[StageSpec(node="stage-0", layers=(0, 2), broker="line"),
                StageSpec(node="stage-1", layers=(2, 4)),
                StageSpec(node="stage-2", layers=(4, 6), broker="line")],
        security=Security(credentials=tmp_path / "credentials", gateways=["plc-1", "plc-2"],
                          ops=["ops"], tls=tls))


def test_the_bridge_carries_only_what_crosses(tmp_path: Path) -> None:
    plant = bridged_plant(tmp_path, tmp_path, 1883, 1884)
    root = plant.topic_root
    topics = bridge_topics(plant, "line")
    # Line nodes send to stage-1 and the coordinator (on the site), and report status
    # and events there; they receive only their own activations.
    assert set(topics.outbound) == {f"{root}/act/stage-1", f"{root}/act/coordinator",
                                    f"{root}/status/stage-0", f"{root}/status/stage-2",
                                    f"{root}/events"}
    assert set(topics.inbound) == {f"{root}/act/stage-0", f"{root}/act/stage-2"}


@pytest.mark.parametrize("site_tls", [False, True], ids=["mqtt", "mqtts-site"])
async def test_a_pipeline_across_the_bridge_is_token_exact(tiny_llama: Path, tmp_path: Path,
                                                           site_tls: bool) -> None:
    site_port, line_port = free_port(LOOPBACK), free_port(LOOPBACK)
    tls = broker_tls(tmp_path / "tls", trustme.CA()) if site_tls else None
    plant = bridged_plant(tiny_llama, tmp_path, site_port, line_port, tls)
    write_mosquitto_config(plant, tmp_path / "site", bind=LOOPBACK)
    written = write_mosquitto_config(plant, tmp_path / "line", broker="line", bind=LOOPBACK)
    assert "connection br-line" in written[-1].parent.joinpath("mosquitto.conf").read_text()
    requests = [GenerateRequest(id=f"b{i}", prompt=prompt, max_tokens=8, ignore_eos=True)
                for i, prompt in enumerate(["Alarm 4711 on press 3 means", "Pump 2 vibration"])]
    site = MosquittoBroker(tmp_path / "mosquitto-site", port=site_port,
                           include_dir=tmp_path / "site")
    line = MosquittoBroker(tmp_path / "mosquitto-line", port=line_port,
                           include_dir=tmp_path / "line")
    try:
        site.start()
        line.start()
        async with running(plant):
            responses = await asyncio.gather(*(
                ask(plant, request, client_id=f"plc-{i + 1}", timeout=WAIT_S)
                for i, request in enumerate(requests)))
    finally:
        line.stop()
        site.stop()
        print(f"--- site ---\n{site.log_tail()}\n--- line ---\n{line.log_tail()}")
    for request, response in zip(requests, responses, strict=True):
        assert response.error is None
        assert response.tokens == reference_tokens(tiny_llama, request)
