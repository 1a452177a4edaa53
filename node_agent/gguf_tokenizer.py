"""A GGUF's own tokenizer and chat template, for a plant whose `model:` names a GGUF file.

The ids come from llama.cpp itself: the file is loaded vocabulary only
(`vocab_only`: no tensor is read), and `llama_tokenize` / `llama_detokenize`
turn text into ids and back, as llama.cpp run whole on that file does. The
chat template is the one the file carries (`tokenizer.chat_template`),
rendered in the same jinja2 sandbox as a model directory's
(tokenizer.TemplatedTokenizer), with the special tokens' texts the file
names. So the coordinator needs neither transformers nor torch, and nothing
of the file is converted (tests/test_gguf_model.py compares ids and text with
the model directory the same GGUF imports to).

Two threads call one tokenizer (the coordinator tokenizes prompts on one and
decodes on another): llama.cpp's vocabulary is read-only once loaded, and
each tokenize call makes its own session.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from edgebus.core.errors import CheckpointError
from node_agent import gguf_model
from node_agent.engines.llamacpp import library
from node_agent.tokenizer import TemplatedTokenizer

# llama.cpp's LLAMA_TOKEN_NULL: the id of a special token the vocabulary does not have.
_NO_TOKEN = -1


class GgufTokenizer(TemplatedTokenizer):
    """The tokenizer of the GGUF file at `path`, through llama.cpp."""

    def __init__(self, path: Path) -> None:
        self._llama = lowlevel = library.llama()
        params = lowlevel.llama_model_default_params()
        params.vocab_only = True
        params.n_gpu_layers = 0
        self._model = lowlevel.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise CheckpointError(f"llama.cpp could not read the vocabulary of {path}: its "
                                  "reasons are in the log lines above (logger llama.cpp)")
        self._vocab = lowlevel.llama_model_get_vocab(self._model)
        count = int(lowlevel.llama_vocab_n_tokens(self._vocab))
        self.special_tokens_map = {
            name: bytes(lowlevel.llama_vocab_get_text(self._vocab, token)).decode()
            for name, token in gguf_model.special_token_ids(path).items() if 0 <= token < count}
        eos = int(lowlevel.llama_vocab_eos(self._vocab))
        self.eos_token_id = None if eos == _NO_TOKEN else eos
        template = lowlevel.llama_model_chat_template(self._model, None)
        self.chat_template = None if template is None else bytes(template).decode()

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        data = text.encode()
        # A token is at least one byte, plus the few the tokenizer adds (BOS, EOS).
        capacity = len(data) + 8
        while True:
            ids = (ctypes.c_int32 * capacity)()
            # parse_special: special tokens written in the text are those tokens, as in
            # transformers (a chat template's markers above all).
            count = int(self._llama.llama_tokenize(self._vocab, data, len(data), ids, capacity,
                                                   add_special_tokens, True))
            if count >= 0:
                return list(ids[:count])
            capacity = -count  # what it needs

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        tokens = (ctypes.c_int32 * len(ids))(*ids)
        capacity = 16 * len(ids) + 16  # bytes: most tokens are a few; grown below if not
        while True:
            text = ctypes.create_string_buffer(capacity)
            # remove_special off: transformers keeps a BOS unless told to skip special tokens,
            # which unparse_special off does for every control token.
            size = int(self._llama.llama_detokenize(self._vocab, tokens, len(ids), text,
                                                    capacity, False, not skip_special_tokens))
            if size >= 0:
                return text.raw[:size].decode("utf-8", errors="replace")
            capacity = -size

    def close(self) -> None:
        if self._model:
            self._llama.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        self.close()
