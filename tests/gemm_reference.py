"""An independent transcription of CONTRACT.md section 2, for tests only.

Exact rational arithmetic (fractions.Fraction) on values decoded from the bf16 bit patterns, one logit at a time:
no float64, no bit tricks, nothing shared with kernel/oracle.py or tests/contract_reference.py. Slow; small
sizes only.
"""
from __future__ import annotations

from fractions import Fraction

ALIGN_FRAC_BITS = 25          # CONTRACT.md section 2, step 4
ALIGN_EXP_FLOOR = -133        # step 3
NAN_BITS = 0x7FFFFFFF         # the NaN the tensor core writes
TWO = Fraction(2)
F32_MIN_NORMAL = TWO ** -126
F32_OVERFLOW = TWO ** 128


def decode_bf16(bits: int):
    """-> 'nan', '+inf', '-inf' or (value Fraction, nominal exponent)."""
    sign = -1 if bits & 0x8000 else 1
    field, frac = (bits >> 7) & 0xFF, bits & 0x7F
    if field == 0xFF:
        return "nan" if frac else ("-inf" if sign < 0 else "+inf")
    if field == 0:
        return sign * Fraction(frac, 128) * TWO ** -126, -126
    return sign * Fraction(128 + frac, 128) * TWO ** (field - 127), field - 127


def floor_log2(x: Fraction) -> int:
    """The e with 2^e <= |x| < 2^(e+1), x != 0."""
    x = abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    while TWO ** e > x:
        e -= 1
    while TWO ** (e + 1) <= x:
        e += 1
    return e


def nominal_exponent_f32(c: Fraction) -> int:
    return -126 if abs(c) < F32_MIN_NORMAL else floor_log2(c)


def trunc(x: Fraction) -> int:
    """Truncation toward zero (int() of a Fraction truncates toward zero)."""
    return int(x)


def to_binary32_toward_zero(x: Fraction):
    """Step 5: a 24-bit significand (or the subnormal grid 2^-149), truncated toward zero; zero is +0;
    >= 2^128 after truncation is an infinity. -> Fraction, '+inf' or '-inf'."""
    if x == 0:
        return Fraction(0)
    ulp = TWO ** (floor_log2(x) - 23) if abs(x) >= F32_MIN_NORMAL else TWO ** -149
    y = trunc(x / ulp) * ulp
    if abs(y) >= F32_OVERFLOW:
        return "+inf" if y > 0 else "-inf"
    return y


def group_step(c, a_bits, b_bits):
    """One k16 group: c (Fraction, '+inf', '-inf' or 'nan') -> the new c."""
    infs, nan, terms = set(), c == "nan", []
    if c in ("+inf", "-inf"):
        infs.add(c)
    for ab, bb in zip(a_bits, b_bits):
        a, b = decode_bf16(ab), decode_bf16(bb)
        if a == "nan" or b == "nan":
            nan = True
        elif isinstance(a, str) or isinstance(b, str):
            fin = b if isinstance(a, str) else a
            inf = a if isinstance(a, str) else b
            if isinstance(fin, str):                        # inf * inf
                infs.add("+inf" if fin == inf else "-inf")
            elif fin[0] == 0:
                nan = True                                  # inf * 0
            else:
                positive = (inf == "+inf") == (fin[0] > 0)
                infs.add("+inf" if positive else "-inf")
        elif a[0] != 0 and b[0] != 0:                       # a product with a zero factor is no term
            terms.append((a[0] * b[0], a[1] + b[1]))
    if nan or len(infs) == 2:
        return "nan"
    if infs:
        return infs.pop()
    if c != 0:
        terms.append((c, nominal_exponent_f32(c)))
    emax = max([e for _, e in terms] + [ALIGN_EXP_FLOOR])
    unit = TWO ** (emax - ALIGN_FRAC_BITS)
    s = sum(trunc(value / unit) for value, _ in terms)
    return to_binary32_toward_zero(s * unit)


def binary32_bits(c) -> int:
    import struct

    if c == "nan":
        return NAN_BITS
    if c == "+inf":
        return 0x7F800000
    if c == "-inf":
        return 0xFF800000
    bits = struct.unpack("<I", struct.pack("<f", float(c)))[0]      # exact: c lies on the binary32 grid
    assert Fraction(struct.unpack("<f", struct.pack("<I", bits))[0]) == c
    return bits


def dot_bits(h_bits, w_bits) -> int:
    """The binary32 bits of one logit from two equal-length lists of bf16 bit patterns (length % 16 == 0)."""
    c = Fraction(0)
    for g in range(0, len(h_bits), 16):
        c = group_step(c, h_bits[g:g + 16], w_bits[g:g + 16])
    return binary32_bits(c)


def logits_bits(h_bits, w_bits):
    """[N][V] binary32 bit patterns from [N][K] and [V][K] lists of bf16 bit patterns."""
    return [[dot_bits(list(hr), list(wr)) for wr in w_bits] for hr in h_bits]
