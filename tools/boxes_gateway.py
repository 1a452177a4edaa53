"""The boxes check's PLC gateway (tools/boxes_check.sh): it runs outside the boxes, on the
host's side of their network, asks the plant as gateway `plc-1` and holds every answer
token for token to llama.cpp running the whole GGUF in this process.

    python tools/boxes_gateway.py references PLANT OUT.json
    python tools/boxes_gateway.py send PLANT WAVE COUNT OUTDIR
    python tools/boxes_gateway.py check REFERENCES OUTDIR WAVE...

`send` asks COUNT requests at once (streamed, so that it can tell when each is being
generated), writes OUTDIR/WAVE.inflight once every one has streamed its first token (the
check then starts its fault), and OUTDIR/WAVE.json once every one has an answer, a refusal
or the gateway's own error. `check` says, per request, whether it was answered token-exact,
refused with an error the plant gave, or lost, and exits 1 if any was lost or different.
Every request runs its whole length (`ignore_eos`), so it is still in flight when the fault
comes; the prompts fit the coordinator's first chunk, as tools/whole_answer.py needs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from whole_answer import whole

from edgebus.ask import ask
from edgebus.core.errors import EdgebusError
from edgebus.core.messages import GenerateRequest
from plant_config import load_plant

PROMPTS = [
    "The three most common causes of motor failure are",
    "To calibrate a pressure sensor, first",
    "A hydraulic pump gets hot when",
    "Before restarting a conveyor after an emergency stop, the operator",
    "The difference between a PLC and a relay panel is",
]
# Long enough that a fault lands mid-answer at the plant's pace here (tens of tokens a
# second through three boxes), short enough to keep the check's faults quick.
MAX_TOKENS = 64
# A request outlives any fault of the check: the watchdog's 90 s, a restart and a reload.
# Past this the gateway gives up, and the check counts the request as lost.
ANSWER_TIMEOUT_S = 360.0


def request(wave: str, index: int) -> GenerateRequest:
    return GenerateRequest(id=f"{wave}-{index}", prompt=PROMPTS[index % len(PROMPTS)],
                           max_tokens=MAX_TOKENS, ignore_eos=True, stream=True)


def references(plant_path: Path, out: Path) -> None:
    plant = load_plant(plant_path)
    answers = {str(i): whole(plant, request("whole", i)) for i in range(len(PROMPTS))}
    out.write_text(json.dumps(answers))


async def send(plant_path: Path, wave: str, count: int, outdir: Path) -> None:
    plant = load_plant(plant_path)
    streaming: set[str] = set()

    def on_delta(request_id: str) -> None:
        streaming.add(request_id)
        if len(streaming) == count:
            (outdir / f"{wave}.inflight").touch()

    async def one(index: int) -> dict[str, object]:
        req = request(wave, index)
        start = time.monotonic()
        try:
            response = await ask(plant, req, on_delta=lambda _: on_delta(req.id),
                                 timeout=ANSWER_TIMEOUT_S)
        except EdgebusError as exc:  # the gateway's own: no broker, no coordinator, no answer
            return {"id": req.id, "index": index, "gateway_error": str(exc),
                    "seconds": time.monotonic() - start}
        return {"id": req.id, "index": index, "tokens": response.tokens,
                "error": response.error.model_dump() if response.error else None,
                "seconds": time.monotonic() - start}

    results = await asyncio.gather(*(one(i) for i in range(count)))
    (outdir / f"{wave}.json").write_text(json.dumps(results))


def check(references_path: Path, outdir: Path, waves: list[str]) -> bool:
    """Print each request's fate; whether none was lost or different."""
    refs: dict[str, list[int]] = json.loads(references_path.read_text())
    good = True
    for wave in waves:
        path = outdir / f"{wave}.json"
        if not path.exists():
            print(f"{wave}: no results (the gateway did not finish)")
            good = False
            continue
        for result in json.loads(path.read_text()):
            head = f"{result['id']}: {result['seconds']:.1f} s,"
            if "gateway_error" in result:
                # Said to the gateway, which knows its request was not answered: refused
                # if it was never sent, lost if it was sent and nothing came back.
                lost = "no response" in result["gateway_error"]
                good &= not lost
                print(f"{head} {'LOST' if lost else 'not sent'}: {result['gateway_error']}")
            elif result["error"]:
                print(f"{head} refused: {result['error']['code']}: {result['error']['message']}")
            else:
                want = refs[str(result["index"] % len(PROMPTS))]
                exact = result["tokens"] == want
                good &= exact
                print(f"{head} {'token-exact' if exact else 'DIFFERENT'} "
                      f"({len(result['tokens'])} tokens)")
    return good


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("references")
    p.add_argument("plant", type=Path)
    p.add_argument("out", type=Path)
    p = sub.add_parser("send")
    p.add_argument("plant", type=Path)
    p.add_argument("wave")
    p.add_argument("count", type=int)
    p.add_argument("outdir", type=Path)
    p = sub.add_parser("check")
    p.add_argument("references", type=Path)
    p.add_argument("outdir", type=Path)
    p.add_argument("waves", nargs="+")
    args = parser.parse_args()
    if args.command == "references":
        references(args.plant, args.out)
    elif args.command == "send":
        asyncio.run(send(args.plant, args.wave, args.count, args.outdir))
    else:
        sys.exit(0 if check(args.references, args.outdir, args.waves) else 1)


if __name__ == "__main__":
    main()
