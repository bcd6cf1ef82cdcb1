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
