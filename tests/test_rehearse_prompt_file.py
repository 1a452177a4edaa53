"""`edgebus rehearse --prompt-file`: a plant's own requests as the rehearsal's workload.

The file's two formats, each bad input's one message (the file, the item, what to fix),
the requests the workload sends from it, and a real rehearsal of SmolLM2's bundled GGUF
sending a file's requests through `edgebus rehearse --prompt-file`.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
from pathlib import Path

import optional
import pytest
from gguf_models import PROCESS_KV_BUDGET_MB

from edgebus.cli import main
from edgebus.core.errors import EdgebusError, PromptFileError
from edgebus.core.messages import ChatMessage
from edgebus.model_import import bundled_gguf
from edgebus.rehearse.prompt_file import FileRequest, check_for_plant, read_prompt_file
from edgebus.rehearse.rehearsal import missing
from edgebus.rehearse.workload import DEFAULT_TOKENS, Workload
from plant_config import BrokerSettings, Liveness, Plant, StageSpec, write_plant
from plant_config.coordinator_section import CoordinatorSpec
from plant_config.schema import BoxSpec
from plant_config.tasks import TaskTemplate

CHAT = {"messages": [{"role": "system", "content": "You are a PLC assistant."},
                     {"role": "user", "content": "Explain: LD I0.0 AND I0.1 ST Q0.0"}],
        "max_tokens": 7}


def write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def read(path: Path) -> list[FileRequest]:
    return list(read_prompt_file(path))


def refused(path: Path) -> str:
    with pytest.raises(PromptFileError) as caught:
        read_prompt_file(path)
    assert isinstance(caught.value, EdgebusError)
    return str(caught.value)


# --- the two formats -------------------------------------------------------------------


def test_a_text_file_is_one_prompt_per_non_empty_line_verbatim(tmp_path: Path) -> None:
    path = write(tmp_path, "prompts", "Axis 2 following error. Check:\r\n\n   \n"
                                      "  [E042] press 3 low pressure  \n")
    requests = read(path)
    assert [r.request.prompt for r in requests] == ["Axis 2 following error. Check:",
                                                    "  [E042] press 3 low pressure  "]
    assert [r.where for r in requests] == [f"--prompt-file {path}, line 1",
                                           f"--prompt-file {path}, line 4"]
    # Nothing set but the prompt: the rehearsal's own knobs apply (Workload).
    assert requests[0].request.model_fields_set == {"id", "prompt"}


def test_a_json_list_holds_prompts_and_chat_requests(tmp_path: Path) -> None:
    path = write(tmp_path, "w.json", json.dumps(["List three causes of a pressure drop:", CHAT]))
    prompt, chat = (r.request for r in read(path))
    assert prompt.prompt == "List three causes of a pressure drop:" and prompt.messages is None
    assert chat.messages == [ChatMessage(role="system", content="You are a PLC assistant."),
                             ChatMessage(role="user", content="Explain: LD I0.0 AND I0.1 ST Q0.0")]
    assert chat.max_tokens == 7 and "max_tokens" in chat.model_fields_set


def test_content_starting_with_a_bracket_is_json_unless_named_txt(tmp_path: Path) -> None:
    listed = json.dumps(["first", "second"])
    sniffed = write(tmp_path, "prompts.list", "\ufeff\n  " + listed)  # byte order mark, spaces
    assert [r.request.prompt for r in read(sniffed)] == ["first", "second"]
    # A PLC alarm text opens with "[": named .txt, it stays a prompt.
    named = write(tmp_path, "alarms.txt", "[E042] axis 2 following error\n" + listed)
    assert [r.request.prompt for r in read(named)] == ["[E042] axis 2 following error", listed]
    # Not named .txt, the same alarm file is read as JSON, and the message says how to fix it.
    message = refused(write(tmp_path, "alarms", "[E042] axis 2 following error\n"))
    assert message.startswith(f"--prompt-file {tmp_path / 'alarms'} is not valid JSON (it starts "
                              "with '[', so it is read as JSON; name it *.txt to read it as one "
                              "prompt per line): Expecting value at line 1 column 2"), message


# --- each bad input, one message -------------------------------------------------------


@pytest.mark.parametrize(("name", "content", "expected"), [
    ("empty.txt", "", "holds no prompt: write one prompt per line, or a JSON list"),
    ("blank.txt", "\n  \n\t\n", "holds no prompt"),
    ("empty.json", "[]", "holds no prompt"),
    ("broken.json", '["a",', "is not valid JSON: Expecting value at line 1 column 6"),
    ("object.json", json.dumps(CHAT), "a JSON prompt file is a list ([...]) of prompts and "
     "requests, not an object ({\"messages\": [{\"role\": \"system\", \"conten...); an "
     "item is a "
     "prompt (a string) or a request object such as"),
    ("long.json", '[{"prompt": "a", "max_tokens": 1' + "0" * 5000 + "}]",
     "holds a number of 5001 characters; a request's numbers have at most 40"),
    ("deep.json", "[" * 100_000 + "]" * 100_000, "nests lists or objects deeper than the JSON "
     "parser follows"),
    ("latin1.txt", "Druckabfall an Presse 3 \u2013 Ursachen?".encode("cp1252"),
     "is not UTF-8 (invalid start byte at byte 24): save it as UTF-8"),
])
def test_a_file_that_holds_no_request_is_refused(tmp_path: Path, name: str,
                                                 content: str | bytes, expected: str) -> None:
    path = write(tmp_path, name, content)
    message = refused(path)
    assert message.startswith(f"--prompt-file {path}") and expected in message, message


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    assert refused(tmp_path / "nope.txt") == (f"--prompt-file {tmp_path / 'nope.txt'}: cannot "
                                              "read it (No such file or directory)")


@pytest.mark.parametrize(("items", "expected"), [
    (["ok", 42], "2nd item is a number (42); an item is a prompt (a string) or a request "
     "object such as {\"messages\": [{\"role\": \"user\", \"content\": \"...\"}], "
     "\"max_tokens\": 64}"),
    (["ok", "ok", "  "], "3rd item is an empty prompt: write its text or remove it"),
    ([{"messages": [{"role": "user"}]}], "1st item: messages.0.content: Field required; an "
     "item is a prompt"),
    ([{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}],
     "1st item: max_tokens: Input should be greater than or equal to 1"),
    ([{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}],
     "1st item: request: give exactly one of 'prompt'"),
    ([{"messages": [{"role": "user", "content": "hi"}], "max_token": 9}],
     "1st item: max_token: unknown field: remove it"),
    ([*["ok"] * 10, {"messages": [{"role": "user", "content": "hi"}], "id": "mine",
                     "stream": False}],
     "11th item sets 'id', 'stream', which the rehearsal sets on every request itself (it "
     "names each, streams it and reads its answer): remove them"),
    ([{"prompt": "x" * (256 * 1024)}],
     "1st item: request is 262179 bytes; the limit is 262144: shorten it"),
])
def test_a_bad_item_is_refused_with_its_place_and_what_to_fix(
        tmp_path: Path, items: list[object], expected: str) -> None:
    path = write(tmp_path, "w.json", json.dumps(items))
    message = refused(path)
    assert message.startswith(f"--prompt-file {path}, ") and expected in message, message
    assert "Traceback" not in message and "\n" not in message


def test_the_cli_prints_the_error_without_a_traceback_before_starting_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plant = seed_plant(tmp_path)
    bad = write(tmp_path, "w.json", json.dumps(["ok", {"messages": []}]))
    with pytest.raises(SystemExit) as exited:
        main(["rehearse", str(plant), "--prompt-file", str(bad)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err == (f"edgebus: error: --prompt-file {bad}, 2nd item: messages: List should have "
                   "at least 1 item after validation, not 0; an item is a prompt (a string) or "
                   "a request object such as {\"messages\": [{\"role\": \"user\", \"content\": "
                   "\"...\"}], \"max_tokens\": 64}\n"), err


# --- against the plant -----------------------------------------------------------------


def seed_plant(tmp_path: Path) -> Path:
    """A one-box plant file of SmolLM2's bundled GGUF, with a task and a low token limit."""
    plant = Plant(plant_id="p", topic_root="edgebus/p", broker=BrokerSettings(url="mqtt://a:1883"),
                  model=bundled_gguf(), boxes=[BoxSpec(name="a", memory_mb=2048)],
                  stages=[StageSpec(node="a", layers=(0, 30), weights="gguf")],
                  coordinator=CoordinatorSpec(max_tokens_limit=100),
                  tasks={"explain": TaskTemplate(user="Explain: {code}", vars={"code": "str"})})
    path = tmp_path / "plant.yaml"
    write_plant(plant, path)
    return path


