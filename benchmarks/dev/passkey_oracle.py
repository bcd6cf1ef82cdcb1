"""How much of the passkey task's loss at ratio 0.5 is the needle's: the eval's best KVzip against the same policy
with the needle forced into every (layer, KV head) (an oracle no real policy has: it knows where the needle is).

Each example of `python -m eval.long_context --task passkey` (the same seeded examples, the question appended after
the compression, greedy answers judged as the eval does) is answered three ways: the full cache, `KVzip` as the
eval's `kv_zip_global` builds it (`--share-heads` for ``share_heads=True``), and `NeedleKVzip`, the same policy whose
scores put the needle's tokens above all others, so every layer and head keeps the needle and its nearest
neighbours, and the budget's rest goes as before. If the oracle misses where the full cache answers, the miss comes
from what else was evicted, not from the needle. Also printed: the log-probability of the key (the sum over its
tokens, teacher-forced after the question), a finer measure than the answers, and its mean over the examples.
Examples are numbered as the eval numbers them: 0-8 at 1k, 9-17 at 2k, 18-26 at 4k (depths 10/50/90, 3 keys).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/dev/passkey_oracle.py --lengths 1024 2048 --share-heads
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass, fields

import torch
from transformers import set_seed

from eval.config import EvalConfig
from eval.data import load_text
from eval.long_context import answer, policy_for, prefill
from eval.long_context_config import LongContextConfig
from eval.tasks.passkey import metrics as passkey_metrics
from eval.tasks.passkey import prepare as passkey_prepare
from hf_pagedkv import BlockPool, PagedCache, cache_kwargs
from hf_pagedkv.retention import KVzip
from hf_pagedkv.tools.models import load_model

#: the eval's passkey grid (`make_examples` numbers the examples in this order)
CONTEXTS, DEPTHS, KEYS = (1024, 2048, 4096), (10, 50, 90), 3
METHODS = ("full", "kv_zip", "oracle")


def ratio(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"a compression ratio is in (0, 1), got {text}")
    return value


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


#: added to the needle's raw reconstruction scores (which are softmax weights, at most 1): above every other token
#: even after average pooling over 7 tokens
FORCED = 100.0


@dataclass(frozen=True)
class NeedleKVzip(KVzip):
    """`KVzip` whose scores rank the positions `forced` first in every layer and head (an oracle)."""

    forced: tuple[int, ...] = ()

    def _boost(self, scores: torch.Tensor) -> torch.Tensor:  # [rows, num_kv_heads, held]
        out = scores.clone()
        out[..., list(self.forced)] += FORCED
        return out

    def scores(self, keys, observed=None, valid=None):
        return super().scores(keys, None if observed is None else self._boost(observed), valid)

    def score_budgets(self, scores, keep, held, block_size, valid=None):
        return super().score_budgets([[self._boost(s) for s in tier] for tier in scores], keep, held, block_size, valid)


def needle_positions(example: dict, tokenizer) -> tuple[int, ...]:
    """The positions of the needle's tokens in the example's context."""
    needle = tokenizer(passkey_prepare.NEEDLE.format(key=example["key"]), add_special_tokens=False)["input_ids"]
    ids = example["context_ids"]
    for i in range(len(ids) - len(needle) + 1):
        if ids[i: i + len(needle)] == needle:
            return tuple(range(i, i + len(needle)))
    raise ValueError(f"example {example['example']}: the needle's tokens are not in its context")


def key_ids(tokenizer, example: dict) -> list[int]:
    """The key's tokens as an answer after the question starts (a space, then the digits)."""
    return tokenizer(" " + str(example["key"]), add_special_tokens=False)["input_ids"]


def key_measures(logits: torch.Tensor, key: list[int]) -> tuple[float, bool]:
    """From the logits that predict the key's tokens (`[len(key), vocab]`, teacher-forced): the key's
    log-probability (summed over its tokens) and whether every key token is the argmax."""
    lp = logits.float().log_softmax(-1)
    return (sum(lp[j, t].item() for j, t in enumerate(key)),
            all(lp[j].argmax().item() == t for j, t in enumerate(key)))


