"""`--retention` specs and the planner's use of them (no model loaded)."""

from __future__ import annotations

import json

import pytest

from hf_pagedkv.retention import KVzip, KeyDiff, KeyNorm, PyramidKV, SinkWindow, SnapKV
from hf_pagedkv.retention.spec import parse_retention
from hf_pagedkv.tools.cli import main


def test_specs_parse_to_their_policies():
    assert parse_retention("sink_window:4:1024") == SinkWindow(sink_tokens=4, window=1024)
    assert parse_retention("key_norm:512") == KeyNorm(budget=512)
    assert parse_retention("key_diff:0.5") == KeyDiff(compression_ratio=0.5)
    assert parse_retention("snapkv:0.5") == parse_retention("snap_kv:0.5") == SnapKV(compression_ratio=0.5)
    assert parse_retention("snapkv:256") == SnapKV(budget=256)
    assert parse_retention("pyramidkv:0.5") == parse_retention("pyramid_kv:0.5") == PyramidKV(compression_ratio=0.5)
    assert parse_retention("pyramidkv:512") == PyramidKV(budget=512) != SnapKV(budget=512)
    assert parse_retention(" kv_zip:512:0.25 ") == KVzip(budget=512, recent_share=0.25,
                                                         scoring="plain")  # whitespace around: fine
    assert parse_retention("KV_Zip : 0.5") == KVzip(compression_ratio=0.5,
                                                    scoring="plain")  # around each part, and in any case
    glob = KVzip(compression_ratio=0.5, scoring="global")  # max-pooled, the eval's default
    assert parse_retention("kv_zip_global:0.5") == parse_retention("kvzip_global:0.5") == glob
    best = KVzip(compression_ratio=0.5, scoring="weighted")  # the passkey eval's best (docs/retention.md)
    assert parse_retention("kv_zip_weighted:0.5") == parse_retention("kvzip_weighted:0.5") == best != glob
    assert parse_retention("kv_zip_weighted:512:0.25") == KVzip(budget=512, recent_share=0.25, scoring="weighted")


@pytest.mark.parametrize("spec, message", [
    ("sink", "unknown policy 'sink'; the policies: sink_window, key_norm"),
    ("", "the spec is empty"),
    (" : ", "the spec is empty"),
    ("kv_zip:\u0661\u0662\u0663", "use ASCII letters and digits only"),  # (int() takes Arabic-Indic digits)
    ("kv_zip:x:y", "BUDGET or RATIO (an int of tokens kept, or a float in (0, 1)) is not a number: 'x'"),  # first
    ("kv_zip:0.5:1", "SHARE (`recent_share`) must be a float in [0, 1)"),
    ("sink_window:4", "1 part after the name; expected sink_window:SINK:WINDOW, two ints"),
    ("sink_window:a:5", "SINK must be an int, got 'a'"),
    ("sink_window:4:0", "`window` must be an int >= 1, got 0"),
    ("key_norm", "0 parts after the name; expected key_norm:BUDGET or key_norm:RATIO"),
    ("kv_zip:1:2:3", "3 parts after the name"),
    ("kv_zip_global:0.5:", "part 2 after the name is empty"),  # a stray ':' is not silently dropped
    ("kv_zip::0.5", "part 1 after the name is empty"),
    ("key_norm:x", "BUDGET or RATIO (an int of tokens kept, or a float in (0, 1)) is not a number: 'x'"),
    ("key_norm:1.5", "'1.5' is neither a RATIO (a float in (0, 1)"),
    ("key_norm:-0.5", "'-0.5' is neither a RATIO"),
    ("key_norm:nan", "'nan' is neither a RATIO"),
    ("kv_zip:0.5:x", "SHARE (a float in [0, 1)) is not a number: 'x'"),
    ("kv_zip:0.5:2", "SHARE (`recent_share`) must be a float in [0, 1)"),
    # 10 < sinks + recent tokens + 1: the advice is one the command line can follow
    ("key_norm:10", "got 10. Give a larger BUDGET or a RATIO; a smaller budget needs the policy built in Python"),
])
def test_a_bad_spec_names_the_part_that_is_wrong(spec, message):
    with pytest.raises(ValueError) as e:
        parse_retention(spec)
    assert str(e.value).startswith(f"retention spec {spec!r}: ") and message in str(e.value), str(e.value)
    assert "StreamingLLM" not in str(e.value)  # not every form listed, only the one that applies


