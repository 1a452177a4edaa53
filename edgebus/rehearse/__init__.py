"""`edgebus rehearse PLANT.yaml`: a plant's boxes rehearsed on one machine.

Each box of the plant file becomes a network namespace on a private bridge
(`netns`), with a CPU quota in proportion to its `speed` and a memory limit
from its `memory_mb` (`cgroups`, v1 or v2), and a link rate from its
`link_mbit`. The broker and every agent run as real processes inside
(`rehearsal`); a fixed workload is sent from outside (`workload`); and the
table printed (`report`) sets what was measured beside what the planner's
cost model predicts. docs/rehearse.md has the details and the fault tests
that use the same machinery.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from edgebus.core.errors import EdgebusError
from edgebus.rehearse.fit import check_boxes
from edgebus.rehearse.prompt_file import FileRequest, check_for_plant, read_prompt_file
from edgebus.rehearse.rehearsal import Options, Rehearsal
from edgebus.rehearse.report import box_table, first_start_table, predict, summary
from edgebus.rehearse.sizing import box_shares
from edgebus.rehearse.workload import (
    ROWS_PER_GROUP,
    Client,
    Measurement,
    Workload,
    measure,
    wait_online,
)
from plant_config import Plant, even_split, load_plant
from plant_config.schema import resolve_engine

# Tokens of the warm-up request each rehearsal runs first: the first forward
# passes of a fresh process pay for allocator growth and kernel choices.
WARMUP_TOKENS = 8

__all__ = ["Options", "Rehearsal", "Workload", "clean_leftovers", "one_box_variant",
           "rehearse_plant", "run_rehearse"]


def even_variant(plant: Plant) -> Plant:
    """`plant` with its layers split evenly over its stages, replicas kept."""
    ranges = even_split(plant.num_layers, len(plant.pipeline))
    stages = [spec.model_copy(update={"layers": ranges[stage.index]})
              for stage in plant.pipeline for spec in stage.nodes]
    return plant.model_copy(update={"stages": stages})


def one_box_variant(plant: Plant, box: str, options: Options) -> tuple[Plant, Options]:
    """The whole model on `box` alone, with the CPU and memory that box has in `plant`'s
    rehearsal: what the plant's pipeline is measured against ("the Jetson alone").

    Same engine and weights (with `gguf`, llama.cpp running the whole GGUF), broker and
    coordinator on that box, as a one-box plant would run them.
    """
    shares = {share.box: share for share in box_shares(plant, cpu_total=options.cpu_total,
                                                        memory_scale=options.memory_scale)}
    if box not in shares:
        raise EdgebusError(f"--compare-one-box {box!r} is not a box of the plant (boxes: "
                           f"{', '.join(shares)})")
    assert plant.boxes is not None  # box_shares refuses a plant without boxes
    spec = next((s for s in plant.stages if s.node == box), plant.stages[-1])
    whole = spec.model_copy(update={"node": box, "layers": (0, plant.num_layers)})
    alone = plant.model_copy(update={
        "boxes": [b for b in plant.boxes if b.name == box], "stages": [whole]})
    # Alone, the box would get every core of --cpus: give it exactly its share instead.
    return alone, Options(cpu_total=shares[box].cpu_cores, memory_scale=options.memory_scale,
                          batch_groups=options.batch_groups)


async def rehearse_plant(plant: Plant, workdir: Path, options: Options, workload: Workload,
                         progress: Callable[[str], None], *,
                         planned: dict[str, str] | None = None, source: str | None = None
                         ) -> tuple[Rehearsal, Measurement]:
    """Build `plant`'s boxes, run `workload` once warm, tear down; the measurement.
    `planned`: what the plan counts for each node, in words, for the report of a death;
    `source`: the prompt file the workload's requests come from, for the progress line."""
    with Rehearsal(plant, workdir, options, progress=progress) as rehearsal:
        rehearsal.planned = planned or {}
        started = time.time()
        rehearsal.start()
        async with Client(rehearsal.plant) as client:
            progress("waiting for every agent to load its layers and come online")
            await wait_online(rehearsal, client, since=started)
            try:
                progress("warming up")
                await measure(rehearsal, client, Workload(1, WARMUP_TOKENS), "warmup-")
                progress(f"workload: {workload.describe(source)}")
                measured = await measure(rehearsal, client, workload, "r-")
            except EdgebusError as exc:
                raise EdgebusError("; ".join([str(exc), *map(rehearsal.describe_exit,
                                                            rehearsal.dead())])) from None
            for name in rehearsal.dead():
                progress(rehearsal.describe_exit(name))
        progress("tearing down")
    return rehearsal, measured


