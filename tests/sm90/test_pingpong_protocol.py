"""The synchronisation of the persistent ping-pong kernel (kernel/csrc/pingpong_kernel.cuh), transcribed wait for wait
and run under random interleavings on the CPU: the producer's `empty` waits, the TMA fills completing in any order
and at any later time, each consumer's `full` waits, stage releases one K block behind (`wgmma.wait_group 1`), and
the order barriers (a consumer's `bar.sync` before each mainloop but its first, the other's `bar.arrive` once each
mainloop with a successor tile has issued its last wgmma, before the release of its last stage). Checks: every consumer reads the fill it waited for (no mbarrier parity wait passes
a phase early), no named-barrier generation sees two signals or two waits, and every schedule finishes. A change
to the kernel's waits is a change to this transcription. The negative tests show the model catches the failures it
checks for.

The same for CLUSTER = 2 (pingpong-128x192-mc2): two CTAs whose producers each load their own hidden rows and one
half of the weight tile into the same stage of both CTAs (every part landing in any order and at any later time,
before or after the receiving CTA's expect_tx); a stage's full barrier counts one arrival and the transaction bytes of
three parts, its empty barrier one release from each CTA. Checks, besides the above: no part lands in a stage that a
consumer of that CTA has not yet released.

The dynamic schedule (pingpong-128x192-dyn): every CTA of the grid at once, sharing the tile counter, with the ring of
tile slots and the end marks. Checks, besides the above: every slot read holds the number posted for it, every tile
is computed exactly once, and no order-barrier signal is left without its wait."""
from __future__ import annotations

import random

import pytest

STAGES = 5      # PingPongCfg::STAGES


class Fault(AssertionError):
    pass


def _drive(rnd, agents, pending, land, steps, stuck):
    """Runs the agents (generators: each next() is one step up to a wait) and the landing of the pending copies (a
    list; land(item) completes one) in a random order until every agent has finished; raises Fault(stuck) if that
    takes more than `steps` steps."""
    alive = [True] * len(agents)
    for _ in range(steps):
        ready = [k for k in range(len(agents)) if alive[k]] + (["tma"] if pending else [])
        if not ready:
            return
        k = rnd.choice(ready)
        if k == "tma":
            land(pending.pop(rnd.randrange(len(pending))))
        else:
            try:
                next(agents[k])
            except StopIteration:
                alive[k] = False
    raise Fault(stuck)


def _passed(completed, parity):
    """mbarrier.try_wait.parity on a barrier that has completed `completed` phases."""
    return (completed & 1) != parity


def _order_wait(bars, c):
    """Consumer c's `bar.sync` at its order barrier (bars[c] = [signals, waits] of the current generation)."""
    bars[c][1] += 1
    if bars[c][1] != 1:
        raise Fault("two waits in one generation of an order barrier")
    while bars[c][0] < 1:
        yield
    bars[c][0] -= 1
    bars[c][1] -= 1


def _order_signal(bars, c):
    """Consumer c's `bar.arrive` at the other consumer's order barrier."""
    bars[1 - c][0] += 1
    if bars[1 - c][0] != 1:
        raise Fault("a second signal before the wait of the first")


def _ring(empty, content, who):
    """release(s) and check(s, q) of one CTA's ring: one arrival on stage s's empty barrier; a Fault unless stage s
    holds fill q."""
    def release(s):
        empty[s] += 1

    def check(s, q):
        if content[s] != q:
            raise Fault(f"{who} read fill {content[s]} of stage {s} for fill {q}")
    return release, check


