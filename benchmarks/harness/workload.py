"""What every phase of the bench sends: two fixed prompts, greedy, a fixed number of tokens.

The pipeline and the one-process baselines get the same token ids: both go
through `node_agent.text.prompt_ids`, which is what the coordinator runs.
"""

from __future__ import annotations

import secrets

from transformers import PreTrainedTokenizerBase

from edgebus.core.messages import ChatMessage, GenerateRequest
from node_agent.text import prompt_ids

# The question `edgebus demo` asks: a typical short shop-floor chat turn.
CHAT_PROMPT = "What does a PLC do in a factory? Answer in two sentences."
# The TTFT phase's prompt length: a long work instruction or alarm history pasted in.
LONG_PROMPT_TOKENS = 512
# Built from words that are one token each in SmolLM2's vocabulary, so the
# prompt reaches LONG_PROMPT_TOKENS exactly.
_FILLER = ("the press line stops when the oil pressure in the main pump drops below "
           "the set point and the operator has to reset the alarm on the panel before "
           "the next part can be made so check the filter and the valve first ")


def chat_request(request_id: str, max_tokens: int) -> GenerateRequest:
    """The short chat prompt, greedy, exactly `max_tokens` tokens (EOS ignored), streamed."""
    return GenerateRequest(id=request_id, messages=[ChatMessage(role="user", content=CHAT_PROMPT)],
                           max_tokens=max_tokens, ignore_eos=True, stream=True)


def long_request(request_id: str, prompt: str, max_tokens: int = 1) -> GenerateRequest:
    """The long prompt verbatim, greedy; one token by default, for time to first token."""
    return GenerateRequest(id=request_id, prompt=prompt, max_tokens=max_tokens,
                           ignore_eos=True, stream=True)


def long_prompt(tokenizer: PreTrainedTokenizerBase, tokens: int = LONG_PROMPT_TOKENS) -> str:
    """The longest prefix (in words) of a fixed filler text that is at most `tokens` tokens."""
    words = (_FILLER * (tokens // len(_FILLER.split()) + 2)).split()
    low, high = 1, len(words)  # invariant: words[:low] fits
    while low < high:
        mid = (low + high + 1) // 2
        if len(prompt_ids(tokenizer, long_request("probe", " ".join(words[:mid])))) <= tokens:
            low = mid
        else:
            high = mid - 1
    return " ".join(words[:low])


def request_id(tag: str) -> str:
    """A unique request id (a topic level) that says which phase sent it."""
    return f"{tag}-{secrets.token_hex(4)}"
