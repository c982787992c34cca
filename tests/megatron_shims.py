"""Test helpers that run megatron-core's GPTModel (0.16.1, 0.19.2) forward and backward with real Megatron.

On CPU (gloo) the CUDA-only pieces are replaced by fused_logp_jobs.megatron_cpu (its docstring lists them: the
GlobalMemoryBuffer scratch tensor, the CUDA RNG tracker, the default causal mask, RoPE's device move); nothing
else of Megatron is replaced. The tiny CPU model below uses learned absolute positions and an explicit CPU
causal mask (causal_mask). Apex/TE are absent, so Megatron's local spec uses torch norms (which do not allow
sequence parallelism); the sequence-parallel path of the plugin is therefore exercised at the output-processor
level. On CUDA (tests/megatron/test_megatron_model.py, bench/megatron_tp_nccl.py) nothing is shimmed: NCCL, Megatron's own
CUDA RNG tracker, mask, RoPE and GlobalMemoryBuffer run as in training.
"""
from __future__ import annotations

import contextlib

import os

import torch
import torch.distributed as dist

from fused_logp_jobs.megatron_scoring import free_port  # noqa: E402,F401  (one helper for every rendezvous)


def causal_mask(b: int, s: int) -> torch.Tensor:
    """Replaces get_default_causal_mask (CUDA): True = masked."""
    return torch.triu(torch.ones(s, s, dtype=torch.bool), 1).expand(b, 1, s, s)


def build_tiny_gpt(*, vocab_size=512, hidden=64, layers=1, heads=4, seq=16, tied=True, tp=1, seed=1234,
                   **config_overrides):
    """A bf16 GPTModel (local spec, learned absolute positions) wrapped in Megatron's Float16Module, the way
    Megatron runs bf16 training. Returns (wrapped, gpt_model)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                            use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True,
                            tensor_model_parallel_size=tp, hidden_dropout=0.0, attention_dropout=0.0,
                            init_method_std=0.05, **config_overrides)
    gpt = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=vocab_size, max_sequence_length=seq,
                   position_embedding_type="learned_absolute", share_embeddings_and_output_weights=tied)
    return Float16Module(cfg, gpt), gpt


def batch(b: int, s: int, real_vocab: int, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, real_vocab, (b, s), generator=g)
    labels = torch.randint(0, real_vocab, (b, s), generator=g)
    pos = torch.arange(s).expand(b, s).contiguous()
    return ids, pos, causal_mask(b, s), labels


class CaptureFinalHidden:
    """Records the decoder's output (the post-final-norm hidden states [s, b, h] that reach _postprocess)."""

    def __init__(self, gpt, retain_grad=False):
        self.value = None
        self._retain = retain_grad
        self._h = gpt.decoder.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        if self._retain and out.requires_grad:
            out.retain_grad()
        self.value = out

    def remove(self):
        self._h.remove()


def start_model_parallel(rank: int = 0, world_size: int = 1, *, tp: int = 1, cp: int = 1, device: str = "cuda",
                         seed: int = 1234, port: int | None = None):
    """Process group (NCCL on "cuda", one GPU per rank; gloo on "cpu") unless one exists (torchrun scripts
    create their own), Megatron's model-parallel state (TP x CP), and its RNG on "cuda" or the CPU shims on
    "cpu". Spawned ranks that create a group of several processes pass the `port` their parent chose. Returns
    True when it created the process group."""
    from megatron.core import parallel_state, tensor_parallel

    from fused_logp_jobs import megatron_cpu

    created = not dist.is_initialized()
    if created:
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "nccl" if device == "cuda" else "gloo"
        if world_size == 1:
            # one process: an in-memory store, no port (a port chosen here can collide with a parent's store)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            if port is None:
                raise ValueError(f"port: the {world_size} ranks of a new process group must share one; got None")
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(port)
            dist.init_process_group(backend, rank=rank, world_size=world_size)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    if device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        megatron_cpu.install(force=True)
    return created


def stop_model_parallel(destroy_process_group: bool = True):
    from megatron.core import parallel_state

    from fused_logp_jobs import megatron_cpu

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()
    megatron_cpu.uninstall()


def build_qwen3_style_gpt(*, vocab_size, hidden, heads, query_groups, ffn, seq, tied, layers=1, tp=1, seed=1234,
                          device="cuda", init_std=0.05):
    """A bf16 GPTModel with Qwen3's layer structure (RMSNorm, RoPE, grouped-query attention with qk-norm,
    SwiGLU, no biases; Megatron's local spec), wrapped in Float16Module. On "cuda" Megatron initializes the
    weights on the GPU under its CUDA RNG tracker, as in training; on "cpu" on the CPU. Returns (wrapped, gpt)."""
    import torch.nn.functional as F
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    if device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                            num_query_groups=query_groups, kv_channels=hidden // heads, ffn_hidden_size=ffn,
                            normalization="RMSNorm", qk_layernorm=True, gated_linear_unit=True,
                            activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
                            hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
                            use_cpu_initialization=device != "cuda", params_dtype=torch.bfloat16, bf16=True,
                            init_method_std=init_std, transformer_impl="local")
    gpt = GPTModel(cfg, get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"), vocab_size=vocab_size,
                   max_sequence_length=seq, position_embedding_type="rope", rotary_percent=1.0,
                   rotary_base=1000000, share_embeddings_and_output_weights=tied)
    if device == "cuda":
        gpt.cuda(torch.cuda.current_device())          # torch norms are built on the CPU (megatron.training does this too)
    return Float16Module(cfg, gpt), gpt


