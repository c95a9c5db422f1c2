"""Errors of the harness runner: configuration mistakes are `ConfigError`s that name the bad field.

What goes wrong *inside* an execution or an evaluation is not an exception: it becomes an event
(`execution_finished` with `harness_error`, `evaluation_failed`), because downstream code decides on it.
"""

from gyre.errors import ConfigError, GyreError


class HarnessError(GyreError):
    """Base class of errors the harness package raises on purpose."""


class TemplateError(ConfigError):
    """A command or environment template names an unknown placeholder or uses unsupported syntax."""


class TaskSetError(ConfigError):
    """A task set file is missing, unreadable, or does not match the task schema."""


class WorkspaceError(HarnessError):
    """An execution's directory could not be prepared (it exists already, or a starting file escapes it)."""
