"""The sampling-transform program on the H200: the SM90 kernel's logits feed the same program arithmetic, so the
program logp bytes equal the CPU oracle's; and the device (torch on CUDA) path of kernel/transforms.py gives the
numpy path's bytes: kept masks, logp, lse_kept, at the Qwen3-8B vocabulary. Skipped without an SM90 GPU."""
import numpy as np
import pytest
import torch

from fused_logp import linear_logp
from fused_logp.kernel import transforms
from fused_logp.kernel.op import linear_logp_program
from fused_logp.kernel.transcendentals import contract_ex2_torch, contract_log_torch
from fused_logp.shared_contract.numpy_contract import contract_ex2, contract_log
from fused_logp.kernel.transforms import TransformProgram, kept_mask, program_logp_from_logits

from helpers import same_bytes

pytestmark = pytest.mark.gpu

D, V, ROWS = 4096, 151936, 128




def _ext():
    from fused_logp.kernel import sm90
    ok, why = sm90.SM90Backend().available()
    assert ok, why
    return sm90._ext


@pytest.mark.parametrize("program", [TransformProgram(1.0, top_k=5), TransformProgram(0.8, top_p=0.9),
                                     TransformProgram(1.2, top_k=50, top_p=0.99, min_p=0.01)], ids=str)
def test_program_bytes_equal_oracle(program):
    g = torch.Generator().manual_seed(11)
    h = (torch.randn(6, 256, generator=g) * 2).bfloat16()
    w = (torch.randn(2000, 256, generator=g) * 0.1).bfloat16()
    z = linear_logp(h, w, torch.zeros(6, dtype=torch.long), return_logits=True, backend="oracle").logits
    keep = kept_mask(z, program)
    t = torch.tensor([int(keep[i].nonzero()[0]) for i in range(6)])
    cpu = linear_logp_program(h, w, t, program, backend="oracle")
    gpu = linear_logp_program(h.cuda(), w.cuda(), t.cuda(), program, backend="sm90")
    assert torch.equal(cpu.logp.view(torch.int32), gpu.logp.cpu().view(torch.int32))
    assert torch.equal(cpu.lse.view(torch.int32), gpu.lse.cpu().view(torch.int32))


def test_device_path_is_the_default_on_cuda():
    _ext()
    assert transforms.resolve_path(None, torch.device("cuda")) == "torch"
    assert "SM90" in transforms.describe_path(None, "cuda")


def test_torch_exp_log_on_cuda_bits_equal_numpy():
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(0, 2**32, (1 << 22,), generator=g, dtype=torch.int64).to(torch.uint32)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), 1e-45, -1e-45,
                            88.72284, 88.72283, -103.97208, -103.97207, 1.1754944e-38, 1.1754942e-38])
    x = torch.cat([bits.view(torch.float32), special, -torch.rand(1 << 21, generator=g) * 110.0,
                   torch.rand(1 << 20, generator=g) * 1e-37])
    xn = torch.where(x > 0, -x, x)                                # the exp2's domain: x <= 0
    assert same_bytes(contract_ex2_torch(xn.cuda()), torch.from_numpy(contract_ex2(xn.numpy())))
    assert same_bytes(contract_log_torch(x.cuda()), torch.from_numpy(contract_log(x.numpy())))
    # the temperature division: a device tensor divisor is an IEEE division
    t = torch.full((x.numel(), 1), float(np.float32(0.7)), device="cuda")
    assert same_bytes(torch.div(x.cuda()[:, None], t)[:, 0], torch.from_numpy(x.numpy() / np.float32(0.7)))


def _first_reaching(q: np.ndarray, p: float) -> np.ndarray:
    c = np.cumsum(q, axis=1, dtype=np.float32)
    reach = c >= np.float32(p)
    return np.where(reach.any(axis=1), reach.argmax(axis=1), -1)


