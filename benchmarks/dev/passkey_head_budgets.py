"""Would budgets per (layer, KV head) answer the passkey task better at ratio 0.5 than the cache's budgets per layer?
A simulation with a head-masked reference (no cache), at equal numbers of kept tokens.

The eval's best policy (`KVzipScoring(kernel_size=7, pooling="avg", layer_budgets="global")`, as `kv_zip_global` builds
it) ranks every (layer, KV head, token) by its pooled reconstruction score, but the cache stores a layer's KV heads in
the same blocks, so every head of a layer keeps the same number of tokens. KVzip's paper and AdaKV (Feng et al., arXiv
2407.11550) instead let each head keep what it has in the joint ranking, which needs a block table per head. This script
scores each of the eval's seeded examples once (`compress_context` on a cache, as the eval does), then runs the model
without a cache over the context, the question and the key, with an attention that hides from the question and the key,
per layer and KV head, exactly the context tokens a selection rule evicts (the context itself is computed over the full
context, as a cache compressed after the prefill holds it). Rules, each keeping the same number of tokens in all (the
sinks and the last `recent_tokens` always kept):

- `layer`: the cache's rule (`KVzip.score_budgets`, then each head its own best `keep` tokens; per-head scores);
- `share`: the same with ``share_heads=True`` (a layer's heads keep the same tokens);
- `head_max`: the joint ranking cut to what today's blocks can store: a layer keeps, in every head, as many tokens as its best-provided head
  has in the joint ranking, the ranking cut where the layers' total reaches the uniform total;
- `head`: each (layer, KV head) keeps exactly what it has in the joint ranking (KVzip's non-uniform heads, AdaKV's
  allocation): not storable by the cache today;
- `full`: nothing hidden.

With `--value-weighted` every rule ranks by the scores times the tokens' relative value norms
(`KVzipScoring(value_weighted=True)`, VATP) instead of the reconstruction scores alone (`--value-power P`: to the
power `P`); `--kernel K` pools them over `K` tokens instead of the eval's 7.

Printed per example and rule: the key's log-probability after the question (summed over its tokens,
teacher-forced) and whether every key token is the argmax (teacher-forced, a proxy for the eval's greedy answer),
then their totals. Examples are numbered as the eval numbers them: 0-8 at 1k, 9-17 at 2k, 18-26 at 4k.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/dev/passkey_head_budgets.py [--seed 1]   # about 55 minutes each
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/dev/passkey_head_budgets.py --lengths 1024 2048 --rules full layer \
        share --value-weighted
"""

from __future__ import annotations

import json

import torch

from eval.config import EvalConfig
from eval.data import load_text
from eval.long_context import policy_for
from eval.long_context_config import LongContextConfig
from eval.tasks.passkey import prepare as passkey_prepare
from hf_pagedkv import BlockPool, PagedCache, cache_kwargs, compress_context
from hf_pagedkv.retention import KVzip, KVzipScoring
from hf_pagedkv._compat import register_attention
from hf_pagedkv.tools.models import load_model
from passkey_oracle import CONTEXTS, DEPTHS, KEYS, example_arguments, key_ids, key_measures, parse_examples

RULES = ("full", "layer", "share", "head_max", "head")
#: the attention implementation this script registers (a head-masked `sdpa`, no cache)
MASKED = "passkey_head_mask"


class HeadMask:
    """The context tokens each (layer, KV head) keeps, hidden from every later position where not kept.

    Invariant: `kept[layer]` is `[1, num_kv_heads, context]` bool; `context` is the number of context tokens.
    """

    def __init__(self) -> None:
        self.kept: dict[int, torch.Tensor] = {}
        self.context = 0

    def attention(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        """`sdpa` over `[batch, heads, T, head_dim]` with a causal mask that also hides the evicted context tokens
        from the positions after the context (GQA: a KV head's mask applies to its query heads)."""
        P, T = self.context, query.shape[2]
        group = query.shape[1] // key.shape[1]
        visible = torch.ones(T, T, dtype=torch.bool, device=query.device).tril()
        visible = visible.expand(1, key.shape[1], T, T).clone()  # [1, num_kv_heads, T, T]
        visible[:, :, P:, :P] &= self.kept[module.layer_idx].to(query.device)[:, :, None, :]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1),
            attn_mask=visible.repeat_interleave(group, 1), scale=scaling)
        return out.transpose(1, 2).contiguous(), None


