"""Watching a pool: stats snapshots, metrics and alerts, the block event log, traces, Prometheus."""
