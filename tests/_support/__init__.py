"""Helpers only rallypoint's own tests use (not shipped with the package)."""