def _mainloop(full, release, check, i, kblocks):
    """A consumer's mainloop of its CTA's i-th tile: each K block's full wait (check: its fill must be the one waited
    for), the previous K block's stage released one behind. -> the last K block's stage, which the caller releases
    after the order signal (the kernel signals once it has issued the last wgmma, and waits for them before the
    release)."""
    held = None
    for kb in range(kblocks):
        q = i * kblocks + kb
        s = q % STAGES
        while not _passed(full[s], (q // STAGES) & 1):
            yield
        check(s, q)
        if held is not None:
            release(held)                # the previous K block's stage
        held = s
        yield
    return held


def _run(tiles, grid, kblocks, seed, *, order=True, producer_parity_flip=False):
    rnd = random.Random(seed)
    for block in range(grid):
        n = len(range(block, tiles, grid))          # this CTA's tiles
        full, empty = [0] * STAGES, [0] * STAGES    # completed phases of each mbarrier
        content = [None] * STAGES                   # the fill a stage holds
        issued = []                                 # (stage, seq) TMA loads not yet complete
        bars = {0: [0, 0], 1: [0, 0]}               # order barrier kOrderBar + c: [signals, waits] of this generation

        def producer():
            for q in range(n * kblocks):
                s = q % STAGES
                parity = ((q // STAGES) & 1) ^ (0 if producer_parity_flip else 1)
                while not _passed(empty[s], parity):
                    yield
                issued.append((s, q))
                yield

        def consumer(c):
            release, check = _ring(empty, content, f"consumer {c}")
            for i in range(c, n, 2):
                if order and i > 0:
                    yield from _order_wait(bars, c)
                last = yield from _mainloop(full, release, check, i, kblocks)
                if order and i + 1 < n:
                    _order_signal(bars, c)
                yield
                release(last)
                yield

        def land(item):
            s, q = item
            content[s] = q
            full[s] += 1

        _drive(rnd, [producer(), consumer(0), consumer(1)], issued, land, 200000,
               f"no progress: tiles {tiles}, grid {grid}, K blocks {kblocks}, CTA {block}")


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


def _run_cluster(units, clusters, kblocks, seed, *, release_both=True, parts=3, beyond=()):
    """One cluster of two CTAs of pingpong_kernel<LOGITS, 2>, each CTA's consumers in the order of the one-CTA kernel
    (the signal once the last wgmma is issued, then the last stage's release). release_both=False: each consumer
    releases its own CTA's stage only, with an empty barrier of count 1 (the negative control of the cross-CTA
    release); parts: the parts a full barrier's expect_tx counts (3: own hidden rows and both weight halves); beyond:
    the cluster's units i whose CTA-1 tile lies beyond the rows (its consumer, in its turn, releases each stage as soon
    as its wait passes, then signals)."""
    rnd = random.Random(seed)
    for cl in range(clusters):
        n = len(range(cl, units, clusters))         # this cluster's units
        need_empty = 2 if release_both else 1
        full = [[0] * STAGES for _ in range(2)]      # completed phases
        full_pend = [[1] * STAGES for _ in range(2)]
        tx = [[0] * STAGES for _ in range(2)]        # transaction parts outstanding in the current phase
        empty = [[0] * STAGES for _ in range(2)]
        empty_pend = [[need_empty] * STAGES for _ in range(2)]
        released = [[0] * STAGES for _ in range(2)]  # fills of a stage that this CTA's consumers have released
        content = [[{} for _ in range(STAGES)] for _ in range(2)]
        landing = []                                 # (cta, stage, part, seq) in flight
        bars = [{0: [0, 0], 1: [0, 0]} for _ in range(2)]

        def full_done(x, s):
            if full_pend[x][s] == 0 and tx[x][s] == 0:
                full[x][s] += 1
                full_pend[x][s] = 1

        def arrive_empty(x, s):
            empty_pend[x][s] -= 1
            if empty_pend[x][s] == 0:
                empty[x][s] += 1
                empty_pend[x][s] = need_empty

        def producer(x):
            for q in range(n * kblocks):
                s = q % STAGES
                while not _passed(empty[x][s], ((q // STAGES) & 1) ^ 1):
                    yield
                tx[x][s] += parts                    # mbarrier.arrive.expect_tx
                full_pend[x][s] -= 1
                full_done(x, s)
                landing.append((x, s, "A", q))       # own hidden rows
                landing.append((0, s, f"B{x}", q))   # this CTA's weight half, multicast into both
                landing.append((1, s, f"B{x}", q))
                yield

        def release(x, s):
            released[x][s] += 1
            for y in ((0, 1) if release_both else (x,)):
                arrive_empty(y, s)

        def consumer(x, c):
            def check(s, q):
                if content[x][s] != {"A": q, "B0": q, "B1": q}:
                    raise Fault(f"CTA {x} consumer {c} read fill {content[x][s]} of stage {s} for fill {q}")

            for i in range(c, n, 2):
                if i > 0:
                    yield from _order_wait(bars[x], c)
                held = None
                if x == 1 and i in beyond:
                    for kb in range(kblocks):
                        q = i * kblocks + kb
                        s = q % STAGES
                        while not _passed(full[x][s], (q // STAGES) & 1):
                            yield
                        check(s, q)
                        release(x, s)
                        yield
                else:
                    held = yield from _mainloop(full[x], lambda s: release(x, s), check, i, kblocks)
                if i + 1 < n:
                    _order_signal(bars[x], c)
                yield
                if held is not None:
                    release(x, held)
                yield

        def land(item):
            y, s, part, q = item
            if released[y][s] < q // STAGES:
                raise Fault(f"fill {q} landed in CTA {y}'s stage {s} before its fill {q - STAGES} was released")
            content[y][s][part] = q
            tx[y][s] -= 1
            full_done(y, s)

        agents = [producer(0), producer(1), consumer(0, 0), consumer(0, 1), consumer(1, 0), consumer(1, 1)]
        _drive(rnd, agents, landing, land, 400000,
               f"no progress: units {units}, clusters {clusters}, K blocks {kblocks}, cluster {cl}")
        if any(v[0] for b in bars for v in b.values()):
            raise Fault("an order barrier signal without its wait")


@pytest.mark.parametrize("kblocks", [1, 2, 4, 5, 6, 7, 11])
def test_clusters_of_two_read_their_own_fills_and_finish(kblocks):
    for units in (1, 2, 3, 5, 8):
        for clusters in (1, 2, 3):
            for seed in range(12):
                _run_cluster(units, clusters, kblocks, seed)
                # the last unit's second tile beyond the rows (an odd number of m tiles), or every unit's (one m tile)
                _run_cluster(units, clusters, kblocks, seed, beyond={len(range(0, units, clusters)) - 1})
                _run_cluster(units, clusters, kblocks, seed, beyond=set(range(units)))


def test_without_the_release_into_the_peer_a_fill_lands_in_a_stage_still_read():
    with pytest.raises(Fault, match="landed in CTA"):
        for seed in range(300):
            _run_cluster(6, 1, 3, seed, release_both=False)


def test_a_full_barrier_that_does_not_count_the_peer_half_passes_early():
    with pytest.raises(Fault, match="read fill"):
        for seed in range(300):
            _run_cluster(4, 1, 3, seed, parts=2)


TILE_SLOTS = 8      # kTileSlots


def _run_dynamic(tiles, grid, kblocks, seed, *, slots=TILE_SLOTS, peek=True):
    """pingpong_kernel<LOGITS, 1> on the dynamic schedule: `grid` CTAs run together and share the tile counter. A
    CTA's producer takes tile blockIdx.x first, then claims each next tile (grid + counter, incremented) before the
    current tile's loads; it writes slot i % slots once it has waited for the release of tile i - 1's last stage, and
    past the last tile posts the end mark into slots i and i + 1. A consumer waits for its slot (the mbarrier's phase
    parity) before each tile, and after each mainloop waits for the next slot and signals the other consumer's order
    barrier only if that slot holds a tile (peek=False: always signals, as the static schedule's test of a successor
    cannot be made here). Checks, besides the static schedule's: every slot read holds what was posted for that index,
    every tile is computed exactly once over the CTAs, and every run finishes."""
    rnd = random.Random(seed)
    counter = [0]
    computed = []
    agents, issued, lands = [], [], {}

    for block in range(min(grid, tiles)):
        st = {"full": [0] * STAGES, "empty": [0] * STAGES, "content": [None] * STAGES,
              "posted": [0] * slots, "unit": [None] * slots, "sent": {}, "bars": {0: [0, 0], 1: [0, 0]}}

        def producer(st=st, block=block):
            u, i, seq = block, 0, 0
            while u < tiles:
                nxt = grid + counter[0]
                counter[0] += 1
                yield
                st["unit"][i % slots] = u
                st["sent"][i] = u
                st["posted"][i % slots] += 1
                for _ in range(kblocks):
                    s = seq % STAGES
                    while not _passed(st["empty"][s], ((seq // STAGES) & 1) ^ 1):
                        yield
                    issued.append((block, s, seq))
                    seq += 1
                    yield
                u, i = nxt, i + 1
            for e in (i, i + 1):
                st["unit"][e % slots] = tiles
                st["sent"][e] = tiles
                st["posted"][e % slots] += 1
                yield

        def unit_at(i, c, st=st):
            k = i % slots
            while not _passed(st["posted"][k], (i // slots) & 1):
                yield
            if st["unit"][k] != st["sent"].get(i):
                raise Fault(f"consumer {c} read slot {k} = {st['unit'][k]} for index {i}, posted {st['sent'].get(i)}")
            return st["unit"][k]

        def consumer(c, st=st, unit_at=unit_at):
            bars = st["bars"]
            release, check = _ring(st["empty"], st["content"], f"consumer {c}")
            i = c
            while True:
                u = yield from unit_at(i, c)
                if u >= tiles:
                    return
                if i > 0:
                    yield from _order_wait(bars, c)
                last = yield from _mainloop(st["full"], release, check, i, kblocks)
                computed.append(u)
                nxt = yield from unit_at(i + 1, c)
                if nxt < tiles or not peek:
                    _order_signal(bars, c)
                yield
                release(last)
                yield
                i += 2

        lands[block] = st
        agents += [producer(), consumer(0), consumer(1)]

    def land(item):
        block, s, q = item
        lands[block]["content"][s] = q
        lands[block]["full"][s] += 1

    _drive(rnd, agents, issued, land, 400000, f"no progress: tiles {tiles}, grid {grid}, K blocks {kblocks}")
    if sorted(computed) != list(range(tiles)):
        raise Fault(f"tiles computed {sorted(computed)}, expected each of 0 .. {tiles - 1} once")
    for st in lands.values():
        if any(v[0] for v in st["bars"].values()):
            raise Fault("an order barrier signal without its wait")


@pytest.mark.parametrize("kblocks", [1, 2, 5, 7])
def test_the_dynamic_schedule_reads_its_own_slots_computes_every_tile_once_and_finishes(kblocks):
    for tiles in (1, 2, 3, 5, 8, 13):
        for grid in (1, 2, 3, 5):
            for seed in range(12):
                _run_dynamic(tiles, grid, kblocks, seed)


def test_a_ring_of_stages_plus_one_tile_slots_fails():
    """One slot fewer than kTileSlots's bound (STAGES + 2): a slot is posted twice before its reader waits, and the
    reader's parity wait never passes (two slots: the reader reads a later tile's number)."""
    with pytest.raises(Fault, match="no progress"):
        for seed in range(300):
            _run_dynamic(20, 1, 1, seed, slots=STAGES + 1)
    with pytest.raises(Fault, match="read slot"):
        for seed in range(300):
            _run_dynamic(20, 1, 1, seed, slots=2)


def test_signalling_past_the_last_tile_leaves_a_signal_without_its_wait():
    with pytest.raises(Fault, match="without its wait"):
        for seed in range(50):
            _run_dynamic(5, 2, 2, seed, peek=False)
