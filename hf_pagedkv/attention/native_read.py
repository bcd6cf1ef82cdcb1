"""`NativeCodeAttention`: the quantized decode read (`fused_code_read`'s contract) as one C function
(`native/code_read.c`), built with the machine's C compiler at first use and called through `ctypes`.

Used by the ``"hf_pagedkv_compiled"`` attention implementation before its `torch.compile`d read.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from hf_pagedkv.storage.code_read import CodeRead
from hf_pagedkv.storage.code_table import CodeTable
from hf_pagedkv.storage.codecs import Fp8Codec, Int2Codec, Int3Codec, Int4Codec, Int8Codec

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "code_read.c"
#: compiler flags: OpenMP for batches on several threads; no fast-math (the scores hold -inf); products and sums
#: fused into FMAs (``-std=c11`` alone turns contraction off: the products ran as separate multiplies and adds);
#: 512-bit vectors for the loops gcc vectorizes where the CPU has them (gcc's default for AVX-512 CPUs is 256-bit:
#: a k4v4 read of 2,048 tokens 157-162 -> 133-141 us on a Xeon; without AVX-512 the option changes nothing)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
         "-ffp-contract=fast", "-mprefer-vector-width=512", "-fPIC", "-shared", "-std=c11")
#: the C side's limits (`code_read.c`): head_dim, query rows per key/value head, block size; head_dim a multiple of
#: LANES
MAX_DIM, MAX_ROWS, MAX_BLOCK, LANES = 256, 64, 256, 16
#: int64 entries per storage segment in the C side's pool description (`code_read.c`'s `SEG_WIDTH`; for a
#: full-precision pool `FP_SEG_WIDTH`)
SEG_WIDTH, FP_SEG_WIDTH = 9, 5
#: the code formats the C side reads (`code_read.c`'s `Format`): integer codecs by type, fp8 by format (per-group
#: scales only: a per-block scale has no per-group form, `Fp8Codec.affine`)
FORMATS = {Int8Codec: 8, Int4Codec: 4, Int3Codec: 3, Int2Codec: 2, "e4m3": 43, "e5m2": 52}


def code_format(codec) -> int | None:
    """The C side's number for `codec`'s codes (`FORMATS`), or None when it does not read them."""
    if type(codec) is Fp8Codec:
        return None if codec.per_block else FORMATS[codec.fmt]
    return FORMATS.get(type(codec))


def unread_codecs(codecs: tuple, dims: tuple[int, int]) -> str | None:
    """Why the C read does not take keys and values coded with `codecs` (key and value head dims `dims`), or None
    when it does: int8/int4/int3/int2 or fp8 (per-group scales) keys per channel and values per token in one group
    per head, key and value dims equal (rotated keys come with their inner codec, `rotate_code_table`)."""
    kc, vc = codecs
    if any(type(c) is Fp8Codec and c.per_block for c in codecs):
        return "fp8 codes with one scale per block (fp8_scales='block') have no per-group form the C kernel reads"
    if code_format(kc) is None or code_format(vc) is None:
        return "the C kernel reads int8/int4/int3/int2 codes and fp8 codes with per-group scales"
    if kc.axis != "channel" or vc.axis != "token" or vc.group(dims[1]) != dims[1] or dims[0] != dims[1]:
        return ("the C kernel reads keys per channel and values per token in one group per head (value_group_size "
                ">= head_dim), key and value head dims equal")
    return None


def _cpu_key() -> str:
    """What the built library depends on besides its source and flags: the CPU (``-march=native``)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return f"{platform.machine()}|{platform.processor()}|{flags}"


def library_path() -> Path:
    """Where the built library lives: ``$HF_PAGEDKV_NATIVE_DIR`` or ``~/.cache/hf_pagedkv/native``, one file per
    (source, flags, CPU)."""
    key = hashlib.blake2b("|".join((SOURCE.read_text(), " ".join(FLAGS), _cpu_key())).encode(),
                          digest_size=8).hexdigest()
    root = os.environ.get("HF_PAGEDKV_NATIVE_DIR") or Path.home() / ".cache" / "hf_pagedkv" / "native"
    return Path(root) / f"code_read-{key}.so"


