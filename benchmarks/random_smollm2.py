"""Save a randomly initialised model of SmolLM2-135M's shape, for machines that cannot carry the bundled GGUF file.

    python benchmarks/random_smollm2.py DIR      # then: python benchmarks/serving.py --model DIR --device cuda

The shape is SmolLM2-135M-Instruct's (Llama: 30 layers, hidden 576, 9 query and 3 KV heads of 64, MLP 1536, vocab
49,152, tied embeddings), so timings and KV bytes are the real model's; the weights are random (normal, std 0.02),
so the tokens mean nothing, but every method of a benchmark gets the same ones. The tokenizer is a byte-level BPE of
512 tokens trained on the committed WikiText-2 test text (the benchmarks feed token ids, not text).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TEXT = Path(__file__).resolve().parent.parent / "eval" / "data" / "wikitext-2-raw" / "wiki.test.raw"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the directory to write (config, safetensors weights, tokenizer)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([TEXT.read_text(encoding="utf-8")[:200_000]],
                            trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"saved a random SmolLM2-135M-shaped Llama ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
          f"parameters) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