@torch.no_grad()
def key_logprob(model, tokenizer, example: dict, cache: PagedCache) -> float:
    """Log-probability of the key after the question (summed over its tokens), fed through `cache`, which holds the
    prefilled (and compressed) context."""
    q, key = example["question_ids"], key_ids(tokenizer, example)
    logits = model(torch.tensor([q + key], device=model.device), **cache_kwargs(cache)).logits[0]
    return key_measures(logits[len(q) - 1: len(q) - 1 + len(key)], key)[0]


def example_arguments(description: str) -> argparse.ArgumentParser:
    """A parser with the options every passkey benchmark takes: --lengths, --ratio, --seed, --threads, --examples."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--lengths", type=int, nargs="+", choices=CONTEXTS, default=list(CONTEXTS),
                    help="the context lengths to run (the examples are always made for 1k, 2k and 4k, as the eval's)")
    ap.add_argument("--ratio", type=ratio, default=0.5, help="the compression ratio, in (0, 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=positive, default=1)
    ap.add_argument("--examples", type=int, nargs="+",
                    help="only these example indices (0-8 at 1k, 9-17 at 2k, 18-26 at 4k, each within --lengths)")
    return ap


def parse_examples(ap: argparse.ArgumentParser, argv=None) -> tuple[argparse.Namespace, list[int]]:
    """The parsed arguments and the indices of the examples they select (an argparse error if none)."""
    args = ap.parse_args(argv)
    wanted = [i for i, (n, _, _) in enumerate(itertools.product(CONTEXTS, DEPTHS, range(KEYS)))
              if n in args.lengths and (not args.examples or i in args.examples)]
    if not wanted:
        ap.error(f"no example is both in --lengths {args.lengths} and in --examples {args.examples} (examples "
                 f"0-8 are 1k, 9-17 2k, 18-26 4k)")
    return args, wanted


def main(argv=None) -> int:
    ap = example_arguments(__doc__.splitlines()[0])
    ap.add_argument("--share-heads", action="store_true")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    args, wanted = parse_examples(ap, argv)
    methods = list(dict.fromkeys(args.methods))  # (each once)
    torch.set_num_threads(args.threads)
    cfg = LongContextConfig(task="passkey", contexts=list(CONTEXTS), depths=list(DEPTHS), num_keys=KEYS,
                            seed=args.seed, kv_zip_pooling="avg", kv_zip_share_heads=args.share_heads)  # the best
    model, tok = load_model(cfg.model)
    model.set_attn_implementation("hf_pagedkv")
    examples = passkey_prepare.make_examples(cfg, tok, load_text(EvalConfig(dataset=cfg.dataset,
                                                                              data_dir=cfg.data_dir)))
    totals = {m: [0, 0, 0.0] for m in methods}  # correct, examples, sum of log-probabilities
    for ex in examples:
        if ex["example"] not in wanted:
            continue
        for method in methods:
            set_seed(cfg.seed)
            policy = None if method == "full" else policy_for("kv_zip_global", cfg, ratio=args.ratio,
                                                              context=len(ex["context_ids"]))
            if method == "oracle":
                policy = NeedleKVzip(**{f.name: getattr(policy, f.name) for f in fields(policy)},
                                     forced=needle_positions(ex, tok))
            cache = PagedCache(pool=BlockPool(block_size=cfg.block_size), config=model.config, retention=policy)
            out = prefill(model, tok, cache, ex, cfg)  # the context, prefilled and compressed once for both measures
            with cache.fork() as forked:  # (copy-on-write: the answer's tokens do not reach the fork's blocks)
                lp = key_logprob(model, tok, ex, forked)
            text, _ = answer(model, tok, cache, ex, cfg, prefilled=out)
            cache.release()
            ok = passkey_metrics.is_correct(text, ex["key"])
            t = totals[method]
            t[0], t[1], t[2] = t[0] + ok, t[1] + 1, t[2] + lp
            print(json.dumps({"example": ex["example"], "context_len": ex["context_len"], "depth": ex["depth"],
                              "method": method, "correct": ok, "key_logprob": round(lp, 3), "answer": text}),
                  flush=True)
    for method, (ok, n, lp) in totals.items():
        print(f"{method}: {ok}/{n} correct, key log-probability {lp / n:.3f} on average")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
