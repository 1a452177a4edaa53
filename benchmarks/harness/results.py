"""What one bench run measured, as plain data: the runner fills it, the report renders it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from harness.metrics import HopLatency, LoadStats, StreamStats
from plant_config.schema import WeightMode

if TYPE_CHECKING:
    from harness.peers import PeerRuns, Skipped
    from harness.shared_cores import Floor
    from harness.speculation import SpeculationLoad, SpeculationRun
    from harness.stage_steps import StageSteps

BROKERS = ("amqtt", "mosquitto")
# The pipeline's weight modes: fp32 (torch, the exact reference) on every broker, and the
# fast mode on the production broker only (the broker is not what it is about).
WEIGHT_MODES: tuple[WeightMode, ...] = ("fp32", "int4", "gguf")
# Requests per closed-loop client, single-stream runs, and concurrency levels.
FULL_REQUESTS_EACH, QUICK_REQUESTS_EACH = 2, 1
FULL_RUNS, QUICK_RUNS = 3, 2
FULL_CONCURRENCY, QUICK_CONCURRENCY = (1, 4, 8, 16), (1, 4)
# Concurrency of the "boxes add throughput" phase: enough requests to keep two stages busy.
BOXES_CONCURRENCY = (4, 8)
DEFAULT_TOKENS, QUICK_TOKENS = 64, 16
# The bench's command, from the repository's root: docs/benchmarks.md says how to repeat a run.
BENCH_SCRIPT = "benchmarks/pipeline_vs_peers.py"


@dataclass(frozen=True)
class BenchSettings:
    out: Path
    quick: bool
    brokers: tuple[str, ...]
    tokens: int  # generated per request, every request
    weights: tuple[WeightMode, ...] = WEIGHT_MODES
    # The seed's model shape (DeepSeek-Coder-1.3B, random weights): minutes per variant.
    seed_shape: bool = True

    @property
    def concurrency(self) -> tuple[int, ...]:
        return QUICK_CONCURRENCY if self.quick else FULL_CONCURRENCY

    @property
    def requests_each(self) -> int:
        return QUICK_REQUESTS_EACH if self.quick else FULL_REQUESTS_EACH

    @property
    def runs(self) -> int:
        """Measured runs of each one-request-at-a-time measurement."""
        return QUICK_RUNS if self.quick else FULL_RUNS

    @property
    def boxes(self) -> bool:
        """The pinned-stage phase: fp32 torch stages, so only when fp32 is measured."""
        return not self.quick and "fp32" in self.weights

    def command(self) -> str:
        """The command line that repeats this run."""
        default = QUICK_TOKENS if self.quick else DEFAULT_TOKENS
        parts = ["python", BENCH_SCRIPT, "--out", str(self.out)]
        parts += ["--quick"] if self.quick else []
        parts += [] if self.brokers == BROKERS else ["--brokers", ",".join(self.brokers)]
        parts += [] if self.tokens == default else ["--tokens", str(self.tokens)]
        parts += [] if self.weights == WEIGHT_MODES else ["--weights", ",".join(self.weights)]
        parts += [] if self.seed_shape or self.quick else ["--no-seed-shape"]
        return " ".join(parts)


@dataclass(frozen=True)
class Machine:
    cpu: str
    cores: int
    usable_cores: int
    memory_gib: float
    kernel: str
    python: str
    torch: str
    transformers: str
    mosquitto: str | None
    llama_cpp: str | None
    date: str
    load_average: tuple[float, float, float]  # at the start: other work skews every number


@dataclass(frozen=True)
class TransformersBaseline:
    single: StreamStats
    batch_tok_s: dict[int, float]  # batch size -> generated tokens / s
    long_ttft_s: float             # the long prompt's prefill plus its first token


@dataclass(frozen=True)
class OneCoreBaseline:
    """transformers on one pinned core with one thread: the one process that 2 pinned
    stages are compared with."""

    single_tok_s: float            # requests one at a time: how generate serves them
    batch_tok_s: dict[int, float]  # the same requests as one static batch: an upper bound


@dataclass(frozen=True)
class Wire:
    """Payload bytes one decode token puts on each activation topic ({root}/act/<agent>)."""

    per_topic: dict[str, float]

    @property
    def per_hop(self) -> float:
        return sum(self.per_topic.values()) / len(self.per_topic)


@dataclass(frozen=True)
class PipelineRun:
    broker: str
    weights: str
    engine: str                   # what `engine: auto` runs `weights` on
    single: StreamStats
    load: list[LoadStats]
    long_ttft_s: float
    wire: Wire
    hop: HopLatency
    compute_per_step_s: list[float] | None  # per stage; None when stages publish no metrics
    overhead_per_hop_s: float | None
    # process name -> bytes: peak (VmHWM) once online (loading included, nothing
    # served yet), after the one-request-at-a-time measurements, at the end of the
    # phase (every concurrency's KV caches included), and RSS (VmRSS) at the end.
    online_peak_rss: dict[str, int]
    single_peak_rss: dict[str, int]
    peak_rss: dict[str, int]
    end_rss: dict[str, int]
    # stage node -> its status's `engine`: kernel choice and weight bytes
    engines: dict[str, dict[str, str | int | float]]

    @property
    def label(self) -> str:
        return f"{self.weights} ({self.engine}) over {self.broker}"

    def at(self, concurrency: int) -> LoadStats | None:
        return next((s for s in self.load if s.concurrency == concurrency), None)


@dataclass(frozen=True)
class BoxesRun:
    stages: int
    layers: list[tuple[int, int]]  # each stage's [first, last + 1)
    load: list[LoadStats]


@dataclass(frozen=True)
class SeedShapeRun:
    """One engine and weight mode of the seed's model shape, 3 stages over Mosquitto."""

    engine: str
    weights: str
    completion: StreamStats       # SEED_COMPLETION_TOKENS generated, one request
    weight_bytes: int             # all stages together


