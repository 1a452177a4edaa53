"""A mixed plant: the coordinator (with its embedded broker) and stage-0 on this x86 host,
stage-1 and stage-2 on aarch64 under qemu-user, in the aarch64 check's root filesystem,
over MQTT on 127.0.0.1 (the chroot shares the host's network).

Run by tools/aarch64_check.sh when EDGEBUS_ARM_MIXED_PYTHON names an x86 python with edgebus
installed; as root, while the root filesystem's /proc and /dev are mounted. It prints the
plant's answers beside llama.cpp's whole-model answers on x86 and on aarch64, and how many
ids differ: the stages' kernels differ by architecture (AVX2 against NEON dot products),
so the plant need equal neither. It fails only if the plant does not answer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from aarch64_plant import REQUESTS, ask_all, compare, plant_file, wait_online
from whole_answer import whole

from edgebus.model_import import bundled_gguf

ARM_STAGES = ("stage-1", "stage-2")
HOST_STAGES = ("stage-0",)
# Where tools/aarch64_check.sh put the project inside the root filesystem.
ARM_REFERENCE = "/check/src/tools/aarch64_plant.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rootfs", type=Path, required=True, help="the aarch64 root filesystem")
    parser.add_argument("--in-rootfs", required=True,
                        help="the command that runs its arguments inside the root filesystem "
                             "on the emulated CPU (the check writes one)")
    parser.add_argument("--arm-python", default="/opt/edgebus/bin/python",
                        help="edgebus's python inside the root filesystem")
    args = parser.parse_args()
    # The same absolute paths on both sides, so that one plant file names the model for
    # every agent, as on real boxes.
    shared = Path(tempfile.mkdtemp(prefix="edgebus-mixed-"))
    inside = args.rootfs / shared.relative_to("/")
    inside.mkdir(parents=True)
    model = shared / "model.gguf"
    shutil.copy(bundled_gguf(), model)
    plant, path = plant_file(shared, model, plant_id="mixed")
    shutil.copy(model, inside / model.name)
    shutil.copy(path, inside / path.name)
    here = [sys.executable, "-m", "edgebus"]
    there = [args.in_rootfs, args.arm_python, "-m", "edgebus"]
    # `edgebus up` runs the embedded broker as a process of its own; so does this.
    commands = {"broker": [*here, "broker", str(path)],
                "coordinator": [*here, "coordinator", str(path)],
                **{n: [*here, "node", str(path), "--id", n] for n in HOST_STAGES},
                **{n: [*there, "node", str(path), "--id", n] for n in ARM_STAGES}}
    agents = {}
    try:
        for name, cmd in commands.items():
            with (shared / f"{name}.log").open("wb") as log:
                agents[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL)
        print(f"agents online after {wait_online(plant, agents['coordinator']):.0f} s",
              flush=True)
        answers = ask_all(path)
    finally:
        for agent in agents.values():
            agent.terminate()
        for name, agent in agents.items():
            agent.wait()
            print(f"--- {name} ---\n"
                  f"{(shared / f'{name}.log').read_text(errors='replace')[-1500:]}", flush=True)
    on_x86 = {r.id: whole(plant, r) for r in REQUESTS}
    on_arm = json.loads(subprocess.run(
        [args.in_rootfs, args.arm_python, ARM_REFERENCE, "whole", str(path)],
        check=True, capture_output=True, text=True).stdout)
    print(f"the plant against llama.cpp whole on x86: "
          f"{'token-exact' if compare(answers, on_x86, 'x86 whole') else 'not token-exact'}")
    print(f"the plant against llama.cpp whole on aarch64: "
          f"{'token-exact' if compare(answers, on_arm, 'arm whole') else 'not token-exact'}")
    print(f"llama.cpp whole, x86 against aarch64: "
          f"{'the same' if on_x86 == on_arm else 'different'}")
    shutil.rmtree(shared)
    shutil.rmtree(inside)


if __name__ == "__main__":
    main()
