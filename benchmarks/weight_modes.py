"""Engines and weight modes side by side: speed, memory and quality of each.

    python benchmarks/weight_modes.py [--out docs/weight-modes.md]

The whole demo model (SmolLM2-135M-Instruct) runs as one stage in each
variant (an engine and a weight mode, node_agent/engines/), on one thread:

- decode tokens/s of a single stream after a 64-token prompt, the variants
  taking turns so that other work on the cores weighs on all of them alike;
- the stage's resident memory above an idle process's, measured in a child
  process per variant, for the whole model and for a middle stage (layers
  10-19: no embedding, no head);
- greedy agreement with torch fp32 (the reference, token-exact against
  `generate`): the fraction of generated tokens equal to its at the same
  position, over fixed chat prompts of 32 tokens each (a token after the first
  difference is compared in a different context, so this counts how long
  outputs stay the same as much as how often);
- perplexity of a fixed English text, every token predicted by decode steps
  (teacher forcing), the path a stage runs in production.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from edgebus.model_import import ensure_demo_model
from node_agent.engines import StageEngine, load_engine
from node_agent.engines.onnx_engine import prepare_graphs
from node_agent.engines.tuning import cpu_model
from node_agent.kv_cache import KVCache
from plant_config.schema import EngineName, WeightMode

THREADS = 1             # as the measurements: kernels compared, not cores
MIDDLE = (10, 20)       # a stage with neither end: its weights are decoder layers only
PROMPT_TOKENS = 64      # a short chat's worth of history
WARMUP_STEPS = 4        # first calls pay for allocation and lazy initialisation
# The modes take turns for a few short rounds and each keeps its best: the cores
# here are shared, and a busy moment slows one round, not one mode's whole figure.
TIMING_ROUNDS = 6
STEPS_PER_ROUND = 12    # 0.3-1 s a round: long enough to time, short enough to interleave
AGREEMENT_TOKENS = 32
AGREEMENT_PROMPTS = (
    "What does a PLC do in a factory?",
    "Give three reasons a hydraulic press loses pressure.",
    "Explain preventive maintenance in one paragraph.",
    "Write a short safety reminder for forklift drivers.",
)
# Fixed, plain English (written for this benchmark): ~300 tokens, enough for a
# perplexity that tells 1 % apart, short enough to score in seconds per mode.
PERPLEXITY_TEXT = (
    "The maintenance team starts every shift with a walk through the plant. They listen to "
    "the presses, check the oil levels on the hydraulic units and read the counters on the "
    "conveyor drives. Anything unusual goes into the log, together with the time and the name "
    "of the machine. Most days the walk takes half an hour and finds nothing, but once or "
    "twice a month it catches a leaking seal or a bearing that has started to run hot before "
    "it stops a line.\n\n"
    "When a machine does stop, the operator first makes it safe: the power is switched off, "
    "the stored pressure is released and a lock is put on the main switch. Only then does the "
    "technician open the guard. The cause is often simple, such as a loose cable, a blocked "
    "filter or a sensor covered in dust. A good technician checks these first, because they "
    "are quick to test and cheap to fix, and moves on to the controller and the program only "
    "when the simple causes have been ruled out.\n\n"
    "Spare parts are kept in a small store next to the workshop. Each shelf is labelled, and "
    "the parts that fail most often, such as fuses, belts and proximity sensors, are always "
    "kept in stock. At the end of the month the team looks at the log, counts how often each "
    "machine stopped and for how long, and decides which repairs to plan for the next "
    "shutdown. Over a year, this simple routine has cut unplanned downtime by more than a "
    "third."
)

# Run in a child process: its resident memory grows by the stage and nothing else.
_RSS_CHILD = """
import json, sys
from pathlib import Path
import torch
from node_agent.engines import load_engine

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024

