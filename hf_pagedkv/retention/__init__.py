"""Retention policies: which tokens to keep (scoring only, one frozen dataclass each).

The mechanism that applies them to a cache and gives evicted blocks back to the pool is the adapter's
(`adapter/evictor.py`, `adapter/compress.py`).
"""

from hf_pagedkv.retention.context_scores import ContextScores
from hf_pagedkv.retention.importance import ImportancePolicy
from hf_pagedkv.retention.key_diff import KeyDiff
from hf_pagedkv.retention.key_norm import KeyNorm
from hf_pagedkv.retention.kv_zip import KVzip
from hf_pagedkv.retention.kv_zip_scoring import KVZIP_PRESETS, KVzipScoring
from hf_pagedkv.retention.policy import EvictionPlan, RetentionPolicy
from hf_pagedkv.retention.retention_stats import RetentionStats
from hf_pagedkv.attention.query_window import QueryWindow
from hf_pagedkv.retention.sink_window import SinkWindow
from hf_pagedkv.retention.snap_kv import SnapKV
from hf_pagedkv.retention.pyramid_kv import PyramidKV

__all__ = ["ContextScores", "EvictionPlan", "ImportancePolicy", "KVzip", "KeyDiff", "KeyNorm", "QueryWindow",
           "RetentionPolicy", "RetentionStats", "SinkWindow", "SnapKV"]
__all__ += ["PyramidKV", "KVZIP_PRESETS", "KVzipScoring"]
