"""Interleaved timing on one GPU, shared by bench/ab_launches.py and bench/benchmark_linear_logp.py: each round times
every callable over `iters` calls between two CUDA events (2 warm-up calls first), the order reversed every other
round, so that a drift of the machine (on the H200, its clock falling under the power limit) falls on all of them."""
import torch


def interleaved_rounds(fns, rounds, iters, before=None):
    """name -> [ms a call, one figure a round] for fns (name -> callable); before(name), where given, runs once
    before each name's block of a round, outside the timed calls."""
    names = list(fns)
    times = {k: [] for k in names}
    for r in range(rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            if before is not None:
                before(k)
            fn = fns[k]
            for _ in range(2):
                fn()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(iters):
                fn()
            e.record()
            torch.cuda.synchronize()
            times[k].append(s.elapsed_time(e) / iters)
    return times
