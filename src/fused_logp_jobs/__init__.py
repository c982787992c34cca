"""The harness around the library, run from a source checkout (not part of the wheel): the main job (`fused-logp
demo`: vLLM rollout -> Megatron trainer agreement), the RL loop, the validation ladder, the tiny random Qwen3, the
Megatron GPT builder for it and the CPU shims that let megatron-core's GPTModel run without CUDA."""
