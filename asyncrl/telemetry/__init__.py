"""Telemetry: the console progress view, the event log, Prometheus metrics, the dashboard page, alarms and
TensorBoard/W&B, all fed the same run events through one seam (`sinks.py`)."""
