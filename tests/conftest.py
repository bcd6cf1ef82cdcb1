"""Shared fixtures: tiny random models (built once per session) and the real SmolLM2 model (loaded once)."""

from __future__ import annotations

import os

import pytest
import torch

# The Triton read's kernel runs under Triton's interpreter where there is no CUDA device (tests/attention/
# test_triton_read.py); the switch is read when Triton is first imported (importing a transformers model does), so
# it is set before anything else is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import (  # noqa: E402
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 96


def _tiny(name: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if name == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif name == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    elif name == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif name == "gemma2":  # alternating sliding-window (window 8) and full layers
        model = Gemma2ForCausalLM(Gemma2Config(**{**common, "num_hidden_layers": 4}, head_dim=16,
                                               sliding_window=8))
    elif name == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**{**common, "num_hidden_layers": 4}, head_dim=16,
                                                    sliding_window=8, sliding_window_pattern=2))
    elif name == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=512,
                                           pad_token_id=0, bos_token_id=1, eos_token_id=2))
    else:
        raise KeyError(name)
    model.generation_config.pad_token_id = 0
    return model.eval()


_TINY_CACHE: dict = {}


def tiny_model(name: str):
    """A tiny randomly initialised model (seeded, fp32, eval mode), built once per session."""
    if name not in _TINY_CACHE:
        torch.manual_seed(1234)
        _TINY_CACHE[name] = _tiny(name)
    return _TINY_CACHE[name]


ARCHS = ["llama", "qwen2", "gemma2", "gpt2"]


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tiny models on one intra-op thread: on a busy 2-core machine, two threads spin against the
    other processes and make tiny-model steps 10x-100x slower. Restores the thread count afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm():
    """The real SmolLM2-135M-Instruct (fp32) and its tokenizer, loaded once per test session."""
    from hf_pagedkv.tools.models import load_model

    return load_model()


def ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Random token ids `[batch, length]` avoiding the special ids 0..2."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)
