"""Block bookkeeping, no tensors: ids and refcounts, block tables, the prefix index, invariants."""
