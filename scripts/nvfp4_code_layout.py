#!/usr/bin/env python3
"""Where the W4A16 layout puts each E2M1 code's bits, and why (kernels/cuda/gemm_common.cuh).

A packed word holds fragment registers j = 0..3, two codes each (h = 0, 1: the low and the high
half). Register j decodes to BF16 bits with each code's sign at bit 15 + 16h and its magnitude
e1 e0 m at bits 8..6 + 16h: the word rotated left by a_j, masked for the magnitudes, and rotated
by b_j, masked for the signs. A register with a_j == b_j takes one rotation (none at 0) and one
mask; otherwise two rotations (a zero one free) and two masks. Rotations shared by registers are
computed once.

  python3 scripts/nvfp4_code_layout.py          the cheapest rotations, by exhaustive search
  python3 scripts/nvfp4_code_layout.py --check  the layout of gemm_common.cuh's wq_rot against
                                                the nibble layout before it, on random codes

The search: every (a_j, b_j) pair whose bits do not overlap, every four of them that cover the
32 bits of the word once; the cost is the distinct non-zero rotations plus the masks.
"""
import random
import sys

MAG = (6, 7, 8, 22, 23, 24)  # magnitude bits of both halves after decoding
SIGN = (15, 31)
ROT = [(0, 0), (3, 1), (6, 6), (11, 5)]  # (a_j, b_j): wq_rot(j, false), wq_rot(j, true)
M32 = 0xFFFFFFFF


def sources(bits, rot):
    """The word's bits that a left rotation by rot brings to bits."""
    return frozenset((b - rot) % 32 for b in bits)


def cost(choice):
    rotations = {r for pair in choice for r in pair if r}
    return len(rotations) + sum(1 if a == b else 2 for a, b in choice)


def search():
    pairs = [(a, b, sources(MAG, a) | sources(SIGN, b))
             for a in range(32) for b in range(32)
             if not sources(MAG, a) & sources(SIGN, b)]
    best = [None, None]

    def walk(start, used, choice):
        if len(choice) == 4:
            if len(used) == 32 and (best[0] is None or cost(choice) < best[0]):
                best[0], best[1] = cost(choice), list(choice)
            return
        if best[0] is not None and cost(choice) >= best[0]:
            return
        for i in range(start, len(pairs)):
            a, b, bits = pairs[i]
            if not used & bits:
                walk(i + 1, used | bits, choice + [(a, b)])

    walk(0, frozenset(), [])
    return best


def rotl(q, r):
    return ((q << r) | (q >> (32 - r))) & M32 if r % 32 else q


def pack(codes, rot):  # codes[j][h]: 4-bit E2M1 codes s e1 e0 m
    q = 0
    for j in range(4):
        for h in range(2):
            for b in range(4):
                pos = ((15 if b == 3 else 6 + b) + 16 * h - rot[j][b == 3]) & 31
                q |= ((codes[j][h] >> b) & 1) << pos
    return q


def decode(q, j, rot):
    a, b = rot[j]
    return (rotl(q, a) & 0x01C001C0) | (rotl(q, b) & 0x80008000)


def nibble_decode(codes, j):  # the layout before: nibbles at bits 12 - 4j and 28 - 4j
    q = 0
    for jj in range(4):
        for h in range(2):
            q |= codes[jj][h] << (16 * h + 12 - 4 * jj)
    mag = (q << (4 * j - 6)) & M32 if 4 * j >= 6 else q >> (6 - 4 * j)
    return (mag & 0x01C001C0) | ((q << (4 * j)) & 0x80008000)


def main():
    if sys.argv[1:] == ["--check"]:
        rng = random.Random(1)
        for _ in range(100000):
            codes = [[rng.randrange(16) for _ in range(2)] for _ in range(4)]
            q = pack(codes, ROT)
            for j in range(4):
                assert decode(q, j, ROT) == nibble_decode(codes, j), (codes, j)
        print("wq_rot's layout decodes as the nibble layout did: 100000 random words, 4 registers")
        print("instructions a word:", cost(ROT), "(nibble layout: 15)")
        return
    c, choice = search()
    print("cheapest:", c, "instructions a word, rotations (a_j, b_j):", choice)
    print("gemm_common.cuh's wq_rot:", cost(ROT), ROT)


if __name__ == "__main__":
    main()