def kept_by_cache_rule(policy: KVzip, scores: dict[int, torch.Tensor], held: int, block_size: int):
    """The cache's selection: `score_budgets` per layer (whole blocks), then each head's best tokens."""
    layers = sorted(scores)
    budgets = policy.score_budgets([[scores[i]] for i in layers], policy.keep_for(held), held, block_size)
    kept = {}
    for i, keep in zip(layers, budgets):
        s = scores[i]
        idx = policy.select(torch.empty(*s.shape, 0), keep, observed=s)  # [1, num_kv_heads, keep]
        kept[i] = torch.zeros(s.shape, dtype=torch.bool).scatter_(-1, idx, True)
    return kept


def kept_by_joint_ranking(policy: KVzip, scores: dict[int, torch.Tensor], held: int, per_layer_max: bool):
    """The joint ranking of every (layer, KV head, token) between the sinks and the recent tokens, cut at the uniform
    budget's number of ranked tokens; `per_layer_max`: every head of a layer keeps as many as its best-provided head
    (the ranking cut earlier, so that the layers' total stays the uniform total), else each head what it has."""
    layers = sorted(scores)
    lo, hi = policy.sink_tokens, held - policy.recent_tokens
    per_head = policy.keep_for(held) - (held - (hi - lo))  # the ranked tokens a uniform budget keeps per head
    ranked = [policy.scores(torch.empty(*scores[i].shape, 0), scores[i])[..., lo:hi]  # [1, num_kv_heads, hi - lo]
              for i in layers]
    heads = ranked[0].shape[1]
    flat = torch.cat([r.reshape(-1) for r in ranked])
    order = flat.argsort(descending=True, stable=True)
    pair = torch.arange(len(layers) * heads).repeat_interleave(hi - lo)  # (layer, head) of each flat entry

    def counts(n: int) -> torch.Tensor:  # [layers, heads]: tokens each pair has in the top `n`
        return torch.bincount(pair[order[:n]], minlength=len(layers) * heads).view(len(layers), heads)

    kept = {}
    if not per_layer_max:
        top = torch.zeros_like(flat, dtype=torch.bool)
        top[order[: per_head * len(layers) * heads]] = True
        for j, i in enumerate(layers):
            k = torch.ones(scores[i].shape, dtype=torch.bool)
            k[..., lo:hi] = top[j * heads * (hi - lo): (j + 1) * heads * (hi - lo)].view(1, heads, hi - lo)
            kept[i] = k
        return kept
    a, b = 0, len(flat)  # the largest cut whose per-layer maxima fit the uniform total
    while a < b:
        mid = (a + b + 1) // 2
        a, b = (mid, b) if int(counts(mid).amax(1).sum()) <= per_head * len(layers) else (a, mid - 1)
    most = counts(a).amax(1)  # [layers]: what each layer's best-provided head has at that cut
    for j, i in enumerate(layers):
        s = scores[i]
        keep = held - (hi - lo) + int(most[j])
        idx = policy.select(torch.empty(*s.shape, 0), keep, observed=s)
        kept[i] = torch.zeros(s.shape, dtype=torch.bool).scatter_(-1, idx, True)
    return kept


