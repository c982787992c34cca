"""fused_logp: one lm_head + log-sum-exp operator with a frozen numeric contract (CONTRACT.md).

Rooms: shared_contract (constants, provenance, config, errors, the fingerprint's definition; imports nothing
above it), kernel (the op, its backends: the CPU oracle and the SM90 kernel), vllm_plugin and megatron_plugin
(engine adapters, no arithmetic), golden (stored digests of fixed inputs).
"""
from .kernel.fingerprint import weight_fingerprint
from .kernel.op import (LogpResult, ShardStats, check_input_errors, linear_logp, linear_logp_program, linear_logp_tp,
                        logits_and_stats, logp_from_logits, logp_of_ids, merge_shard_stats, shard_tile_stats)
from .kernel.transforms import TransformProgram, kept_mask, program_logp_from_logits
from .shared_contract.constants import CONTRACT_VERSION
from .shared_contract.errors import (BackendUnavailableError, ContractInputError, FingerprintMismatchError,
                                     StrictModeError)

__all__ = ["CONTRACT_VERSION", "BackendUnavailableError", "ContractInputError", "FingerprintMismatchError",
           "LogpResult", "ShardStats", "StrictModeError", "TransformProgram", "check_input_errors", "kept_mask",
           "linear_logp", "linear_logp_program", "linear_logp_tp", "logits_and_stats", "logp_from_logits",
           "logp_of_ids", "merge_shard_stats", "program_logp_from_logits", "shard_tile_stats", "weight_fingerprint"]
