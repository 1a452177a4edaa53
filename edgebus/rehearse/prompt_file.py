"""`edgebus rehearse --prompt-file FILE`: the requests of a plant's own workload, read and
checked before anything is built.

A plant rehearses what its PLCs will send (alarm texts, code to explain) instead of the
built-in PROMPTS (workload.py). A file is either

- text: one prompt per non-empty line, each used verbatim; or
- JSON: a list whose items are prompts (strings) or request objects as the gateway
  contract has them (`{"messages": [...], "max_tokens": 64}`, or a plant task).

Each item is checked as the coordinator checks a request (`parse_request`, then
`apply_task` against the plant's tasks), so that a bad item stops the rehearsal with its
place in the file before minutes of loading, not as an error answer at the end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgebus.core.errors import PromptFileError, RequestError
from edgebus.core.messages import MAX_NUMBER_CHARS, GenerateRequest, parse_request
from plant_config import Plant
from plant_config.tasks import apply_task

# A file named so is read as JSON whatever it starts with, and one named .txt as prompts
# whatever it starts with: the name settles what sniffing the content cannot, a text file
# whose first prompt starts with "[" (a PLC alarm such as "[E042] axis 2 ...").
JSON_SUFFIX = ".json"
TEXT_SUFFIX = ".txt"
# The content of a file named neither way is a JSON list if it starts with this.
JSON_LIST_START = "["
# Fields the rehearsal sets on every request itself: it names each one (the measurement
# reads answers back by id), streams it (the first delta times TTFT) and reads its answer
# on its own client's topic.
REHEARSAL_FIELDS = ("id", "stream", "reply_to")
# The id an item is checked under: the contract requires one, and the rehearsal gives each
# request it sends its own.
_CHECK_ID = "prompt-file"
# Characters of a wrong item shown in its error: enough to find it in the file, not a
# whole object (or a file's worth of one) in a terminal line.
EXCERPT_CHARS = 40
ITEM_SHAPE = ('an item is a prompt (a string) or a request object such as {"messages": '
              '[{"role": "user", "content": "..."}], "max_tokens": 64}')


@dataclass(frozen=True)
class FileRequest:
    """One request of a prompt file, checked as the coordinator checks a request."""

    request: GenerateRequest    # under a stand-in id; its fields as the item set them
    where: str                  # "FILE, line 3" or "FILE, 3rd item": for an error about it


def read_prompt_file(path: Path) -> tuple[FileRequest, ...]:
    """The requests of `path`, in the file's order; PromptFileError if it holds none or an
    item is no request."""
    text = _read_text(path)
    if _is_json(path, text):
        items = [(f"--prompt-file {path}, {_ordinal(n)} item", item)
                 for n, item in enumerate(_json_list(path, text), 1)]
    else:
        items = [(f"--prompt-file {path}, line {n}", line)
                 for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not items:
        raise PromptFileError(f"--prompt-file {path} holds no prompt: write one prompt per line, "
                              f"or a JSON list of prompts and requests ({ITEM_SHAPE})")
    return tuple(FileRequest(_request(where, item), where) for where, item in items)


def check_for_plant(requests: tuple[FileRequest, ...], plant: Plant) -> None:
    """Refuse, as the plant's coordinator would answer it, a request that names a task the
    plant lacks (or fills one in wrongly) or asks for more tokens than the plant allows."""
    limit = plant.coordinator.max_tokens_limit
    for file_request in requests:
        request = file_request.request
        try:
            apply_task(request, plant.tasks)
        except RequestError as exc:
            raise PromptFileError(f"{file_request.where}: {exc.message}") from None
        if "max_tokens" in request.model_fields_set and request.max_tokens > limit:
            raise PromptFileError(f"{file_request.where}: max_tokens {request.max_tokens} is "
                                  f"past the plant's limit of {limit} (coordinator."
                                  "max_tokens_limit): lower it, or raise the limit")


def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PromptFileError(f"--prompt-file {path}: cannot read it ({exc.strerror})") from None
    try:
        # utf-8-sig: a file saved by Windows tools starts with a byte order mark, which
        # would otherwise open the first prompt (or hide the JSON list's "[").
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise PromptFileError(f"--prompt-file {path} is not UTF-8 ({exc.reason} at byte "
                              f"{exc.start}): save it as UTF-8") from None


def _is_json(path: Path, text: str) -> bool:
    suffix = path.suffix.lower()
    if suffix in (JSON_SUFFIX, TEXT_SUFFIX):
        return suffix == JSON_SUFFIX
    return text.lstrip().startswith(JSON_LIST_START)


def _json_list(path: Path, text: str) -> list[Any]:
    named = path.suffix.lower() == JSON_SUFFIX
    why = "" if named else (f" (it starts with {JSON_LIST_START!r}, so it is read as JSON; "
                            f"name it *{TEXT_SUFFIX} to read it as one prompt per line)")
    try:
        data = json.loads(text, parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        raise PromptFileError(f"--prompt-file {path} is not valid JSON{why}: {exc.msg} at line "
                              f"{exc.lineno} column {exc.colno}") from None
    except _LongNumber as exc:
        raise PromptFileError(f"--prompt-file {path} holds a number of {exc.digits} "
                              f"characters; a request's numbers have at most "
                              f"{MAX_NUMBER_CHARS}") from None
    except RecursionError:
        raise PromptFileError(f"--prompt-file {path} nests lists or objects deeper than the JSON "
                              "parser follows: a request is a flat object with a list of "
                              "messages") from None
    if not isinstance(data, list):
        raise PromptFileError(f"--prompt-file {path}: a JSON prompt file is a list ([...]) of "
                              f"prompts and requests, not {_kind(data)}; {ITEM_SHAPE}")
    return data


class _LongNumber(Exception):
    def __init__(self, digits: int) -> None:
        super().__init__(digits)
        self.digits = digits


def _bounded_int(text: str) -> int:
    # Refused before Python converts it, as parse_request refuses it: past 4300 digits
    # int() raises a ValueError whose advice (sys.set_int_max_str_digits) is Python's, not
    # the file's fix, and a long one costs time quadratic in its length.
    if len(text) > MAX_NUMBER_CHARS:
        raise _LongNumber(len(text))
    return int(text)


def _request(where: str, item: object) -> GenerateRequest:
    if isinstance(item, str):
        if not item.strip():
            raise PromptFileError(f"{where} is an empty prompt: write its text or remove it")
        fields: dict[str, Any] = {"prompt": item}
    elif isinstance(item, dict):
        if own := [name for name in REHEARSAL_FIELDS if name in item]:
            raise PromptFileError(f"{where} sets {', '.join(map(repr, own))}, which the "
                                  "rehearsal sets on every request itself (it names each, "
                                  "streams it and reads its answer): remove "
                                  + ("it" if len(own) == 1 else "them"))
        fields = item
    else:
        raise PromptFileError(f"{where} is {_kind(item)}; {ITEM_SHAPE}")
    try:
        return parse_request(json.dumps({"id": _CHECK_ID, **fields}).encode())
    except RequestError as exc:
        # A field wrong: the item's shape helps; too large: only shortening it does.
        fix = ": shorten it" if exc.code == "too_large" else f"; {ITEM_SHAPE}"
        raise PromptFileError(f"{where}: {exc.message}{fix}") from None


def _kind(value: object) -> str:
    names = {dict: "an object", list: "a list", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    text = json.dumps(value)
    shown = text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "..."
    return f"{names.get(type(value), type(value).__name__)} ({shown})"


def _ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th ... 11th, 12th, 13th ... 21st: an item's place counted from 1, as a
    reader counts, where JSON's own indices count from 0."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
