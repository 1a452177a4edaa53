"""The cheap parts of the boxes check (tools/boxes_check.sh, docs/boxes-check.md): how its
gateway judges each request's fate, and its command line. The check itself boots five
containers and takes minutes: it is run by hand, not in the suite."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from dev_tools import ROOT, dev_tool

dev_tool("tools/whole_answer.py")  # what boxes_gateway imports by name
gateway = dev_tool("tools/boxes_gateway.py")

REFERENCES = {str(i): [i, 1, 2, 3] for i in range(len(gateway.PROMPTS))}


def results(tmp_path: Path, wave: str, *fates: dict[str, object]) -> Path:
    (tmp_path / "refs.json").write_text(json.dumps(REFERENCES))
    (tmp_path / f"{wave}.json").write_text(json.dumps(
        [{"id": f"{wave}-{i}", "index": i, "seconds": 1.0, **fate}
         for i, fate in enumerate(fates)]))
    return tmp_path / "refs.json"


def test_answers_token_exact_refusals_and_unsent_requests_pass(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refs = results(tmp_path, "w",
                   {"tokens": [0, 1, 2, 3], "error": None},
                   {"tokens": [], "error": {"code": "unavailable", "message": "stage 1 ..."}},
                   {"gateway_error": "coordinator 'coordinator' is not online on broker:8883"})
    assert gateway.check(refs, tmp_path, ["w"])
    out = capsys.readouterr().out
    assert "w-0: 1.0 s, token-exact (4 tokens)" in out
    assert "w-1: 1.0 s, refused: unavailable: stage 1 ..." in out
    assert "w-2: 1.0 s, not sent: coordinator" in out


@pytest.mark.parametrize(("fate", "said"), [
    ({"tokens": [0, 1, 2, 4], "error": None}, "DIFFERENT"),
    ({"gateway_error": "no response to request w-0 within 360 s"}, "LOST"),
])
def test_a_different_or_lost_answer_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          fate: dict[str, object], said: str) -> None:
    assert not gateway.check(results(tmp_path, "w", fate), tmp_path, ["w"])
    assert said in capsys.readouterr().out


def test_a_wave_without_results_fails(tmp_path: Path) -> None:
    assert not gateway.check(results(tmp_path, "w"), tmp_path, ["w", "missing"])


@pytest.mark.parametrize("args", [["bogus"], ["in", "stage-1"]])
def test_the_script_says_how_to_call_it(args: list[str]) -> None:
    done = subprocess.run(["bash", str(ROOT / "tools/boxes_check.sh"), *args],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 1
    assert "usage: tools/boxes_check.sh" in done.stderr
