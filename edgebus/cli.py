"""The `edgebus` command: one entry point for every agent and tool.

Each subcommand parses its arguments and hands over to the module that does
the work; errors edgebus raises on purpose are printed as one clear line.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
from pathlib import Path

from edgebus.errors import EdgebusError


def _init(args: argparse.Namespace) -> None:
    from plant_config import init_plant_file

    plant = init_plant_file(args.plant, args.model, stages=args.stages, broker=args.broker,
                            topic_root=args.topic_root, force=args.force)
    print(f"wrote {args.plant}: {len(plant.stages)} stages over {plant.num_layers} layers")
    for stage in plant.stages:
        print(f"  {stage.node}: layers [{stage.layers[0]}, {stage.layers[1]})")


def _node(args: argparse.Namespace) -> None:
    from node_agent.stage import run_stage
    from plant_config import load_plant

    run_stage(load_plant(args.plant), args.id, threads=args.threads,
              batch_groups=args.batch_groups)


def _coordinator(args: argparse.Namespace) -> None:
    from node_agent.coordinator import run_coordinator
    from plant_config import load_plant

    run_coordinator(load_plant(args.plant))


def _broker(args: argparse.Namespace) -> None:
    from broker.embedded import run_broker_forever
    from plant_config import load_plant

    settings = load_plant(args.plant).broker
    if not settings.embedded:
        raise EdgebusError(f"{args.plant} uses the broker at {settings.url}; `edgebus broker` "
                           "runs only the embedded one (broker.url: embedded)")
    run_broker_forever(settings.bind or settings.host, settings.port)


def _up(args: argparse.Namespace) -> None:
    from edgebus.launcher import run_up

    sys.exit(run_up(Path(args.plant)))


def _ask(args: argparse.Namespace) -> None:
    from edgebus.ask import ask
    from edgebus.messages import ChatMessage, GenerateRequest
    from plant_config import load_plant

    plant = load_plant(args.plant)
    request = GenerateRequest(
        id=secrets.token_hex(6),
        prompt=args.text if args.raw else None,
        messages=None if args.raw else [ChatMessage(role="user", content=args.text)],
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
        stream=args.stream)

    def show(delta: str) -> None:
        print(delta, end="", flush=True)

    response = asyncio.run(ask(plant, request, on_delta=show if args.stream else None))
    if args.json:
        print(response.model_dump_json(indent=2))
    elif response.error is not None:
        raise EdgebusError(f"{response.error.code}: {response.error.message}")
    elif args.stream:
        print()
    else:
        print(response.text)


def _import_gguf(args: argparse.Namespace) -> None:
    from edgebus.model_import import import_gguf

    print(f"imported into {import_gguf(Path(args.src), Path(args.dest))}")


def _demo(args: argparse.Namespace) -> None:
    from edgebus.demo import run_demo

    run_demo(args.prompt)


def _bench(args: argparse.Namespace) -> None:
    from edgebus.bench.results import DEFAULT_TOKENS, QUICK_TOKENS, BenchSettings
    from edgebus.bench.runner import run_bench

    tokens = args.tokens if args.tokens is not None else (
        QUICK_TOKENS if args.quick else DEFAULT_TOKENS)
    brokers = tuple(name.strip() for name in args.brokers.split(",") if name.strip())
    run_bench(BenchSettings(out=Path(args.out), quick=args.quick, brokers=brokers,
                            tokens=tokens))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgebus", description="Pipeline-parallel LLM inference for edge boxes, over MQTT.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("init", help="write a plant file with an even layer split")
    p.add_argument("plant", help="plant file to write (YAML)")
    p.add_argument("--model", required=True, help="model directory (HF layout)")
    p.add_argument("--stages", type=int, default=3, help="number of stage nodes (default 3)")
    p.add_argument("--broker", default="embedded", help="'embedded' or mqtt(s)://[user:pw@]host:port")
    p.add_argument("--topic-root", help="MQTT topic root (default edgebus/<plant id>)")
    p.add_argument("--force", action="store_true", help="overwrite an existing plant file")
    p.set_defaults(run=_init)

    p = sub.add_parser("node", help="run a stage agent")
    p.add_argument("plant")
    p.add_argument("--id", required=True, help="node id from the plant file")
    p.add_argument("--threads", type=int,
                   help="torch threads (default: the plant file's, else all cores)")
    p.add_argument("--batch-groups", type=int,
                   help="request groups kept in flight (default: one per stage; `up` "
                        "passes one per core, since its stages share this box's cores)")
    p.set_defaults(run=_node)

    p = sub.add_parser("coordinator", help="run the coordinator agent")
    p.add_argument("plant")
    p.set_defaults(run=_coordinator)

    p = sub.add_parser("broker", help="run the embedded MQTT broker (amqtt)")
    p.add_argument("plant")
    p.set_defaults(run=_broker)

    p = sub.add_parser("up", help="start every agent of the plant, each in its own process")
    p.add_argument("plant")
    p.set_defaults(run=_up)

    p = sub.add_parser("ask", help="send one request and print the answer")
    p.add_argument("plant")
    p.add_argument("text")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stream", action="store_true", help="print tokens as they come")
    p.add_argument("--json", action="store_true", help="print the whole response as JSON")
    p.add_argument("--raw", action="store_true",
                   help="send TEXT as a verbatim prompt instead of a chat message")
    p.set_defaults(run=_ask)

    p = sub.add_parser("model", help="model tools")
    model_sub = p.add_subparsers(dest="model_command", required=True, metavar="TOOL")
    q = model_sub.add_parser("import-gguf", help="convert a GGUF file to an HF safetensors dir")
    q.add_argument("src")
    q.add_argument("dest")
    q.set_defaults(run=_import_gguf)

    p = sub.add_parser("demo", help="import the bundled model, start a 3-stage plant, ask")
    p.add_argument("--prompt", default="What does a PLC do in a factory? Answer in two sentences.")
    p.set_defaults(run=_demo)

    p = sub.add_parser("bench", help="measure the pipeline against one-process baselines")
    p.add_argument("--out", default="docs/benchmarks.md",
                   help="markdown report to write; the plot goes beside it as .png")
    p.add_argument("--quick", action="store_true",
                   help="16 tokens, concurrency 1 and 4, no pinned-stage phase (~2 min)")
    p.add_argument("--brokers", default="amqtt,mosquitto",
                   help="comma-separated: amqtt (embedded) and/or mosquitto")
    p.add_argument("--tokens", type=int,
                   help="tokens generated per request (default 64, 16 with --quick)")
    p.set_defaults(run=_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except EdgebusError as exc:
        print(f"edgebus: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


