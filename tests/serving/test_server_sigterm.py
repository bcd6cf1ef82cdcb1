"""`hf-pagedkv serve` as a process: SIGTERM drains (the streamed request in flight finishes, a new one gets 503),
the prefix-cache file is saved at exit (code 0), and a second server loads it and hits its blocks; flags that
cannot work are refused before the model loads."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from hf_pagedkv.tools import cli
from tests.eval_helpers import tiny_model_dir
from tests.serving.server_helpers import get, openai, post

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "The history of the city of London in the nineteenth century"


class ServeProcess:
    """`python -m hf_pagedkv.tools.cli serve ...` on the tiny model, on a free port."""

    def __init__(self, *flags: str) -> None:
        env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hf_pagedkv.tools.cli", "serve", "--model", tiny_model_dir(),
             "--served-model-name", "tiny", "--port", "0", "--block-size", "4", "--num-threads", "1", *flags],
            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        self.lines: list[str] = []
        deadline = time.monotonic() + 120
        while True:
            line = self.proc.stderr.readline()
            assert line or self.proc.poll() is None, "".join(self.lines)
            self.lines.append(line)
            m = re.search(r"at http://127\.0\.0\.1:(\d+)/v1", line)
            if m:
                self.port = int(m.group(1))
                break
            assert time.monotonic() < deadline, "".join(self.lines)
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0)

    def stream_then_signal(self, sig: int, max_tokens: int):
        """Start a streamed completion, send `sig` once its first chunk came, wait until `/health` answers 503
        (draining); returns the stream's chunks left."""
        stream = self.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        self.proc.send_signal(sig)
        deadline = time.monotonic() + 10
        while get(self.port, "/health")[0] != 503:  # the signal is handled between ticks
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return chunks

    def stop(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def test_sigterm_drains_saves_the_prefix_cache_and_a_restart_loads_it(tmp_path):
    path = str(tmp_path / "prefix.safetensors")
    server = ServeProcess("--prefix-cache-file", path)
    try:
        chunks = server.stream_then_signal(signal.SIGTERM, max_tokens=1000)
        status, answer, _ = post(server.port, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert status == 503 and "shutting down" in answer["error"]["message"]
        rest = [c.choices[0] for c in chunks]
        assert rest[-1].finish_reason == "length"
        assert server.proc.wait(60) == 0, "".join(server.lines)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    time.sleep(0.2)  # the reader thread takes the last lines
    assert "".join(server.lines).rstrip().endswith("hf-pagedkv serve: stopped")
    assert os.path.getsize(path) > 0 and not [f for f in os.listdir(tmp_path) if f != "prefix.safetensors"]

    again = ServeProcess("--prefix-cache-file", path)
    try:
        loaded = int(re.search(r"loaded (\d+) prefix blocks", "".join(again.lines)).group(1))
        assert loaded >= 3  # the prompt's full blocks of 4 tokens, and those of the generated tokens
        again.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
        metrics = get(again.port, "/metrics")[1]
        hit = float(re.search(r"^hf_pagedkv_service_prefix_hit_ratio (\S+)$", metrics, re.M).group(1))
        assert hit > 0.5  # the first request of this process found its prompt cached
        assert again.stop() == 0
    finally:
        if again.proc.poll() is None:
            again.proc.kill()


@pytest.mark.parametrize("argv, message", [
    (["--retention", "sink_window:4"], "--retention 'sink_window:4': 1 part after the name"),
    (["--retention", "kv_zip:0.5"], "compresses through a reconstruction pass"),
    (["--retention", "snapkv:0.5"], "scores tokens with the queries"),
    (["--max-memory", "lots"], "--max-memory"),
    (["--max-body-bytes", "lots"], "--max-body-bytes: `--max-body-bytes` must be bytes (int) or a size like"),
    (["--block-size", "0"], "--quant/--block-size"),
    (["--max-queue", "0"], "--max-queue must be >= 1"),
    (["--port", "70000"], "--port must be <= 65535"),
    (["--prefix-cache-file", "/no/such/folder/p.safetensors"], "not a writable directory"),
])
def test_serve_refuses_bad_flags_before_loading_the_model(argv, message, monkeypatch, capsys):
    monkeypatch.setattr("hf_pagedkv.tools.models.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit):
        cli.main(["serve", *argv])
    assert message in capsys.readouterr().err


def test_serve_with_a_port_in_use_fails_before_loading_the_model(monkeypatch, capsys):
    import socket

    monkeypatch.setattr("hf_pagedkv.tools.models.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        assert cli.main(["serve", "--port", str(taken.getsockname()[1])]) == 2
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


def test_serve_with_a_budget_below_one_block_says_so_before_serving(capsys):
    """The tiny model's block of 4 tokens is 2 layers x 2 KV heads x 16 x 2 x 4 B x 4 = 2,048 B: 1KiB holds none."""
    argv = ["serve", "--model", tiny_model_dir(), "--port", "0", "--block-size", "4", "--max-memory", "1KiB"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "hf-pagedkv serve: --max-memory:" in err and "less than one block" in err and "at http" not in err


def test_serve_with_a_prefix_file_bigger_than_the_pool_refuses_it_in_one_line(tmp_path, capsys):
    """A prefix file saved from a bigger pool loads all of its blocks or none: with --max-memory too small for them
    the command says so in one line and exits 2 (no traceback), before serving."""
    import torch

    from hf_pagedkv import BlockPool
    from hf_pagedkv.serving import Engine
    from hf_pagedkv.tools.models import load_model

    model, tokenizer = load_model(tiny_model_dir(), dtype=torch.float32)
    pool = BlockPool(block_size=4, prefix_caching=True)
    engine = Engine(model, pool)
    with torch.inference_mode():
        engine.add_request(tokenizer(PROMPT * 3).input_ids, max_new_tokens=2)
        while engine.has_unfinished:
            engine.step()
        path = str(tmp_path / "prefix.safetensors")
        saved = pool.save_prefix_cache(path, model=model)
    assert saved >= 10  # 40 tokens and more in blocks of 4; 8KiB holds 4 blocks of the tiny model (2,048 B each)
    argv = ["serve", "--model", tiny_model_dir(), "--port", "0", "--block-size", "4", "--max-memory", "8KiB",
            "--prefix-cache-file", path]
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "at http" not in err, err
    assert err == (f"hf-pagedkv serve: --prefix-cache-file {path}: the file's prefix blocks do not fit the pool (the "
                   f"file needs {saved} blocks in the full layer group, the pool has 4 free and 0 cached-idle of 4); "
                   "nothing was loaded. Raise --max-memory, add --host-memory to take the rest, or move the file "
                   "away to start with an empty prefix cache.\n")


def test_two_ctrl_c_with_a_request_in_flight_stop_in_one_line_and_still_save_the_prefix_cache(tmp_path):
    path = str(tmp_path / "prefix.safetensors")
    server = ServeProcess("--prefix-cache-file", path)
    try:
        chunks = server.stream_then_signal(signal.SIGINT, max_tokens=4000)  # the first signal drains
        server.proc.send_signal(signal.SIGINT)  # the second stops at once
        assert server.proc.wait(60) == 130
        assert [c.choices[0].finish_reason for c in chunks][-1] == "abort"
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    time.sleep(0.2)  # the reader thread takes the last lines
    err = "".join(server.lines)
    assert "Traceback" not in err, err
    assert err.rstrip().endswith("hf-pagedkv serve: interrupted"), err
    assert os.path.getsize(path) > 0
