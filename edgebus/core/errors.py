"""The exceptions edgebus raises. Catch `EdgebusError` to catch them all.

Each message says what is wrong *and* what to change, because the person who
reads it is a plant engineer at a terminal, not the author of this code.
"""

from __future__ import annotations


class EdgebusError(Exception):
    """Base class of every error edgebus raises on purpose."""


class PlantConfigError(EdgebusError):
    """The plant file is missing, unreadable or inconsistent with the model."""


class ModelImportError(EdgebusError):
    """A checkpoint could not be converted into the HF layout edgebus loads."""


class CheckpointError(EdgebusError):
    """A model directory lacks files or tensors that a stage needs."""


class EngineError(EdgebusError):
    """A stage engine cannot run this model, weight mode or device here."""


class FrameError(EdgebusError):
    """An activation frame could not be decoded (garbage, truncated, wrong version...)."""


class BusError(EdgebusError):
    """The MQTT connection failed in a way retrying will not fix (auth, TLS, bad URL)."""


class RequestError(EdgebusError):
    """A gateway request is invalid or refused. `code` goes into the error response, and
    `retry_after_s`, for a refusal that asks for a retry (`busy`), how long to wait first."""

    def __init__(self, code: str, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


class PromptFileError(EdgebusError):
    """A rehearsal's --prompt-file is unreadable, empty, or holds an item that is no request."""
