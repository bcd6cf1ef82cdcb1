"""`hf-pagedkv plan --host-memory`: what a host tier holds for the planned workload."""

import json

import pytest

from hf_pagedkv.tools.cli import main


def test_plan_shows_the_host_tier(capsys):
    # the textbook 7B: 32 layers x 32 KV heads x 128 x 2 x 2 B = 512 KiB per fp16 token, 8 MiB per block of 16
    argv = ["plan", "--model", "llama", "--max-seq-len", "4096", "--memory", "64GiB", "--dtype", "float16"]
    assert main([*argv, "--host-memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "host tier: 64.00 GiB -> 8,192 blocks = 131,072 tokens = 32 sequences of 4,096 tokens" in out
    assert main([*argv, "--host-memory", "64GiB", "--json"]) == 0
    host = json.loads(capsys.readouterr().out)["host_tier"]
    assert host == {"bytes": 64 * 2**30, "blocks": 8192, "tokens": 131072, "sequences": 32}


def test_plan_host_memory_errors(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama", "--max-seq-len", "128", "--host-memory", "lots"])
    assert "--host-memory" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--host-memory", "--prefix-cache-memory"])
def test_plan_refuses_a_memory_below_one_block(capsys, flag):
    # the textbook 7B at fp16: 8 MiB per block of 16 tokens, so 1 B and 8 MiB - 1 B hold no block
    argv = ["plan", "--model", "llama", "--max-seq-len", "128", "--dtype", "float16"]
    for size in ("1B", str(8 * 2**20 - 1)):
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, flag, size])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert flag in err and "holds no block" in err and "8,388,608 bytes" in err
    assert main([*argv, flag, str(8 * 2**20)]) == 0  # exactly one block is planned
    out = capsys.readouterr().out
    assert ("host tier: 8.00 MiB -> 1 blocks" in out) if flag == "--host-memory" else ("prefix cache: 8.00 MiB" in out)
