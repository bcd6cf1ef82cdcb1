"""Block bookkeeping, no tensors: ids and refcounts, block tables, the prefix index and its budget, compaction plans,
the owner registry, host-tier ids."""
