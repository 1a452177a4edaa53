"""The command line's parser for subcommands: options and positionals in any order.

Plain argparse matches positionals in runs between options, and fills an
optional positional (`ask`'s TEXT) with nothing when its run ends before
it: `edgebus ask plant.yaml --raw "text"` was refused ("unrecognized
arguments: text"), and only `ask plant.yaml "text" --raw` worked.
`parse_known_intermixed_args` reads every option first and then the
positionals, as a user types them. It cannot take a subcommand's own
subcommands or a REMAINDER (`broker mosquitto-config ...`): those parsers
keep plain parsing.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


class IntermixedParser(argparse.ArgumentParser):
    _intermixing = False  # inside parse_known_intermixed_args, which calls back in here

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        if self._intermixing or any(action.nargs in (argparse.PARSER, argparse.REMAINDER)
                                    for action in self._actions):
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False
