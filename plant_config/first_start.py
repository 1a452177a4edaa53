"""What a box's first start waits on its disk: the estimate `edgebus plan` states per box.

A llama.cpp node (`weights: gguf`) whose stage is not the whole model cuts its stage
file from the model's GGUF on its own box when it first starts
(node_agent/engines/llamacpp/stage_gguf.py): it reads its share of the GGUF (its layers'
blocks, and the embedding or the LM head where it has them) and writes the stage file,
which holds the same blocks and the stand-in matrix of zeros llama.cpp insists on (written,
never read). Then llama.cpp reads the stage file, which the cut has just written and the
page cache still holds on a box with the memory for it (where the box's memory cannot hold
the file beside llama.cpp's copy of it, a part is read again: docs/rehearse.md, not
counted here). On a later start the stage file
is cut already, and the start reads it alone. A node of the whole model cuts nothing and
reads the GGUF.

On an SD card reading and writing share one card, so the estimate adds the two. It counts
the disk alone: the cut's copy and llama.cpp's repacking of the blocks take CPU beside it
(docs/benchmarks.md), and the cut's fingerprint of the GGUF (32 MiB) is left out.

Other weight modes read a checkpoint in its own dtype and convert as they load; no
estimate is stated for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from plant_config.layout import LayerRange
from plant_config.planner import Box, ModelCosts, Plan
from plant_config.schema import DiskSpec
from plant_config.stage_memory import MIB


@dataclass(frozen=True)
class FirstStart:
    """Bytes a node's first start reads and writes, and the seconds its disk takes for them."""

    disk: DiskSpec
    read_bytes: int    # the cut's reads of the GGUF, or the whole GGUF read by llama.cpp
    write_bytes: int   # the stage file the cut writes (0: no cut)
    stage_bytes: int   # what a later start reads: the stage file, or the whole GGUF

    @property
    def read_s(self) -> float:
        return self.disk.read_s(self.read_bytes)

    @property
    def write_s(self) -> float:
        return self.disk.write_s(self.write_bytes)

    @property
    def total_s(self) -> float:
        return self.read_s + self.write_s

    @property
    def later_s(self) -> float:
        """A start whose stage file is cut already."""
        return self.disk.read_s(self.stage_bytes)


def first_start(costs: ModelCosts, box: Box, layers: LayerRange) -> FirstStart | None:
    """`box`'s first start running `layers`; None where its disk or its weights' reads are
    not known (no `disk:`, or a weight mode other than gguf)."""
    if box.disk is None or box.weights != "gguf":
        return None
    stage = costs.weight_bytes(layers, "gguf")
    first, stop = layers
    if first == 0 and stop == costs.num_layers:
        return FirstStart(box.disk, read_bytes=stage, write_bytes=0, stage_bytes=stage)
    return FirstStart(box.disk, read_bytes=stage - costs.standin_bytes(layers), write_bytes=stage,
                      stage_bytes=stage)


def seconds(value: float) -> str:
    """Seconds as the tables print them: tenths below ten, where a small model's start is."""
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


def first_start_table(result: Plan, costs: ModelCosts) -> str | None:
    """The plan's first starts, a line per node, as `edgebus plan` prints them; None where no
    box has a `disk:`."""
    if all(box.disk is None for stage in result.stages for box in stage.boxes):
        return None
    header = ("node", "disk MB/s read/write", "reads MiB", "writes MiB", "first start",
              "later starts")
    rows = [header]
    for stage in result.stages:
        for box in stage.boxes:
            estimate = first_start(costs, box, stage.layers)
            if estimate is None:
                why = "no disk: in the plant file" if box.disk is None else \
                    f"not estimated for {box.weights} weights"
                rows.append((box.node, why, "-", "-", "-", "-"))
                continue
            rows.append((
                box.node, f"{estimate.disk.read_mb_s:g} / {estimate.disk.write_mb_s:g}",
                f"{estimate.read_bytes / MIB:.0f}", f"{estimate.write_bytes / MIB:.0f}",
                f"{seconds(estimate.read_s)} + {seconds(estimate.write_s)} = "
                f"{seconds(estimate.total_s)} s" if estimate.write_bytes
                else f"{seconds(estimate.read_s)} s",
                f"{seconds(estimate.later_s)} s"))
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    table = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
             .rstrip() for row in rows]
    return "\n".join([
        "first start, on each box's disk: a llama.cpp node cuts its stage file from the GGUF "
        "on its box (reads its share, writes the file: read + write s), then llama.cpp reads "
        "the file, from the page cache where the box's memory still holds it; later starts "
        "read the cut file (disk alone: the cut's copy and llama.cpp's load take CPU beside "
        "it)", *table])