def build(path: Path) -> Path:
    """Compile `SOURCE` into `path` (written to a temporary file, then renamed over: concurrent builds are safe).

    Raises:
        RuntimeError: no C compiler (``$CC``, ``cc``, ``gcc``) or the compile failed (its output in the message).
    """
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{cc} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _fits(t: torch.Tensor, shape: tuple, dtype: torch.dtype) -> bool:
    """Whether `t` is a CPU tensor of `shape` and `dtype` whose last dim is contiguous (what the C side indexes)."""
    return t.shape == shape and t.dtype == dtype and t.is_cpu and t.stride(-1) == 1


def _bias_fits(bias: torch.Tensor | None, batch: int, rows: int, width: int) -> bool:
    """Whether an additive mask is absent or the form the C side reads: `[1, batch, rows | 1, width]` fp32, on the
    CPU, its last dim contiguous."""
    return bias is None or (bias.dim() == 4 and bias.shape[2] in (1, rows)
                            and _fits(bias, (1, batch, bias.shape[2], width), torch.float32))


def _strides(t: torch.Tensor, dims: int) -> list[int]:
    return [t.stride(i) for i in range(dims)]


class NativeCodeAttention:
    """The quantized read in C: per (key/value head, row) it decodes one block of codes at a time (int8, int4, int3,
    int2, or fp8 e4m3/e5m2 with per-group scales: `unread_codecs`) into a fp32 tile, scores it against the query
    rows, takes one softmax over the read and sums the values the same way (key scales folded into the query, value
    scales into the probabilities, as `fused_code_read`). No Python or torch headers: `ctypes` calls one function
    with the tensors' pointers and strides (about 10 us per call).

    Reads it takes: the form of `CompiledCodeAttention.supports` (no window start inside the first block, at least
    one encoded block) over the codecs `unread_codecs` takes, on the CPU, fp32 queries and full-precision tokens,
    fp16 scales, head_dim <= 256, at most 64 query rows per key/value head, blocks of at most 256 tokens. Anything
    else returns None (the caller reads another way). The library is built once per machine (about 1 s) into
    `library_path()`; no compiler, or a failed build, logs a warning once and turns this object off.
    """

    def __init__(self) -> None:
        self._fn = None  # the loaded C function, made on first use
        self._table_fn = None  # its form that follows block ids (`read_table`), loaded with it
        self._fp_fn = None  # the full-precision read through block ids (`read_fp_view`), loaded with it
        self._pools: dict[tuple, tuple] = {}  # a layer's pool state -> (codecs, its C description or None)
        self.failed = False  # no compiler or a failed build/load: off for the rest of the process

    def load(self):
        """The C function (built and loaded on first call), or None when it cannot be built here or
        ``HF_PAGEDKV_NATIVE_READ=0`` (read at each call) turns the C reads off."""
        if os.environ.get("HF_PAGEDKV_NATIVE_READ", "1") == "0":
            return None
        if self._fn is None and not self.failed:
            try:
                path = library_path()
                if not path.exists():
                    build(path)
                try:
                    lib = ctypes.CDLL(str(path))
                except OSError:  # a truncated or corrupted file (a disk full while copying it): built again, once
                    lib = ctypes.CDLL(str(build(path)))
                for fn in (lib.hf_pagedkv_code_read, lib.hf_pagedkv_code_table_read, lib.hf_pagedkv_fp_table_read):
                    fn.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64))
                    fn.restype = ctypes.c_int
                self._fn, self._table_fn = lib.hf_pagedkv_code_read, lib.hf_pagedkv_code_table_read
                self._fp_fn = lib.hf_pagedkv_fp_table_read
            except Exception as e:  # noqa: BLE001 - no compiler, no writable cache: the other reads are right
                self.failed = True
                logger.warning("hf_pagedkv: the native quantized read is off (%s: %s); reading with torch",
                               type(e).__name__, e)
        return self._fn

    @staticmethod
    def supports(qh: torch.Tensor, read: CodeRead, bias: torch.Tensor | None) -> bool:
        """Whether the C function computes this read: its form (`CompiledCodeAttention.supports`'s), codecs, dtypes and
        devices, and every shape the C side indexes by (it trusts them: a wrong one would read out of bounds)."""
        kc, vc = read.codecs
        dk = read.dims[0]
        if not (sys.byteorder == "little" and read.lo == read.pos0 and read.num_encoded > 0
                and unread_codecs(read.codecs, read.dims) is None and dk <= MAX_DIM and dk % LANES == 0
                and read.block_size <= MAX_BLOCK and read.block_size % 2 == 0):
            return False
        H, batch, rows, dim = qh.shape
        n, bs, sink = read.num_encoded, read.block_size, max(0, read.sink_end - read.lo)
        m = read.end - read.pos0 - n * bs + sink  # the tail, then the sink tokens
        shapes = [(qh, (H, batch, rows, dim)), (read.full[0], (H, batch, m, dim)), (read.full[1], (H, batch, m, dim)),
                  (read.codes[0], (H, batch, n, bs * dim * kc.bits // 8)),
                  (read.codes[1], (H, batch, n, bs * dim * vc.bits // 8)),
                  (read.scales[0], (H, batch, n, dim * (1 if kc.bits == 8 else 2))),
                  (read.scales[1], (H, batch, n, bs * (1 if vc.bits == 8 else 2)))]
        dtypes = [torch.float32] * 3 + [torch.uint8] * 2 + [torch.float16] * 2
        return (dim == dk and rows <= MAX_ROWS and _bias_fits(bias, batch, rows, read.end - read.lo)
                and all(_fits(t, shape, dtype) for (t, shape), dtype in zip(shapes, dtypes)))

    def __call__(self, qh: torch.Tensor, read: CodeRead, bias: torch.Tensor | None) -> torch.Tensor | None:
        """Attention over `read` (see `code_attention`), or None where this path does not apply.

        Args:
            qh (`torch.Tensor` of shape `[H, batch, rows, dim]`): the scaled query.
            read (`CodeRead`): the quantized read.
            bias (`torch.Tensor` of shape `[1, batch, rows | 1, end - lo]`, *optional*): additive mask.

        Returns:
            `torch.Tensor` of shape `[H, batch, rows, dim]`, or None.
        """
        if not self.supports(qh, read, bias):
            return None
        fn = self.load()
        if fn is None:
            return None
        H, batch, rows, dim = qh.shape
        (kc, vc), (ks, vs), (fk, fv) = read.codes, read.scales, read.full
        kcodec, vcodec = read.codecs
        out = torch.empty((H, batch, rows, dim), dtype=torch.float32)
        b = None if bias is None else bias[0]  # [batch, rows | 1, width]
        meta = [H, batch, rows, dim, read.num_encoded, fk.shape[2], code_format(kcodec), code_format(vcodec),
                read.block_size,
                max(0, read.sink_end - read.lo), torch.get_num_threads()]
        for t in (qh, kc, ks, vc, vs, fk, fv):
            meta += _strides(t, 3)
        meta += [0, 0] if b is None else [b.stride(0), b.stride(1) if b.shape[1] > 1 else 0]
        ptrs = [t.data_ptr() for t in (qh, kc, ks, vc, vs, fk, fv)] + [None if b is None else b.data_ptr(),
                                                                     out.data_ptr()]
        if fn((ctypes.c_void_p * 9)(*ptrs), (ctypes.c_int64 * len(meta))(*meta)):
            return None
        return out

    @staticmethod
    def supports_table(qh: torch.Tensor, table: CodeTable, bias: torch.Tensor | None) -> bool:
        """Whether the C function that follows block ids computes this read: the form of `supports`, and the pool's,
        staging's, new tokens' and sinks' shapes, dtypes and devices (it trusts them)."""
        return (NativeCodeAttention._pool_form_fits(table, qh.shape[0])
                and NativeCodeAttention._call_fits(qh, table, bias))

    @staticmethod
    def _pool_form_fits(table: CodeTable, heads: int) -> bool:
        """The half of `supports_table` that holds for every read of a layer's pool: codecs, sizes, pool layout."""
        dk = table.dims[0]
        return (sys.byteorder == "little" and unread_codecs(table.codecs, table.dims) is None
                and dk <= MAX_DIM and dk % LANES == 0 and table.block_size <= MAX_BLOCK
                and table.block_size % 2 == 0 and table.pools_fit(heads, torch.device("cpu")))

    @staticmethod
    def _call_fits(qh: torch.Tensor, table: CodeTable, bias: torch.Tensor | None) -> bool:
        """The half of `supports_table` that depends on the call: the query, the block ids, the full-precision
        tokens and the mask (shapes, dtypes, CPU, contiguous last dims). (Written out rather than as a list of
        (tensor, shape, dtype) triples: it runs per layer and step, and the list cost as much as the checks.)"""
        H, batch, rows, dim = qh.shape
        ids, f32, i64 = table.ids, torch.float32, torch.long
        new = table.new
        q = 0 if new is None else new[0].shape[2]
        width = table.num_encoded * table.block_size + table.rest + q
        if (dim != table.dims[0] or rows > MAX_ROWS or width != table.end - table.lo or not _fits(qh, qh.shape, f32)
                or not _fits(ids, (batch, table.num_encoded), i64) or not ids.is_contiguous()):
            return False
        for part in (table.staged, table.sinks):
            if part is not None and not all(_fits(t, (H, t.shape[1], dim), f32) for t in part):
                return False
        if new is not None and not all(_fits(t, (batch, H, q, dim), f32) for t in new):
            return False
        for t in (table.stage, table.sink_slot):
            if t is not None and not _fits(t, (batch,), i64):
                return False
        return _bias_fits(bias, batch, rows, table.end - table.lo)

    def _pool_segments(self, table: CodeTable, heads: int):
        """The C side's description of the layer's pool, `[nseg, SEG_WIDTH]` int64 as a ctypes array (each storage
        segment's first block id, then the address and head stride of its key codes, key scales, value codes and
        value scales), or None when the pool does not have the form the C function reads (`_pool_form_fits`).

        NOTE: kept per pool state (the four `SegmentedTensor.generation`s, never reused in a process: a segment
        added or dropped, or another pool, misses): building it and checking the pool took about a quarter of the
        Python around each layer's read. The entries hold no tensor, so a released cache's memory is not kept."""
        pools = (table.codes[0], table.scales[0], table.codes[1], table.scales[1])
        generations = tuple(t.generation for t in pools)
        key = (generations, heads, table.block_size, table.dims)
        entry = self._pools.get(key)
        if entry is not None and entry[0][0] is table.codecs[0] and entry[0][1] is table.codecs[1]:
            return entry[1]
        segs = None
        if self._pool_form_fits(table, heads):
            rows = [x for i, start in enumerate(pools[0].starts)
                    for x in (start, *(y for t in pools for y in (t.segments[i].data_ptr(),
                                                                   t.segments[i].stride(0))))]
            segs = (ctypes.c_int64 * len(rows))(*rows)
        return self._remember(key, table.codecs, segs)

    def _remember(self, key: tuple, codecs, segs):
        """Keep a pool's C description (`segs`, or None) under `key`; returns `segs`."""
        if len(self._pools) >= 1024:  # (layers x pools of a long-lived process: drop the stale ones at once)
            self._pools.clear()
        self._pools[key] = (codecs, segs)
        return segs

    def read_table(self, qh: torch.Tensor, table: CodeTable, bias: torch.Tensor | None,
                   rotation: torch.Tensor | None = None) -> torch.Tensor | None:
        """Attention over `table` (the read of `__call__`, its blocks found through their ids in the C function), or
        None where this path does not apply.

        Args:
            qh (`torch.Tensor` of shape `[H, batch, rows, dim]`): the scaled query, in the basis of the table's key
                codes and full-precision keys; with `rotation`, in the model's basis.
            table (`CodeTable`): the quantized read, where it lies.
            bias (`torch.Tensor` of shape `[1, batch, rows | 1, end - lo]`, *optional*): additive mask.
            rotation (`torch.Tensor` of shape `[dim, dim]`, *optional*): for rotated keys whose full-precision keys
                were left as they lie (`PagedView.code_table(turn_keys=False)`), the matrix their codes were turned
                by: the C side turns the query rows once for the codes and scores the full-precision keys with `qh`
                as it is (fp32, CPU; another form: None).

        Returns:
            `torch.Tensor` of shape `[H, batch, rows, dim]`, or None.
        """
        if self.load() is None:
            return None
        H, batch, rows, dim = qh.shape
        segs = self._pool_segments(table, H)
        if segs is None or not self._call_fits(qh, table, bias):
            return None
        if rotation is not None:
            rotation = rotation.to(torch.float32).contiguous()
            if rotation.shape != (dim, dim) or not rotation.is_cpu:
                return None
        kcodec, vcodec = table.codecs
        out = torch.empty((H, batch, rows, dim), dtype=torch.float32)
        b = None if bias is None else bias[0]  # [batch, rows | 1, width]
        staged, new, sinks = table.staged or (None, None), table.new or (None, None), table.sinks or (None, None)
        q = 0 if new[0] is None else new[0].shape[2]
        meta = [H, batch, rows, dim, table.num_encoded, code_format(kcodec), code_format(vcodec), table.block_size,
                table.sink_end - table.lo if table.sink_end else 0, torch.get_num_threads(), table.rest, q,
                *qh.stride()[:3]]
        for t in (table.codes[0], table.scales[0], table.codes[1], table.scales[1]):
            meta += (0, t.d2)  # (the head stride is each segment's)
        for t in staged:
            meta += (0, 0) if t is None else t.stride()[:2]
        for t in new:
            meta += (0, 0, 0) if t is None else t.stride()[:3]
        for t in sinks:
            meta += (0, 0) if t is None else t.stride()[:2]
        meta += (0, 0) if b is None else (b.stride(0), b.stride(1) if b.shape[1] > 1 else 0)
        meta.append(len(segs) // SEG_WIDTH)
        ptrs = (qh.data_ptr(), ctypes.addressof(segs), None if rotation is None else rotation.data_ptr(), None, None,
                table.ids.data_ptr(),
                *(None if t is None else t.data_ptr() for t in (table.stage, *staged, *new, table.sink_slot, *sinks,
                                                                 b)), out.data_ptr())
        if self._table_fn((ctypes.c_void_p * 16)(*ptrs), (ctypes.c_int64 * len(meta))(*meta)):
            return None
        return out

    def read_view(self, qh: torch.Tensor, view, bias: torch.Tensor | None) -> torch.Tensor | None:
        """`read_table` over a `PagedView`'s quantized tokens (`PagedView.code_table`), `read_fp_view` over a
        full-precision store's, or None. `qh` is the query in the model's basis; for rotated keys the C side turns it
        for their codes and scores the full-precision keys as they lie (`code_table(turn_keys=False)`): no matrix
        product over the layer's whole staging area, nor one for the query, per read."""
        if not view.store.is_quantized:
            return self.read_fp_view(qh, view, bias)
        rotation = view.key_rotation()
        table = view.code_table(turn_keys=rotation is None)
        return None if table is None else self.read_table(qh, table, bias, rotation)

    def _fp_segments(self, keys, values, block_size: int, heads: int, dim: int):
        """The C side's description of a full-precision layer's pool, `[nseg, FP_SEG_WIDTH]` int64 as a ctypes array
        (each storage segment's first block id, then the address and head stride of its keys and of its values), or
        None when the pool does not have the form the C function reads: fp32 on the CPU, `[heads, slots, dim]`
        segments with contiguous slots, each starting at a block boundary. Kept per pool state, as
        `_pool_segments`."""
        key = ("fp", keys.generation, values.generation, block_size, heads, dim)
        if key in self._pools:
            return self._pools[key][1]
        segs = None
        if (keys.dtype == values.dtype == torch.float32 and keys.d0 == values.d0 == heads
                and keys.d2 == values.d2 == dim and keys.starts == values.starts
                and all(start % block_size == 0 for start in keys.starts)
                and all(s.is_cpu and s.stride(2) == 1 and s.stride(1) == dim
                        for t in (keys, values) for s in t.segments)):
            rows = [x for i, start in enumerate(keys.starts)
                    for x in (start // block_size, keys.segments[i].data_ptr(), keys.segments[i].stride(0),
                              values.segments[i].data_ptr(), values.segments[i].stride(0))]
            segs = (ctypes.c_int64 * len(rows))(*rows)
        return self._remember(key, None, segs)

    def read_fp_view(self, qh: torch.Tensor, view, bias: torch.Tensor | None) -> torch.Tensor | None:
        """Attention over a full-precision (fp32) store's tokens ``lo .. end - 1`` of a `PagedView`, its blocks found
        through the block table by the C function (`hf_pagedkv_fp_table_read`): per (key/value head, row) the scores
        block by block (the next block prefetched), one softmax (`NEGLIGIBLE` as the torch read), the values' sum.
        Nothing is gathered; batch rows need not be consecutive. Up to fp32 rounding, `sdpa` over the gathered K/V
        (the sums run in another order). None where this path does not apply (another dtype or device, head_dim not
        a multiple of 16 or above 256, more than 64 query rows per key/value head, key and value dims that differ).

        Args:
            qh (`torch.Tensor` of shape `[H, batch, rows, dim]`): the scaled query, fp32.
            view (`PagedView`): a full-precision store's view.
            bias (`torch.Tensor` of shape `[1, batch, rows | 1, end - lo]`, *optional*): additive mask.

        Returns:
            `torch.Tensor` of shape `[H, batch, rows, dim]`, or None.
        """
        if self.load() is None:
            return None
        H, batch, rows, dim = qh.shape
        bs, lo, end = view.block_size, view.lo, view.end
        if (sys.byteorder != "little" or dim % LANES or dim > MAX_DIM or rows > MAX_ROWS or end <= lo
                or not _fits(qh, qh.shape, torch.float32)):
            return None
        if not _bias_fits(bias, batch, rows, end - lo):
            return None
        spec = view.spec
        if spec.key_dim != dim or spec.value_dim != dim or spec.num_kv_heads != H:
            return None
        segs = self._fp_segments(view.store.keys[view.layer_idx], view.store.values[view.layer_idx], bs, H, dim)
        if segs is None:
            return None
        first, last = lo // bs, -(-end // bs)
        ids = view.table[:, first:last]
        if ids.shape != (batch, last - first) or ids.dtype != torch.long:
            return None
        ids = ids.contiguous()
        low, high = torch.aminmax(ids)  # the C side trusts the ids: a row's unused table entries must not reach it
        if int(low) < 0 or (int(high) + 1) * bs > view.store.keys[view.layer_idx].length:
            return None
        out = torch.empty((H, batch, rows, dim), dtype=torch.float32)
        b = None if bias is None else bias[0]  # [batch, rows | 1, width]
        meta = [H, batch, rows, dim, last - first, bs, lo - first * bs, end - lo, torch.get_num_threads(),
                *qh.stride()[:3], *((0, 0) if b is None else (b.stride(0), b.stride(1) if b.shape[1] > 1 else 0)),
                len(segs) // FP_SEG_WIDTH]
        ptrs = (qh.data_ptr(), ctypes.addressof(segs), ids.data_ptr(), None if b is None else b.data_ptr(),
                out.data_ptr())
        if self._fp_fn((ctypes.c_void_p * 5)(*ptrs), (ctypes.c_int64 * len(meta))(*meta)):
            return None
        return out


__all__ = ["FORMATS", "NativeCodeAttention", "build", "code_format", "library_path", "unread_codecs"]
