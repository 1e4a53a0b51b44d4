"""`memfit report`: a self-contained HTML report of finished runs (build.py says what it holds; runs.py what it
reads; plots.py its figures; templates/report.html.j2 the page)."""

from memfit_gpu.report.build import DEFAULT_MAX_BYTES, Report, build_report, question_records, question_table
from memfit_gpu.report.runs import ReportError, read_run

__all__ = ["DEFAULT_MAX_BYTES", "Report", "ReportError", "build_report", "question_records", "question_table",
           "read_run"]
