"""fused_logp: one lm_head + log-sum-exp operator with a frozen numeric contract (CONTRACT.md).

Rooms: shared_contract (constants, provenance, config, errors, the fingerprint's definition; imports nothing
above it), kernel (the op, its backends: the CPU oracle and the SM90 kernel), vllm_plugin and megatron_plugin
(engine adapters, no arithmetic), golden (stored digests of fixed inputs).
"""
from .shared_contract.constants import CONTRACT_VERSION
from .kernel.op import (LogpResult, ShardStats, linear_logp, linear_logp_tp, logp_from_logits,
                        merge_shard_stats, shard_tile_stats)
from .shared_contract.fingerprint import weight_fingerprint

__all__ = ["CONTRACT_VERSION", "LogpResult", "ShardStats", "linear_logp", "linear_logp_tp", "logp_from_logits",
           "merge_shard_stats", "shard_tile_stats", "weight_fingerprint"]
