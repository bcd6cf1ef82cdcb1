"""`TritonCodeAttention`: the quantized decode read through block tables as a Triton kernel, for GPUs.

The GPU engine of ``"hf_pagedkv_compiled"``, with the contract of `NativeCodeAttention.read_table` (the C read, the
CPU engine): attention of a few query rows over a layer's int8/int4 codes and fp16 scales found through each row's
block ids, plus the full-precision tokens (the staged partial block, the step's own tokens, the sink tokens) where
they lie; nothing gathered, nothing de-quantized into memory. Triton is imported on first use only (a CUDA build of
torch brings it); the same kernel runs on the CPU under Triton's interpreter, which is how the tests check it
against the C read and the eager one.
"""

from __future__ import annotations

import logging

import torch

from hf_pagedkv.attention.compiled_read import CompiledCodeAttention
from hf_pagedkv.attention.rotated_read import turn
from hf_pagedkv.storage.code_table import CodeTable

logger = logging.getLogger(__name__)

#: scores more than this below their row's maximum get probability 0 (the eager read's `NEGLIGIBLE`)
_NEGLIGIBLE = -64 * 0.6931471805599453
#: the most query rows per key/value head (`tl.dot` tiles are padded to at least 16 rows)
MAX_ROWS = 64


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


class TritonCodeAttention:
    """The quantized read through block tables in Triton (`code_table_read` above): per (key/value head, batch
    row), one program decodes one block of codes at a time in registers (int8: the byte; int4: a nibble of the
    byte `(t mod bs/2, d)`), scores it with `tl.dot` in fp32 (``input_precision="ieee"``: no TF32) and folds it
    into an online softmax; the staged partial block, the step's tokens and the sink tokens follow in full
    precision. Each block id's storage segment is found in the pool's segment table (a grown pool needs no copy).

    Reads it takes: `CompiledCodeAttention.supports_codecs`'s codecs, head_dim a power of two >= 16, blocks of a
    power of two >= 16 tokens, at most 64 query rows per key/value head, every tensor on the query's device (a
    CUDA device; the CPU under `interpret=True`), float queries, tokens and mask. Anything else returns None (the
    caller reads another way); so does everything once Triton failed to import or a launch raised (logged once).

    Args:
        interpret (`bool`, defaults to False): read CPU tensors under Triton's interpreter (tests; slow), which needs
            ``TRITON_INTERPRET=1`` in the environment before Triton is imported.
    """

    def __init__(self, interpret: bool = False) -> None:
        self.interpret = interpret
        self._fn = None  # the kernel, made on first use
        self.failed = False  # Triton missing or a launch failed: off for the rest of the process

    def load(self):
        """The kernel (Triton imported and the function wrapped on first call), or None without Triton."""
        if self._fn is None and not self.failed:
            try:
                import triton
                import triton.language as tl

                from hf_pagedkv.attention.triton_kernel import code_table_read

                # Triton wraps its own library functions (tl.zeros, ...) for the interpreter only when
                # TRITON_INTERPRET=1 was set at its import
                if self.interpret and type(tl.zeros).__name__ != "InterpretedFunction":
                    raise RuntimeError("interpret=True needs TRITON_INTERPRET=1 in the environment before Triton is "
                                       "first imported, i.e. before torch, transformers or hf_pagedkv are (Triton "
                                       "wraps its own library functions at import)")
                self._fn = triton.jit(code_table_read)
            except Exception as e:  # noqa: BLE001 - no Triton here: the other reads are right
                self.failed = True
                logger.warning("hf_pagedkv: the Triton quantized read is off (%s: %s)", type(e).__name__, e)
        return self._fn

    def supports_table(self, qh: torch.Tensor, table: CodeTable, bias: torch.Tensor | None) -> bool:
        """Whether the kernel computes this read: the form, and every tensor's shape, dtype and device (the kernel
        trusts them)."""
        device = qh.device
        if (device.type == "cpu") != self.interpret:
            return False
        dk, bs = table.dims[0], table.block_size
        if not (CompiledCodeAttention.supports_codecs(table.codecs, table.dims) and _pow2(dk) and dk >= 16
                and _pow2(bs) and bs >= 16):
            return False
        H, batch, rows, dim = qh.shape
        n = table.num_encoded
        q = 0 if table.new is None else table.new[0].shape[2]
        if (not qh.is_floating_point() or dim != dk or rows > MAX_ROWS
                or n * bs + table.rest + q != table.end - table.lo):
            return False
        if not table.pools_fit(H, device):
            return False
        full = [t for part in (table.staged, table.new, table.sinks) if part is not None for t in part]
        shapes = [(t, (batch, H, q, dim) if t.dim() == 4 else (H, t.shape[1], dim)) for t in full]
        if bias is not None:
            if bias.dim() != 4 or bias.shape[2] not in (1, rows):
                return False
            shapes.append((bias, (1, batch, bias.shape[2], table.end - table.lo)))
        ints = [t for t in (table.ids, table.stage, table.sink_slot) if t is not None]
        return (table.ids.is_contiguous() and tuple(table.ids.shape) == (batch, n)
                and all(tuple(t.shape) == shape and t.is_floating_point() and t.device == device
                        and t.stride(-1) == 1 for t, shape in shapes)
                and all(t.dtype == torch.long for t in ints))

    def read_table(self, qh: torch.Tensor, table: CodeTable, bias: torch.Tensor | None) -> torch.Tensor | None:
        """Attention over `table` (`NativeCodeAttention.read_table`'s contract), or None where this path does not
        apply.

        Args:
            qh (`torch.Tensor` of shape `[H, batch, rows, dim]`): the scaled query.
            table (`CodeTable`): the quantized read, where it lies.
            bias (`torch.Tensor` of shape `[1, batch, rows | 1, end - lo]`, *optional*): additive mask.

        Returns:
            `torch.Tensor` of shape `[H, batch, rows, dim]` in the query's dtype (summed in float32), or None.
        """
        if not self.supports_table(qh, table, bias) or self.load() is None:
            return None
        H, batch, rows, dim = qh.shape
        device, bs = qh.device, table.block_size
        kcodec, vcodec = table.codecs
        pools = (table.codes[0], table.scales[0], table.codes[1], table.scales[1])
        # each array's lowest segment is its base: every segment lies at a non-negative element offset from it
        bases = [min(t.segments, key=lambda seg: seg.data_ptr()) for t in pools]
        segs = torch.tensor([[start] + [x for t, base in zip(pools, bases)
                                        for x in ((t.segments[i].data_ptr() - base.data_ptr()) // base.element_size(),
                                                  t.segments[i].stride(0))]
                             for i, start in enumerate(pools[0].starts)], dtype=torch.long, device=device)
        q = 0 if table.new is None else table.new[0].shape[2]
        # the block ids and slot lists are bookkeeping, on the CPU: the kernel reads them on its device
        ids, stage, sink_slot = (None if t is None else t.to(device, non_blocking=True)
                                 for t in (table.ids, table.stage, table.sink_slot))
        zero = torch.zeros(batch, dtype=torch.long, device=device)  # stands in for an absent slot list
        stk, stv = table.staged or (qh, qh)
        nk, nv = table.new or (qh.unsqueeze(0), qh.unsqueeze(0))
        sk, sv = table.sinks or (qh, qh)
        sink = table.sink_end - table.lo if table.sink_end else 0
        b = torch.zeros(1, 1, 1, 1, device=device) if bias is None else bias
        out = torch.empty((H, batch, rows, dim), dtype=torch.float32, device=device)
        block_t = max(16, 1 << (max(table.rest, q, sink, 1) - 1).bit_length())
        try:
            self._fn[(H * batch,)](
                qh, qh.stride(0), qh.stride(1), qh.stride(2), ids, table.num_encoded, segs, len(segs),
                *bases, *(t.d2 for t in pools),
                stk, stv, stk.stride(0), stk.stride(1), stv.stride(0), stv.stride(1),
                zero if stage is None else stage, table.rest,
                nk, nv, nk.stride(0), nk.stride(1), nk.stride(2), nv.stride(0), nv.stride(1), nv.stride(2), q,
                sk, sv, sk.stride(0), sk.stride(1), sv.stride(0), sv.stride(1),
                zero if sink_slot is None else sink_slot, sink,
                b, b.stride(1), b.stride(2) if b.shape[2] > 1 else 0, table.end - table.lo, out, batch, rows,
                D=dim, BS=bs, KBITS=kcodec.bits, VBITS=vcodec.bits, BLOCK_R=max(16, 1 << (rows - 1).bit_length()),
                BLOCK_T=block_t, HAS_BIAS=bias is not None, NEGLIGIBLE=_NEGLIGIBLE)
        except Exception as e:  # noqa: BLE001 - a compile or launch error: the other reads are right
            self.failed = True
            logger.warning("hf_pagedkv: the Triton quantized read failed and is off (%s: %s)", type(e).__name__, e)
            return None
        return out if qh.dtype == torch.float32 else out.to(qh.dtype)

    def read_view(self, qh: torch.Tensor, view, bias: torch.Tensor | None) -> torch.Tensor | None:
        """`read_table` over a `PagedView`'s quantized tokens (`PagedView.code_table`), or None. `qh` is the query in
        the model's basis: for rotated keys it is turned here (`code_table` turns their full-precision keys)."""
        if (qh.device.type == "cpu") != self.interpret:
            return None
        table = view.code_table()
        if table is None:
            return None
        return self.read_table(turn(qh, view.key_rotation()), table, bias)


__all__ = ["TritonCodeAttention"]
