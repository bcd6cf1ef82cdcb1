"""The pool: `BlockPool`, a face over its layer groups, with growth, owners, host tiers and persistence."""