model_dir, engine, weights = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
first, end = int(sys.argv[4]), int(sys.argv[5])
load_engine(model_dir, 1, 2, engine=engine, weights=weights, threads=1)  # imports, lazy init
base = rss()
stage = load_engine(model_dir, first, end, engine=engine, weights=weights, threads=1)
if isinstance(stage, torch.nn.Module):
    # Every weight resident. max, not sum: an int8 sum makes int64 temporaries that
    # would count as the stage's memory. (ONNX Runtime holds its weights loaded.)
    assert all(bool(p.max().isfinite()) for p in stage.parameters())
print(json.dumps({"grown": rss() - base}))
"""


@dataclass(frozen=True)
class Variant:
    """An engine and weight mode, on the fp32 import or on a GGUF import that kept its blocks."""

    engine: EngineName
    weights: WeightMode
    kept_gguf: bool = False

    @property
    def label(self) -> str:
        return f"{self.engine} {self.weights}" + (" (GGUF blocks kept)" if self.kept_gguf
                                                  else "")


VARIANTS = (Variant("torch", "fp32"), Variant("torch", "bf16"), Variant("torch", "int8"),
            Variant("onnxruntime", "fp32"), Variant("onnxruntime", "int8"),
            Variant("onnxruntime", "int4"), Variant("onnxruntime", "int4", kept_gguf=True))


@dataclass(frozen=True)
class VariantResult:
    variant: Variant
    tokens_per_s: float
    rss_bytes: int               # the whole model as one stage, above an idle process
    middle_rss_bytes: int        # layers MIDDLE
    weight_bytes: int
    agreement: tuple[int, int]   # tokens equal to torch fp32's, tokens compared
    perplexity: float


def stage_rss(model_dir: Path, variant: Variant, first: int, end: int) -> int:
    """Bytes a process's resident memory grows by when it loads the stage [first, end)."""
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(model_dir), variant.engine,
                          variant.weights, str(first), str(end)], check=True,
                         capture_output=True, text=True, timeout=600).stdout
    grown: int = json.loads(out.strip().splitlines()[-1])["grown"]
    return grown


def decode_tokens_per_s(models: dict[Variant, StageEngine]) -> dict[Variant, float]:
    """Best single-stream decode rate of each model over interleaved rounds."""
    caches = {variant: KVCache() for variant in models}
    positions = dict.fromkeys(models, PROMPT_TOKENS)
    token = torch.tensor([[100]])

    def steps(variant: Variant, count: int) -> None:
        for _ in range(count):
            models[variant].decode(token, [caches[variant]], [positions[variant]])
            positions[variant] += 1

    for variant, model in models.items():
        model.prefill(torch.arange(100, 100 + PROMPT_TOKENS).unsqueeze(0), caches[variant], 0)
        steps(variant, WARMUP_STEPS)
    best = dict.fromkeys(models, 0.0)
    for _ in range(TIMING_ROUNDS):
        for variant in models:
            started = time.perf_counter()
            steps(variant, STEPS_PER_ROUND)
            best[variant] = max(best[variant],
                                STEPS_PER_ROUND / (time.perf_counter() - started))
    return best


def greedy(model: StageEngine, prompt: list[int]) -> list[int]:
    cache = KVCache()
    logits = model.prefill(torch.tensor([prompt]), cache, 0)                          # [1,V]
    tokens: list[int] = []
    for position in range(len(prompt), len(prompt) + AGREEMENT_TOKENS):
        tokens.append(int(logits.argmax()))
        logits = model.decode(torch.tensor([[tokens[-1]]]), [cache], [position])
    return tokens


