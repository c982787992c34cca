"""The contract-bearing CPU backends every contract test runs on: `oracle` (numpy, the readable reference) and
`oracle-fast` (compiled, what `auto` selects for CPU inputs). The `cpu_backend` fixture of conftest.py
parametrizes a test over CPU_BACKENDS and makes the backend the configured default, so that every call without
a `backend=` argument runs on it; `hopper_logits` gives the bare GEMM of the configured one."""
import torch

from fused_logp.kernel.backends import get_backend
from fused_logp.shared_contract.config import get_config

CPU_BACKENDS = ("oracle", "oracle-fast")


def configured() -> str:
    """The backend the `cpu_backend` fixture configured (a name of CPU_BACKENDS)."""
    name = get_config().backend
    assert name in CPU_BACKENDS, f"the test runs on a CPU backend set by the cpu_backend fixture, not {name!r}"
    return name


def hopper_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """z = hidden @ weight.T under the Hopper k16 rule (CONTRACT.md section 2) on the configured CPU backend."""
    if configured() == "oracle":
        from fused_logp.shared_contract.gemm_rule import hopper_logits as numpy_logits
        return numpy_logits(hidden, weight)
    return get_backend("oracle-fast").logits(hidden, weight, weight.shape[0])
