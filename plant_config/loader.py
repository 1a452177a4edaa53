"""Reading, checking and writing plant files, and making new ones from a model directory.

`load_plant` is what every agent calls at start-up: it turns any mistake in
the file, or any mismatch with the model directory, into one
`PlantConfigError` that lists every problem as `plant.yaml: field: what`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from edgebus.core.errors import CheckpointError, PlantConfigError
from plant_config.broker_section import BrokerSettings
from plant_config.layout import even_split, fit_problems
from plant_config.problems import Problem, Problems, from_validation_error, plant_error
from plant_config.schema import GGUF_SUFFIX, Plant, WeightMode
from plant_config.section import RELATIVE_TO
from plant_config.tasks import EXAMPLE_TASKS

# Replica node name suffixes: a plant rarely runs more than two or three boxes per stage.
_REPLICA_NAMES = "abcdefgh"

# Multimodal checkpoints nest the decoder's config under one of these keys;
# searching every nested dict could pick vision_config's layer count instead.
_TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")

_HEADER = """\
# edgebus plant file: which node runs which layers of which model, and where the broker is.
# Every agent reads this same file; relative paths (model:, security:) are relative to it.
# model: a .gguf file, which llama.cpp stages (weights: gguf) run as it is, or a model directory.
# layers: [first, last + 1] - [0, 10] means layers 0-9. Optional per stage: threads: N.
# weights: gguf, the GGUF's own blocks in llama.cpp, no torch (docs/plant-file.md); or, with the
# torch extra, fp32 (token-exact against transformers), bf16, int8 or int4 (docs/weight-modes.md).
# security: every agent, gateway and ops tool logs in as its own identity with the password
# in credentials/<identity>.password; without it the broker admits anyone (docs/plant-file.md).
"""
# The plant id `edgebus init` writes (its CA's subject names it).
INIT_PLANT_ID = "plant"
# MQTT over TLS's IANA port, where `init` puts the embedded broker.
MQTTS_PORT = 8883
# Where `edgebus init` puts the plant's secrets, relative to the plant file:
# beside it, so the plant file and its credentials move together.
CREDENTIALS_DIR = "credentials"
# The embedded broker's password files (hashes only), relative to the plant file: one per
# plant file, named for it (plant.yaml: broker/plant.passwd), so that a second plant made in
# the same folder leaves the first one's broker admitting the first one's identities.
PASSWORD_DIR = "broker"
PASSWORD_SUFFIX = ".passwd"
# The identities `edgebus init` names besides the agents: one PLC gateway,
# which `edgebus ask` uses, and the read-only ops identity of `edgebus status` and `up`.
DEFAULT_GATEWAYS = ("plc-1",)
DEFAULT_OPS = ("ops",)
# The gateway identity of `edgebus http` (the OpenAI HTTP API), which `init`
# adds to the gateways, and the name of the one API key it makes for it.
DEFAULT_HTTP_GATEWAY = "http"
DEFAULT_API_KEYS = ("http-1",)


def load_plant(path: str | os.PathLike[str]) -> Plant:
    """Read and check a plant file, including against the model directory it names."""
    source = os.fspath(path)
    raw = _read_yaml(Path(path), source)
    try:
        plant = Plant.model_validate(raw, context={RELATIVE_TO: Path(path).resolve().parent})
    except ValidationError as exc:
        raise plant_error(source, from_validation_error(exc, Plant)) from None
    problems = _disk_problems(plant)
    if problems:
        raise plant_error(source, problems)
    return plant


def write_plant(plant: Plant, path: str | os.PathLike[str]) -> None:
    """Write `plant` as a plant file that `load_plant` reads back equal."""
    target = Path(path)
    home = target.resolve().parent
    broker_fields_not_used = set() if plant.broker.embedded else set(BrokerSettings.EMBEDDED_ONLY)
    # Line brokers are URL brokers (validated), so none has embedded-only fields;
    # a plant without any is written without the section.
    line_broker_fields: dict[str, set[str]] | bool = (
        {name: set(BrokerSettings.EMBEDDED_ONLY) for name in plant.brokers} or True)
    data = plant.model_dump(mode="json", exclude_none=True,
                            exclude={"broker": broker_fields_not_used,
                                     "brokers": line_broker_fields})
    data["model"] = _path_for_file(plant.model, home)
    if not plant.tasks:
        del data["tasks"]
    if plant.broker.ca_file is not None:
        data["broker"]["ca_file"] = _path_for_file(plant.broker.ca_file, home)
    if plant.broker.password is not None:
        # The plant file is where the password lives; model_dump masked it.
        data["broker"]["password"] = plant.broker.password.get_secret_value()
    if plant.security is not None:
        data["security"]["credentials"] = _path_for_file(plant.security.credentials, home)
        if plant.security.tls:
            data["security"]["tls"].update(
                {name: _path_for_file(getattr(plant.security.tls, name), home)
                 for name in ("cafile", "certfile", "keyfile")})
        if plant.security.password_file is not None:
            data["security"]["password_file"] = _path_for_file(plant.security.password_file,
                                                                home)
    text = _HEADER + yaml.dump(data, Dumper=_PlantDumper, sort_keys=False, allow_unicode=True)
    try:
        target.write_text(text, encoding="utf-8")
        if plant.broker.password is not None:
            target.chmod(0o600)  # holds a secret now
    except OSError as exc:
        raise PlantConfigError(f"{target}: cannot write the plant file: {exc}") from None


def make_plant(model_dir: str | os.PathLike[str], *, stages: int = 3, broker: str = "embedded",
               topic_root: str | None = None, plant_id: str = INIT_PLANT_ID, replicas: int = 1,
               weights: WeightMode = "fp32") -> Plant:
    """A plant that splits the model in `model_dir` evenly over nodes stage-0..stage-{n-1}.

    With replicas > 1 each stage gets that many nodes, stage-0-a, stage-0-b, ...
    Every node keeps its weights in `weights` mode.
    """
    model = Path(model_dir).expanduser().resolve()
    try:
        num_layers, _ = _num_hidden_layers(model)
    except Problems as exc:
        raise plant_error(None, exc.problems) from None
    if not 1 <= replicas <= len(_REPLICA_NAMES):
        raise PlantConfigError(f"replicas must be 1..{len(_REPLICA_NAMES)}, got {replicas}")
    names = [""] if replicas == 1 else [f"-{c}" for c in _REPLICA_NAMES[:replicas]]
    stage_list = [{"node": f"stage-{index}{name}", "layers": layers, "weights": weights}
                  for index, layers in enumerate(even_split(num_layers, stages))
                  for name in names]
    try:
        return Plant.model_validate({"plant_id": plant_id, "broker": {"url": broker},
                                     "topic_root": topic_root or f"edgebus/{plant_id}",
                                     "model": model, "stages": stage_list})
    except ValidationError as exc:
        raise plant_error(None, from_validation_error(exc, Plant)) from None


def init_plant_file(path: str | os.PathLike[str], model_dir: str | os.PathLike[str], *,
                    stages: int = 3, broker: str = "embedded", topic_root: str | None = None,
                    force: bool = False, replicas: int = 1, weights: WeightMode = "fp32",
                    secure: bool = True,
                    gateways: Sequence[str] = DEFAULT_GATEWAYS,
                    finish: Callable[[Plant], Plant] | None = None) -> Plant:
    """Make a plant for `model_dir`, write it to `path` and return it as agents will load it.

    `secure`: with a `security:` section (see `with_security`); the passwords
    themselves are made by `broker.mosquitto_config.write_credentials`. `finish`: a
    last change before writing (`edgebus init` sizes llama.cpp nodes' KV budgets).
    """
    plant = make_plant(model_dir, stages=stages, broker=broker, topic_root=topic_root,
                       replicas=replicas, weights=weights)
    if finish is not None:
        plant = finish(plant)
    if secure:
        plant = with_security(plant, Path(path), gateways=gateways)
    return write_new_plant(plant, path, force=force)


def with_security(plant: Plant, plant_file: Path, *,
                  gateways: Sequence[str] = DEFAULT_GATEWAYS,
                  ops: Sequence[str] = DEFAULT_OPS) -> Plant:
    """`plant`, to be written to `plant_file`, with a `security:` section: an identity per
    agent, per gateway (and `edgebus http`'s) and per ops tool, their passwords in
    `credentials/` beside the plant file, and (embedded broker) the hashes in
    `broker/<plant file's stem>.passwd`; the name of one API key for `edgebus http`; and
    TLS, the plant's CA and the broker's certificate in `credentials/tls/`
    (`plant_config.certificates` makes them), with the embedded broker on 8883, MQTT over
    TLS's port. An `mqtt://` broker URL says plain MQTT on purpose: `tls: off`.

    A broker URL's shared user name and password are refused: every identity
    logs in as itself instead.
    """
    if plant.broker.username is not None or plant.broker.password is not None:
        raise PlantConfigError("the broker URL carries a user name and password, which every "
                               "agent would share; with security each identity logs in as "
                               "itself — remove user:password@ from the URL, or keep the shared "
                               "login without security (`edgebus init --insecure`)")
    home = plant_file.resolve().parent
    security = {"credentials": home / CREDENTIALS_DIR,
                "gateways": list(dict.fromkeys([*gateways, DEFAULT_HTTP_GATEWAY])),
                "ops": list(ops), "api_keys": list(DEFAULT_API_KEYS),
                "password_file": (home / PASSWORD_DIR / f"{plant_file.stem}{PASSWORD_SUFFIX}"
                                  if plant.broker.embedded else None)}
    # Here, not at the top: every agent loads plant files, and this one module of the plant's
    # certificates brings cryptography (~0.1 s to import), which only `init` needs here.
    from plant_config.certificates import default_files

    data = plant.model_dump(exclude_unset=True)
    tls_files = default_files(home / CREDENTIALS_DIR)
    if plant.broker.embedded:
        security["tls"] = tls_files
        if "port" not in plant.broker.model_fields_set:
            data["broker"] = {**data.get("broker", {}), "port": MQTTS_PORT}
    elif plant.broker.endpoint().tls:
        security["tls"] = tls_files
        if plant.broker.ca_file is None:
            data["broker"] = {**data.get("broker", {}), "ca_file": tls_files["cafile"]}
    else:
        security["tls"] = False
    data["security"] = security
    try:
        return Plant.model_validate(data)
    except ValidationError as exc:
        raise plant_error(None, from_validation_error(exc, Plant)) from None


def write_new_plant(plant: Plant, path: str | os.PathLike[str], *, force: bool = False) -> Plant:
    """Write `plant` to `path` unless a file is there (or `force`); return it as agents load it.

    A plant without task templates gets the example one, so a new plant shows
    how a PLC asks (docs/plant-file.md, "Task templates") and the Node-RED
    flow in docs/examples answers out of the box.
    """
    refuse_to_overwrite(path, force=force)
    write_plant(plant.model_copy(update={"tasks": plant.tasks or EXAMPLE_TASKS}), path)
    return load_plant(path)


def refuse_to_overwrite(path: str | os.PathLike[str], *, force: bool) -> None:
    """PlantConfigError if a file is at `path` and not `force`: `init` checks this before it
    profiles a model (`--example`: seconds to minutes), and again when it writes."""
    if Path(path).exists() and not force:
        raise PlantConfigError(f"{os.fspath(path)}: already exists — not overwriting it; "
                               "remove it first or use --force")


def _read_yaml(path: Path, source: str) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PlantConfigError(f"{source}: no such plant file — create one with "
                               f"`edgebus init {source} --model DIR`") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlantConfigError(f"{source}: cannot read the plant file: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        where = ""
        if exc.problem_mark is not None:
            where = f"line {exc.problem_mark.line + 1}, column {exc.problem_mark.column + 1}: "
        context = f" ({exc.context})" if exc.context else ""
        raise PlantConfigError(f"{source}: {where}invalid YAML: {exc.problem}{context}") from None
    except yaml.YAMLError as exc:
        raise PlantConfigError(f"{source}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise PlantConfigError(f"{source}: expected a mapping with plant_id:, topic_root:, "
                               f"model: and stages:, found {type(data).__name__}")
    return data


def _disk_problems(plant: Plant) -> list[Problem]:
    """What in a schema-valid plant does not match the files it names."""
    problems: list[Problem] = []
    try:
        num_layers, config = _num_hidden_layers(plant.model)
    except Problems as exc:
        problems.extend(exc.problems)
    else:
        ranges = [stage.layers for stage in plant.stages]
        problems.extend(p.under("stages") for p in fit_problems(ranges, num_layers, config))
    ca_file = plant.broker.ca_file
    if ca_file is not None and not ca_file.is_file():
        problems.append(Problem(("broker", "ca_file"), f"{ca_file} is not a file"))
    return problems


def _num_hidden_layers(model_dir: Path) -> tuple[int, Path]:
    """The model's decoder layer count and the file it came from (config.json, or the GGUF);
    Problems at `model`."""
    if model_dir.suffix.lower() == GGUF_SUFFIX:
        return _gguf_layers(model_dir), model_dir
    config = model_dir / "config.json"
    fix = (f"fix model: or create the directory from a GGUF checkpoint with "
           f"`edgebus model import-gguf SRC.gguf {model_dir}`")
    if model_dir.is_file():
        raise Problems([Problem(("model",), f"{model_dir} is a file, not a model directory — "
                                            "if it is a GGUF checkpoint, name it with its .gguf "
                                            "suffix (llama.cpp stages run it as it is), or "
                                            "convert it with `edgebus model import-gguf "
                                            f"{model_dir} DIR`")])
    if not model_dir.is_dir():
        raise Problems([Problem(("model",), f"no model directory at {model_dir} — {fix}")])
    if not config.is_file():
        raise Problems([Problem(("model",), f"{model_dir} has no config.json (looked for "
                                            f"{config}) — {fix}")])
    try:
        settings = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Problems([Problem(("model",), f"cannot read {config}: {exc}")]) from None
    if not isinstance(settings, dict):
        settings = {}
    nested = [settings[key] for key in _TEXT_CONFIG_KEYS if isinstance(settings.get(key), dict)]
    for section in [settings, *nested]:
        count = section.get("num_hidden_layers")
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            return count, config
    raise Problems([Problem(("model",), f"{config} has no positive integer num_hidden_layers "
                                        f"(also looked in {', '.join(_TEXT_CONFIG_KEYS)}) — "
                                        "edgebus needs a decoder-only transformer checkpoint")])


def _gguf_layers(path: Path) -> int:
    """The layer count of the GGUF file at `path`; Problems at `model`."""
    from node_agent.gguf_model import read_config  # gguf-py, read only for a GGUF plant

    if not path.is_file():
        raise Problems([Problem(("model",), f"no GGUF file at {path} — fix model:")])
    try:
        return int(read_config(path).num_hidden_layers)
    except CheckpointError as exc:
        raise Problems([Problem(("model",), str(exc))]) from None


def _path_for_file(path: Path, home: Path) -> str:
    """`path` as a plant file in `home` writes it: relative if inside `home`, so both can move."""
    return str(path.relative_to(home)) if path.is_relative_to(home) else str(path)


class _PlantDumper(yaml.SafeDumper):
    """Writes lists of scalars, i.e. layer ranges, inline: `layers: [0, 10]`."""

    def represent_list(self, data: Any) -> yaml.SequenceNode:
        flow = all(not isinstance(item, list | dict) for item in data)
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_PlantDumper.add_representer(list, _PlantDumper.represent_list)
