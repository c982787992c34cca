"""Small helpers shared by the tests."""
import torch


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality of two float32 tensors (NaN payloads and signed zeros included)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))
