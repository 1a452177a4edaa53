"""PLC task templates: named prompts a PLC fills in with typed values.

A PLC cannot compose prose, but it can publish a task name and a few tag
values. The plant file's `tasks:` section names each template:

    tasks:
      alarm_summary:
        system: You are a maintenance assistant. Answer in one sentence.
        user: "Machine {machine} raised alarm {code}. What should the operator check first?"
        vars: {code: int, machine: str}
        max_tokens: 48

and a gateway publishes `{"id": "a1", "task": "alarm_summary", "vars": {"code": 4711,
"machine": "press 3"}}`. The coordinator renders it into a chat (system, user)
that goes through the model's chat template, like a `messages` request.
"""

from __future__ import annotations

import string
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from edgebus.core.errors import RequestError
from edgebus.core.messages import (
    MAX_STOP_STRINGS,
    ChatMessage,
    GenerateRequest,
    StopString,
    VarValue,
)

VarType = Literal["str", "int", "float", "bool"]
# What a JSON value must be for each declared type. bool is excluded from int and
# float on purpose: Python counts True as 1, a PLC sending TRUE for a count is a bug.
_ACCEPTS: dict[VarType, tuple[type, ...]] = {
    "str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}
# A str variable is a tag value or a machine name, not a document: this bounds
# what one variable adds to the prompt.
MAX_STR_VAR_CHARS = 1024


class TaskTemplate(BaseModel):
    """One named prompt: a system prompt, a user template and the defaults of its requests."""

    model_config = ConfigDict(extra="forbid")

    system: str | None = None
    # `{name}` is a variable; `{{` and `}}` are literal braces.
    user: str = Field(min_length=1)
    vars: dict[str, VarType] = {}
    max_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=10.0)
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)

    @field_validator("system", "user")
    @classmethod
    def _plain_fields(cls, text: str | None) -> str | None:
        for _, name, spec, conversion in string.Formatter().parse(text or ""):
            # Attribute or index access ({x.y}, {x[0]}) would let a template reach
            # into Python objects, and a format spec ({x:04d}) fails on the text a
            # value is rendered as: only plain names are variables.
            if name is not None and (not name.isidentifier() or spec or conversion):
                raise ValueError(f"{{{name}{'!' + conversion if conversion else ''}"
                                 f"{':' + spec if spec else ''}}} is not a plain variable: "
                                 "use {name} for a variable, {{ and }} for literal braces")
        return text

    @model_validator(mode="after")
    def _vars_match_fields(self) -> TaskTemplate:
        used = _fields(self.user) | _fields(self.system or "")
        if undeclared := sorted(used - self.vars.keys()):
            raise ValueError(f"the template uses {', '.join(undeclared)} but vars: does not "
                             "declare them: add each with its type (str, int, float or bool)")
        if unused := sorted(self.vars.keys() - used):
            raise ValueError(f"vars: declares {', '.join(unused)} but neither system nor user "
                             "uses them: use {name} in the template or remove the variable")
        return self

    def render(self, task: str, values: dict[str, VarValue]) -> list[ChatMessage]:
        """The chat this task means with `values`; RequestError naming any variable that is
        missing, not declared or of the wrong type."""
        if missing := sorted(self.vars.keys() - values.keys()):
            raise RequestError("missing_var", f"task {task!r} needs vars {', '.join(missing)} "
                               f"({', '.join(f'{n}: {self.vars[n]}' for n in missing)})")
        if extra := sorted(values.keys() - self.vars.keys()):
            raise RequestError("unknown_var", f"task {task!r} has no vars {', '.join(extra)}; "
                               f"it takes {', '.join(sorted(self.vars)) or 'none'}")
        for name, kind in self.vars.items():
            value = values[name]
            if not isinstance(value, _ACCEPTS[kind]) or (kind != "bool"
                                                         and isinstance(value, bool)):
                raise RequestError("wrong_type", f"task {task!r}: var {name} must be {kind}, "
                                   f"got {type(value).__name__} {value!r}")
            if isinstance(value, str) and len(value) > MAX_STR_VAR_CHARS:
                raise RequestError("wrong_type", f"task {task!r}: var {name} is {len(value)} "
                                   f"characters; the limit is {MAX_STR_VAR_CHARS}")
        text = {name: _show(values[name]) for name in self.vars}
        chat = [ChatMessage(role="user", content=self.user.format_map(text))]
        if self.system is not None:
            chat.insert(0, ChatMessage(role="system", content=self.system.format_map(text)))
        return chat


def apply_task(request: GenerateRequest, tasks: dict[str, TaskTemplate]) -> GenerateRequest:
    """`request` as a chat request, if it names a task: the template's defaults for the knobs
    the request leaves unset. A request without a task is returned as it is."""
    if request.task is None:
        return request
    template = tasks.get(request.task)
    if template is None:
        known = ", ".join(sorted(tasks)) or "none: add a tasks: section to the plant file"
        raise RequestError("unknown_task", f"no task {request.task!r} in this plant; "
                           f"known tasks: {known}")
    messages = template.render(request.task, request.vars or {})
    given = request.model_fields_set
    defaults = {key: getattr(template, key) for key in ("max_tokens", "temperature", "stop")
                if key not in given}
    return request.model_copy(update={"task": None, "vars": None, "messages": messages,
                                      **defaults})


def _fields(text: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}


def _show(value: VarValue) -> str:
    # JSON's spelling for booleans: a PLC engineer reads "true", not Python's "True".
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


# What `edgebus init` writes into a new plant file, as an example to follow.
EXAMPLE_TASKS = {"alarm_summary": TaskTemplate(
    system="You are a maintenance assistant on a shop floor. Answer in one or two sentences.",
    user="Machine {machine} raised alarm {code}. What should the operator check first?",
    vars={"machine": "str", "code": "int"}, max_tokens=64)}
