"""Observability: events history, recoveries, metrics, reports, the live view, worker logs."""
