"""Plant-file problems: a field path plus what is wrong there.

Validators and the loader collect `Problem`s instead of stopping at the first,
so one `PlantConfigError` lists everything a plant engineer has to fix, each
on its own line as `plant.yaml: stages[1].layers: ...`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import NamedTuple, get_args

from pydantic import BaseModel, ValidationError

from edgebus.core.errors import PlantConfigError

Loc = tuple[str | int, ...]


def format_loc(loc: Loc) -> str:
    """`("stages", 1, "layers")` -> `stages[1].layers`."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else part
    return text


class Problem(NamedTuple):
    loc: Loc
    message: str

    def under(self, *prefix: str | int) -> Problem:
        """The same problem, seen from a model that holds this one at `prefix`."""
        return Problem((*prefix, *self.loc), self.message)

    def __str__(self) -> str:
        return f"{format_loc(self.loc)}: {self.message}" if self.loc else self.message


class Problems(ValueError):
    """Raised by a validator that found problems in its sub-fields.

    Pydantic keeps the exception in the error's context, which lets
    `from_validation_error` put each problem at its own path instead of at the
    validator's field.
    """

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("; ".join(map(str, problems)))
        self.problems = problems


def from_validation_error(exc: ValidationError, root: type[BaseModel]) -> list[Problem]:
    """One `Problem` per pydantic error; `root` is the model that was validated."""
    problems: list[Problem] = []
    for error in exc.errors(include_url=False):
        loc: Loc = tuple(error["loc"])
        cause = error.get("ctx", {}).get("error")
        if isinstance(cause, Problems):
            problems.extend(p.under(*loc) for p in cause.problems)
        elif isinstance(cause, ValueError):
            # Our validators' messages are complete sentences; pydantic's
            # "Value error, " prefix only adds noise.
            problems.append(Problem(loc, str(cause)))
        elif error["type"] == "extra_forbidden":
            problems.append(Problem(loc, _unknown_field(str(loc[-1]), _fields_at(root, loc[:-1]))))
        elif error["type"] == "missing":
            problems.append(Problem(loc, "required field is missing"))
        else:
            # Never append the input: it may be a password.
            problems.append(Problem(loc, error["msg"]))
    return problems


def plant_error(source: str | None, problems: Iterable[Problem]) -> PlantConfigError:
    """The error to raise: one line per problem, each starting with `source` (the plant file)."""
    prefix = f"{source}: " if source else ""
    return PlantConfigError("\n".join(prefix + str(p) for p in problems))


def _unknown_field(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        return f"unknown field — did you mean {close[0]!r}?"
    return "unknown field — expected one of " + ", ".join(known)


def _fields_at(root: type[BaseModel], loc: Loc) -> list[str]:
    """The field names of the model found at `loc` inside `root`, or [] if none is."""
    model: type[BaseModel] | None = root
    for part in loc:
        if model is None:
            break
        if isinstance(part, int):
            continue  # a list index: the items are the model the list's annotation names
        field = model.model_fields.get(part)
        model = _model_in(field.annotation) if field else None
    return list(model.model_fields) if model else []


def _model_in(annotation: object) -> type[BaseModel] | None:
    """The pydantic model in an annotation such as `X`, `list[X]` or `X | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for arg in get_args(annotation) if (m := _model_in(arg))), None)