def perplexity(model: StageEngine, ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of ids[1:], each predicted from the ones before it."""
    cache = KVCache()
    logits = model.prefill(torch.tensor([ids[:1]]), cache, 0)                         # [1,V]
    nll = 0.0
    for position, token in enumerate(ids[1:], start=1):
        nll -= float(F.log_softmax(logits[0], dim=-1)[token])
        if position < len(ids) - 1:
            logits = model.decode(torch.tensor([[token]]), [cache], [position])
    return math.exp(nll / (len(ids) - 1))


def _chat_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    encoded: Any = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                 add_generation_prompt=True, return_dict=True)
    return list(encoded["input_ids"])


def measure(model_dirs: dict[bool, Path]) -> list[VariantResult]:
    """Every variant whose model directory is in `model_dirs` (by `kept_gguf`)."""
    variants = [v for v in VARIANTS if v.kept_gguf in model_dirs]
    fp32_dir = model_dirs[False]
    tokenizer = AutoTokenizer.from_pretrained(fp32_dir)
    prompts = [_chat_ids(tokenizer, p) for p in AGREEMENT_PROMPTS]
    text_ids: list[int] = tokenizer(PERPLEXITY_TEXT)["input_ids"]
    layers = AutoConfig.from_pretrained(fp32_dir).num_hidden_layers
    models = {v: load_engine(model_dirs[v.kept_gguf], 0, layers, engine=v.engine,
                             weights=v.weights, threads=THREADS) for v in variants}
    speed = decode_tokens_per_s(models)
    reference = [greedy(models[VARIANTS[0]], prompt) for prompt in prompts]
    results = []
    for variant, model in models.items():
        outputs = [greedy(model, prompt) for prompt in prompts]
        same = sum(a == b for out, ref in zip(outputs, reference, strict=True)
                   for a, b in zip(out, ref, strict=True))
        model_dir = model_dirs[variant.kept_gguf]
        if variant.engine == "onnxruntime":  # built here, so the child measures loading only
            for first, end in ((1, 2), MIDDLE):
                prepare_graphs(model_dir, first, end, variant.weights, progress=False)
        result = VariantResult(variant=variant, tokens_per_s=speed[variant],
                               rss_bytes=stage_rss(model_dir, variant, 0, layers),
                               middle_rss_bytes=stage_rss(model_dir, variant, *MIDDLE),
                               weight_bytes=model.param_bytes,
                               agreement=(same, len(prompts) * AGREEMENT_TOKENS),
                               perplexity=perplexity(model, text_ids))
        print(result, flush=True)
        results.append(result)
    return results


def table(results: list[VariantResult]) -> str:
    base = results[0]
    lines = ["| engine and weights | decode tok/s | stage RSS above idle, whole model | "
             f"stage RSS above idle, layers {MIDDLE[0]}-{MIDDLE[1] - 1} | weight bytes | "
             "greedy tokens equal to torch fp32's | perplexity |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        same, total = r.agreement
        lines.append(
            f"| {r.variant.label} "
            f"| {r.tokens_per_s:.1f} ({r.tokens_per_s / base.tokens_per_s:.2f}x) "
            f"| {r.rss_bytes / 2**20:.0f} MiB ({r.rss_bytes / base.rss_bytes:.2f}x) "
            f"| {r.middle_rss_bytes / 2**20:.0f} MiB "
            f"({r.middle_rss_bytes / base.middle_rss_bytes:.2f}x) "
            f"| {r.weight_bytes / 2**20:.0f} MiB | {same}/{total} ({same / total:.0%}) "
            f"| {r.perplexity:.3f} ({(r.perplexity / base.perplexity - 1) * 100:+.2f} %) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/weight-modes.md"))
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    model_dirs = {False: ensure_demo_model(), True: ensure_demo_model(keep_quantized=True)}
    # The cores may be shared: the load says how much, tok/s ratios within a run still hold.
    load = os.getloadavg()[0]
    results = measure(model_dirs)
    text_tokens = len(AutoTokenizer.from_pretrained(model_dirs[False])(PERPLEXITY_TEXT)[
        "input_ids"])
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    args.out.write_text(_document(results, stamp, load, text_tokens))
    print(f"wrote {args.out}")


def _document(results: list[VariantResult], stamp: str, load: float, text_tokens: int) -> str:
    return (
        "# Weight modes\n\n"
        "A stage's weights can be kept in fp32 (the default), bf16, int8 or int4, and run by "
        "the torch or the onnxruntime engine; the plant file chooses per node (`weights:` and "
        "`engine:` in [plant-file.md](plant-file.md), or `edgebus init ... --weights`). "
        f"Measured by `python benchmarks/weight_modes.py` on {stamp} on {cpu_model()}, "
        f"{THREADS} thread, the whole SmolLM2-135M-Instruct as one stage (load average "
        f"{load:.1f} on {os.cpu_count()} cores when it started: compare tok/s within the "
        "table, not across runs).\n\n"
        f"{table(results)}\n\n"
        f"- decode tok/s: one stream after a {PROMPT_TOKENS}-token prompt; the variants take "
        f"{TIMING_ROUNDS} turns of {STEPS_PER_ROUND} steps and each keeps its best turn.\n"
        "- stage RSS above idle: how much a process's resident memory grows when it loads the "
        "stage (in a child process per variant), for the whole model and for a stage with "
        "neither end (no embedding, no head); weight bytes: what the tensors (torch) or the "
        "graphs' files (onnxruntime) hold. A whole-model stage holds the tied embedding/head "
        "matrix twice in torch fp32 (plain for the embedding, packed for oneDNN for the head) "
        "and in onnxruntime (a lookup table beside the head's graph).\n"
        f"- greedy tokens: {len(AGREEMENT_PROMPTS)} fixed chat prompts, {AGREEMENT_TOKENS} "
        "tokens each, compared position by position with torch fp32's.\n"
        f"- perplexity: a fixed {text_tokens}-token English text built into the benchmark, "
        "every token scored by a decode step.\n\n"
        "How each works. torch (`node_agent/engines/torch_weights.py`): bf16 stores every "
        "Linear, the embedding and each MoE expert's matrices in bf16 and runs those matmuls "
        "in bf16; int8 stores them as int8 with one bf16 scale per output row and runs "
        "torch's `aten._weight_int8pack_mm` on bf16 activations. onnxruntime "
        "(`node_agent/engines/onnx_weights.py`): ONNX Runtime's `MatMulNBits` on blocks of 32 "
        "weights with int8 activations (accuracy level 4); int8 is symmetric 8-bit codes, "
        "int4 is 4-bit codes spanning each block's [min, max] with a float minimum, as "
        "GGUF's Q4_1, and keeps the embedding and the LM head at 8 bits as llama.cpp does. "
        "Norms and the KV cache stay fp32 everywhere. Only torch fp32 is token-exact against "
        "`generate`, which is why it is the default; every other variant is token-exact "
        "against itself in one process through any split (tests/test_engines.py), torch "
        "bf16 only on a CPU with AVX512-BF16 and no AMX, where that was verified (AMD EPYC, "
        "Zen 4): on an Intel Xeon with AVX-512 a bf16 row's result depended on the rows "
        "batched with it.\n\n"
        "About the int4 perplexity: SmolLM2's fp32 import is itself the bundled Q4_1 GGUF "
        "dequantized, so int4 with a float minimum per block nearly finds that grid again. A "
        "model trained in fp32 loses more. Measured on this model, rounding the minimum to an "
        "integer zero point instead (ONNX Runtime's own quantizer) cost +29 % perplexity, "
        "symmetric 4-bit codes +25 %; that is why int4 keeps the minimum, at 4 extra small "
        "operators per product.\n\n"
        "Paths tried for int8 on torch and not taken: optimum-quanto qint8 (12.6 tok/s "
        "against 30 for fp32 on an earlier run); `_weight_int8pack_mm` with fp32 or fp16 "
        "activations (10-16x slower per matmul than with bf16); int8 dequantized to bf16 "
        "before each matmul (3x slower than fp32); torch.ao dynamic quantization (it also "
        "quantizes activations to 8 bits per tensor, and torch.ao.quantization is "
        "deprecated). For int4 on torch, `aten._weight_int4pack_mm_for_cpu` was only ~1.3x "
        "faster than the int8 kernel per matmul here.\n\n"
        "Reproduce: `python benchmarks/weight_modes.py` (about 10 minutes on an idle 2-core "
        "box; the demo model is imported on first use, and the first load of each "
        "onnxruntime variant builds its graphs).\n")


if __name__ == "__main__":
    main()
