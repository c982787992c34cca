"""The synchronisation of the persistent ping-pong kernel (kernel/csrc/pingpong_kernel.cuh), transcribed wait for wait
and run under random interleavings on the CPU: the producer's `empty` waits, the TMA fills completing in any order
and at any later time, each consumer's `full` waits, stage releases one K block behind (`wgmma.wait_group 1`), and
the order barriers (a consumer's `bar.sync` before each mainloop but its first, the other's `bar.arrive` after each
mainloop with a successor tile). Checks: every consumer reads the fill it waited for (no mbarrier parity wait passes
a phase early), no named-barrier generation sees two signals or two waits, and every schedule finishes. A change
to the kernel's waits is a change to this transcription. The negative tests show the model catches the failures it
checks for."""
from __future__ import annotations

import random

import pytest

STAGES = 5      # PingPongCfg::STAGES


class Fault(AssertionError):
    pass


def _run(tiles, grid, kblocks, seed, *, order=True, producer_parity_flip=False):
    rnd = random.Random(seed)
    for block in range(grid):
        n = len(range(block, tiles, grid))          # this CTA's tiles
        full, empty = [0] * STAGES, [0] * STAGES    # completed phases of each mbarrier
        content = [None] * STAGES                   # the fill a stage holds
        issued = []                                 # (stage, seq) TMA loads not yet complete
        bars = {0: [0, 0], 1: [0, 0]}               # order barrier kOrderBar + c: [signals, waits] of this generation

        def passed(completed, parity):              # mbarrier.try_wait.parity
            return (completed & 1) != parity

        def producer():
            for q in range(n * kblocks):
                s = q % STAGES
                parity = ((q // STAGES) & 1) ^ (0 if producer_parity_flip else 1)
                while not passed(empty[s], parity):
                    yield
                issued.append((s, q))
                yield

        def consumer(c):
            for i in range(c, n, 2):
                if order and i > 0:
                    bars[c][1] += 1
                    if bars[c][1] != 1:
                        raise Fault("two waits in one generation of an order barrier")
                    while bars[c][0] < 1:
                        yield
                    bars[c][0] -= 1
                    bars[c][1] -= 1
                held = None
                for kb in range(kblocks):
                    q = i * kblocks + kb
                    s = q % STAGES
                    while not passed(full[s], (q // STAGES) & 1):
                        yield
                    if content[s] != q:
                        raise Fault(f"consumer {c} read fill {content[s]} of stage {s} for fill {q}")
                    if held is not None:
                        empty[held] += 1             # the previous K block's stage
                    held = s
                    yield
                empty[held] += 1
                if order and i + 1 < n:
                    bars[1 - c][0] += 1
                    if bars[1 - c][0] != 1:
                        raise Fault("a second signal before the wait of the first")
                yield

        agents = [producer(), consumer(0), consumer(1)]
        alive = [True] * 3
        for _ in range(200000):
            ready = [k for k in range(3) if alive[k]] + (["tma"] if issued else [])
            if not ready:
                break
            k = rnd.choice(ready)
            if k == "tma":
                s, q = issued.pop(rnd.randrange(len(issued)))
                content[s] = q
                full[s] += 1
            else:
                try:
                    next(agents[k])
                except StopIteration:
                    alive[k] = False
        else:
            raise Fault(f"no progress: tiles {tiles}, grid {grid}, K blocks {kblocks}, CTA {block}")


@pytest.mark.parametrize("kblocks", [1, 2, 4, 5, 6, 7, 11])
def test_every_schedule_reads_its_own_fill_and_finishes(kblocks):
    for tiles in (1, 2, 3, 5, 8, 13):
        for grid in (1, 2, 3, 5):
            for seed in range(30):
                _run(tiles, grid, kblocks, seed)


def test_without_the_order_barriers_a_consumer_reads_a_wrong_fill():
    with pytest.raises(Fault, match="read fill"):
        for seed in range(200):
            _run(6, 1, 3, seed, order=False)


def test_a_wrong_producer_parity_never_finishes():
    with pytest.raises(Fault, match="no progress"):
        _run(3, 1, 2, 0, producer_parity_flip=True)
