"""fused_logp: one lm_head + log-sum-exp operator with a frozen numeric contract (CONTRACT.md).

The folders kernel/, shared_contract/, vllm_plugin/ and megatron_plugin/ are installed as
fused_logp.kernel, fused_logp.shared_contract, fused_logp.vllm_plugin and fused_logp.megatron_plugin.
"""
from .shared_contract.constants import CONTRACT_VERSION
from .kernel.op import (LogpResult, ShardStats, linear_logp, linear_logp_tp, logp_from_logits,
                        merge_shard_stats, shard_tile_stats)
from .shared_contract.fingerprint import weight_fingerprint

__all__ = ["CONTRACT_VERSION", "LogpResult", "ShardStats", "linear_logp", "linear_logp_tp", "logp_from_logits",
           "merge_shard_stats", "shard_tile_stats", "weight_fingerprint"]