def test_the_planner_sizes_a_sequence_by_what_it_keeps(capsys):
    argv = ["plan", "--model", "llama", "--max-seq-len", "100000", "--memory", "64GiB", "--block-size", "16"]
    # a one-step prefill stores the whole prompt before the first eviction: sized for 100,000 tokens (no fit)
    assert main(argv + ["--retention", "sink_window:4:2048"]) == 1
    out = capsys.readouterr().out
    # one 16-token sink block, the window's 2047 tokens plus up to 15 of alignment, and the step's token
    assert "holds at most 2,079" in out and "per sequence: 100,000 tokens" in out
    # evicting between 2,048-token prefill chunks: the sinks and window, plus one chunk beside them
    assert main(argv + ["--retention", "sink_window:4:2048", "--prefill-chunk", "2048"]) == 0
    assert "per sequence: 4,126 tokens" in capsys.readouterr().out
    main(argv + ["--retention", "key_norm:0.75"])  # (its peak while compressing does not fit 64GiB: exit 1)
    assert "holds at most 25,001" in capsys.readouterr().out
    main(argv + ["--retention", "snapkv:0.5"])  # (its peak while compressing does not fit 64GiB: exit 1)
    assert "holds at most 50,001" in capsys.readouterr().out
    main(argv + ["--retention", "pyramidkv:0.5"])  # the same tokens on average over the layers
    assert "holds at most 50,001" in capsys.readouterr().out
    main(argv + ["--retention", "snapkv:1024"])  # the prompt is compressed once: no bound claimed (100k: no fit)
    assert "holds at most" not in capsys.readouterr().out


def test_the_planner_sizes_the_pool_for_the_peak_while_a_policy_compresses(capsys):
    argv = ["plan", "--model", "llama", "--max-seq-len", "100000", "--memory", "512GiB", "--block-size", "16"]
    assert main(argv + ["--retention", "key_norm:0.75"]) == 0
    out = capsys.readouterr().out  # the prefill holds the whole prompt, the compaction the kept tokens beside it
    assert "holds up to 125,001 tokens" in out and "per sequence: 125,001 tokens" in out
    assert main(argv + ["--retention", "kv_zip:0.5"]) == 0
    out = capsys.readouterr().out  # the reconstruction pass holds the context twice
    assert "holds up to 200,040 tokens" in out and "reconstruction pass" in out  # (+ the repeat instruction)
    assert main(argv + ["--retention", "sink_window:4:2048"]) == 0  # drops whole blocks: no peak beyond its bound
    assert "holds up to" not in capsys.readouterr().out


def test_plan_with_retention_on_a_hybrid_model(tmp_path, capsys):
    """A Gemma2-shaped config (sliding window 512): a budget of at least window - 1 plans, a smaller one is refused
    as the cache refuses it (`WindowRealign`)."""
    from transformers import Gemma2Config

    Gemma2Config(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=64, head_dim=16,
                 intermediate_size=96, vocab_size=96, sliding_window=512).save_pretrained(tmp_path)
    argv = ["plan", "--model", str(tmp_path / "config.json"), "--max-seq-len", "4096", "--batch", "1",
            "--memory", "1GiB"]
    assert main(argv + ["--retention", "sink_window:4:1024"]) == 0
    assert "holds at most" in capsys.readouterr().out
    for spec, message in (("sink_window:4:256", "must keep at least window - 1 tokens"),
                          ("sink_window:0:4", "keeps as few as 3 tokens"),  # (its bound of 19 is a maximum)
                          ("kv_zip:0.5", "KVzip is not supported on models with sliding-window"),
                          ("kv_zip:64", "KVzip is not supported"),  # (not "a larger budget", which would fail too)
                          ("sink_window:4:128", "must keep at least window - 1 tokens, here 511 "),
                          ("pyramidkv:0.5", "has 2: build PyramidKV(tiers=...) with fewer tiers")):  # 2 of 4 are full attention
        with pytest.raises(SystemExit) as e:
            main(argv + ["--retention", spec])
        assert e.value.code == 2, spec
        assert message in capsys.readouterr().err, spec
    with pytest.raises(SystemExit):  # a sequence shorter than the window: it must keep all of it, not window - 1
        main(argv[:4] + ["400"] + argv[5:] + ["--retention", "key_norm:0.9"])
    assert "keeps as few as 69 tokens" in (err := capsys.readouterr().err) and "here 400 (the sequence's" in err