@pytest.mark.parametrize("length", [1, 5, 31, 32, 33, 255, 256, 257, 1000, 4097, V])
def test_topp_crossing_kernel_is_the_sequential_sum(length):
    """The kernel's first crossing equals numpy's sequential float32 cumsum's, on rows that cross anywhere (the
    first and last entry included), never, exactly at p, after a NaN (never), and through a strided view."""
    ext = _ext()
    g = torch.Generator().manual_seed(length)
    n = 64
    q = torch.rand(n, length, generator=g) ** 8
    q = q / q.sum(dim=1, keepdim=True)
    q = torch.sort(q, dim=1, descending=True).values.contiguous()
    q[1] = 0.0                                                          # never
    q[2, 0] = 0.95                                                      # the first entry
    q[3] = 0.0
    q[3, -1] = 1.0                                                      # the last entry
    q[4, min(7, length - 1)] = float("nan")                             # NaN: never after it
    q[5] = 1e-30                                                        # tiny: never
    q[6] = torch.rand(length, generator=g) * 1e-7                       # a sum that crawls
    for p in (0.5, 0.9, 0.99, 1.0, float(np.float32(0.3))):
        want = _first_reaching(q.numpy(), p)
        exact = float(np.cumsum(q[0].numpy(), dtype=np.float32)[length // 2])
        got = ext.topp_crossing(q.cuda(), float(np.float32(p))).cpu().numpy()
        assert np.array_equal(got, want), p
        at = ext.topp_crossing(q[:1].cuda(), exact).cpu().numpy()       # c_j == p exactly: crosses at j (or before)
        assert np.array_equal(at, _first_reaching(q[:1].numpy(), exact))
    wide = torch.zeros(n, length + 40)
    wide[:, :length] = q
    got = ext.topp_crossing(wide.cuda()[:, :length], float(np.float32(0.9))).cpu().numpy()
    assert np.array_equal(got, _first_reaching(q.numpy(), 0.9))


@pytest.fixture(scope="module")
def qwen_logits():
    """[128, 151936] FP32 logits from the SM90 kernel at D=4096: rows 0-63 flat (logit std ~2: top-p 0.9 keeps
    ~36k tokens, beyond the first ordered prefix), rows 64-127 peaked (std ~6); with ties at the top, a row of
    quarter steps, signed zeros, NaN and +-inf."""
    _ext()
    g = torch.Generator(device="cuda").manual_seed(5)
    w = (torch.randn(V, D, generator=g, device="cuda") * D ** -0.5).bfloat16()
    h = torch.randn(ROWS, D, generator=g, device="cuda") * 2
    h[64:] *= 3
    z = linear_logp(h.bfloat16(), w, torch.zeros(ROWS, dtype=torch.long, device="cuda"), return_logits=True,
                    backend="sm90").logits.clone()
    del w
    top = z.argmax(dim=1)
    for r in (10, 70, 71):
        z[r, (top[r] + 12345) % V] = z[r, top[r]]                       # a tie at the top (the lower id first)
        z[r, (top[r] + 777) % V] = z[r, top[r]]
    z[72, :5000] = z[72, top[72]]                                       # 5000 tied maxima
    z[20] = torch.round(z[20] * 4) / 4
    z[84] = torch.round(z[84] * 2) / 2
    z[30, 1000] = float("nan")
    z[31, 2000] = float("inf")
    z[32, 3000] = float("-inf")
    z[93, 7] = float("-inf")
    z[33] = 0.0
    z[33, ::3] = -0.0
    z[34] = torch.round(z[34]).clamp(max=-0.0)
    torch.cuda.synchronize()
    return z


GPU_PROGRAMS = [
    TransformProgram(1.0, top_k=1), TransformProgram(0.7, top_k=50), TransformProgram(1.0, top_p=0.9),
    TransformProgram(0.8, top_p=0.5), TransformProgram(1.0, top_p=0.99), TransformProgram(0.7, top_k=50, top_p=0.9),
    TransformProgram(1.0, min_p=0.1), TransformProgram(1.3, top_p=0.9, min_p=0.01),
    TransformProgram(0.9, top_k=5, top_p=0.99, min_p=0.1), TransformProgram(0.7),
]


@pytest.mark.parametrize("program", GPU_PROGRAMS, ids=str)
def test_device_path_bytes_equal_numpy_at_qwen3_shape(qwen_logits, program):
    """128 rows x V=151936 of SM90 logits: the CUDA path's kept masks, logp, lse_kept and kept flags equal the
    numpy path's byte for byte (NaN payloads aside); memory stays bounded by the row chunk."""
    z = qwen_logits
    zc = z.cpu()
    g = torch.Generator().manual_seed(17)
    ids = torch.randint(0, V, (ROWS, 3), generator=g)
    ids[:, 0] = torch.nan_to_num(zc, nan=float("-inf")).argmax(dim=1)     # a top token: kept by most programs
    keep_np = np.empty((ROWS, V), dtype=bool)                           # the numpy path once: bytes and mask
    want = [torch.from_numpy(a) for a in
            transforms._program_numpy(zc, ids.numpy(), program, V, transforms.NUMPY_ROWS_PER_CHUNK, keep_out=keep_np)]
    want_keep = torch.from_numpy(keep_np)
    assert want[2][:, 0].sum() >= ROWS // 2

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = program_logp_from_logits(z, ids.cuda(), program, require_kept=False)          # the default: torch on CUDA
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    got_keep = kept_mask(z, program)
    assert got_keep.is_cuda and got[0].is_cuda
    bad = (got_keep.cpu() != want_keep).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"kept sets differ in rows {bad[:10]}"
    for what, x, y in zip(("logp", "lse", "kept"), got, want):
        assert same_bytes(x, y), f"{what} differs in rows {((x.cpu() != y) & ~(x.cpu() != x.cpu())).nonzero()[:5].tolist()}"
    per_logit = peak / (ROWS * V)
    print(f"{program}: peak working memory {peak / 2**20:.0f} MiB ({per_logit:.1f} B per logit)")
    assert per_logit < 128


def test_device_path_chunking_is_bit_neutral(qwen_logits):
    z = qwen_logits[:40]
    ids = torch.randint(0, V, (40,), device="cuda")
    prog = TransformProgram(0.9, top_k=2000, top_p=0.9, min_p=0.01)
    ref = program_logp_from_logits(z, ids, prog, require_kept=False)
    for rows in (7, 40):
        got = program_logp_from_logits(z, ids, prog, require_kept=False, rows_per_chunk=rows)
        assert all(same_bytes(x, y) for x, y in zip(got, ref))


def test_trainer_program_on_cuda_equals_numpy_replay():
    """linear_logp_program on CUDA (SM90 logits, device path, its default chunks) equals the numpy replay of
    the same logits."""
    g = torch.Generator(device="cuda").manual_seed(9)
    w = (torch.randn(V, D, generator=g, device="cuda") * D ** -0.5).bfloat16()
    h = (torch.randn(300, D, generator=g, device="cuda") * 3).bfloat16()
    prog = TransformProgram(0.8, top_k=50, top_p=0.9)
    z = linear_logp(h, w, torch.zeros(300, dtype=torch.long, device="cuda"), return_logits=True,
                    backend="sm90").logits
    t = kept_mask(z, prog).to(torch.uint8).argmax(dim=1)
    res = linear_logp_program(h, w, t, prog, backend="sm90")
    lp, lse, kept = program_logp_from_logits(z.cpu(), t.cpu(), prog, path="numpy")
    assert kept.all() and same_bytes(res.logp, lp) and same_bytes(res.lse, lse)