@dataclass(frozen=True)
class SeedShape:
    """The seed's model shape (DeepSeek-Coder-1.3B, random weights) beside llama.cpp."""

    model: str
    prompt_tokens: int
    tokens: int
    runs: list[SeedShapeRun]
    llama_cpp: dict[str, StreamStats | Skipped]  # GGUF type -> llama-server single stream
    stage_gguf: str = "Q4_0"  # the GGUF type the llamacpp stages run
    stage_threads: int = 1  # each edgebus stage's, as `edgebus up` gives them on this box
    # llama-server on the stages' GGUF type with a stage's threads, where those are fewer than
    # the box's cores: the one-process run the stages are held to.
    llama_cpp_stage_threads: StreamStats | Skipped | None = None


@dataclass(frozen=True)
class BenchResult:
    settings: BenchSettings
    machine: Machine
    model: str
    chat_prompt_tokens: int
    long_prompt_tokens: int
    transformers: TransformersBaseline
    llama_cpp: StreamStats | None  # None: llama-cpp-python is not installed
    idle_rss: int
    stage_layers: list[tuple[int, int]]
    stage_param_bytes: list[int]
    pipelines: list[PipelineRun]
    boxes: list[BoxesRun]  # empty with --quick
    one_core: OneCoreBaseline | None  # None with --quick
    elapsed_s: float
    notes: list[str]
    bandwidth_gbs: float | None = None   # memory read bandwidth of one thread
    peers: PeerRuns | None = None        # llama.cpp's own tools on the bundled GGUF
    seed_shape: SeedShape | None = None  # None with --quick or --no-seed-shape
    # llama.cpp stages' decode steps against the whole model's, per model and thread count.
    stage_steps: list[StageSteps] | None = None
    # The llama.cpp stages chained by pipes against the whole model, per model: what sharing
    # this box's cores costs a plant, with no transport at all.
    floors: list[Floor] | None = None
    # A lone request with prompt-lookup drafts and without, per model and workload, beside
    # llama.cpp with and without its lookup decoding; and 16 at once, drafts on and off.
    speculation: list[SpeculationRun] | None = None
    speculation_load: SpeculationLoad | None = None
