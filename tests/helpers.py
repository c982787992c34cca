"""Small helpers shared by the tests."""
import torch


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality of two float32 tensors (NaN payloads and signed zeros included)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality; NaN matches NaN whatever its payload (the contract does not fix NaN payloads, and CUDA
    does not keep them); bool tensors must be equal."""
    a, b = a.detach().contiguous().cpu(), b.detach().contiguous().cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(torch.where(na, 0, a.view(torch.int32)),
                                               torch.where(nb, 0, b.view(torch.int32)))
