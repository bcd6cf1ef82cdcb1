"""When the tests compare bit for bit, and the tolerances they use when they cannot.

Same forward steps (the same tokens per step, so the same tensor shapes in every matmul and attention call): fp32
results are bit-identical, and the tests say so with `torch.equal` (or `atol=0`). That is what `PagedCache`
promises against `DynamicCache`.

Different forward steps -- a 3-token prefill against a 2-token prefill plus a decode step, a prefix hit computing
its suffix in a step of its own against one full prefill, a pre-filled prompt fed in two steps where
`DynamicCache` takes one -- compute the same values through kernels that block their sums by shape, so the sums
are reassociated and the last bits differ. How much depends on the CPU's kernels (AVX2 or AVX-512, the MKL and
oneDNN version), not on the cache, so these bounds come from the dtype, not from one machine's measurement.
"""

#: |logit difference| allowed between fp32 runs with different step shapes. Measured on an Intel Xeon (AVX-512):
#: up to 3.2e-5 for a SmolLM2 prefix hit, up to 3e-7 on the tiny test models (|logits| < 1.1). 1e-4 leaves room for
#: other CPUs and larger logits, and is still far below what a cache fault does to logits (a wrongly freed block
#: overwritten by another request moves them by more than 1e-2 in test_prefix_caching).
CROSS_STEP_LOGIT_ATOL = 1e-4
