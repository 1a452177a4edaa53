"""The model's tokenizer and chat template without transformers: `tokenizers` and jinja2.

A box that runs the llamacpp engine has no transformers (docs/deploy.md), so
its coordinator reads the files transformers' `save_pretrained` wrote into the
model directory (tokenizer.json, tokenizer_config.json, chat_template.jinja)
with the libraries transformers itself hands them to: the Rust `tokenizers`
for ids, jinja2's sandbox for the chat template. It offers what node_agent/text.py
calls of a transformers tokenizer, and gives the same ids and text
(tests/test_text.py compares them on the models the tests run).

`TemplatedTokenizer` is that interface with the chat template rendered here;
`FileTokenizer` fills in ids from tokenizer.json, and gguf_tokenizer.py's
`GgufTokenizer` from a GGUF's own vocabulary, through llama.cpp.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

from edgebus.core.errors import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The special tokens a chat template sees by name, as transformers passes them.
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                  "cls_token", "mask_token")
# What transformers' `clean_up_tokenization` undoes, for the WordPiece tokenizers it is
# meant for (transformers skips it for BPE, and so does this module).
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
             (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which transformers' templates may use to
    mark the assistant's part: rendered as its body, as transformers renders it."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it so, on Extension)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' tojson: jinja2's own escapes HTML characters, which a prompt must keep.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken's fields."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class TemplatedTokenizer(ABC):
    """What node_agent/text.py calls of a transformers tokenizer, its chat template rendered
    as transformers renders it: a subclass supplies the ids and the text of ids, and sets
    `special_tokens_map`, `eos_token_id` and `chat_template`."""

    special_tokens_map: dict[str, str]
    eos_token_id: int | None
    chat_template: str | None
    _template: jinja2.Template | None = None

    @abstractmethod
    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """`text` as ids, special tokens in it recognised; `add_special_tokens`: with those
        the tokenizer adds around a text (a BOS, where the model wants one)."""

    @abstractmethod
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """`ids` as text; `skip_special_tokens`: leaving out special tokens (EOS, chat
        markers)."""

    def __call__(self, text: str) -> dict[str, list[int]]:
        """`text` as ids, with the special tokens the tokenizer adds."""
        return {"input_ids": self.encode(text, add_special_tokens=True)}

    def apply_chat_template(self, chat: list[dict[str, Any]], *, add_generation_prompt: bool,
                            tokenize: bool = True, return_dict: bool = True) -> Any:
        """`chat` rendered by the model's template and tokenized, as transformers does it."""
        if self.chat_template is None:
            raise CheckpointError("the model has no chat template: send 'prompt', not "
                                  "'messages'")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[_Generation, jinja2.ext.loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(self.chat_template)
        # transformers drops the keys a message leaves None before rendering.
        messages = [{k: v for k, v in m.items() if v is not None} for m in chat]
        text = self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens_map)
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids} if return_dict else ids


class FileTokenizer(TemplatedTokenizer):
    """The tokenizer of a model directory, as transformers' fast tokenizer would load it."""

    def __init__(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / TOKENIZER_FILE
        if not path.is_file():
            raise CheckpointError(f"{model_dir} holds no {TOKENIZER_FILE}, which the coordinator "
                                  "of a llama.cpp plant reads: import the model with `edgebus "
                                  "model import-gguf FILE.gguf DIR`")
        self._tokenizer = Tokenizer.from_file(str(path))
        config_path = model_dir / TOKENIZER_CONFIG_FILE
        config: dict[str, Any] = (json.loads(config_path.read_text())
                                  if config_path.is_file() else {})
        self.special_tokens_map = {name: text for name in _NAMED_SPECIAL
                                   if (text := _token_text(config.get(name))) is not None}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
        extra_texts = [t for t in map(_token_text, extra if isinstance(extra, list) else [])
                       if t is not None]
        # transformers marks the config's special tokens special in the backend too, so that
        # decoding with skip_special_tokens leaves them out.
        self._tokenizer.add_special_tokens(
            [AddedToken(text, special=True) for text in
             [*self.special_tokens_map.values(), *extra_texts]])
        eos = self.special_tokens_map.get("eos_token")
        self.eos_token_id = None if eos is None else self._tokenizer.token_to_id(eos)
        self._clean_up = bool(config.get("clean_up_tokenization_spaces")) and (
            json.loads(path.read_text()).get("model", {}).get("type") != "BPE")
        template_path = model_dir / CHAT_TEMPLATE_FILE
        template = (template_path.read_text() if template_path.is_file()
                    else config.get("chat_template"))
        if isinstance(template, list):  # named templates: transformers uses "default"
            template = {t.get("name"): t.get("template") for t in template}.get("default")
        self.chat_template = template if isinstance(template, str) else None

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        if self._clean_up:
            for old, new in _CLEAN_UP:
                text = text.replace(old, new)
        return text
