"""The bench's harness: the pipeline measured against one-process baselines and llama.cpp's own
tools on the same machine (benchmarks/pipeline_vs_peers.py runs it; developer tooling, not
installed with edgebus).

- `metrics`: the arithmetic (percentiles, rates, bytes per token, per-hop overhead), pure.
- `workload`: the fixed prompts and requests every phase sends.
- `baseline`: transformers and llama.cpp in this process, and memory references.
- `gateway`: the MQTT side: a timestamping gateway, a frame sniffer, a broker ping-pong.
- `runner`: the phases, each plant started as real processes, and the command itself.
- `results`: what a run measured, as plain data.
- `report`: the targets, `docs/benchmarks.md` and its plot.
- `peers`: llama.cpp's own tools (built once into a cache), llama-server and RPC driven.
- `seed_model`: the random model of the seed plant's shape.
- `speculation`: drafts off and on; `shared_cores`: stages chained by pipes on shared cores;
  `stage_steps`: each stage's step against the whole model's; `roofline`: memory bandwidth.
"""
