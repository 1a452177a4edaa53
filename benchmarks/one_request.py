"""One request on the seed's plant, rehearsed: the Jetson alone, the plant with drafts off
and with drafts on (docs/benchmarks.md, "One request: the seed's headline").

    python benchmarks/one_request.py [--cpus 0.6] [--drafts 8] [--rounds 2]
        [--model GGUF] [--workloads code alarm free] [--prefill-chunk N] [--layers N N N]

The plant is what `edgebus init --example jetson-2pi --insecure` writes for the model (the
bundled SmolLM2 by default), rehearsed by `edgebus rehearse`'s own machinery: each box a
network namespace and a CPU quota, Mosquitto and the coordinator on the Jetson's box. The
Jetson alone is the whole model on that box with the same quota (`--compare-one-box`),
decoding without drafts, as the seed measured it.
Each workload is a prompt file of benchmarks/prompts/ (`rehearse --prompt-file`): (a) a
code rewrite of a function of this repository, (b) an alarm summary that quotes its input,
(c) free text that quotes nothing; each asks 256 tokens. The three variants take turns in
every round, so that they see the same minutes of a shared machine. Per run: the time from
sending to the answer, drafts taken of those sent, frames of several positions each box
verified and their mean size, and each box's busy share.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from edgebus.model_import import bundled_gguf
from edgebus.rehearse import Options, Workload, one_box_variant, rehearse_plant
from edgebus.rehearse.prompt_file import read_prompt_file
from edgebus.rehearse.report import busy_share, verification
from edgebus.rehearse.workload import Measurement
from plant_config import Plant, load_plant

PROMPTS = Path(__file__).parent / "prompts"
# The seed's plant, and the box it is measured against.
EXAMPLE, ALONE = "jetson-2pi", "jetson"
# "drafts off, TLS": the plant as init makes it by default (TLS, passwords, ACLs), against
# the same plant in plain MQTT ("drafts off"): what TLS costs a token.
# "drafts on, 1 a frame": every draft in a frame of its own (speculation.positions_per_frame
# 1), against "drafts on"'s window spread over a frame per stage: what packing drafts saves.
VARIANTS = ("alone", "drafts off", "drafts on", "drafts off, TLS", "drafts on, 1 a frame")
# Cores of this machine the three boxes share (the rehearsal splits them by speed): with
# 0.6 the Jetson gets 0.36 of a core, at which SmolLM2 took about 80 ms a token on the Intel
# Xeon VM, where the seed's Jetson took 31. The ratios are what the bench measures; by
# proportion, --cpus 1.6 would give the seed's speed, and leaves the bench less room on 2.
DEFAULT_CPUS = 0.6


@dataclass(frozen=True)
class Run:
    variant: str
    workload: str
    measured: Measurement


def seed_plant(model: Path, drafts: int, folder: Path, *, secured: bool = False) -> Plant:
    """The plant `edgebus init --example jetson-2pi` writes, as a user makes it: plain MQTT
    (`--insecure`), or `secured` as init's default is (TLS, passwords, ACLs)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "plant.yaml"
    subprocess.run([sys.executable, "-m", "edgebus", "init", str(path), "--model", str(model),
                    "--example", EXAMPLE, "--drafts", str(drafts),
                    *([] if secured else ["--insecure"])],
                   check=True, stdout=subprocess.DEVNULL)
    return load_plant(path)


def with_chunk(plant: Plant, chunk: int | None) -> Plant:
    """`plant` with prompts sent in chunks of `chunk` positions (None: as it is)."""
    if chunk is None:
        return plant
    return plant.model_copy(update={
        "coordinator": plant.coordinator.model_copy(update={"prefill_chunk": chunk})})


def with_layers(plant: Plant, counts: list[int] | None) -> Plant:
    """`plant` with its stages holding `counts` layers each, in order (None: init's split)."""
    if counts is None:
        return plant
    if len(counts) != len(plant.stages) or sum(counts) != plant.num_layers:
        raise SystemExit(f"--layers: {len(plant.stages)} counts adding up to "
                         f"{plant.num_layers} layers, one a stage")
    first, stages = 0, []
    for stage, count in zip(plant.stages, counts, strict=True):
        stages.append(stage.model_copy(update={"layers": (first, first + count)}))
        first += count
    return plant.model_copy(update={"stages": stages})


def with_speculation(plant: Plant, **settings: int) -> Plant:
    """`plant` with these `coordinator.speculation` settings."""
    coordinator = plant.coordinator.model_copy(update={
        "speculation": plant.coordinator.speculation.model_copy(update=settings)})
    return plant.model_copy(update={"coordinator": coordinator})


def without_drafts(plant: Plant) -> Plant:
    return with_speculation(plant, drafts=0)


def busy(measured: Measurement) -> str:
    return ", ".join(f"{box} {busy_share(measured, box):.0%}" for box in measured.boxes)


