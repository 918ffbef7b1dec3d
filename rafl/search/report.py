"""The cost model's profiling report, as called by ``rafl search`` for every subnet it finds.

A thin alias of :func:`rafl.reports.profile_report.write_profile_report` (the report lives with
the other shared report helpers); writes ``cost_report.md``, ``cost_report.json`` and
``cost_report.png`` into the given folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rafl.reports.profile_report import write_profile_report

__all__ = ["write_report", "write_profile_report"]


def write_report(arch, profile, directory: str | Path, *, space=None, model=None, supernet=None,
                 repeats: int = 10, **kwargs: Any) -> dict[str, Any]:
    """``write_profile_report(arch, profile, directory, space=..., ...)`` with fewer timing repeats
    (a search writes one report per profile). See :func:`write_profile_report` for the arguments."""
    return write_profile_report(arch, profile, directory, space=space, model=model, supernet=supernet,
                                repeats=repeats, **kwargs)
