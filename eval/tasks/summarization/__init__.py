"""Query-based meeting summarisation (QMSum): ROUGE-L of each config's summary vs the baseline's and the reference."""