def report(runs: list[Run], workloads: list[str]) -> str:
    lines = ["| workload | variant | sent to answer (median) | x the Jetson alone | TTFT | "
             "decode tok/s | drafts taken / sent | frames of several positions (x mean "
             "size) | busy |", "|" + " --- |" * 9]
    for workload in workloads:
        mine = [r for r in runs if r.workload == workload]
        alone = statistics.median(r.measured.wall_s for r in mine if r.variant == "alone")
        for variant in VARIANTS:
            these = [r.measured for r in mine if r.variant == variant]
            if not these:
                continue
            wall = statistics.median(m.wall_s for m in these)
            last = these[-1]
            each = ", ".join(f"{m.wall_s:.1f}" for m in these)
            lines.append(
                f"| {workload} | {variant} | {wall:.1f} s ({each}) "
                f"| {wall / alone:.2f}x | {statistics.median(m.ttft_s[0] for m in these):.2f} s "
                f"| {statistics.median(m.decode_tok_s for m in these):.1f} "
                f"| {last.drafts_accepted} / {last.drafts_proposed} | {verification(last)} "
                f"| {busy(last)} |")
    floors = [line for workload in workloads if (line := floor(runs, workload))]
    return "\n".join(lines + floors)


def floor(runs: list[Run], workload: str) -> str | None:
    """The least time drafts on could take at the acceptance it had, against the Jetson alone.

    A token no draft foretold (the first sampled after a rejected draft, or with no draft
    left) enters stage 0 only once the last stage has answered its predecessor: one whole
    pass through the pipeline, at least what a drafts-off token takes (a pass of one
    position, where a frame of drafts takes longer). So a request of n tokens of which d
    came from taken drafts takes at least its time to first token and n - 1 - d passes,
    however the frames in flight overlap.
    """
    def of(variant: str) -> list[Measurement]:
        return [r.measured for r in runs if r.workload == workload and r.variant == variant]

    off, on = of("drafts off"), of("drafts on")
    if not (off and on) or not all(m.decode_tok_s for m in off):
        return None
    alone_s = statistics.median(m.wall_s for m in of("alone"))
    pass_s = statistics.median(1 / m.decode_tok_s for m in off)
    least = [m.ttft_s[0] + (m.tokens - 1 - m.drafts_accepted) * pass_s for m in on]
    return (f"\n{workload}: drafts on cannot take less than "
            f"{statistics.median(least) / alone_s:.2f}x the Jetson alone at the acceptance "
            f"it had (its time to first token, then a drafts-off pass of "
            f"{pass_s * 1e3:.0f} ms for each of the "
            f"{statistics.median(m.tokens - 1 - m.drafts_accepted for m in on):.0f} tokens "
            "no taken draft foretold)")


async def main(args: argparse.Namespace) -> None:
    folder = Path(tempfile.mkdtemp(prefix="edgebus-one-request-"))
    drafting = with_layers(with_chunk(seed_plant(args.model, args.drafts, folder),
                                      args.prefill_chunk), args.layers)
    options = Options(cpu_total=args.cpus)
    alone, alone_options = one_box_variant(drafting, ALONE, options)
    # The Jetson alone decodes plainly, as the seed's 8 s were measured.
    secured = with_layers(with_chunk(seed_plant(args.model, args.drafts, folder / "secured",
                                                secured=True), args.prefill_chunk), args.layers)
    variants = [("alone", without_drafts(alone), alone_options),
                ("drafts off", without_drafts(drafting), options),
                ("drafts on", drafting, options),
                ("drafts off, TLS", without_drafts(secured), options),
                ("drafts on, 1 a frame", with_speculation(drafting, positions_per_frame=1),
                 options)]
    runs: list[Run] = []
    for round_ in range(args.rounds):
        for workload in args.workloads:
            requests = tuple(r.request for r in read_prompt_file(PROMPTS / f"{workload}.json"))
            load = Workload(1, args.tokens, file_requests=requests)
            # Each round in another order: no variant always runs first on a cooling machine.
            turn = [v for v in variants if v[0] in args.variants]
            for name, plant, plant_options in turn[round_ % len(turn):] + turn[:round_ % len(turn)]:
                print(f"== round {round_ + 1}, {workload}, {name}", flush=True)
                _, measured = await rehearse_plant(
                    plant, folder / f"{round_}-{workload}-{name.replace(' ', '-')}",
                    plant_options, load, lambda text: None)
                if measured.errors:
                    raise SystemExit(f"{name}: {measured.errors}")
                runs.append(Run(name, workload, measured))
                print(f"   {measured.wall_s:.1f} s, drafts {measured.drafts_accepted}/"
                      f"{measured.drafts_proposed}, verified {verification(measured)}, "
                      f"busy {busy(measured)}", flush=True)
    print(report(runs, args.workloads))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="the GGUF (default: the bundled SmolLM2)")
    parser.add_argument("--cpus", type=float, default=DEFAULT_CPUS)
    parser.add_argument("--drafts", type=int, default=8,
                        help="coordinator.speculation.drafts of the drafting plant")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--workloads", nargs="+", default=["code", "alarm", "free"],
                        help="prompt files of benchmarks/prompts/ (context-1000 and "
                        "context-3000: a long code context, one token: time to first token)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS[:3]),
                        help="the Jetson alone is always run: the ratios are against it")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="coordinator.prefill_chunk of every variant (default: init's)")
    parser.add_argument("--layers", type=int, nargs="+", default=None,
                        help="layers each stage holds, in order (default: init's split)")
    arguments = parser.parse_args()
    arguments.model = arguments.model or bundled_gguf()
    arguments.variants = sorted({"alone", *arguments.variants}, key=VARIANTS.index)
    asyncio.run(main(arguments))
