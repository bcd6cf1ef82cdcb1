"""Autograd through a `PagedCache` step: gradients reach the step's own K/V, as with `DynamicCache`.

The pool stores K/V without autograd history (its tensors are shared by every cache of the pool and outlive any
graph). So under grad mode a step returns what the pool read, connected to the graph by `attach_step_grad`: the
gradient at the step's own token positions flows back to the `key_states` / `value_states` the model passed in.
Tokens cached by earlier forward calls carry no gradient. That is exactly `DynamicCache`'s gradient when those
tokens were computed without grad (a prompt prefilled under `torch.no_grad()`, then a forward with grad). When they
were computed with grad, `DynamicCache` would also backpropagate into the earlier calls; `PagedCache` cannot, and
`backward()` raises instead of returning different gradients.
"""

from __future__ import annotations

import torch

GRAD_HISTORY_LOST = (
    "PagedCache keeps no autograd history of the K/V cached by earlier forward calls, and this backward pass "
    "needs it (those tokens were computed with grad enabled, so DynamicCache would backpropagate into them). "
    "Run the earlier calls under torch.no_grad() (then only this call's tokens get gradients, as with "
    "DynamicCache), or use transformers' DynamicCache to train through several cached forward calls."
)


class _StepGrad(torch.autograd.Function):
    """Forward: a copy of `read` `[batch, heads, seq_len, dim]` (no alias of pool storage, which later steps
    write in place). Backward: the gradient of the positions ``offset .. offset + num_new - 1`` goes to `new`
    `[batch, heads, num_new, dim]`, whose values those positions hold; raises when `history_lost`."""

    @staticmethod
    def forward(ctx, read: torch.Tensor, new: torch.Tensor, offset: int, history_lost: bool) -> torch.Tensor:
        ctx.offset, ctx.num_new, ctx.history_lost = offset, new.shape[2], history_lost
        return read.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.history_lost:
            raise RuntimeError(GRAD_HISTORY_LOST)
        return None, grad.narrow(2, ctx.offset, ctx.num_new), None, None


def needs_grad(key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
    """Whether a step must connect its output to autograd (grad mode on and the new K/V require grad)."""
    return torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad)


def attach_step_grad(read: tuple[torch.Tensor, torch.Tensor], new: tuple[torch.Tensor, torch.Tensor], offset: int,
                     history_lost: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`read` (keys, values `[batch, heads, seq_len, dim]`, positions ``lo ..`` of every row) with the step's own
    tokens, at positions ``offset ..`` of `read`, differentiable with respect to `new` (the step's key_states and
    value_states `[batch, heads, num_new, dim]`, every row). `history_lost`: earlier positions were computed with
    grad; a backward pass through this step then raises `RuntimeError(GRAD_HISTORY_LOST)`."""
    return tuple(_StepGrad.apply(r, n, offset, history_lost) for r, n in zip(read, new, strict=True))
