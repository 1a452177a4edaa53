"""llama.cpp's greedy answer for a plant's GGUF run whole, in this one unconstrained process:
what a llama.cpp plant must answer token for token (the prompt fits the coordinator's first
chunk, so the plant's chunking cannot make them differ; tests/test_llamacpp.py holds the
chunked whole-model path to the same `Llama.generate`).

    python tools/whole_answer.py PLANT --prompt TEXT --tokens N [--ignore-eos]

prints the answer's token ids as JSON. tools/aarch64_plant.py and
benchmarks/bigger_than_any_box.py compare their plants with it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llama_cpp import Llama

from edgebus.core.messages import GenerateRequest
from node_agent.coordinator.token_loop import prefill_chunks
from node_agent.engines.llamacpp import library
from node_agent.gguf_tokenizer import GgufTokenizer
from node_agent.model_config import generation_eos
from node_agent.text import prompt_ids
from plant_config import Plant, load_plant

# Positions the reference's context holds: a prompt chunk and an answer (a few MiB of KV).
CONTEXT = 512


def whole(plant: Plant, request: GenerateRequest) -> list[int]:
    """llama.cpp's greedy answer with the whole GGUF, one request, in this process."""
    tokenizer = GgufTokenizer(plant.model)
    ids = prompt_ids(tokenizer, request)
    tokenizer.close()
    chunks = prefill_chunks(len(ids), plant.coordinator.prefill_chunk)
    if len(chunks) != 1:
        sys.exit(f"{request.id}: a prompt of {len(ids)} tokens is cut into {len(chunks)} "
                 "chunks, which Llama.generate does not reproduce: use a shorter one")
    # Its weights placed as the stages place theirs (off AMX where an x86 CPU faults in it;
    # on ARM, only the matrices whose repacked kernels keep rows exact repacked).
    with library.placed_as_stages(plant.model):
        llm = Llama(str(plant.model), n_ctx=CONTEXT, n_batch=128, n_threads=1,
                    flash_attn=True, verbose=False)
    eos = generation_eos(plant.model)
    stop = set() if request.ignore_eos else set(eos) if isinstance(eos, list) else {eos}
    tokens: list[int] = []
    for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0):
        tokens.append(token)  # the coordinator's answer ends with the end token too
        if len(tokens) == request.max_tokens or token in stop:
            break
    llm.close()
    return tokens



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("plant", type=Path)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--ignore-eos", action="store_true")
    args = parser.parse_args()
    request = GenerateRequest(id="whole", prompt=args.prompt, max_tokens=args.tokens,
                              ignore_eos=args.ignore_eos)
    print(json.dumps(whole(load_plant(args.plant), request)))


if __name__ == "__main__":
    main()
