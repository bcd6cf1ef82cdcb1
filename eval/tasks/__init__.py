"""Task folders of the drift suite; each has `README.md`, `prepare.py` (examples) and `metrics.py` (definitions)."""