def test_items_are_checked_against_the_plants_tasks_and_token_limit(tmp_path: Path) -> None:
    from plant_config import load_plant

    plant = load_plant(seed_plant(tmp_path))
    path = write(tmp_path, "w.json", json.dumps([
        {"task": "explain", "vars": {"code": "LD I0.0"}, "max_tokens": 100}]))
    check_for_plant(read_prompt_file(path), plant)  # a task of the plant, at the limit
    for items, expected in [
        ([{"task": "alarm", "vars": {}}], "1st item: no task 'alarm' in this plant; known "
         "tasks: explain"),
        ([{"task": "explain", "vars": {"cod": "LD I0.0"}}], "1st item: task 'explain'"),
        (["ok", CHAT | {"max_tokens": 101}], "2nd item: max_tokens 101 is past the plant's "
         "limit of 100 (coordinator.max_tokens_limit): lower it, or raise the limit"),
    ]:
        path = write(tmp_path, "w.json", json.dumps(items))
        with pytest.raises(PromptFileError) as caught:
            check_for_plant(read_prompt_file(path), plant)
        assert str(caught.value).startswith(f"--prompt-file {path}, ") \
            and expected in str(caught.value), str(caught.value)


# --- what the workload sends -----------------------------------------------------------


def test_the_workload_sends_the_files_requests_in_order_cycling(tmp_path: Path) -> None:
    path = write(tmp_path, "w.json", json.dumps(["first", CHAT, {"prompt": "third",
                                                                  "ignore_eos": False}]))
    workload = Workload(requests=5, tokens=12,
                        file_requests=tuple(r.request for r in read_prompt_file(path)))
    batch = workload.batch("r-")
    assert [r.id for r in batch] == ["r-0", "r-1", "r-2", "r-3", "r-4"]
    assert [r.prompt for r in batch] == ["first", None, "third", "first", None]
    assert batch[1].messages is not None and batch[1].messages[1].content.startswith("Explain")
    # --tokens and ignore_eos where the item sets neither; the item's own where it does.
    assert [r.max_tokens for r in batch] == [12, 7, 12, 12, 7]
    assert [r.ignore_eos for r in batch] == [True, True, False, True, True]
    assert all(r.stream for r in batch)
    assert workload.mean_tokens() == round((12 + 7 + 12 + 12 + 7) / 5)
    assert workload.describe("w.json") == ("5 requests from w.json (3 in it, in turn, again from "
                                           "the first), 12 tokens where an item sets no "
                                           "max_tokens")
    assert Workload(2, file_requests=workload.file_requests).describe("w.json").startswith(
        "2 requests from w.json (3 in it, the first 2)")
    # Without a file: the built-in prompts, as before.
    assert Workload(2).describe() == f"2 requests x {DEFAULT_TOKENS} tokens"


