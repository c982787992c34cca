"""The sampling-transform program on the H200: the SM90 kernel's logits feed the same program arithmetic, so the
program logp bytes equal the CPU oracle's. Skipped without an SM90 GPU."""
import pytest
import torch

from fused_logp import linear_logp
from fused_logp.kernel.op import linear_logp_program
from fused_logp.kernel.transforms import TransformProgram, kept_mask

pytestmark = pytest.mark.gpu


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
