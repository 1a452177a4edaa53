"""A plant's first start on its boxes' disks: the bench section "First start on a box's disk".

    python benchmarks/first_start.py PLANT.yaml [--unlimited] [--cpus N]   # as root

The plant's boxes are rehearsed (edgebus/rehearse), each box's disk held to its `disk:`
read and write rates with the io controller and the model dropped from the page cache;
its agents are started and the bench waits until every one is online. Per stage box: the
first start (its process started to "online": the stage file cut from the model's GGUF,
then llama.cpp's load), the CPU time the box used until then (a start that used less than
its quota's CPU waited on its disk, or on this machine's other work), the time the box's
disk takes to read its share (the stage file it cut) at its read rate, their ratio, the
cut's own time (from the agent's log) and what the box's io controller counted. The
share's read time is the peer: what the box cannot start faster than. `--unlimited` then
starts the same plant with the boxes' disk: left out, at this machine's disk, for what
the rates add.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from edgebus.core.errors import EdgebusError
from edgebus.rehearse import Options, Rehearsal
from edgebus.rehearse.cgroups import DiskBytes
from edgebus.rehearse.workload import Client, wait_online
from plant_config import Plant, load_plant
from plant_config.first_start import seconds
from plant_config.stage_memory import MIB

# Cutting a multi-GB GGUF into stage files at an SD card's rate and loading them on a
# fraction of a core.
FIRST_START_TIMEOUT_S = 3600.0
# The cut's closing log line (node_agent/engines/llamacpp/stage_gguf.py, _Progress.done).
_CUT_LINE = re.compile(r"cut layers \[(\d+), (\d+)\) of .*: (\d+) MiB in (\d+) s")


@dataclass(frozen=True)
class BoxStart:
    box: str
    read_mb_s: float | None
    first_start_s: float
    cpu_s: float               # the box's CPU time until then
    stage_bytes: int           # the stage file the box cut (its share)
    cut_s: float | None        # the cut, as its agent logged it (None: under 5 s, unlogged)
    disk: DiskBytes | None     # what the box's io controller counted until online

    @property
    def share_s(self) -> float | None:
        """The box's share read at its disk's read rate."""
        return None if self.read_mb_s is None else self.stage_bytes / (self.read_mb_s * 1e6)


def say(text: str) -> None:
    print(text, flush=True)


def machine() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.machine()


def load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def start(plant: Plant, workdir: Path, options: Options) -> list[BoxStart]:
    """Start `plant`'s agents in its rehearsed boxes; each stage box's first start."""
    with Rehearsal(plant, workdir, options, progress=say) as rehearsal:
        since = time.time()
        rehearsal.start()

        async def online() -> None:
            async with Client(rehearsal.plant) as client:
                await wait_online(rehearsal, client, since=since, timeout=FIRST_START_TIMEOUT_S)

        asyncio.run(online())
        stages = workdir / "home" / "stages"
        starts = []
        for spec in plant.stages:
            first, end = spec.layers
            cut = list(stages.glob(f"*.{first}-{end}.*.gguf"))
            log = (workdir / "logs" / f"{spec.node}.log").read_text(errors="replace")
            cut_s = next((float(m.group(4)) for m in _CUT_LINE.finditer(log)), None)
            began = rehearsal.online[spec.node]  # wait_online saw every agent online
            box = next(b for b in plant.boxes or () if b.name == spec.node)
            starts.append(BoxStart(
                box=spec.node, read_mb_s=box.disk.read_mb_s if box.disk else None,
                first_start_s=began.seconds, cpu_s=began.cpu_s,
                stage_bytes=cut[0].stat().st_size if cut else plant.model.stat().st_size,
                cut_s=cut_s, disk=began.disk))
        say("tearing down")
    return starts


def without_disks(plant: Plant) -> Plant:
    """`plant` with its boxes' disk: rates left out: at this machine's disk."""
    assert plant.boxes is not None
    return plant.model_copy(update={"boxes": [box.model_copy(update={"disk": None})
                                              for box in plant.boxes]})


def table(starts: list[BoxStart], rated: list[BoxStart] | None = None) -> str:
    """Markdown rows, a box each; `rated`: the run at the boxes' rates, for the share."""
    lines = ["| box | disk read MB/s | stage file (share) | first start | box CPU | its share "
             "at the read rate | first start / share | the cut | read / written (io "
             "controller) |", "|---|---|---|---|---|---|---|---|---|"]
    for start_, peer in zip(starts, rated or starts, strict=True):
        share_s = peer.share_s
        lines.append(
            f"| {start_.box} | {start_.read_mb_s or 'unlimited'} | "
            f"{start_.stage_bytes / MIB:,.0f} MiB | {seconds(start_.first_start_s)} s | "
            f"{seconds(start_.cpu_s)} s | "
            + (f"{seconds(share_s)} s | {start_.first_start_s / share_s:.2f}x | "
               if share_s else "- | - | ")
            + (f"{start_.cut_s:.0f} s | " if start_.cut_s is not None else "under 5 s | ")
            + (f"{start_.disk.read / MIB:,.0f} / {start_.disk.written / MIB:,.0f} MiB |"
               if start_.disk else "- |"))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plant", type=Path, help="plant file whose boxes: have disk: rates")
    parser.add_argument("--unlimited", action="store_true",
                        help="then start it again at this machine's disk, for comparison")
    parser.add_argument("--cpus", type=float, help="cores for all boxes (rehearse's --cpus)")
    args = parser.parse_args(argv)
    plant = load_plant(args.plant)
    options = Options(cpu_total=args.cpus)
    say(f"{machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {load()}")
    try:
        with tempfile.TemporaryDirectory(prefix="edgebus-first-start-") as workdir:
            rated = start(plant, Path(workdir) / "rated", options)
            say(table(rated))
            if args.unlimited:
                unlimited = start(without_disks(plant), Path(workdir) / "unlimited", options)
                say("\nat this machine's disk (shares read at the rated boxes' rates):")
                say(table(unlimited, rated))
            say(f"load {load()} at the end")
    except EdgebusError as exc:
        print(f"first_start: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
