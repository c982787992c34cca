// Generated from shared_contract/constants.py by `python -m fused_logp.kernel.contract_header --write`;
// do not edit. The contract constants both compiled implementations use (CUDA and the CPU oracle).
#pragma once
#define FL_CONTRACT_VERSION "cuda-fused-linear-logp-sm90-contract-v2"
#define FL_TRANSCENDENTAL_ID "sm90-ex2-approx-ftz-table-v1+contract-log-v1"
#define FL_VOCAB_TILE 64
#define FL_K_GROUP 16
#define FL_ALIGN_FRAC_BITS 25
#define FL_ACC_BITS 24
#define FL_ALIGN_EXP_FLOOR -133
#define FL_GEMM_NAN_BITS 0x7FFFFFFFu
#define FL_EXP_LOG2E 0x3FB8AA3Bu
#define FL_EX2_FRAC_BITS 23
#define FL_LOG_SQRT2_BITS 0x3FB504F3u
#define FL_LOG_LN2_HI 0x3F317200u
#define FL_LOG_LN2_LO 0x35BFBE8Eu
#define FL_LOG_Q0 0xBF000000u
#define FL_LOG_Q1 0x3EAAAAA3u
#define FL_LOG_Q2 0xBE80001Bu
#define FL_LOG_Q3 0x3E4CD2A0u
#define FL_LOG_Q4 0xBE2AA805u
#define FL_LOG_Q5 0x3E119335u
#define FL_LOG_Q6 0xBDFEAEC9u
#define FL_LOG_Q7 0x3DF47039u
#define FL_LOG_Q8 0xBDEC58E2u
#define FL_LOG_Q9 0x3D851DBDu
#define FL_CONTRACT_CONSTANTS_LIST FL_VOCAB_TILE, FL_K_GROUP, FL_ALIGN_FRAC_BITS, FL_ACC_BITS, FL_ALIGN_EXP_FLOOR, FL_GEMM_NAN_BITS, FL_EXP_LOG2E, FL_EX2_FRAC_BITS, FL_LOG_SQRT2_BITS, FL_LOG_LN2_HI, FL_LOG_LN2_LO, FL_LOG_Q0, FL_LOG_Q1, FL_LOG_Q2, FL_LOG_Q3, FL_LOG_Q4, FL_LOG_Q5, FL_LOG_Q6, FL_LOG_Q7, FL_LOG_Q8, FL_LOG_Q9