@torch.no_grad()
def main(argv=None) -> int:
    ap = example_arguments(__doc__.splitlines()[0])
    ap.add_argument("--rules", nargs="+", choices=RULES, default=list(RULES))
    ap.add_argument("--value-weighted", action="store_true",
                    help="rank by the scores times the tokens' relative value norms "
                         "(KVzipScoring(value_weighted=True))")
    ap.add_argument("--value-power", type=float, default=1.0,
                    help="with --value-weighted: the exponent of the relative value norm (KVzip.value_power)")
    ap.add_argument("--kernel", type=int, default=7, help="the pooling's kernel, odd (KVzip.kernel_size; the eval's 7)")
    args, wanted = parse_examples(ap, argv)
    try:  # (KVzip's own checks, before the model loads)
        KVzip(budget=64, scoring=KVzipScoring(kernel_size=args.kernel, pooling="avg",
                                              value_weighted=args.value_weighted, value_power=args.value_power))
    except ValueError as exc:
        ap.error(str(exc))
    rules = list(dict.fromkeys(args.rules))
    torch.set_num_threads(args.threads)
    cfg = LongContextConfig(task="passkey", contexts=list(CONTEXTS), depths=list(DEPTHS), num_keys=KEYS,
                            seed=args.seed, kv_zip_pooling="avg")  # the eval's best
    model, tok = load_model(cfg.model)
    mask = HeadMask()
    register_attention(MASKED, mask.attention)
    examples = passkey_prepare.make_examples(cfg, tok, load_text(EvalConfig(dataset=cfg.dataset,
                                                                              data_dir=cfg.data_dir)))
    totals = {r: [0, 0, 0.0] for r in rules}  # keys right, examples, sum of log-probabilities
    for ex in examples:
        if ex["example"] not in wanted:
            continue
        ctx, q = ex["context_ids"], ex["question_ids"]
        key = key_ids(tok, ex)
        policy = policy_for("kv_zip_global", cfg, ratio=args.ratio, context=len(ctx)).with_scoring(
            value_weighted=args.value_weighted, value_power=args.value_power, kernel_size=args.kernel)
        scores = None
        if set(rules) - {"full"}:  # the reconstruction scores, from a cache compressed as the eval compresses it
            model.set_attn_implementation("hf_pagedkv")
            cache = PagedCache(pool=BlockPool(block_size=cfg.block_size), config=model.config, retention=policy)
            model(torch.tensor([ctx], device=model.device), **cache_kwargs(cache))
            values = ({i: layer.values.clone() for i, layer in enumerate(cache.layers)}  # [1, H, n, d] each
                      if policy.settings.value_weighted else {})  # (the held values, before the compression)
            scores = {i: (policy.weigh(s, values[i]) if policy.settings.value_weighted else s).cpu()
                      for i, s in compress_context(model, cache, ctx, tokenizer=tok).items()}
            cache.release()
        row = {"example": ex["example"], "context_len": ex["context_len"], "depth": ex["depth"]}
        for rule in rules:
            if rule == "full":
                model.set_attn_implementation("sdpa")
            else:
                mask.context = len(ctx)
                mask.kept = (kept_by_cache_rule(policy.with_scoring(share_heads=rule == "share"), scores, len(ctx),
                                                cfg.block_size) if rule in ("layer", "share")
                             else kept_by_joint_ranking(policy, scores, len(ctx), per_layer_max=rule == "head_max"))
                model.set_attn_implementation(MASKED)
            logits = model(torch.tensor([ctx + q + key], device=model.device), use_cache=False).logits[0]
            logp, right = key_measures(logits[len(ctx) + len(q) - 1: len(ctx) + len(q) - 1 + len(key)], key)
            t = totals[rule]
            t[0], t[1], t[2] = t[0] + right, t[1] + 1, t[2] + logp
            row[rule] = {"key_right": right, "key_logprob": round(logp, 3)}
        print(json.dumps(row), flush=True)
    for rule, (right, n, lp) in totals.items():
        print(f"{rule}: key right (teacher-forced argmax) {right}/{n}, key log-probability {lp / n:.3f} on average")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
