"""The durable, event-sourced log: one writer, checksummed Arrow frames, readers, DuckDB views."""

from gyre.log.reader import LogReader, VerifyReport
from gyre.log.writer import LogRecoveryWarning, LogWriter, Recovery, SeqRange

__all__ = ["LogReader", "LogRecoveryWarning", "LogWriter", "Recovery", "SeqRange", "VerifyReport"]