def token_batch(b: int, s: int, real_vocab: int, seed: int = 7, device: str = "cpu"):
    """(input ids, position ids, labels), each [b, s]; identical on every rank for one seed."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, real_vocab, (b, s), generator=g)
    labels = torch.randint(0, real_vocab, (b, s), generator=g)
    pos = torch.arange(s).expand(b, s).contiguous()
    return ids.to(device), pos.to(device), labels.to(device)


def lm_head_weight(gpt) -> torch.Tensor:
    return gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
        else gpt.output_layer.weight


def op_rows(x_bs, mask_bs):
    """[b, s] -> the op's row order (sequence-major, as [s, b] flattened), masked-in rows only."""
    flat = x_bs.t().reshape(-1)
    return flat if mask_bs is None else flat[mask_bs.t().reshape(-1) != 0]


def op_hidden_rows(h_sbd, mask_bs):
    """[s, b, d] hidden states -> the op's rows [N, d], masked-in rows only."""
    flat = h_sbd.reshape(-1, h_sbd.shape[-1])
    return flat if mask_bs is None else flat[mask_bs.t().reshape(-1) != 0]


def check_megatron_style_step(gpt):
    """The fingerprint tracker with an optimizer whose step() returns Megatron's (update_successful, grad_norm,
    num_zeros): a skipped step is not counted, a successful one is, detach() restores the optimizer. Leaves the
    untied lm_head weight as it found it."""
    from fused_logp import megatron_plugin as mp

    class Opt:
        ok = True

        def step(self):
            with torch.no_grad():
                gpt.output_layer.weight[0, 0] += 1.0
            return self.ok, 0.0, 0

    opt = Opt()
    fp = mp.track_lm_head(gpt, opt)
    first = fp.fingerprint
    opt.ok = False
    assert opt.step()[0] is False and fp.version == 0 and fp.fingerprint == first   # skipped step: not counted
    with torch.no_grad():
        gpt.output_layer.weight[0, 0] -= 1.0
    opt.ok = True
    opt.step()
    assert fp.version == 1 and fp.fingerprint != first
    fp.detach()
    assert "step" not in vars(opt)
    with torch.no_grad():
        gpt.output_layer.weight[0, 0] -= 1.0


def gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's x along dim 0, in rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def fp32_reference_grads(h2, w, targets, rows_mask, temperature, real_vocab, c_lse):
    """FP32 torch gradients (IEEE matmul, no TF32) of -sum(logp) + c_lse * sum(lse) over the rows where
    rows_mask != 0, logp from log_softmax over the real vocabulary. h2 [N, D], w [V_rows, D], targets [N].
    Returns (dh [N, D], dW [V_rows, D]) in FP32 (zero rows of dW beyond the real vocabulary)."""
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.enable_grad():
            h32 = h2.detach().float().requires_grad_()
            w32 = w.detach().float().requires_grad_()
            z = (h32 @ w32[:real_vocab].t()) / temperature
            lp = torch.log_softmax(z, dim=1).gather(1, targets.clamp(0, real_vocab - 1)[:, None]).squeeze(1)
            lse = torch.logsumexp(z, dim=1)
            m = rows_mask.float()
            (-(lp * m).sum() + c_lse * (lse * m).sum()).backward()
    finally:
        torch.set_float32_matmul_precision(prev)
    return h32.grad, w32.grad


def grad_close(got, ref, tol: float = 2 ** -6):
    """(ok, max |got - ref|, relative norm error): |got - ref| <= tol * (|ref| + max|ref|) elementwise and
    ||got - ref|| <= tol * ||ref||. tol = 2^-6 as tests/backward/test_backward_gpu.py: the op's CUDA backward feeds dz to
    its GEMMs in bf16 (relative 2^-9) and stores bf16 gradients (2^-9); the FP32 reference's logits differ from
    the contract's only in GEMM rounding (far below that)."""
    got, ref = got.float(), ref.float()
    diff = (got - ref).abs()
    rel = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
    ok = bool((diff <= tol * (ref.abs() + ref.abs().max())).all()) and rel <= tol
    return ok, float(diff.max()), rel


@contextlib.contextmanager
def model_parallel_world(device: str = "cpu"):
    """A world of size 1 with Megatron's model-parallel state for a test module; the plugin's hook is removed
    before it is torn down."""
    from fused_logp import megatron_plugin as mp

    created = start_model_parallel(0, 1, device=device)
    yield
    mp.uninstall()
    stop_model_parallel(destroy_process_group=created)


@contextlib.contextmanager
def fresh_plugin_state():
    """One test's plugin state: the hook uninstalled, no plugin settings and the default configuration before the
    test, and the same (configuration re-read from the environment) after it."""
    from fused_logp import megatron_plugin as mp
    from fused_logp.shared_contract.config import Config, set_config

    mp.uninstall()
    mp.configure(None)
    set_config(Config())
    yield
    mp.uninstall()
    mp.configure(None)
    set_config(None)
