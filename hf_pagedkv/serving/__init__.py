"""Serving: a continuous-batching engine on a `BlockPool` (`Engine`, `generate_batch`). Importing it registers the
packed attention (``"hf_pagedkv_packed"``) in transformers' `AttentionInterface`; nothing else changes."""

from hf_pagedkv.serving import packed_attention as _packed_attention
from hf_pagedkv.serving.engine import Engine
from hf_pagedkv.serving.engine_stats import EngineStats, LatencySummary
from hf_pagedkv.serving.generate_batch import generate_batch
from hf_pagedkv.serving.request import RequestOutput, RequestStatus
from hf_pagedkv.serving.sampling import SamplingParams

_packed_attention.register()

__all__ = ["Engine", "EngineStats", "LatencySummary", "RequestOutput", "RequestStatus", "SamplingParams",
           "generate_batch"]
