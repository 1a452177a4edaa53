"""Kernel options measured at a stage's first load, cached, and reported in its status."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from node_agent.engines import load_engine, tuning
from node_agent.engines.base import Kernels
from node_agent.status_payload import StatusPayload


@pytest.fixture
def model_dir(tmp_path: Path, tiny_llama: Path) -> Path:
    """A private copy: the tuning cache is written into the model directory."""
    return Path(shutil.copytree(tiny_llama, tmp_path / "model",
                                ignore=shutil.ignore_patterns(tuning.TUNING_FILE)))


def test_fp32_times_every_layout_caches_the_winner_and_reuses_it(model_dir: Path) -> None:
    kernels, how = tuning.choose(model_dir, 0, 6, "torch", "fp32", "cpu", threads=1)
    assert how == "measured"
    options = tuning.candidates("torch", "fp32", 1)
    assert kernels in options and len(options) == 3  # packed+padded, packed, plain
    cache = json.loads((model_dir / tuning.TUNING_FILE).read_text())
    (entry,) = cache.values()
    assert [Kernels(**k) for k, _ in entry["ms"]] == options
    assert all(ms > 0 for _, ms in entry["ms"])
    winner = min(entry["ms"], key=lambda pair: pair[1])[0]
    assert Kernels(**winner) == kernels and entry["cpu"] == tuning.cpu_model()

    again, how = tuning.choose(model_dir, 0, 6, "torch", "fp32", "cpu", threads=1)
    assert (again, how) == (kernels, "cached")


def test_thread_counts_are_candidates_only_where_the_plant_leaves_them_open() -> None:
    assert tuning.candidates("onnxruntime", "int4", 2) == [Kernels(2)]
    open_counts = [k.threads for k in tuning.candidates("onnxruntime", "int4", None)]
    assert open_counts[0] == 1 and open_counts[-1] == len(os.sched_getaffinity(0))


def test_a_single_candidate_is_not_timed_or_cached(model_dir: Path) -> None:
    kernels, how = tuning.choose(model_dir, 0, 3, "onnxruntime", "int8", "cpu", threads=1)
    assert (kernels, how) == (Kernels(1), "fixed")
    assert not (model_dir / tuning.TUNING_FILE).exists()


def test_the_status_reports_what_the_stage_chose(model_dir: Path) -> None:
    stage = load_engine(model_dir, 0, 6, weights="fp32", threads=1, tune=True)
    described = stage.describe()
    assert described["engine"] == "torch" and described["tuned"] == "measured"
    assert {"threads", "packed", "min_rows"} <= described.keys()
    status = json.loads(StatusPayload("stage-0", "stage", 0, (0, 6),
                                      engine=described)("online", 1))
    assert status["engine"] == described
