"""Timing on one GPU by CUDA events. events_ms: one block of calls between two events (also the backward benchmark's
sample). interleaved_rounds, shared by bench/ab_launches.py and bench/benchmark_linear_logp.py: each round times every
callable over `iters` calls (2 warm-up calls first), the order reversed every other round, so that a drift of the
machine (on the H200, its clock falling under the power limit) falls on all of them."""
import torch


def events_ms(fn, calls):
    """ms a call of `calls` back-to-back calls of fn, between two CUDA events (synchronised at the end)."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(calls):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / calls


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
            times[k].append(events_ms(fn, iters))
    return times
