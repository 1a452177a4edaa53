"""What a llama.cpp stage holds in memory, as the planner, the node's start-up check and
the rehearsal count it before anything loads.

A `weights: gguf` node holds, on its box:

- its stage GGUF, the file's bytes of its layers: read into anonymous memory
  once (the engine does not map it, so llama.cpp's repacked copy of a block is
  the only copy), counted against a cgroup and a box;
- its KV, sequences x padded positions x bytes per position: llama.cpp
  reserves (and zeroes) the whole context at load;
- llama.cpp's buffers (`LlamaCppShape.context_bytes`): the compute graph's
  scratch, the logits of a batch;
- its vocabulary of empty tokens, EMPTY_TOKEN_BYTES a token on the first and
  the last stage (no stage file keeps the tokenizer: stage_gguf.py);
- the agent process, IDLE_AGENT_BYTES: Python, numpy, paho, libllama, measured;
- the broker and the coordinator where they share its box (MOSQUITTO_BYTES or
  EMBEDDED_BROKER_BYTES, COORDINATOR_BYTES);
- HEADROOM_BYTES, for what the count leaves out.

`ContextShape` is how the engine sizes llama.cpp's context from the plant
(node_agent/engines/llamacpp/engine.py passes n_ctx = sequences x
sequence_positions and n_seq_max = sequences): one rule, here, for the engine
and for everything that counts before it loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgebus.core.frames import MAX_BATCH_ROWS
from plant_config.schema import Plant

MIB = 1 << 20
# llama.cpp's own limit on sequences in one context (LLAMA_MAX_SEQ).
MAX_SEQUENCES = 256
# llama.cpp sizes a sequence's share of the context in multiples of this many positions.
CONTEXT_PAD = 256
# `edgebus init` gives a llama.cpp node room for at least this many requests of the
# plant's longest length: one request group's rows (node_agent/groups.py), so a batch
# fits on every stage. llama.cpp reserves a request's whole share up front, so the
# default 512 MiB held none on the 15-layer stage of the 1.3B seed model (600 MiB each).
# The planner sizes the budgets it plans for `init` the same way (planner.Box.kv_requests).
INIT_KV_REQUESTS = 4
# Bytes of a float32 in llama.cpp's compute graph and logits.
_FLOAT = 4

# RSS of an idle llama.cpp stage agent that is neither its weights, nor its KV, nor
# llama.cpp's buffers, nor its vocabulary. Measured with `edgebus up` of the bundled
# SmolLM2 Q4_1 in 3 stages (the default limits, 13 requests of 5120 positions a stage)
# on the 2-vCPU EPYC, 2026-12-03, /proc/PID/status of the middle stage online and idle:
# 541 MiB anonymous (RssAnon; 487.5 MiB of KV and 27.0 of compute buffer as llama.cpp
# logs them: 26.3 MiB left) and 51.0 MiB of file pages (RssFile; 21.2 MiB of its stage
# file: 29.8 MiB of libraries). 56 MiB, and room for what its heap grows by under load.
IDLE_AGENT_BYTES = 64 * MIB
# llama.cpp's tokenizer tables, per vocabulary entry, in the coordinator (the one agent that
# tokenizes). In the run above a stage that kept the tokenizer had 22.0-24.4 MiB more
# RssAnon for SmolLM2's 49,152 tokens (and 48,900 merges): 470-520 bytes a token.
VOCAB_BYTES_PER_TOKEN = 576
# What a stage's vocabulary of empty tokens (stage_gguf.py: `tokenizer.ggml.model = none`)
# costs llama.cpp a token: its token_data entry, an empty std::string, a score and
# attributes (40 bytes on 64-bit). Measured on Llama-3-8B's first stage, 2026-12-03: 33 MiB
# less RssAnon than the same stage keeping its 128,256-token tokenizer.
EMPTY_TOKEN_BYTES = 40
# The coordinator of a llama.cpp plant (llama.cpp's tokenizer, no torch): 84.8 MiB of
# RSS idle and 87.2 MiB after 4 requests with SmolLM2 in the same run, ~27 MiB of which
# its vocabulary (VOCAB_BYTES_PER_TOKEN): this plus the model's vocabulary.
COORDINATOR_BYTES = 72 * MIB
# Mosquitto idle: 8.3 MiB of RSS (2.0.11, measured here); it grows with the messages it
# queues for slow clients, which the coordinator's in-flight bound keeps to a few MiB.
MOSQUITTO_BYTES = 16 * MIB
# The embedded broker (amqtt, in Python): 56.9 MiB of RSS at its peak in the same run.
EMBEDDED_BROKER_BYTES = 64 * MIB
# Memory a box keeps free beyond what is counted. A stage once mapped its GGUF, whose
# file pages the kernel reclaims first when a cgroup or the box is full and then reads
# again on every forward pass (the 8B shape's stage stepped 4.3x slower than predicted
# with 1,971 of 2,048 MiB planned, issue 33); read into anonymous memory the weights stay,
# and a box short of memory fails at load, not slowly. What the count leaves
# out lands there: frames waiting in the inbox (a Llama-3-8B prefill chunk is 2 MiB), the
# heap growing under load (+9 MiB on a SmolLM2 stage serving 4 requests, same run), the
# page cache of its logs and of a stage file being cut.
HEADROOM_BYTES = 64 * MIB


# llama.cpp insists on a token embedding and an LM head of the vocabulary's size in every
# model it loads, and when a file has no LM head it loads the embedding a second time as
# one (repacked for the matrix product). A first stage computes no logits and a last
# stage looks up no tokens, so each gets the matrix it does not use as a stand-in of
# zeros (node_agent/engines/llamacpp/stage_gguf.py) in the smallest type whose block
# fits a row: (ggml type, values a block, bytes a block). For Llama-3-8B in Q4_0 the
# first stage held 282 MiB of embedding twice and the last the whole embedding beside
# the head; the IQ1_S stand-in is 98 MiB.
STANDIN_TYPES = (("IQ1_S", 256, 50), ("Q4_0", 32, 18), ("F16", 1, 2))


def standin_type(hidden: int) -> tuple[str, int, int]:
    """The stand-in's type for rows of `hidden` values (STANDIN_TYPES)."""
    return next(kind for kind in STANDIN_TYPES if hidden % kind[1] == 0)


