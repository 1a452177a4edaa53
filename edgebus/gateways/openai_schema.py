"""The part of OpenAI's HTTP API the gateway serves, as pydantic models.

Requests keep OpenAI's field names and ranges. Fields the plant cannot
honour (tools, log probabilities, penalties, several choices) are refused
with a 400 that names them rather than ignored: an answer that silently
ignored a penalty or a tool list would look right and be wrong. Fields that
change nothing about the answer (`user`, `metadata`, ...) are accepted and
ignored, since every client sends some of them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgebus.core.messages import ChatMessage, FinishReason, GenerateRequest

# OpenAI's chat roles; "developer" is its newer name for "system", and
# chat templates know only "system".
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Request(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extension (openai clients send it in extra_body): generate exactly
    # max_tokens, for benchmarks and tests that need a known length.
    ignore_eos: bool = False
    # edgebus's extension (extra_body): how long the request may wait for the plant to
    # start it, within the plant's coordinator.max_wait_s (GenerateRequest.max_wait_s).
    max_wait_s: float | None = None

    @model_validator(mode="after")
    def _supported(self) -> _Request:
        refused = self._unsupported()
        if refused:
            raise ValueError(f"not supported by this server: {', '.join(refused)}; "
                             "leave them out")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def _unsupported(self) -> list[str]:
        refused = []
        if self.n != 1:
            refused.append("n other than 1")
        if self.presence_penalty or self.frequency_penalty:
            refused.append("presence_penalty and frequency_penalty other than 0")
        if self.logit_bias:
            refused.append("logit_bias")
        return refused

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _knobs(self) -> dict[str, Any]:
        # Always streamed from the coordinator: the gateway then hears of every
        # token, and its timeout is a time without word, not a cap on length.
        knobs: dict[str, Any] = {"stream": True, "ignore_eos": self.ignore_eos}
        for name in ("max_tokens", "temperature", "top_p", "seed", "max_wait_s"):
            value = getattr(self, name)
            if value is not None:
                knobs[name] = value
        if self.stop is not None:
            knobs["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        return knobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart]

    @model_validator(mode="after")
    def _known_role(self) -> ChatMessageIn:
        if self.role not in _ROLES:
            raise ValueError(f"role {self.role!r} is not supported: use one of "
                             f"{', '.join(_ROLES)}")
        return self

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    logprobs: bool | None = None
    response_format: dict[str, Any] | None = None

    def _unsupported(self) -> list[str]:
        refused = super()._unsupported()
        if self.tools or self.functions:
            refused.append("tools and functions")
        if self.logprobs:
            refused.append("logprobs")
        if self.response_format is not None and self.response_format.get("type") != "text":
            refused.append("response_format other than text")
        return refused

    def to_generate(self, request_id: str) -> GenerateRequest:
        """The plant's request for this chat; raises pydantic's ValidationError on bad values."""
        knobs = self._knobs()
        if self.max_completion_tokens is not None:  # its newer name, which wins
            knobs["max_tokens"] = self.max_completion_tokens
        return GenerateRequest(
            id=request_id, **knobs,
            messages=[ChatMessage(role=_ROLES[m.role], content=m.text()) for m in self.messages])


class CompletionRequest(_Request):
    prompt: str | list[str]
    suffix: str | None = None
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None

    def _unsupported(self) -> list[str]:
        refused = super()._unsupported()
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            refused.append("a list of prompts (send one prompt per request)")
        if self.suffix:
            refused.append("suffix (fill-in-the-middle)")
        if self.echo:
            refused.append("echo")
        if self.best_of not in (None, 1):
            refused.append("best_of other than 1")
        if self.logprobs:
            refused.append("logprobs")
        return refused

    def to_generate(self, request_id: str) -> GenerateRequest:
        """The plant's request for this prompt; raises pydantic's ValidationError on bad values."""
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        return GenerateRequest(id=request_id, prompt=prompt, **self._knobs())


# -- responses ---------------------------------------------------------------------

OpenAIFinish = Literal["stop", "length"]


def finish_reason(reason: FinishReason) -> OpenAIFinish:
    """OpenAI's finish reason for the plant's ("error" never reaches a successful answer)."""
    return "length" if reason == "length" else "stop"


class UsageOut(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: OpenAIFinish
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageOut


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: OpenAIFinish | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageOut | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: OpenAIFinish | None
    logprobs: None = None


class Completion(BaseModel):
    """A text completion, and (with `usage` None or choices empty) one chunk of a stream."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageOut | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
