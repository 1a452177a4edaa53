"""Upgrade a running plant box by box, from a wheel of an earlier edgebus to this checkout's.

    python tools/upgrade_check.py [--from COMMIT] [--rollback] [--gateways N] [--tokens N]
                                  [--keep DIR]

1. Builds two wheels with `pip wheel --no-deps`: COMMIT's (`git archive`, default fe58f49,
   the start of the session before the one that wrote this) and this checkout's, its files
   as they are, and installs each with `pip install --no-deps --target` into a folder of
   its own: the two releases a box would have installed. Both run on this Python's
   dependencies (edgebus pins llama-cpp-python, so both link the same llama.cpp).
2. The OLD release writes the plant (`edgebus init --stages 2 --replicas 2 --broker
   mqtt://...`) and the files of its broker (`edgebus broker mosquitto-config`), as an
   older plant has them; Debian's Mosquitto runs with them. The plant file is never
   rewritten: the new release must run an older release's file.
3. Every agent starts from the old wheel, as a process of its own (`python -m edgebus node
   PLANT --id NODE`, `... coordinator PLANT`), all with one EDGEBUS_HOME: a box's stage
   files and journal stay where they are when its release changes.
4. GATEWAYS gateways send greedy requests all along, each its next one once the last is
   answered (`edgebus ask`'s client). Every answer is compared with llama.cpp's answer for
   the whole GGUF in one process as each release computes it (its own
   tools/whole_answer.py): releases may configure llama.cpp differently.
5. One agent at a time, in the order docs/upgrades.md gives (`edgebus status`'s
   upgrade_order: each stage's standbys, the coordinator, then each stage's first node; the
   coordinator first where the old one is edgebus 0.1.0's): a stage's first node is first
   given up to DRAIN_S to finish its requests (a standby's are replayed on a node of its
   own release), then SIGTERM (what `systemctl stop` sends), the
   process's end, a start from the new wheel, its status online with the new release, and
   an answer to every gateway since, before the next box. Halfway, `edgebus status` of the
   new release shows the mixed plant.
6. With --rollback, back to the earlier release the same way (the coordinator last where
   that release is 0.1.0: its coordinator mixes releases on a route).
7. Prints every step with its time, `edgebus status` at the mixed point, the coordinator's
   counters, and per phase the answers token-exact against each release, against neither,
   and the refusals (with why).

Exit status 0 when every request was answered token-exact against one release's whole answer.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiomqtt
from whole_answer import whole  # beside this file, as tools/aarch64_plant.py imports it

from broker.mosquitto import MosquittoProcess
from edgebus.ask import ask
from edgebus.core.client import BusClient
from edgebus.core.messages import GenerateRequest
from edgebus.core.processes import free_port
from edgebus.status_view import upgrade_order
from plant_config import Plant, load_plant

REPO = Path(__file__).resolve().parents[1]
# The earlier main upgraded from: the start of the session before the one that wrote this
# check (2026-12-04), the newest release before statuses said their frame version.
DEFAULT_FROM = "fe58f49"
# Short questions a plant answers in a few tokens each; greedy, so each has one answer.
PROMPTS = ("What does a PLC do?", "Name one use of a hydraulic press.",
           "Why does a motor overheat?", "What is a torque wrench for?")
# How long an agent may take from start to its online status: a stage loads (and maybe cuts)
# its layers, seconds for SmolLM2 here; generous for a loaded 2-core machine.
START_S = 180.0
# How long a stopped agent may take to end after SIGTERM before it is killed.
STOP_S = 30.0
# How long the plant may take to answer every gateway once after a box's upgrade: a request
# waits at most for a replay and the coordinator's restart.
SETTLE_S = 300.0
# How long a stage node may take to finish its requests before it is stopped anyway (they
# are then replayed): a few answers' time.
DRAIN_S = 30.0


def run(command: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """Run a command to its end; its output, or the check stops with it."""
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env,
                          cwd=cwd)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return str(done.stdout)


def build(source: Path, wheels: Path, site: Path) -> str:
    """A wheel of the tree at `source`, installed into `site`; its file name."""
    before = set(wheels.glob("*.whl"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(source)])
    wheel = (set(wheels.glob("*.whl")) - before or before).pop()
    run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
         str(wheel)])
    return wheel.name


def checkout_tree(commit: str | None, target: Path) -> None:
    """`commit`'s files (`git archive`), or this checkout's as they are (None)."""
    target.mkdir(parents=True)
    if commit is not None:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
        return
    listed = run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
                  "--exclude-standard"])
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


@dataclass
class Release:
    """An installed wheel: which folder to put on PYTHONPATH, and its release."""

    label: str
    site: Path
    version: str = ""

    def command(self, *args: str) -> list[str]:
        """`edgebus ARGS` of this release: run it outside any checkout, whose edgebus/
        `python -m` would find first."""
        return [sys.executable, "-m", "edgebus", *args]

    def env(self, home: Path) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(self.site), "EDGEBUS_HOME": str(home)}


@dataclass
class Phase:
    """What the gateways got while the plant was in one state: answers token-exact against
    each release's whole answer, answers exact against none, refusals."""

    name: str
    exact: dict[str, int] = field(default_factory=dict)  # by the releases it is exact against
    answered: int = 0  # token-exact against either release's whole answer
    differing: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)

    def line(self) -> str:
        exact = ", ".join(f"{count} token-exact as {release} computes"
                          for release, count in sorted(self.exact.items()))
        return (f"{self.name}: {exact or '0 token-exact'}, {len(self.differing)} exact "
                f"against neither, {len(self.refused)} refused")


