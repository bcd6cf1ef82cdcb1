"""Drift with a format per layer: `batched_drift.py` where chosen layers use another preset (a developer probe).

The store keeps one key and one value codec for all its layers; this probe swaps in another preset's codecs for the
chosen layers (their codes, scales and bytes follow that preset) by wrapping the store's per-layer entry points, so
the 20-window protocol can say whether a per-layer choice pays before the store supports one. Bytes are the sum of
each layer's block bytes. A config ``BASE@L1,L2=OTHER`` stores layers L1, L2 in preset OTHER and the rest in BASE:

    python benchmarks/dev/per_layer_drift.py --num-windows 20 --configs k8v4rv@6,11,17,19,24=k8v8rv \
        k8v4rv@17,19,24=k8v8rv k8v4rv@0,29=k8v8rv

``--screen N``: rank the layers by how much of the residual stream their 4-bit rotated values move instead (one
forward pass over the first N windows' 2,048 tokens: for each layer, the mean norm of ``o_proj`` of the attention
output's change over the last 256 positions when the values are k8v4rv's 4-bit codes instead of full precision,
divided by the mean norm of the layer's input), printed most sensitive first:

    python benchmarks/dev/per_layer_drift.py --screen 3
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import batched_drift  # noqa: E402
from hf_pagedkv import QuantConfig  # noqa: E402
from hf_pagedkv.storage.codecs import codecs_for  # noqa: E402
from hf_pagedkv.storage.quantized_reader import QuantizedReader  # noqa: E402
from hf_pagedkv.storage.quantized_store import QuantizedPageStore  # noqa: E402
from hf_pagedkv.storage.quantized_writer import QuantizedWriter  # noqa: E402

OVERRIDES: dict[int, tuple] = {}  # layer_idx -> (key codec, value codec) for the next store made


def _with_layer_codecs(method):
    def wrapped(self, layer_idx, *args, **kwargs):
        saved = self.codecs
        self.codecs = self.layer_codecs.get(layer_idx, saved)
        try:
            return method(self, layer_idx, *args, **kwargs)
        finally:
            self.codecs = saved
    return wrapped


def install() -> None:
    """Give every `QuantizedPageStore` made from now on the codecs in `OVERRIDES` for those layers."""
    init, add_layer = QuantizedPageStore.__init__, QuantizedPageStore.add_layer

    def store_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.layer_codecs = self.reader.layer_codecs = self.writer.layer_codecs = dict(OVERRIDES)

    def store_add_layer(self, layer_idx, spec):  # the layer's code and scale tensors in its own layouts
        saved = self.key_codec, self.value_codec
        self.key_codec, self.value_codec = self.layer_codecs.get(layer_idx, saved)
        try:
            add_layer(self, layer_idx, spec)
        finally:
            self.key_codec, self.value_codec = saved

    QuantizedPageStore.__init__, QuantizedPageStore.add_layer = store_init, store_add_layer
    QuantizedPageStore.bytes_per_block = property(lambda self: sum(
        spec.num_kv_heads * sum(layout.bytes for layout in self.layouts[i]) for i, spec in self.specs.items()))
    for cls, names in ((QuantizedReader, ("decode_blocks", "read", "read_codes", "layer_table")),
                       (QuantizedWriter, ("write",))):
        for name in names:
            setattr(cls, name, _with_layer_codecs(getattr(cls, name)))
    make_cache = batched_drift.make_cache

    def per_layer_cache(name: str, model):
        OVERRIDES.clear()
        if "@" in name:
            name, rest = name.split("@")
            layers, other = rest.split("=")
            OVERRIDES.update({int(i): codecs_for(QuantConfig.preset(other)) for i in layers.split(",")})
        return make_cache(name, model)

    batched_drift.make_cache = per_layer_cache


@torch.inference_mode()
def screen(num_windows: int) -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from eval.tasks.perplexity.prepare import load_examples
    from hf_pagedkv.tools.models import load_model

    codec = codecs_for(QuantConfig.preset("k8v4rv"))[1]
    moved, size = {}, {}

    def fake_quant(v):  # [batch, heads, T, dim] -> the same, whole 32-token blocks through the codec
        b, h, t, d = v.shape
        t -= t % 32
        x = v[:, :, :t].transpose(0, 1).reshape(h, b * t // 32, 32, d).contiguous()
        out = v.clone()
        out[:, :, :t] = codec.decode(*codec.encode(x), torch.empty_like(x)).reshape(h, b, t, d).transpose(0, 1)
        return out

    def probe(module, q, k, v, mask, **kw):
        out, w = sdpa_attention_forward(module, q, k, v, mask, **kw)
        quant, _ = sdpa_attention_forward(module, q, k, fake_quant(v), mask, **kw)
        delta = module.o_proj((quant - out).transpose(1, 2).reshape(q.shape[0], q.shape[2], -1))[:, -256:]
        moved[module.layer_idx] = float(delta.norm(dim=-1).mean())
        return out, w

    AttentionInterface.register("per_layer_probe", probe)
    model, tokenizer = load_model()
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(
            lambda m, a, i=i: size.__setitem__(i, float(a[0][:, -256:].norm(dim=-1).mean())))
    cfg = batched_drift.EvalConfig(num_windows=num_windows, prefill_len=1983, score_len=64)
    windows = torch.tensor([w["ids"] for w in load_examples(cfg, tokenizer)])[:, :2048]
    model.set_attn_implementation("per_layer_probe")
    model(input_ids=windows, use_cache=False, logits_to_keep=1)
    for i in sorted(moved, key=lambda i: -moved[i] / size[i]):
        print(f"layer {i:2d}  {moved[i] / size[i]:.3e}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--screen"]:
        torch.set_num_threads(1)
        screen(int(sys.argv[2]))
    else:
        install()
        batched_drift.main()
