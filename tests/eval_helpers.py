"""Helpers of the eval tests: a tiny random Llama with a small byte-level BPE tokenizer, saved once per session."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch

from eval.config import resolve_data_dir

REPO = Path(__file__).resolve().parent.parent
# The data committed in eval/data/ (eval.config.DEFAULT_DATA_DIR), or $HF_PAGEDKV_DATA_DIR as for eval itself
DATA_DIR = resolve_data_dir()


@functools.lru_cache(maxsize=1)
def tiny_model_dir() -> str:
    """A directory holding a tiny random `LlamaForCausalLM` (2 layers, 2 KV heads, head_dim 16, vocab 512) and a
    byte-level BPE tokenizer trained on the first 200 kB of WikiText-2 test; built once per test session."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    text = (DATA_DIR / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")[:200_000]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the default init, so that logits are far from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    path = tempfile.mkdtemp(prefix="hf_pagedkv_tiny_")
    atexit.register(shutil.rmtree, path, True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@functools.lru_cache(maxsize=1)
def tiny_model():
    """The model and tokenizer of `tiny_model_dir()`, loaded once."""
    from hf_pagedkv.tools.models import load_model

    return load_model(tiny_model_dir())


def passkey_example(tokenizer, context_len: int, depth: int = 50) -> dict:
    """The eval's first seeded passkey example (`eval.tasks.passkey.prepare.make_examples`) of `context_len` tokens
    with the needle at `depth` percent, from the committed WikiText-2 test haystack: `context_ids`, `question_ids`,
    `key`, ..."""
    from eval.config import EvalConfig
    from eval.data import load_text
    from eval.long_context_config import LongContextConfig
    from eval.tasks.passkey.prepare import make_examples

    cfg = LongContextConfig(task="passkey", contexts=[context_len], depths=[depth], num_keys=1,
                            data_dir=str(DATA_DIR))
    return make_examples(cfg, tokenizer, load_text(EvalConfig(data_dir=str(DATA_DIR))))[0]