def test_plan_counts_the_protected_tokens_of_a_ratio(capsys):
    """key_norm:0.99 of 1,000 tokens would keep 10, but its 4 sinks + 64 recent tokens + 1 are always kept."""
    argv = ["plan", "--max-seq-len", "1000", "--batch", "1", "--memory", "1GiB", "--retention", "key_norm:0.99"]
    main(argv)
    assert "holds at most 70 once compressed" in capsys.readouterr().out


RECON = 2 * 4096 + 40  # KVzip's reconstruction pass: the context twice and the repeat instruction (at most 40)


@pytest.mark.parametrize("spec, peak, unevicted_peak", [
    ("kv_zip:2000", RECON, RECON), ("kv_zip_global:3000", RECON, RECON),  # the pass runs even if nothing is evicted
    ("kv_zip_weighted:3000", RECON, RECON),  # (the weighting changes which tokens are kept, not how many)
    ("snapkv:3000", 4096 + 3001, None), ("key_norm:2000", 4096 + 2001, None)])
def test_a_budget_plans_the_peak_while_it_compresses_as_a_ratio_does(spec, peak, unevicted_peak, capsys):
    """A budget below max_seq_len compresses a prompt of max_seq_len tokens: the prefill plus the kept tokens in fresh
    blocks, or KVzip's reconstruction pass; a budget the prompt never reaches plans no peak, but KVzip's pass."""
    argv = ["plan", "--max-seq-len", "4096", "--batch", "1", "--memory", "8GiB", "--block-size", "16"]
    assert main(argv + ["--retention", spec]) == 0
    out = capsys.readouterr().out
    assert f"holds up to {peak:,} tokens" in out and f"per sequence: {peak:,} tokens" in out
    assert main(argv + ["--retention", spec.split(":")[0] + ":5000"]) == 0
    out = capsys.readouterr().out
    if unevicted_peak is None:
        assert "holds up to" not in out and "per sequence: 4,096 tokens" in out
    else:
        assert f"per sequence: {unevicted_peak:,} tokens" in out
    assert main(argv + ["--retention", spec, "--json"]) == 0  # the JSON alone, and what the policy changed
    plan = json.loads(capsys.readouterr().out)
    assert plan["max_seq_len"] == peak and plan["retention"]["peak"] == peak
    assert plan["retention"]["max_seq_len"] == 4096 and plan["retention"]["spec"] == spec


def test_an_empty_retention_spec_is_refused_not_ignored(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--max-seq-len", "4096", "--memory", "8GiB", "--retention", ""])
    assert e.value.code == 2 and "--retention ''" in capsys.readouterr().err


def test_paged_cache_takes_a_spec_string_as_engine_and_generate_batch_do():
    from hf_pagedkv import PagedCache

    cache = PagedCache(retention="sink_window:4:16")
    policy = cache.retention_policy
    assert isinstance(policy, SinkWindow) and (policy.sink_tokens, policy.window) == (4, 16)
    with pytest.raises(ValueError, match="sink_window:x"):
        PagedCache(retention="sink_window:x:8")
    with pytest.raises(ValueError, match="must be a retention policy"):
        PagedCache(retention=3)
