"""The plant file's `coordinator` section: admission, the waiting room, prompt chunks,
speculation (node_agent/coordinator/)."""

from __future__ import annotations

from pydantic import BaseModel, Field, PositiveFloat, PositiveInt, field_validator, model_validator

from edgebus.core.frames import MAX_DECODE_POSITIONS
from edgebus.core.messages import MAX_WAIT_S
from edgebus.core.topics import check_level
from plant_config.section import SECTION_CONFIG


class _Section(BaseModel):
    model_config = SECTION_CONFIG


class Speculation(_Section):
    """Drafts sent down the pipeline ahead of a lone request's token
    (node_agent/speculation.py): exact, they fill stages that would idle."""

    # Drafts a request keeps in flight ahead of its token; 0 turns speculation off. A
    # plant of S stages has S - 1 stages idle with one request: S - 1 drafts fill them.
    drafts: int = Field(default=0, ge=0, le=16)
    # Speculate only while at most this many requests are in flight: with more, the
    # coordinator's groups already keep every stage busy, and drafts would take turns
    # from other requests' tokens.
    max_in_flight: PositiveInt = 1
    # Lengths of the n-grams looked up in the request's text, longest first: one token
    # matches too often to be a quote, past 4 a match is rarely missed by a shorter one.
    min_ngram: PositiveInt = 2
    max_ngram: PositiveInt = 4
    # N-grams of the plant's recent prompts and answers kept to draft from where a
    # request's own text has no match (node_agent/ngram_cache.py); 0 turns it off. About
    # 250 bytes each: the default holds ~8 MiB, the n-grams of some 11000 tokens of text,
    # tens of recent requests; the most allowed ~250 MiB.
    answer_cache: int = Field(default=32768, ge=0, le=1_000_000)
    # Positions a decode frame carries at most, the token's and drafts: unset, the window
    # spread over a frame per stage up to the stages' `exact_rows` (node_agent/speculation.py);
    # set, at most that many, where a plant's benchmark finds smaller frames pay.
    positions_per_frame: int | None = Field(default=None, ge=1, le=MAX_DECODE_POSITIONS)

    @model_validator(mode="after")
    def _ngrams_in_order(self) -> Speculation:
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram {self.min_ngram} exceeds max_ngram {self.max_ngram}")
        return self


class CoordinatorSpec(_Section):
    """The agent that admits requests and drives the token loop."""

    id: str = "coordinator"
    max_tokens_limit: PositiveInt = 1024  # requests asking for more get an error response
    max_prompt_tokens: PositiveInt = 4096
    max_in_flight: PositiveInt = 64  # admission limit
    # What one gateway (client id) may hold of max_in_flight; past it its requests get
    # `busy`. Default: three quarters, so a gateway that floods the plant (a retry loop,
    # an HTTP gateway under load) leaves a quarter for the PLC bridges.
    max_in_flight_per_client: PositiveInt | None = None
    # Requests that may wait for a slot past max_in_flight (node_agent/coordinator/
    # waiting_room.py), fair across gateways; past it a request is answered `busy` at once,
    # with a retry time. 512 holds an alarm storm of 16 PLCs x 25 requests beside a full
    # plant (docs/benchmarks.md), and bounds the journal a storm leaves on disk and in
    # memory to 512 requests of at most 256 KiB each; 0: nothing waits (busy at once).
    max_queue: int = Field(default=512, ge=0, le=100_000)
    # Seconds a request waits for a slot at most (a request may ask for less, max_wait_s);
    # past it, `busy` with a retry time. The storm of 16 PLCs x 25 requests of 16 tokens
    # on the bundled SmolLM2 (3 llama.cpp stages, 2-core Xeon VM at load 9-13) had its
    # last answer 169-201 s after it began (docs/benchmarks.md): 600 s serves it 3 times
    # over, and a PLC still waiting for alarm advice after 10 minutes has moved on.
    max_wait_s: float = Field(default=600.0, ge=0.0, le=MAX_WAIT_S)
    candidates: PositiveInt = 64  # top-k (id, logit) pairs the last stage returns per token
    request_timeout_s: PositiveFloat = 120.0
    # Prompt positions per prefill frame. Other requests' decode steps wait
    # for at most one chunk's compute; stages work on successive chunks at the
    # same time, which cuts time to first token; and frames stay far under a
    # broker's packet limit (64 x 4096 fp32 = 1 MiB). On the rehearsed seed plant
    # (Jetson and two Pis, docs/benchmarks.md) 64 took a 1,000-token prompt to its
    # first token in 0.84x the Jetson alone's time and a 3,000-token one in 0.80x,
    # where 128 took 0.94x and 0.85x: smaller chunks keep the stages busier sooner.
    prefill_chunk: PositiveInt = 64
    # More coordinators serving the plant at once, by instance name (each runs
    # as `EDGEBUS_INSTANCE=NAME edgebus coordinator PLANT`, status `<id>.NAME`).
    # With any listed, every coordinator takes requests from one MQTT 5 shared
    # subscription; docs/failover.md says what that keeps and what it cannot.
    instances: list[str] = []
    speculation: Speculation = Field(default_factory=Speculation)

    @field_validator("id")
    @classmethod
    def _check_id(cls, agent_id: str) -> str:
        return check_level(agent_id, "coordinator id")

    @model_validator(mode="after")
    def _share_within_limit(self) -> CoordinatorSpec:
        share = self.max_in_flight_per_client
        if share is not None and share > self.max_in_flight:
            raise ValueError(f"max_in_flight_per_client {share} exceeds max_in_flight "
                             f"{self.max_in_flight}: a gateway's share is part of the whole")
        return self

    @property
    def client_limit(self) -> int:
        """Requests one gateway may have in flight (max_in_flight_per_client)."""
        return self.max_in_flight_per_client or max(1, self.max_in_flight * 3 // 4)

    @field_validator("instances")
    @classmethod
    def _check_instances(cls, names: list[str]) -> list[str]:
        for name in names:
            check_level(name, "coordinator instance")
        if len(set(names)) != len(names):
            raise ValueError("instance names must be distinct")
        return names
