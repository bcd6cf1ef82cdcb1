"""Exceptions raised by hf_pagedkv, and messages shared by several entry points."""

#: Why an empty prompt is refused, the same words in every entry point (`PagedCache.from_prefix`,
#: `hf_pagedkv.generate`, `hf-pagedkv generate`), each prefixing its own name.
EMPTY_PROMPT = ("the prompt is empty (0 tokens): the model needs at least one token to compute the next-token "
                "logits from; give at least one token")


def out_of_vocabulary(token_id: int, position: str, vocab_size: int) -> str:
    """Why a prompt's token id is refused, the same words in every entry point (`hf_pagedkv.generate`,
    `Engine.add_request`), each prefixing its own name: ``out_of_vocabulary(70000, "position 3", 49152)`` ->
    ``"token id 70000 (position 3) is outside the model's vocabulary [0, 49152); encode the prompt with the model's
    own tokenizer."``"""
    return (f"token id {token_id} ({position}) is outside the model's vocabulary [0, {vocab_size}); encode the "
            "prompt with the model's own tokenizer.")


def install_hint(extra: str, packages: str) -> str:
    """The commands that install an optional extra, for `ImportError` messages.

    hf_pagedkv installs from a clone of its repository (it is not on a package index, so installing it by name
    finds nothing): the extra's command runs in the clone's root, and the extra's own packages install from anywhere.

    Args:
        extra (`str`): the optional-dependency group of pyproject.toml, e.g. ``"metrics"``.
        packages (`str`): what that extra installs, as pip takes it, e.g. ``"'prometheus_client>=0.20'"``.

    Example: ``install_hint("metrics", "'prometheus_client>=0.20'")`` ->
    ``pip install ".[metrics]" (the `metrics` extra, run in a clone of hf_pagedkv), or pip install
    'prometheus_client>=0.20'``.
    """
    return f'pip install ".[{extra}]" (the `{extra}` extra, run in a clone of hf_pagedkv), or pip install {packages}'


def counted(n: int, noun: str, plural: str | None = None, spec: str = "") -> str:
    """A count and its noun, in the singular for one: ``counted(1, "block")`` -> ``"1 block"``, ``counted(3,
    "block")`` -> ``"3 blocks"``, ``counted(1200, "token", spec=",")`` -> ``"1,200 tokens"``, ``counted(2, "entry",
    "entries")`` -> ``"2 entries"``; for messages, whose counts are often 1.

    Args:
        n (`int`): the count.
        noun (`str`): the singular noun (it may be several words: ``"KV head"``).
        plural (`str`, *optional*, defaults to `noun` + "s"): the plural.
        spec (`str`, *optional*, defaults to ""): the format spec of `n` (``","`` for thousands separators).
    """
    return f"{n:{spec}} {noun if n == 1 else plural or noun + 's'}"


class PoolExhaustedError(RuntimeError):
    """A fixed-size `BlockPool` has too few free blocks for a request.

    The pool is left exactly as it was before the request. The message says how many blocks were needed,
    how many were free, and which setting to change (`num_blocks` / `max_memory`, or `num_blocks=None` to grow).
    """


class InvariantError(RuntimeError):
    """`BlockPool.check_invariants()` found broken bookkeeping; the message names the invariant and the block ids."""


class CacheReleasedError(RuntimeError):
    """A `PagedCache` was used after `release()`; create a new cache (or `fork()` before releasing)."""


class CacheOffloadedError(RuntimeError):
    """A `PagedCache` was used while offloaded to the host tier (`cache.offload()`); call `cache.prefetch()` first."""
