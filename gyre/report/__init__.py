"""``gyre report RUN_DIR``: a self-contained HTML report of a run, built from its log."""

from gyre.report.data import report_data
from gyre.report.html import render, write_report

__all__ = ["render", "report_data", "write_report"]