class Boxes:
    """The plant's processes: Mosquitto and one process per agent, its log in `logs`."""

    def __init__(self, plant: Plant, path: Path, home: Path, logs: Path) -> None:
        self.plant, self.path, self.home, self.logs = plant, path, home, logs
        self.agents: dict[str, tuple[subprocess.Popen[bytes], Release]] = {}
        self.statuses: dict[str, dict[str, object]] = {}

    def start(self, agent: str, release: Release) -> None:
        args = (["coordinator", str(self.path)] if agent == self.plant.coordinator.id
                else ["node", str(self.path), "--id", agent])
        log = open(self.logs / f"{agent}.{release.label}.log", "ab")  # noqa: SIM115
        process = subprocess.Popen(release.command(*args), env=release.env(self.home),
                                   cwd=self.path.parent, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        log.close()
        self.agents[agent] = (process, release)

    def stop(self, agent: str) -> int:
        process, _ = self.agents.pop(agent)
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(STOP_S)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()

    def stop_all(self) -> None:
        for agent in list(self.agents):
            self.stop(agent)

    async def watch(self) -> None:
        """Keep every agent's newest status, as JSON (either release's)."""
        topics = self.plant.topics

        def on_message(message: aiomqtt.Message) -> None:
            agent = topics.agent_of_status_topic(message.topic.value)
            if agent is not None and isinstance(message.payload, bytes):
                self.statuses[agent] = json.loads(message.payload)

        bus = BusClient(self.plant.ops_endpoint(), self.plant.ops_client_id("upgrade"),
                        subscriptions=[(topics.status_filter, 1)])
        await bus.run(on_message)

    async def drained(self, agent: str) -> bool:
        """Whether stage node `agent` computes nothing any more, within DRAIN_S: a status
        newer than this call with no row computed since the one before (rows_per_s 0, which
        `edgebus status` shows as TOK/S). The coordinator sends new requests to nodes of its
        own release, so an old node drains as its requests end. Its count of requests held
        (IN FLIGHT) is no sign: caches of requests a stopped coordinator never released stay
        until the node evicts them."""
        since = time.time()
        deadline = time.monotonic() + DRAIN_S
        while time.monotonic() < deadline:
            status = self.statuses.get(agent, {})
            metrics = status.get("metrics", {})
            if (isinstance(metrics, dict) and float(str(status.get("ts", 0))) > since
                    and metrics.get("rows_per_s") == 0):
                return True
            await asyncio.sleep(0.1)
        return False

    def coordinator_counters(self) -> str:
        """What the coordinator counted since it last started: requests, replays, routes
        over several releases, refused frames (those its release counts)."""
        coordinator = self.plant.coordinator.id
        metrics = self.statuses.get(coordinator, {}).get("metrics", {})
        assert isinstance(metrics, dict)
        counted = ", ".join(f"{name} {metrics[name]:.0f}" for name in (
            "requests_done", "failovers", "recoveries", "mixed_routes", "restarts",
            "foreign_frames")
            if name in metrics)
        return f"{coordinator} ({self.statuses[coordinator].get('version')}) counted {counted}"

    async def online(self, agent: str, version: str) -> None:
        """Return once `agent`'s status says online, in release `version`."""
        deadline = time.monotonic() + START_S
        process, _ = self.agents[agent]
        while not (self.statuses.get(agent, {}).get("state") == "online"
                   and self.statuses[agent].get("version") == version):
            if process.poll() is not None:
                sys.exit(f"{agent} ended with {process.returncode}: see {self.logs}")
            if time.monotonic() > deadline:
                sys.exit(f"{agent} not online as edgebus {version} in {START_S:.0f} s")
            await asyncio.sleep(0.1)


class Gateways:
    """`count` gateways asking one request after another, each answer checked."""

    def __init__(self, plant: Plant, references: dict[str, dict[str, list[int]]],
                 tokens: int, count: int) -> None:
        self.plant, self.references, self.tokens, self.count = plant, references, tokens, count
        self.phase = Phase("")
        self.phases: list[Phase] = []
        self.answered = 0  # answers of any kind since start
        self._ids = itertools.count()

    def begin(self, name: str) -> None:
        self.phase = Phase(name)
        self.phases.append(self.phase)

    async def run(self) -> None:
        await asyncio.gather(*(self._gateway(g) for g in range(self.count)))

    async def _gateway(self, index: int) -> None:
        for prompt in itertools.cycle(PROMPTS[index:] + PROMPTS[:index]):
            request = GenerateRequest(id=f"up-{next(self._ids)}", prompt=prompt,
                                      max_tokens=self.tokens)
            response = await ask(self.plant, request)
            phase = self.phase  # the state the plant was in when the answer came
            if response.error is not None:
                phase.refused.append(f"{request.id}: {response.error.code}: "
                                     f"{response.error.message}")
            elif matches := [r for r, answers in self.references.items()
                             if answers[prompt] == response.tokens]:
                phase.answered += 1
                both = " and ".join(matches)  # releases whose whole answers are the same
                phase.exact[both] = phase.exact.get(both, 0) + 1
            else:
                phase.differing.append(f"{request.id} ({prompt!r}): {response.tokens}")
            self.answered += 1

    async def each_answered(self) -> None:
        """Return once `count` more answers came (each gateway about one)."""
        target = self.answered + self.count
        deadline = time.monotonic() + SETTLE_S
        while self.answered < target:
            if time.monotonic() > deadline:
                sys.exit(f"no answers for {SETTLE_S:.0f} s: the plant stopped answering")
            await asyncio.sleep(0.1)


async def move(boxes: Boxes, gateways: Gateways, order: list[str], source: Release,
               target: Release, started: float) -> None:
    """Take every agent from release `source` to `target`, one at a time in `order`."""
    firsts = {stage.node_ids[0] for stage in boxes.plant.pipeline}
    for index, agent in enumerate(order):
        if agent in firsts:
            # Moved last, once the coordinator sends new requests to the target release's
            # nodes: its own requests end on it, not in a replay on another release.
            say(started, f"{agent} drained" if await boxes.drained(agent) else
                f"{agent} still computes after {DRAIN_S:.0f} s: its requests are replayed")
        if agent == boxes.plant.coordinator.id:
            say(started, boxes.coordinator_counters())
        code = boxes.stop(agent)
        say(started, f"stopped {agent} ({source.version}, exit {code}); starting it as "
                     f"{target.version}")
        gateways.begin(f"{index + 1} of {len(order)} on {target.version} ({agent} restarting)")
        boxes.start(agent, target)
        await boxes.online(agent, target.version)
        say(started, f"{agent} online as {target.version}")
        await gateways.each_answered()
        if index == len(order) // 2:
            shown = subprocess.run(target.command("status", str(boxes.path)),
                                   env=target.env(boxes.home), cwd=boxes.path.parent,
                                   capture_output=True, text=True, check=False)
            print(f"$ edgebus status plant.yaml   # edgebus {target.version}'s, halfway\n"
                  f"{shown.stdout}{shown.stderr}", flush=True)


def say(started: float, text: str) -> None:
    print(f"[{time.monotonic() - started:6.1f} s] {text}", flush=True)


async def check(args: argparse.Namespace, work: Path) -> bool:
    started = time.monotonic()
    wheels = work / "wheels"
    wheels.mkdir()
    old, new = Release("old", work / "old-site"), Release("new", work / "new-site")
    for release, commit in ((old, args.source), (new, None)):
        checkout_tree(commit, work / f"{release.label}-src")
        wheel = build(work / f"{release.label}-src", wheels, release.site)
        release.version = wheel.split("-")[1]
        say(started, f"built {wheel} from {commit or 'this checkout'}, installed into "
                     f"{release.site}")
    if old.version == new.version:
        sys.exit(f"both wheels are edgebus {old.version}: nothing tells the boxes apart")

    port = free_port()
    plant_dir, home, logs = work / "plant", work / "home", work / "logs"
    for folder in (plant_dir, home, logs):
        folder.mkdir()
    path = plant_dir / "plant.yaml"
    model = run(old.command("model", "bundled"), env=old.env(home), cwd=plant_dir).strip()
    run(old.command("init", str(path), "--model", model, "--stages", "2", "--replicas", "2",
                    "--broker", f"mqtt://127.0.0.1:{port}"), env=old.env(home), cwd=plant_dir)
    run(old.command("broker", "mosquitto-config", str(path), str(plant_dir / "mosquitto")),
        env=old.env(home), cwd=plant_dir)
    plant = load_plant(path)
    # Each release's llama.cpp answer for the whole GGUF, as its own tools/whole_answer.py
    # computes it: releases may configure llama.cpp differently (0.2.0 turned flash attention
    # on), and each is token-exact against its own.
    references = {new.version: {p: whole(plant, GenerateRequest(
        id="whole", prompt=p, max_tokens=args.tokens)) for p in PROMPTS}}
    references[old.version] = {p: json.loads(run(
        [sys.executable, str(work / "old-src" / "tools" / "whole_answer.py"), str(path),
         "--prompt", p, "--tokens", str(args.tokens)], env=old.env(home))) for p in PROMPTS}
    same = sum(references[old.version][p] == references[new.version][p] for p in PROMPTS)
    say(started, f"plant written by edgebus {old.version}; llama.cpp's whole answers to "
                 f"{len(PROMPTS)} prompts computed as each release computes them: the same "
                 f"for {same} of {len(PROMPTS)}")

    boxes = Boxes(plant, path, home, logs)
    gateways = Gateways(plant, references, args.tokens, args.gateways)
    # Debian's Mosquitto, with the files the old release wrote, saving its state as a
    # plant's broker does.
    with MosquittoProcess(work / "broker", port=port, include_dir=plant_dir / "mosquitto",
                          persistence=True):
        watcher = asyncio.create_task(boxes.watch())
        try:
            for agent in upgrade_order(plant):
                boxes.start(agent, old)
            for agent in upgrade_order(plant):
                await boxes.online(agent, old.version)
            # edgebus 0.1.0's coordinator says no frame version, and mixes releases on a
            # route: the new one goes first (docs/upgrades.md).
            legacy = "frame_version" not in boxes.statuses[plant.coordinator.id]
            order = upgrade_order(plant, coordinator_first=legacy)
            say(started, f"every agent online as edgebus {old.version}")
            gateways.begin(f"all on {old.version}")
            asking = asyncio.create_task(gateways.run())
            await gateways.each_answered()
            await move(boxes, gateways, order, old, new, started)
            gateways.begin(f"all on {new.version}")
            await gateways.each_answered()
            await gateways.each_answered()
            say(started, boxes.coordinator_counters())
            if args.rollback:
                # Back the same way; to 0.1.0, whose coordinator mixes releases, it goes last.
                back = upgrade_order(plant)
                if legacy:
                    back = [a for a in back if a != plant.coordinator.id] + [plant.coordinator.id]
                await move(boxes, gateways, back, new, old, started)
                gateways.begin(f"all back on {old.version}")
                await gateways.each_answered()
            asking.cancel()
            await asyncio.gather(asking, return_exceptions=True)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            boxes.stop_all()
    print("\n".join(phase.line() for phase in gateways.phases))
    for phase in gateways.phases:
        for line in [*phase.differing, *phase.refused]:
            print(f"  {phase.name}: {line}")
    total = sum(p.answered for p in gateways.phases)
    wrong = sum(len(p.differing) + len(p.refused) for p in gateways.phases)
    say(started, f"{total} of {total + wrong} requests answered token-exact while the plant "
                 f"went from edgebus {old.version} to {new.version} box by box")
    return wrong == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="source", default=DEFAULT_FROM,
                        help=f"the earlier commit to upgrade from (default {DEFAULT_FROM})")
    parser.add_argument("--gateways", type=int, default=2, help="gateways asking at once")
    parser.add_argument("--tokens", type=int, default=24, help="tokens of each answer")
    parser.add_argument("--rollback", action="store_true",
                        help="then take the plant back to the earlier release, box by box")
    parser.add_argument("--keep", type=Path, help="work here and keep it (logs, plant)")
    args = parser.parse_args()
    if shutil.which("mosquitto") is None:
        sys.exit("mosquitto is not installed: apt-get install mosquitto")
    if args.keep is not None:
        args.keep.mkdir(parents=True)
        ok = asyncio.run(check(args, args.keep))
    else:
        with tempfile.TemporaryDirectory(prefix="edgebus-upgrade-") as work:
            ok = asyncio.run(check(args, Path(work)))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
