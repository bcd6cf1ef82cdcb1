"""`plan_capacity(..., tp=N)` and `hf-pagedkv plan --tp N`: one rank's share of the KV heads, bytes and weights."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from hf_pagedkv.tools.cli import main
from hf_pagedkv.tools.planning import ModelShape, kv_heads_per_rank, plan_capacity

GiB, KiB = 2**30, 2**10
LLAMA_7B = ModelShape("7B", num_layers=32, num_sliding=0, sliding_window=None, num_kv_heads=32, head_dim=128,
                      num_params=6_738_415_616)


def test_kv_heads_per_rank():
    assert [kv_heads_per_rank(8, tp) for tp in (1, 2, 4, 8)] == [8, 4, 2, 1]
    with pytest.raises(ValueError, match=r"tp=3 does not divide the model's 8 KV heads.*Use tp in \[1, 2, 4, 8\]"):
        kv_heads_per_rank(8, 3)
    with pytest.raises(ValueError, match=r"tp=16 does not divide the model's 8 KV heads"):  # half a head per rank
        kv_heads_per_rank(8, 16)
    with pytest.raises(ValueError, match="`tp` must be a positive int, got 0"):
        kv_heads_per_rank(8, 0)


def test_plan_per_rank_is_a_tp_th_of_the_kv():
    one = plan_capacity(LLAMA_7B, max_seq_len=4096, batch=16, dtype="float16")
    two = plan_capacity(LLAMA_7B, max_seq_len=4096, batch=16, dtype="float16", tp=2)
    assert (one.tp, one.kv_heads_per_rank, two.tp, two.kv_heads_per_rank) == (1, 32, 2, 16)
    assert one.bytes_per_token == 512 * KiB and two.bytes_per_token == 256 * KiB  # 32 layers x 16 x 128 x 2 x 2 B
    assert (one.kv_bytes, two.kv_bytes) == (32 * GiB, 16 * GiB)
    assert two.pool_blocks == one.pool_blocks == 4916  # every rank holds the same blocks, each with fewer heads
    assert two.pool_bytes == pytest.approx(one.pool_bytes / 2, abs=1)
    assert (one.weight_bytes, two.weight_bytes) == (2 * 6_738_415_616, 6_738_415_616)
    with pytest.raises(ValueError, match="tp=3 does not divide the model's 32 KV heads"):
        plan_capacity(LLAMA_7B, 4096, 16, tp=3)


def test_plan_tp_fits_per_rank():
    # 40 GiB per device: one device does not hold 12.55 GiB of weights + 38.40 GiB of pool, each of 2 ranks holds half
    assert not plan_capacity(LLAMA_7B, 4096, 16, memory=40 * GiB).fits
    assert plan_capacity(LLAMA_7B, 4096, 16, memory=40 * GiB, tp=2).fits


def test_cli_plan_tp_prints_per_rank_bytes(capsys):
    argv = ["plan", "--model", "llama", "--max-seq-len", "4096", "--batch", "16", "--memory", "40GiB"]
    assert main(argv) == 1  # does not fit one 40 GiB device
    capsys.readouterr()
    assert main(argv + ["--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel: 2 ranks, each holds 16 of the 32 KV heads; bytes below are per rank (the job holds 2x)" \
        in out
    assert "bytes per token per rank: 262,144 B (256.00 KiB) = 32 layers x 16 KV heads x 512.0 B" in out
    assert "total KV per rank: batch 16 -> 16.00 GiB" in out
    assert "weights per rank: 6,738.4M parameters x 2 B / 2 ranks (norms, replicated, not counted) = 6.28 GiB" in out
    assert "pool to set per rank (peak x 1.2): 4,916 blocks, 19.20 GiB" in out
    assert "memory: 40.00 GiB (--memory, one rank's): fits, weights + pool = 25.48 GiB (64%)" in out


def test_cli_plan_tp_json(capsys):
    assert main(["plan", "--model", "llama", "--max-seq-len", "4096", "--batch", "16", "--memory", "40GiB",
                 "--tp", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["tp"], plan["kv_heads_per_rank"], plan["model"]["num_kv_heads"]) == (4, 8, 32)
    assert plan["kv_bytes"] == 8 * GiB and plan["bytes_per_token"] == 128 * KiB


@pytest.mark.parametrize("tp, message", [
    ("3", ("--tp 3: tp=3 does not divide the model's 2 KV heads: tensor parallel gives each rank "
           "num_key_value_heads / tp whole heads. Use tp in [1, 2].")),
    ("0", "--tp must be a positive int, got 0"),
])
def test_cli_plan_bad_tp(tmp_path, capsys, tp, message):
    LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                vocab_size=96).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", str(tmp_path), "--max-seq-len", "8", "--batch", "1", "--tp", tp, "--memory", "1GiB"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_plan_tp_on_cpu_splits_the_ram(monkeypatch, tmp_path, capsys):
    """Without CUDA the ranks are processes on one machine: each gets RAM / tp by default."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                vocab_size=96).save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--max-seq-len", "8", "--batch", "1", "--tp", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    from hf_pagedkv.pool.layer_registry import device_memory

    assert plan["memory"] == device_memory(torch.device("cpu")) // 2
    assert main(["plan", "--model", str(tmp_path), "--max-seq-len", "8", "--batch", "1", "--tp", "2"]) == 0
    assert "(this machine's RAM / 2 ranks)" in capsys.readouterr().out
