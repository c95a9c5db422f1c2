"""One exception hierarchy for Gyre, so callers can catch by meaning rather than by module."""


class GyreError(Exception):
    """Base class of every error Gyre raises on purpose."""


class EventValidationError(GyreError, ValueError):
    """An event (or a batch of events) does not match the event schema; the message names the field."""


class UnknownEventKindError(EventValidationError):
    """A kind that the vocabulary does not define."""


class LogError(GyreError):
    """Base class of durable-log errors."""


class LogLockedError(LogError):
    """Another writer holds the log open; a log has exactly one writer at a time."""


class LogCorruptionError(LogError):
    """Bytes on disk fail their checksum or framing before the tail: names the segment and byte offset."""

    def __init__(self, segment: str, offset: int, reason: str) -> None:
        super().__init__(f"corrupt log segment {segment} at byte offset {offset}: {reason}")
        self.segment = segment
        self.offset = offset
        self.reason = reason


class LogClosedError(LogError):
    """The writer was closed (or failed) and accepts no more events."""


class ConfigError(GyreError, ValueError):
    """A configuration file or option is invalid."""


class TransferError(GyreError):
    """A point-to-point transfer (Mooncake Transfer Engine) could not be set up or did not complete."""
