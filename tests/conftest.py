"""Shared fixtures: real MQTT brokers and the imported SmolLM2 demo model.

Integration tests talk to real brokers, never mocks: amqtt in-process and
Mosquitto as a subprocess, each on a port of its own. Both start in ~20 ms,
so the broker fixtures are function-scoped and every test gets a clean one.

The suite can run in several pytest-xdist workers at once (`-n 3 --dist
loadgroup`, README.md): each worker gets an EDGEBUS_HOME of its own for agents' state (the
journals, whose lock refuses a second coordinator of the same plant and id),
whose model and llama.cpp caches are the machine's shared ones. Tests that
change the host itself (network namespaces, cgroups) share an xdist group
(`optional.HOST_NETWORK`), so they run one at a time, on one worker.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable, Generator, Iterator
from importlib.util import find_spec
from pathlib import Path

import gguf
import optional
import pipeline
import pytest
from brokers import (
    MOSQUITTO_INSTALL_HINT,
    AmqttBroker,
    BrokerHandle,
    MosquittoBroker,
    PubackLedger,
    mosquitto_binary,
)
from gguf_models import Tensor, TinyGguf, requantize, tensors, tiny_ggufs
from tiny_models import build_tiny

from edgebus.core.paths import GGUF_FILE
from edgebus.model_import import bundled_gguf, default_model_dir, ensure_demo_model

BROKER_KINDS = ["amqtt", "mosquitto"]

# The drafting Llama: tiny_models' Llama drawn with weights of this scale and seed. At
# tiny_models.INIT_RANGE (0.2) a random model's greedy answers never repeat a pair of
# tokens, so prompt lookup proposes no draft at all; at 0.05 they fall into phrases they
# repeat, left now and then, and still depend on their history (`historyless_tokens`).
# Seed 1 makes every request of test_speculation.py both take drafts and reject some,
# through llama.cpp's F16 and torch's fp32 alike.
DRAFTING_INIT_RANGE = 0.05
DRAFTING_SEED = 1

# What EDGEBUS_HOME holds that is a cache, expensive to fill and safe to fill from
# several processes at once (temporary names renamed into place, or a lock): the
# imported models with their ONNX graphs, the stage GGUF cuts, the planner's llama.cpp
# profiles, and llama.cpp's build and source. Everything else under a home (journal/)
# is one worker's state.
SHARED_CACHES = ("models", "stages", "profiles", "llama.cpp")


def pytest_configure(config: pytest.Config) -> None:
    # Tests must never reach for a model hub: the demo model ships in a pip
    # package. Set before test modules import transformers, because
    # huggingface_hub reads the variable once, at import.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Collection imports torch, transformers and onnx; collecting garbage while their objects
    # are made freed none and cost ~0.9 s of collection's 6 s. Back on once it ends.
    gc.disable()
    # The suite starts ~180 Python processes (agents, `edgebus up`, `init`, `status`),
    # each importing the project's own modules. Where PYTHONDONTWRITEBYTECODE is set (the
    # machines this suite is timed on set it), each compiled them from source again: a
    # tiny plant's `edgebus up` took 2.8 CPU-seconds with their bytecode cached, 3.0
    # without (2-core AMD EPYC). The caches go in the checkout's ignored __pycache__/.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    if find_spec("torch") is not None:
        import torch

        # As the engines this process loads (pipeline.IN_PROCESS_THREADS says why).
        torch.set_num_threads(pipeline.IN_PROCESS_THREADS)


def pytest_collection_finish(session: pytest.Session) -> None:
    # What collection imported (torch, transformers, onnx: ~350k objects) lives as long as
    # the run. Every full collection walked all of it, Python's own and one at each module's
    # end (pipeline.release_models): 0.32 s of CPU each, 7.8 s over four test files (2-core
    # AMD EPYC). Frozen, it is out of the collector's walk; what tests make is collected.
    gc.collect()
    gc.freeze()
    gc.enable()


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
        collector: pytest.Collector) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    # As the report is made, before pytest_collectreport: pytest's session counts a
    # collection error there (and stops the run) before a conftest's hook could change it.
    report = yield
    optional.skip_torch_modules(report)
    optional.fail_skipped_modules(report)
    return report


@pytest.fixture(scope="session", autouse=True)
def edgebus_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """This worker's EDGEBUS_HOME: a fresh directory whose SHARED_CACHES link to the
    machine's (the EDGEBUS_HOME the run was started with, or ~/.cache/edgebus).

    In-process coordinators and the `edgebus` processes tests start journal under it,
    so two workers running plants of the same id never share a journal or its lock.
    """
    shared = default_model_dir().parent.parent
    home = tmp_path_factory.mktemp("edgebus-home")
    for name in SHARED_CACHES:
        (shared / name).mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to(shared / name, target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EDGEBUS_HOME", str(home))
        yield home


@pytest.fixture(scope="module", autouse=True)
def release_models() -> Iterator[None]:
    """A module's shared stage engines and reference models go when it ends
    (pipeline.release_models)."""
    yield
    pipeline.release_models()


@pytest.fixture
def amqtt_broker() -> Iterator[AmqttBroker]:
    """amqtt (MQTT 3.1.1) on a free loopback port, in a thread with its own event loop."""
    broker = AmqttBroker()
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def ledgered_amqtt() -> Iterator[AmqttBroker]:
    """The embedded broker (amqtt) with PubackLedger beside the plugin that admits everyone:
    what each client left unacknowledged."""
    broker = AmqttBroker(plugins={"broker.embedded.AllowAllAuthPlugin": {},
                                  f"brokers.{PubackLedger.__name__}": {}})
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def make_mosquitto(tmp_path: Path) -> Iterator[Callable[..., MosquittoBroker]]:
    """Factory: `make_mosquitto(persistence=True)` starts a Mosquitto, stopped at teardown.

    Its log is printed at teardown, so a failing test's report shows it.
    """
    if mosquitto_binary() is None:
        pytest.fail(f"the mosquitto broker is not installed: {MOSQUITTO_INSTALL_HINT}")
    started: list[MosquittoBroker] = []

    def make(*, persistence: bool = False, autosave_interval: int = 1) -> MosquittoBroker:
        broker = MosquittoBroker(tmp_path / f"mosquitto-{len(started)}", persistence=persistence,
                                 autosave_interval=autosave_interval)
        started.append(broker)
        broker.start()
        return broker

    yield make
    for broker in started:
        # SIGKILL: the test is over and nothing of the broker is kept. Mosquitto 2.0 takes
        # 70-120 ms to act on a SIGTERM once a client has connected (its start's readiness
        # probe is one), ~7 s over the suite's 64 teardowns of it; its log is written line
        # by line to stderr's file, so what it logged is all there.
        broker.stop(kill=True)
        print(f"--- {broker!r} log ---\n{broker.log_tail()}")


@pytest.fixture
def mosquitto_broker(make_mosquitto: Callable[..., MosquittoBroker]) -> MosquittoBroker:
    """Mosquitto (MQTT 5 and 3.1.1) on a free loopback port, no persistence."""
    return make_mosquitto()


@pytest.fixture(params=BROKER_KINDS, ids=BROKER_KINDS)
def broker(request: pytest.FixtureRequest) -> BrokerHandle:
    """Each real broker in turn: the test runs once against amqtt, once against Mosquitto."""
    handle: BrokerHandle = request.getfixturevalue(f"{request.param}_broker")
    return handle


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct in HF layout, imported once per machine into the edgebus cache.

    The import converts through transformers, and the tests given this directory hold
    the plant to the torch reference: on a base install they skip (tests/optional.py)."""
    optional.require_torch()
    return ensure_demo_model(progress=False)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The bundled SmolLM2 GGUF file itself, as a llama.cpp plant's `model:` names it: what
    the llama.cpp tests run on a box without torch (its bytes are the imported
    directory's model.gguf, tests/test_no_torch.py)."""
    return bundled_gguf()


@pytest.fixture(scope="session")
def smollm2_gguf_tensors(smollm2_gguf: Path) -> dict[str, Tensor]:
    """gguf-py's reading of the bundled file's tensors by name, once a run: parsing the
    file's 49k-token vocabulary takes gguf-py 3 s each time."""
    return tensors(smollm2_gguf)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny random Llama (6 layers, 64 wide) with SmolLM2's tokenizer: seconds, not minutes."""
    return build_tiny("llama", tmp_path_factory.mktemp("llama"), smollm2_dir)


@pytest.fixture(scope="session")
def converted_ggufs(tmp_path_factory: pytest.TempPathFactory,
                    smollm2_dir: Path) -> dict[str, Path]:
    """The tiny models with their GGUFs (F16) beside them, by name: every one the suite
    converts, made together the first time a test asks for one (gguf_models.tiny_ggufs)."""
    root = tmp_path_factory.mktemp("tiny-ggufs")
    wanted = {"llama": TinyGguf("llama", root / "llama"),
              "qwen2": TinyGguf("qwen2", root / "qwen2"),
              "deepseek_v3": TinyGguf("deepseek_v3", root / "deepseek_v3"),
              "drafting": TinyGguf("llama", root / "drafting-llama", seed=DRAFTING_SEED,
                                   initializer_range=DRAFTING_INIT_RANGE)}
    tiny_ggufs(list(wanted.values()), smollm2_dir)
    return {name: tiny.dest for name, tiny in wanted.items()}


@pytest.fixture(scope="session")
def tiny_llama_gguf(converted_ggufs: dict[str, Path]) -> Path:
    """The tiny Llama with its GGUF beside it, for tests of faults rather than of an engine:
    a `weights: gguf` agent of it starts in 0.9 s of CPU, where a torch agent spends 6 s
    importing torch and transformers, and fault tests start dozens of agents."""
    return converted_ggufs["llama"]


@pytest.fixture(scope="session")
def tiny_llama_in(tiny_llama_gguf: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The tiny Llama's GGUF in a block type: its own F16 file, or that rewritten once per
    run (`requantize`), for the tests that chain, batch and regroup rows of each type."""
    source = tiny_llama_gguf / GGUF_FILE
    made: dict[str, Path] = {"F16": source}
    folder = tmp_path_factory.mktemp("block-types")
    reader = gguf.GGUFReader(str(source))

    def in_type(qtype: str) -> Path:
        if qtype not in made:
            made[qtype] = requantize(source, folder / f"{qtype}.gguf",
                                     gguf.GGMLQuantizationType[qtype], reader)
        return made[qtype]

    return in_type


@pytest.fixture(scope="session")
def tiny_family_gguf(converted_ggufs: dict[str, Path]) -> Callable[[str], Path]:
    """`tiny_family_gguf("qwen2")`: that tiny random family with its GGUF beside it
    (converted_ggufs: "qwen2", "deepseek_v3")."""
    return converted_ggufs.__getitem__


@pytest.fixture(scope="session")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """The tiny random DeepSeek-V3 (MLA, dense layer 0, MoE after), one checkpoint file."""
    return build_tiny("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3"), smollm2_dir)


@pytest.fixture(scope="session")
def drafting_llama(converted_ggufs: dict[str, Path]) -> Path:
    """The tiny Llama whose answers repeat phrases of their own (DRAFTING_INIT_RANGE), its
    fp32 checkpoint and its GGUF (F16) side by side: pipelined speculation's drafts on a
    tiny model (test_speculation.py, and the bench's speculation phase in test_bench.py)."""
    return converted_ggufs["drafting"]
