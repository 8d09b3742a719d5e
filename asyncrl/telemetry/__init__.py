"""Telemetry: console progress now; Prometheus metrics and dashboards hang off the same records."""
