"""Fixtures of the snapshot tests (defined in ``_jobs``)."""

from _jobs import reference, reference4

__all__ = ["reference", "reference4"]
