"""The tensors: page stores (full precision and quantized), staging, codecs, device budgets."""
