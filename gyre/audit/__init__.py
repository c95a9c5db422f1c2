"""Holding a finished run to its promises: its log (and spill files) audited event by event.

Above the log, the replay and the spill format it reads; `gyre.cli` registers the command as `gyre log audit`.
"""

from gyre.audit.rules import SPILL_DIR, AuditReport, ProducerAudit, audit

__all__ = ["SPILL_DIR", "AuditReport", "ProducerAudit", "audit"]
