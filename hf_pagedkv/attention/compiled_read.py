"""`CompiledCodeAttention`: the quantized decode read (`code_attention`) as one `torch.compile`d function (opt-in).

Used only by the ``"hf_pagedkv_compiled"`` attention implementation; ``"hf_pagedkv"`` stays eager.
"""

from __future__ import annotations

import logging

import torch

from hf_pagedkv.storage.code_read import CodeRead
from hf_pagedkv.storage.codecs.int4 import Int4Codec
from hf_pagedkv.storage.codecs.int8 import Int8Codec

logger = logging.getLogger(__name__)

#: scores more than this below their row's maximum get probability 0 (the eager path's `NEGLIGIBLE`, repeated here
#: so that this module imports nothing from `paged_attention`, which imports it)
_NEGLIGIBLE = -64 * 0.6931471805599453


def _parts(codes: torch.Tensor, bits: int, block_size: int, dim: int) -> tuple[torch.Tensor, ...]:
    """Codes `[H, batch, n, code_size]` (uint8) -> integer-valued parts `[H, batch, n, block_size // k, dim]`,
    part `i` holding tokens ``i * block_size / k ..`` of each block (`k` = 1 for int8, 2 for int4: `Int4Codec`'s
    token-half packing). int8 bytes are read as offset binary, ``v = (u ^ 128) - 128``: a dtype view (`int8`)
    inside a compiled graph is not vectorized (measured 3.5x slower than eager)."""
    H, batch, n, _ = codes.shape
    if bits == 8:
        return ((codes.view(H, batch, n, block_size, dim) ^ 128).float() - 128,)
    c = codes.view(H, batch, n, block_size // 2, dim)
    return c & 15, c >> 4


def fused_code_read(qh: torch.Tensor, kcodes: torch.Tensor, kscales: torch.Tensor, vcodes: torch.Tensor,
                    vscales: torch.Tensor, full_k: torch.Tensor, full_v: torch.Tensor, bias: torch.Tensor | None,
                    kbits: int, vbits: int, block_size: int, sink: int) -> torch.Tensor:
    """`code_attention` for int8/int4 keys (per channel) and values (per token, one group per head) read from
    column 0, written so that inductor fuses it: the key scales are folded into the query block by block
    (``q . (s_b c_t + z_b) = (q * s_b) . c_t + q . z_b``) and both products are reductions over the codes' parts,
    so no tile of codes is ever written in fp32. Same arguments as the tensors of `CodeRead` (`kbits`,
    `vbits`: 8 or 4; `sink`: tokens ``0 .. sink - 1`` read from the end of `full_*` instead of their codes).

    Args:
        qh (`torch.Tensor` of shape `[H, batch, rows, dim]`): the scaled query.
        bias (`torch.Tensor` of shape `[1, batch, rows | 1, width]`, *optional*): additive mask over the read's
            columns (``width = num_encoded * block_size + tail``).

    Returns:
        `torch.Tensor` of shape `[H, batch, rows, dim]`.
    """
    H, batch, n, _ = kcodes.shape
    rows, dim = qh.shape[2], qh.shape[3]
    T = n * block_size
    ks = kscales.float()
    s, z = (ks, None) if kbits == 8 else ks.chunk(2, -1)  # [H, batch, n, dim] each
    qs = qh.unsqueeze(2) * s.unsqueeze(3)  # [H, batch, n, rows, dim]: the query scaled per block
    enc = torch.cat([(qs.unsqueeze(4) * c.unsqueeze(3)).sum(-1) for c in _parts(kcodes, kbits, block_size, dim)],
                    -1)  # [H, batch, n, rows, block_size]
    if z is not None:
        enc = enc + torch.matmul(z, qh.transpose(-1, -2)).unsqueeze(-1)  # q . z_b: [H, batch, n, rows, 1]
    enc = enc.transpose(2, 3).reshape(H, batch, rows, T)
    scores = torch.cat((enc, torch.matmul(qh, full_k.transpose(-1, -2))), -1)  # [.., encoded | tail | sink]
    width = scores.shape[-1] - sink
    if sink:
        scores[..., :sink] = float("-inf")  # read in full precision from the last columns
    if bias is not None:
        scores[..., :width] += bias
        if sink:
            scores[..., width:] += bias[..., :sink]
    m = scores.amax(-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).min)  # finite: a padding row gets 0s
    d = scores - m
    p = torch.where(d < _NEGLIGIBLE, 0.0, torch.exp(d))  # [H, batch, rows, columns]
    l = p.sum(-1, keepdim=True)
    out = torch.matmul(p[..., T:], full_v)  # tail and sink: [H, batch, rows, dim]
    vs = vscales.float()
    pe = p[..., :T].reshape(H, batch, rows, n, block_size)
    s, z = (vs, None) if vbits == 8 else vs.chunk(2, -1)  # [H, batch, n, block_size] each
    w = pe * s.reshape(H, batch, 1, n, block_size)  # p_t s_t
    cs = _parts(vcodes, vbits, block_size, dim)
    w = w.reshape(H, batch, rows, n, len(cs), block_size // len(cs))
    for i, c in enumerate(cs):  # sum over blocks and tokens of (p_t s_t) c_t
        out = out + (w[:, :, :, :, i].unsqueeze(-1) * c.unsqueeze(2)).sum((3, 4))
    if z is not None:
        out = out + (pe * z.reshape(H, batch, 1, n, block_size)).sum((-1, -2)).unsqueeze(-1)  # sum_t p_t z_t
    return out / l.clamp(min=torch.finfo(l.dtype).tiny)  # a row masked everywhere: 0, as `sdpa`


#: graphs of `fused_code_read` a process may hold (batch 1 or more, mask or none, codec bits, reads past 4096 columns,
#: input strides): past it, dynamo runs the function eagerly (correct, slower)
_GRAPH_LIMIT = 32


class CompiledCodeAttention:
    """`fused_code_read` compiled once per process (inductor, ``dynamic=True``: one graph serves every step as the
    read grows), with the eager `code_attention` as fallback.

    Compiles lazily, on the first supported read. Graphs are specialized on batch 1 against larger batches, on a
    mask or none, on the codecs' bits, the block size and the sink length (constants of the graph), and once more
    when a read passes 4096 columns (inductor's accumulator choice), so a process compiles a few graphs (4 s to 2
    min each on a shared 2-core machine) and none per step. Once a graph exists, a call first runs under
    ``torch.compiler.set_stance("fail_on_recompile")`` (a read the graphs held do not serve raises before anything
    runs, and is then compiled under the config patches below): the patches cost 50-170 us per call, the stance
    10-20 (`benchmarks/dev/compiled_read_in_model.py`).

    Reads it takes: the `torch` backend's `Int8Codec`/`Int4Codec` for keys (``axis="channel"``) and values
    (``axis="token"``, one group per head), equal key and value head dims, and a read from the first block's
    first token (no sliding-window cut). Anything else, and any error while compiling or running (logged once,
    then this object stays off), returns None: the caller reads eagerly.
    """

    def __init__(self) -> None:
        self._fn = None  # the compiled `fused_code_read`, made on first use
        self.compile_calls = 0  # calls that were allowed to compile (each one compiled a graph or found one)
        self.failed = False  # a compile or run error happened: off for the rest of the process

    @staticmethod
    def supports(read: CodeRead) -> bool:
        """Whether `read` has the form `fused_code_read` computes."""
        return read.lo == read.pos0 and read.num_encoded > 0 and CompiledCodeAttention.supports_codecs(read.codecs,
                                                                                                     read.dims)

    @staticmethod
    def supports_codecs(codecs: tuple, dims: tuple[int, int]) -> bool:
        """Whether keys and values coded with `codecs` (key and value head dims `dims`) have the form
        `fused_code_read` computes: int8/int4 keys per channel, values per token in one group per head."""
        kc, vc = codecs
        dk, dv = dims
        return (dk == dv and type(kc) in (Int8Codec, Int4Codec) and type(vc) in (Int8Codec, Int4Codec)
                and kc.axis == "channel" and vc.axis == "token" and vc.group(dv) == dv)

    def __call__(self, qh: torch.Tensor, read: CodeRead, bias: torch.Tensor | None) -> torch.Tensor | None:
        """Attention over `read` (see `code_attention`), or None where this path does not apply or failed.

        Args:
            qh (`torch.Tensor` of shape `[H, batch, rows, dim]`): the scaled query.
            read (`CodeRead`): the quantized read.
            bias (`torch.Tensor` of shape `[1, batch, rows | 1, end - lo]`, *optional*): additive mask.

        Returns:
            `torch.Tensor` of shape `[H, batch, rows, dim]`, or None.
        """
        if self.failed or qh.dtype != torch.float32 or not self.supports(read):
            return None  # (the formula decodes into fp32: half-precision queries read eagerly, not a failed compile)
        try:
            if self._fn is None:
                self._fn = torch.compile(fused_code_read, dynamic=True)
            kc, vc = read.codecs
            args = (qh, read.codes[0], read.scales[0], read.codes[1], read.scales[1], read.full[0], read.full[1],
                    bias, kc.bits, vc.bits, read.block_size, max(0, read.sink_end - read.lo))
            if self.compile_calls:
                # the usual call (class docstring): a read that needs another graph raises before anything runs
                try:
                    with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
                        return self._fn(*args)
                except RuntimeError as e:
                    if "fail_on_recompile" not in str(e):
                        raise
            # NOTE: no duck sizing: with it, a block count equal to another size (heads, rows, head_dim) gets a
            # graph of its own, compiled mid-generation; inference only (the graphs guard on the grad mode). A
            # process that runs k8v4 and k4v4 at batch 1 and 8 up to 4096+ tokens held 8 graphs, dynamo's default
            # limit per function (past it, dynamo runs the function eagerly): the limit is raised for this call only.
            # The int arguments (bits, block size, sink length: fixed for a cache) are constants of the graph: as
            # symbols (``dynamic=True`` makes them so) the generated code ran 1.5-2x slower
            with torch.no_grad(), torch.fx.experimental._config.patch(use_duck_shape=False), \
                    torch._dynamo.config.patch(recompile_limit=_GRAPH_LIMIT, specialize_int=True):
                out = self._fn(*args)
            self.compile_calls += 1
            return out
        except Exception as e:  # noqa: BLE001 - no compiler, a lowering error: the eager read is always right
            self.failed = True
            logger.warning("hf_pagedkv_compiled: torch.compile of the quantized read failed (%s: %s); reading "
                           "eagerly from now on", type(e).__name__, e)
            return None


__all__ = ["CompiledCodeAttention", "fused_code_read"]