# --- a real rehearsal ------------------------------------------------------------------

# Up to every agent online and the answers, with a llama.cpp agent on a busy machine.
RUN_S = 300.0
# The measurement waits for a heartbeat before and after each workload (warm-up and the
# run): at the default 2 s, most of the run (as test_rehearse_cleanup.py sets it).
LIVENESS = Liveness(heartbeat_s=0.25, timeout_s=6.0)
# Positions a request may take, which llama.cpp reserves whole: 256 + 64 of SmolLM2's
# 30 layers are ~7 MiB of KV, 4 requests in PROCESS_KV_BUDGET_MB (the default 4096 + 1024
# are 113 MiB each).
SHORT_PROMPTS = 256
FEW_TOKENS = 64


@optional.needs(missing(), "a rehearsal")
@optional.HOST_NETWORK
def test_edgebus_rehearse_sends_a_prompt_files_requests(tmp_path: Path) -> None:
    """SmolLM2's bundled GGUF on one box, through `python -m edgebus rehearse --prompt-file`:
    the file's chat asks for 7 tokens and its prompt for --tokens 2, 3 requests cycle
    through the 2, and the summary counts what was answered: 7 + 2 + 7 = 16 tokens."""
    plant = Plant(plant_id="prompt-file", topic_root=f"edgebus-test/{secrets.token_hex(4)}",
                  broker=BrokerSettings(url="mqtt://box-a:1883"), model=bundled_gguf(),
                  boxes=[BoxSpec(name="box-a", memory_mb=2048)],
                  stages=[StageSpec(node="box-a", layers=(0, 30), weights="gguf",
                                    kv_budget_mb=PROCESS_KV_BUDGET_MB)],
                  coordinator=CoordinatorSpec(max_prompt_tokens=SHORT_PROMPTS,
                                              max_tokens_limit=FEW_TOKENS),
                  liveness=LIVENESS)
    plant_path = tmp_path / "plant.yaml"
    write_plant(plant, plant_path)
    prompts = write(tmp_path, "plc.json", json.dumps([CHAT, "List three causes of a pressure "
                                                            "drop on a hydraulic press:"]))
    done = subprocess.run([sys.executable, "-m", "edgebus", "rehearse", str(plant_path),
                           "--prompt-file", str(prompts), "--requests", "3", "--tokens", "2",
                           "--cpus", "1"], capture_output=True, text=True, timeout=RUN_S)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert (f"workload: 3 requests from {prompts} (2 in it, in turn, again from the first), "
            "2 tokens where an item sets no max_tokens") in out, out
    # 16 tokens over 3 requests: the summary's mean per request.
    assert re.search(r"^3 requests x 5 tokens in \d", out, re.MULTILINE), out
    assert "error:" not in out, out