def clean_leftovers() -> int:
    """`edgebus rehearse --clean`: remove what killed rehearsals left; its exit status."""
    from edgebus.rehearse import leftovers

    if os.geteuid() != 0:
        print("edgebus rehearse --clean: namespaces, links and control groups can only be "
              "removed as root (sudo)", file=sys.stderr)
        return 1
    removed, failed = leftovers.clean()
    for line in removed:
        print(f"removed {line}")
    for line in failed:
        print(f"could not remove all of {line}", file=sys.stderr)
    if not removed and not failed:
        print("nothing to remove: no rehearsal was left behind")
    return 1 if failed else 0


def run_rehearse(plant_path: Path, options: Options, *, requests: int | None, tokens: int,
                 compare_even: bool, keep: bool, compare_one_box: str | None = None,
                 prompt_file: Path | None = None) -> int:
    """The `edgebus rehearse` command; its exit status. `prompt_file`: the requests to send
    instead of the built-in prompts (prompt_file.py)."""
    from node_agent.costs import model_costs, profiled_model

    def progress(text: str) -> None:
        print(text, flush=True)

    plant = load_plant(plant_path)
    # The file is checked before the profile and the boxes: a bad item costs seconds, not a
    # rehearsal.
    file_requests: tuple[FileRequest, ...] = ()
    if prompt_file is not None:
        file_requests = read_prompt_file(prompt_file)
        check_for_plant(file_requests, plant)
    progress(f"cost model of {plant.model.name} (profiles the model once if not cached)")
    costs, _, _ = model_costs(profiled_model(
        plant.model, {resolve_engine(s.engine, s.weights) for s in plant.stages}))
    groups = options.batch_groups or len(plant.pipeline)
    workload = Workload(requests or ROWS_PER_GROUP * groups, tokens,
                        file_requests=tuple(r.request for r in file_requests))
    variants = [("plant file", plant, options)]
    if compare_even:
        variants.append(("even split", even_variant(plant), options))
    if compare_one_box is not None:
        alone, alone_options = one_box_variant(plant, compare_one_box, options)
        variants.append((f"{compare_one_box} alone", alone, alone_options))
    # Every variant's boxes against what the planner counts, before anything starts.
    checked = {name: check_boxes(variant, costs, variant_options)
               for name, variant, variant_options in variants}
    over = checked["plant file"][0]
    if over:
        raise EdgebusError("the plant's boxes cannot hold their parts as rehearsed (memory_mb x "
                           "--memory-scale), so nothing was started:\n" + "\n".join(over)
                           + "\n— `edgebus plan` splits the layers to fit, with remedies")
    workdir = Path(tempfile.mkdtemp(prefix="edgebus-rehearse-"))
    results = []
    ok = False
    try:
        for name, variant, variant_options in variants:
            refused, planned = checked[name]
            if refused:
                print(f"\n{name}: refused before loading, as a box that cannot hold it would "
                      "be:\n" + "\n".join(refused) + "\n")
                continue
            progress(f"== {name}: " + ", ".join(f"{s.node} {list(s.layers)}"
                                                for s in variant.stages))
            rehearsal, measured = asyncio.run(rehearse_plant(
                variant, workdir / name.replace(" ", "-"), variant_options, workload, progress,
                planned=planned, source=None if prompt_file is None else str(prompt_file)))
            prediction = predict(rehearsal.plant, costs, rehearsal.shares, workload.requests,
                                 variant_options.batch_groups or len(variant.pipeline),
                                 rehearsal.broker_box, rehearsal.coordinator_box,
                                 prompt_tokens=measured.prompt_tokens,
                                 tokens=workload.mean_tokens())
            results.append((name, measured, prediction))
            print(f"\n{name}: broker and coordinator on {rehearsal.broker_box}"
                  + (f" / {rehearsal.coordinator_box}"
                     if rehearsal.coordinator_box != rehearsal.broker_box else ""))
            print(box_table(rehearsal.plant, measured, prediction))
            print("first start (started to online: the cut and the load) and the CPU its box "
                  "used by then, against reading the box's share at its disk's read rate; read "
                  "and written: what its io controller counted\n"
                  + first_start_table(rehearsal.plant, costs, rehearsal.online))
            print(summary(rehearsal.plant, measured, prediction) + "\n")
        _, first, first_p = results[0]
        for name, other, other_p in results[1:]:
            predicted = (f", predicted {first_p.tok_s / other_p.tok_s:.2f}x"
                         if name == "even split" else "")
            print(f"plant file against {name}: decode tok/s measured "
                  f"{first.decode_tok_s / other.decode_tok_s:.2f}x{predicted}; first request "
                  f"sent to last answer {other.wall_s:.1f} s -> {first.wall_s:.1f} s "
                  f"({other.wall_s / first.wall_s:.2f}x faster)")
        ok = not any(measured.errors for _, measured, _ in results)
    finally:
        if keep or not ok:
            print(f"logs and plant files kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1
