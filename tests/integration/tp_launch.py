"""`torchrun_ranks`: launch a per-rank script on CPU ranks (gloo) with torchrun and load what each rank wrote."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

WORLD_SIZE = 2

skip_without_gloo = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="tensor parallel on CPU needs torch.distributed with the gloo backend, which this torch build lacks",
)


def torchrun_ranks(script: str, model, root, timeout_s: int) -> list[dict]:
    """Save `model` under `root`, run ``torchrun --standalone --nproc_per_node 2 script MODEL_DIR OUT_DIR`` on CPU
    ranks, and return each rank's ``OUT_DIR/rank{r}.pt`` (rank order). Fails the test on a timeout or an error."""
    model_dir, out_dir = root / "model", root / "out"
    model.save_pretrained(model_dir)
    out_dir.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD_SIZE),
           script, str(model_dir), str(out_dir)]  # `python -m torch.distributed.run` is `torchrun`, this venv's
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # CPU ranks even on a GPU machine
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun did not finish in {timeout_s} s:\n{(e.stderr or b'')[-4000:]}")
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


def reexec_with_rank_hash_seed() -> None:
    """Re-execute this rank's script once with ``PYTHONHASHSEED=1000 + RANK`` (exec keeps the pid torchrun
    watches), so that Python's string hashing differs between ranks: a decision that depended on it would differ."""
    seed = str(1000 + int(os.environ.get("RANK", "0")))
    if os.environ.get("PYTHONHASHSEED") != seed:
        os.environ["PYTHONHASHSEED"] = seed
        os.execv(sys.executable, [sys.executable, *sys.argv])


def save_rank_result(result: dict, out_dir: str) -> None:
    """Write this rank's `result` (with its rank, the world size and a string hash that differs between ranks) to
    `out_dir/rank{rank}.pt`, then end the process group."""
    rank = torch.distributed.get_rank()
    result["rank"], result["world_size"] = rank, torch.distributed.get_world_size()
    result["hash_of_str"] = hash("hf_pagedkv")  # differs between ranks (PYTHONHASHSEED)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
