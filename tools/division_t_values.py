"""The temperatures of `make check-division` (tools/check_row_division.cpp exhaustive), as binary32 bit patterns in
hex, one line: 0.7; k / 20 for k = 1..200; 2^e, its two upper and lower neighbours and 1.5 * 2^e for e = -20..19;
200 random significands in random binades of [2^-20, 2^20) (seeded)."""
import random
import struct


def t_values() -> list[int]:
    def b(x: float) -> int:
        return struct.unpack("<I", struct.pack("<f", x))[0]

    ts = {b(0.7)}
    ts.update(b(k / 20) for k in range(1, 201))
    for e in range(-20, 20):
        base = (127 + e) << 23
        ts.update([base, base | 1, base | 0x7FFFFF, base | 0x7FFFFE, base | 0x400000])
    rng = random.Random(20261202)
    for _ in range(200):
        e = rng.randint(-20, 19)
        ts.add(((127 + e) << 23) | rng.getrandbits(23))
    return sorted(ts)


if __name__ == "__main__":
    print(" ".join(hex(t) for t in t_values()))