def standin_bytes(hidden: int, vocab: int) -> int:
    """Bytes of a vocabulary-sized stand-in matrix."""
    _, block, block_bytes = standin_type(hidden)
    return hidden * vocab // block * block_bytes


@dataclass(frozen=True)
class ContextShape:
    """What the plant lets one node hold, for engines that size their memory up front.

    kv_budget_bytes: the node's `kv_budget_mb`; positions: the most positions one
    request can reach (prompt plus max_tokens); batch_positions: the most positions
    one call carries (a prompt chunk, or a batch of decode rows).

    llama.cpp, with a KV stream per sequence, gives every sequence the same
    share of its context, fixed when the context is made: a request reserves
    `sequence_positions` however long it turns out, and the budget holds
    `sequences(...)` requests.
    """

    kv_budget_bytes: int
    positions: int
    batch_positions: int

    @property
    def sequence_positions(self) -> int:
        return -(-self.positions // CONTEXT_PAD) * CONTEXT_PAD

    def sequences(self, bytes_per_position: int) -> int:
        """Requests the budget holds at once, each with room for `positions`."""
        return min(MAX_SEQUENCES,
                   self.kv_budget_bytes // (self.sequence_positions * bytes_per_position))

    def share_bytes(self, bytes_per_position: int) -> int:
        """What one request reserves: its padded positions' keys and values."""
        return self.sequence_positions * bytes_per_position

    def reserved_bytes(self, bytes_per_position: int) -> int:
        """The KV llama.cpp allocates at load: every sequence's share (at most the budget)."""
        return self.sequences(bytes_per_position) * self.share_bytes(bytes_per_position)


def context_shape(plant: Plant, node_id: str) -> ContextShape:
    """What `node_id` may hold: its KV budget, a request's longest length, a call's most
    positions (a prompt chunk, or a batch of decode rows)."""
    coordinator = plant.coordinator
    return ContextShape(
        kv_budget_bytes=plant.node(node_id).kv_budget_mb * MIB,
        positions=coordinator.max_prompt_tokens + coordinator.max_tokens_limit,
        batch_positions=max(coordinator.prefill_chunk, MAX_BATCH_ROWS))


@dataclass(frozen=True)
class LlamaCppShape:
    """What llama.cpp's per-node memory is sized by, from the GGUF's metadata.

    `kv_bytes`: per layer, the bytes one position of one request adds to the
    cache in llama.cpp's f16 (keys and values; for MLA, the compressed latent
    and the rotary key, which llama.cpp stores alone and views as the values).
    """

    kv_bytes: tuple[int, ...]
    heads: int
    hidden: int
    ffn: int
    vocab: int

    def kv_per_position(self, first: int, stop: int) -> int:
        return sum(self.kv_bytes[first:stop])

    def context_bytes(self, shape: ContextShape, *, vocabulary: bool) -> int:
        """llama.cpp's buffers besides the weights and the KV, for a stage that keeps the
        vocabulary (`vocabulary`: the first and the last; a middle one keeps 32 rows).

        The compute buffer holds the widest point of a `batch_positions` graph: the
        attention scores of every head over a sequence's positions, with the mask, or
        the logits of every row; and the layer's activations beside them. The output
        buffer keeps the logits of every row a call asks for: every row, on a stage
        that captures hidden states. Both checked against llama.cpp's own log on
        SmolLM2 (27.0, 8.3 and 24.6 MiB of compute at 5,120 and 1,280 positions,
        with and without the head: these give 27.6, 8.9 and 26.6).
        """
        vocab = self.vocab if vocabulary else 0
        scores = shape.sequence_positions * (self.heads + 1)
        activations = 4 * self.hidden + 2 * self.ffn
        compute = _FLOAT * shape.batch_positions * (max(scores, vocab) + activations)
        output = _FLOAT * shape.batch_positions * vocab
        return compute + output

    def vocabulary_bytes(self) -> int:
        """The tokenizer's tables (the coordinator's)."""
        return VOCAB_BYTES_PER_TOKEN * self.vocab

    def empty_vocabulary_bytes(self) -> int:
        """A first or a last stage's vocabulary of empty tokens."""
        return EMPTY_TOKEN_BYTES * self.vocab
