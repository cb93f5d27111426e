"""The reference codecs in tests/helpers/quant_refs: real quantizers, bit layouts pinned by
hand-worked words, and the sharding property shardload relies on, checked bit-exactly in pure
numpy.

Sharding property: slicing the *stored* tensors in their own units (packed words, groups, blocks)
gives exactly the slice of the dequantized matrix, ``deq(shard(Q)) == shard(deq(Q))``.
"""

from __future__ import annotations

import functools
import itertools
import math
import zlib

import numpy as np
import pytest
import torch
from helpers.quant_refs import awq, gptq
from helpers.quant_refs import compressed_tensors as ct
from helpers.quant_refs._bits import pack_bits, unpack_bits
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def u32(words) -> np.ndarray:
    """Hex literals as the int32 words a checkpoint stores."""
    return np.array(words, dtype=np.uint64).astype(np.uint32).view(np.int32)


def rand_w(n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, size=(n, 1))
    w[rng.random((n, k)) < 0.002] *= 8.0  # a few outliers
    return w.astype(np.float32)


def bounds(total: int, unit: int, tp: int) -> list[tuple[int, int]]:
    """Split [0, total) into <= tp pieces whose cuts are multiples of unit, as evenly as the units
    allow (uneven when they do not divide); the last piece ends at total, possibly mid-unit."""
    units = math.ceil(total / unit)
    tp = min(tp, units)
    sizes = [units // tp + (r < units % tp) for r in range(tp)]
    cuts = [0, *itertools.accumulate(s * unit for s in sizes)]
    cuts[-1] = total
    return list(itertools.pairwise(cuts))


def splits(total: int, unit: int) -> list[list[tuple[int, int]]]:
    """Even, uneven and lopsided aligned splits of [0, total)."""
    out = [bounds(total, unit, tp) for tp in (1, 2, 3, 4)]
    if total > unit:
        out.append([(0, unit), (unit, total)])
    return out


def lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


# ---------------------------------------------------------------------------------------------
# bit streams


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("axis", [0, 1])
def test_pack_unpack_round_trip(bits, axis):
    rng = np.random.default_rng(bits * 10 + axis)
    for length in (32, 64, 96, 7, 45):
        shape = (length, 5) if axis == 0 else (5, length)
        codes = rng.integers(0, 1 << bits, size=shape)
        words = pack_bits(codes, bits, axis)
        assert words.dtype == np.int32
        assert words.shape[axis] == math.ceil(length * bits / 32)
        assert np.array_equal(unpack_bits(words, bits, axis, length), codes)


def test_pack_bits_lsb_first_and_straddling():
    # 2-bit: code j at bit 2j.  8-bit: byte j.  3-bit: code 10 spans bits 30..32.
    assert pack_bits(np.array([[1, 2, 3] + [0] * 13]), 2, 1)[0, 0] == 0b111001
    assert pack_bits(np.array([[0x11, 0x22, 0x33, 0x84]]), 8, 1).view(np.uint32)[0, 0] == 0x84332211
    c = np.zeros((1, 32), dtype=np.int64)
    c[0, 10] = 0b101  # low two bits -> bits 30, 31 of word 0; high bit -> bit 0 of word 1
    c[0, 21] = 0b011  # low bit -> bit 31 of word 1; high two bits -> bits 0, 1 of word 2
    assert np.array_equal(pack_bits(c, 3, 1), u32([[0x40000000, 0x80000001, 0x00000001]]))


# ---------------------------------------------------------------------------------------------
# GPTQ: hand-worked layouts

S8 = np.array(
    [0.5, 0.25, 1, 0.125, 2, 0.0625, 0.5, 4], dtype=np.float32
)  # powers of two: exact in fp16/bf16


def _gptq4_hand():
    """8x8 weight, one group, asymmetric.  Input row k of output column n has code q[k, n]:
    even columns A = [1,2,3,4,5,6,0,15], odd columns B = [15,14,13,12,0,8,9,10] (each has 0 and
    15, so a min/max quantizer recovers the scale and zero point exactly)."""
    a = [1, 2, 3, 4, 5, 6, 0, 15]
    b = [15, 14, 13, 12, 0, 8, 9, 10]
    q = np.array([a if n % 2 == 0 else b for n in range(8)]).T  # [K, N]
    z = np.array([3, 0, 5, 8, 1, 15, 7, 2])
    w = (S8[:, None] * (q.T - z[:, None])).astype(np.float32)  # [N, K]
    return q, z, w


def test_gptq_4bit_hand_words():
    q, z, w = _gptq4_hand()
    # qweight: column n is one word, code k at bits 4k (LSB first):
    #   A -> nibbles 1,2,3,4,5,6,0,F from the bottom -> 0xF0654321;
    #   B -> F,E,D,C,0,8,9,A -> 0xA980CDEF
    qweight = u32([[0xF0654321, 0xA980CDEF] * 4])
    # qzeros: one word for the 8 columns, column n at bits 4n.
    #   v1 stores z-1 mod 16 = [2,15,4,7,0,14,6,1] (z=0 wraps to 0xF) -> 0x16E074F2
    #   v2 stores z            = [3,0,5,8,1,15,7,2]                   -> 0x27F18503
    qzeros = {1: u32([[0x16E074F2]]), 2: u32([[0x27F18503]])}
    for v in (1, 2):
        t = gptq.quantize_gptq(w, bits=4, group_size=-1, sym=False, version=v)
        assert np.array_equal(t["qweight"], qweight)
        assert np.array_equal(t["qzeros"], qzeros[v])
        assert t["scales"].dtype == np.float16 and np.array_equal(
            t["scales"], S8[None].astype(np.float16)
        )
        assert t["g_idx"].dtype == np.int32 and np.array_equal(t["g_idx"], np.zeros(8))
        hand = {
            "qweight": qweight,
            "qzeros": qzeros[v],
            "scales": S8[None].astype(np.float16),
            "g_idx": np.zeros(8, np.int32),
        }
        assert np.array_equal(gptq.dequantize_gptq(hand, 4, v), w)
        assert np.array_equal(gptq.unpack_qweight(qweight, 4), q)
        assert np.array_equal(gptq.unpack_qzeros(qzeros[v], 4, v), z[None])
    # the same words under the version names used in quantize_config.json
    assert np.array_equal(gptq.dequantize_gptq({**hand, "qzeros": qzeros[2]}, 4, "gptq_v2"), w)


def test_gptq_3bit_hand_words():
    """32x32 weight, one group: code q[k, n] = k % 8 in every column; z[n] = n % 8;
    s[n] = 2**-(n % 4).

    Codes 0..7 make a 24-bit run, octal 76543210 = 0xFAC688; 32 codes = that run 4 times = the
    96-bit number FAC688FAC688FAC688FAC688, whose words (w0 least significant) are 0x88FAC688,
    0xC688FAC6, 0xFAC688FA.  Check w0's top byte by AutoGPTQ's rule: code 9 (=1) at bits 27..29
    -> bit 27; code 10 (=2) keeps its low two bits at 30..31 -> bit 31; so 0x88.
    v1 zero points (z-1) % 8 = 7,0,1,...,6: octal 65432107 = 0xD63447 -> D63447D6 3447D634 47D63447.
    """
    n_ = k_ = 32
    q = np.tile(np.arange(k_) % 8, (n_, 1)).T  # [K, N]
    z = np.arange(n_) % 8
    s = (2.0 ** -(np.arange(n_) % 4)).astype(np.float32)
    w = (s[:, None] * (q.T - z[:, None])).astype(np.float32)
    stream = [0x88FAC688, 0xC688FAC6, 0xFAC688FA]
    qweight = u32([[x] * n_ for x in stream])
    qzeros = {1: u32([[0x47D63447, 0x3447D634, 0xD63447D6]]), 2: u32([stream])}
    for v in (1, 2):
        t = gptq.quantize_gptq(w, bits=3, group_size=-1, sym=False, version=v)
        assert t["qweight"].shape == (3, 32) and t["qzeros"].shape == (1, 3)
        assert np.array_equal(t["qweight"], qweight)
        assert np.array_equal(t["qzeros"], qzeros[v])
        hand = {
            "qweight": qweight,
            "qzeros": qzeros[v],
            "scales": s[None].astype(np.float16),
            "g_idx": np.zeros(32, np.int32),
        }
        assert np.array_equal(gptq.dequantize_gptq(hand, 3, v), w)


@pytest.mark.parametrize(
    "bits,v1_word,v2_word",
    [(4, 0x77777777, 0x88888888), (8, 0x7F7F7F7F, 0x80808080), (2, 0x55555555, 0xAAAAAAAA)],
)
def test_gptq_symmetric_zero_words(bits, v1_word, v2_word):
    w = rand_w(32, 64, seed=bits)
    for v, word in ((1, v1_word), (2, v2_word)):
        t = gptq.quantize_gptq(w, bits=bits, group_size=32, sym=True, version=v)
        assert np.array_equal(t["qzeros"], np.full(t["qzeros"].shape, u32(word)))


def test_gptq_v1_zero_point_zero_wraps_per_field():
    """An all-positive column has z = 0 (asymmetric): v1 stores the all-ones field, its
    neighbours intact."""
    w = rand_w(8, 16, seed=5)
    w[1] = np.abs(w[1]) + 0.1
    t = gptq.quantize_gptq(w, bits=4, group_size=-1, sym=False, version=1)
    z = gptq.unpack_qzeros(t["qzeros"], 4, version=2)  # raw fields
    assert z[0, 1] == 0xF
    assert np.array_equal(gptq.unpack_qzeros(t["qzeros"], 4, 1)[0, 1], 0)
    t2 = gptq.quantize_gptq(w, bits=4, group_size=-1, sym=False, version=2)
    assert np.array_equal(
        (gptq.unpack_qzeros(t2["qzeros"], 4, 2) - 1) % 16, z
    )  # v1 = v2 - 1, field by field
    assert np.array_equal(gptq.dequantize_gptq(t, 4, 1), gptq.dequantize_gptq(t2, 4, 2))


def test_gptq_agrees_with_the_older_4bit_reference():
    """tests/helpers/gptq_reference.py (4-bit v1) decodes the same tensors to the same matrix,
    wrap included."""
    from helpers.gptq_reference import dequantize as old_dequantize

    w = rand_w(32, 64, seed=9)
    w[3] = np.abs(w[3]) + 0.1  # z = 0 in column 3
    for perm in (None, np.random.default_rng(9).permutation(64)):
        t = gptq.quantize_gptq(w, 4, 16, sym=False, version=1, perm=perm)
        assert np.array_equal(
            old_dequantize(t["qweight"], t["qzeros"], t["scales"], t["g_idx"]),
            gptq.dequantize_gptq(t, 4, 1),
        )


def test_gptq_act_order_g_idx():
    perm = np.array([5, 2, 7, 0, 1, 6, 3, 4])
    # groups of 2 in perm order: {5,2} -> 0, {7,0} -> 1, {1,6} -> 2, {3,4} -> 3
    assert np.array_equal(gptq.act_order_g_idx(perm, 2), [1, 2, 0, 3, 3, 0, 2, 1])
    w = rand_w(16, 8, seed=1)
    t = gptq.quantize_gptq(w, bits=4, group_size=2, perm=perm)
    assert np.array_equal(t["g_idx"], [1, 2, 0, 3, 3, 0, 2, 1])


# ---------------------------------------------------------------------------------------------
# GPTQ: quantizer and sharding

GPTQ_N, GPTQ_K = 64, 288  # K = 288: with G = 128 the last group is partial (32 rows)
# (bits, group size, sym, version, act-order). Every bits x sym pair (the packing and the zero
# points differ with both) is crossed with six (group, act-order, version) triples that cover
# every pair of those three: G = 32 (whole groups), 128 (the last group partial: 32 rows) and -1
# (one group), each with v1 and v2, and act-order with both versions and both real group sizes.
# Dropped: act-order with G = -1 (one group: the permutation changes nothing, g_idx is all zeros,
# the same tensors as without it), and the other (G, act-order, version) triples: the version
# only changes how each zero point is stored ((z - 1) mod 2**b per field), which neither the
# group size nor act-order touches. 96 configs before, 48 now.
GPTQ_GROUP_ACT_VERSION = [
    (32, False, 1),
    (32, True, 2),
    (128, False, 2),
    (128, True, 1),
    (-1, False, 1),
    (-1, False, 2),
]
GPTQ_CONFIGS = [
    (bits, g, sym, v, act)
    for bits in (2, 3, 4, 8)
    for sym in (True, False)
    for g, act, v in GPTQ_GROUP_ACT_VERSION
]


def _gptq_id(c):
    bits, g, sym, v, act = c
    return f"b{bits}-g{g}-{'sym' if sym else 'asym'}-v{v}{'-act' if act else ''}"


@functools.cache
def _gptq_case(bits, g, sym, v, act):
    seed = zlib.crc32(repr((bits, g, sym, v, act)).encode())
    w = rand_w(GPTQ_N, GPTQ_K, seed)
    perm = np.random.default_rng(seed).permutation(GPTQ_K) if act else None
    return w, gptq.quantize_gptq(w, bits, g, sym=sym, version=v, perm=perm)


@pytest.mark.parametrize("cfg", GPTQ_CONFIGS, ids=_gptq_id)
def test_gptq_quantizer(cfg):
    bits, g, sym, v, act = cfg
    w, t = _gptq_case(*cfg)
    ng = 1 if g == -1 else math.ceil(GPTQ_K / g)
    assert t["qweight"].shape == (GPTQ_K * bits // 32, GPTQ_N) and t["qweight"].dtype == np.int32
    assert t["qzeros"].shape == (ng, GPTQ_N * bits // 32) and t["qzeros"].dtype == np.int32
    assert t["scales"].shape == (ng, GPTQ_N) and t["scales"].dtype == np.float16
    assert t["g_idx"].shape == (GPTQ_K,) and t["g_idx"].dtype == np.int32
    trivial = np.arange(GPTQ_K) // (GPTQ_K if g == -1 else g)
    assert np.array_equal(t["g_idx"], trivial) == (not act or g == -1)
    # a real quantizer: within half a step of w
    deq = gptq.dequantize_gptq(t, bits, v)
    step = t["scales"].astype(np.float64)[t["g_idx"]].T  # [N, K]
    assert np.all(np.abs(deq - w) <= 0.5 * step * (1 + 1e-6))
    # packing round-trips
    codes = gptq.unpack_qweight(t["qweight"], bits)
    assert codes.min() >= 0 and codes.max() < 2**bits
    assert np.array_equal(gptq.pack_qweight(codes, bits), t["qweight"])
    zeros = gptq.unpack_qzeros(t["qzeros"], bits, v)
    assert np.array_equal(gptq.pack_qzeros(zeros, bits, v), t["qzeros"])


def gptq_shard_cols(t, bits, n0, n1):
    return {
        "qweight": t["qweight"][:, n0:n1],
        "qzeros": t["qzeros"][:, n0 * bits // 32 : n1 * bits // 32],
        "scales": t["scales"][:, n0:n1],
        "g_idx": t["g_idx"],
    }


def gptq_shard_rows(t, bits, g, k0, k1):
    """No act-order: scales/qzeros by group, g_idx rebased."""
    return {
        "qweight": t["qweight"][k0 * bits // 32 : k1 * bits // 32],
        "qzeros": t["qzeros"][k0 // g : math.ceil(k1 / g)],
        "scales": t["scales"][k0 // g : math.ceil(k1 / g)],
        "g_idx": t["g_idx"][k0:k1] - t["g_idx"][k0],
    }


def gptq_shard_rows_replicated(t, bits, k0, k1):
    """Act-order (or G = -1): scales/qzeros whole, g_idx sliced and not rebased."""
    return {
        "qweight": t["qweight"][k0 * bits // 32 : k1 * bits // 32],
        "qzeros": t["qzeros"],
        "scales": t["scales"],
        "g_idx": t["g_idx"][k0:k1],
    }


def _pack_unit(bits):
    return 32 if bits == 3 else 32 // bits


@pytest.mark.parametrize("cfg", GPTQ_CONFIGS, ids=_gptq_id)
def test_gptq_sharding_is_exact(cfg):
    bits, g, sym, v, act = cfg
    _, t = _gptq_case(*cfg)
    full = gptq.dequantize_gptq(t, bits, v)
    # column-parallel: N on packing units (pf; 32 for 3 bit); g_idx replicated
    for split in splits(GPTQ_N, _pack_unit(bits)):
        parts = [
            gptq.dequantize_gptq(gptq_shard_cols(t, bits, n0, n1), bits, v) for n0, n1 in split
        ]
        for (n0, n1), part in zip(split, parts):
            assert np.array_equal(part, full[n0:n1])
        assert np.array_equal(np.concatenate(parts, axis=0), full)
    # row-parallel
    if act or g == -1:
        unit = _pack_unit(bits)
        shard = lambda k0, k1: gptq_shard_rows_replicated(t, bits, k0, k1)  # noqa: E731
    else:
        unit = lcm(g, _pack_unit(bits))
        shard = lambda k0, k1: gptq_shard_rows(t, bits, g, k0, k1)  # noqa: E731
    for split in splits(GPTQ_K, unit):
        parts = [gptq.dequantize_gptq(shard(k0, k1), bits, v) for k0, k1 in split]
        for (k0, k1), part in zip(split, parts):
            assert np.array_equal(part, full[:, k0:k1])
        assert np.array_equal(np.concatenate(parts, axis=1), full)


def test_gptq_act_order_needs_replicated_scales():
    """Control: the no-act-order rule (slice scales by group, rebase g_idx) is wrong for
    act-order."""
    _, t = _gptq_case(4, 32, False, 1, True)
    full = gptq.dequantize_gptq(t, 4, 1)
    wrong = 0
    for k0, k1 in bounds(GPTQ_K, 32, 3):
        try:
            part = gptq.dequantize_gptq(gptq_shard_rows(t, 4, 32, k0, k1), 4, 1)
        except (IndexError, ValueError):
            wrong += 1
            continue
        wrong += not np.array_equal(part, full[:, k0:k1])
    assert wrong >= 2


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
    n_units=st.integers(1, 4),
    k_units=st.integers(1, 6),
    g_mult=st.sampled_from([1, 2, -1]),
    act=st.booleans(),
    tp=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_gptq_sharding_property_fuzz(bits, n_units, k_units, g_mult, act, tp, seed):
    pu = _pack_unit(bits)
    n, k = n_units * pu, k_units * pu * 2
    g = -1 if g_mult == -1 else pu * g_mult
    rng = np.random.default_rng(seed)
    v = 1 + seed % 2
    t = gptq.quantize_gptq(
        rand_w(n, k, seed),
        bits,
        g,
        sym=bool(seed // 2 % 2),
        version=v,
        perm=rng.permutation(k) if act else None,
    )
    full = gptq.dequantize_gptq(t, bits, v)
    for n0, n1 in bounds(n, pu, tp):
        assert np.array_equal(
            gptq.dequantize_gptq(gptq_shard_cols(t, bits, n0, n1), bits, v), full[n0:n1]
        )
    for k0, k1 in bounds(k, pu if (act or g == -1) else g, tp):
        s = (
            gptq_shard_rows_replicated(t, bits, k0, k1)
            if (act or g == -1)
            else gptq_shard_rows(t, bits, g, k0, k1)
        )
        assert np.array_equal(gptq.dequantize_gptq(s, bits, v), full[:, k0:k1])


# ---------------------------------------------------------------------------------------------
# AWQ


def test_awq_order_matches_reverse():
    assert [awq.AWQ_ORDER[j] for j in awq.AWQ_REVERSE_ORDER] == list(range(8))


def test_awq_hand_words():
    """8x16 weight, one group of 16: code q[k, n] = (k + n) % 16, z = [3,0,5,8,1,15,7,2].

    Word for input row k holds nibble i = column AWQ_ORDER[i] = [0,2,4,6,1,3,5,7][i]:
      k=0: nibbles 0,2,4,6,1,3,5,7 -> 0x75316420      k=1: 1,3,5,7,2,4,6,8 -> 0x86427531
      k=9: 9,B,D,F,A,C,E,0         -> 0x0ECAFDB9      k=15: F,1,3,5,0,2,4,6 -> 0x6420531F
    qzeros (as is, same order): z0,z2,z4,z6,z1,z3,z5,z7 = 3,5,1,7,0,8,F,2 -> 0x2F807153.
    """
    n_, k_ = 8, 16
    q = (np.arange(k_)[:, None] + np.arange(n_)[None, :]) % 16  # [K, N]
    z = np.array([3, 0, 5, 8, 1, 15, 7, 2])
    w = (S8[:, None] * (q.T - z[:, None])).astype(np.float32)
    t = awq.quantize_awq(w, group_size=16)
    assert (
        t["qweight"].shape == (16, 1)
        and t["qzeros"].shape == (1, 1)
        and t["scales"].shape == (1, 8)
    )
    for k, word in ((0, 0x75316420), (1, 0x86427531), (9, 0x0ECAFDB9), (15, 0x6420531F)):
        assert t["qweight"][k, 0] == u32(word), hex(k)
    assert np.array_equal(t["qzeros"], u32([[0x2F807153]]))
    assert np.array_equal(t["scales"], S8[None].astype(np.float16))
    assert np.array_equal(awq.unpack_awq(t["qweight"]), q)
    assert np.array_equal(awq.dequantize_awq(t), w)
    # plain (non-interleaved) packing would have given 0x76543210 for row 0
    assert pack_bits(q[:1], 4, 1)[0, 0] == 0x76543210 != t["qweight"][0, 0]


AWQ_N, AWQ_K = 64, 256


@functools.cache
def _awq_case(g):
    w = rand_w(AWQ_N, AWQ_K, seed=100 + g)
    return w, awq.quantize_awq(w, g)


@pytest.mark.parametrize("g", [32, 64, 128, -1])
def test_awq_quantizer_and_sharding(g):
    w, t = _awq_case(g)
    gg = AWQ_K if g == -1 else g
    assert t["qweight"].shape == (AWQ_K, AWQ_N // 8) and t["qweight"].dtype == np.int32
    assert t["qzeros"].shape == (AWQ_K // gg, AWQ_N // 8) and t["scales"].dtype == np.float16
    full = awq.dequantize_awq(t)
    step = np.repeat(t["scales"].astype(np.float64), gg, axis=0).T
    assert np.all(np.abs(full - w) <= 0.5 * step * (1 + 1e-6))
    codes = awq.unpack_awq(t["qweight"])
    assert np.array_equal(awq.pack_awq(codes), t["qweight"])
    # column-parallel on word boundaries
    for split in splits(AWQ_N, 8):
        for n0, n1 in split:
            s = {
                "qweight": t["qweight"][:, n0 // 8 : n1 // 8],
                "qzeros": t["qzeros"][:, n0 // 8 : n1 // 8],
                "scales": t["scales"][:, n0:n1],
            }
            assert np.array_equal(awq.dequantize_awq(s), full[n0:n1])
    # row-parallel on group boundaries (G = -1: the one group is replicated)
    for split in splits(AWQ_K, gg if g != -1 else 8):
        for k0, k1 in split:
            if g == -1:
                s = {"qweight": t["qweight"][k0:k1], "qzeros": t["qzeros"], "scales": t["scales"]}
            else:
                s = {
                    "qweight": t["qweight"][k0:k1],
                    "qzeros": t["qzeros"][k0 // g : k1 // g],
                    "scales": t["scales"][k0 // g : k1 // g],
                }
            assert np.array_equal(awq.dequantize_awq(s), full[:, k0:k1])


# ---------------------------------------------------------------------------------------------
# compressed-tensors pack-quantized


def test_ct_pack_quantized_hand_words():
    """8x16 weight, 4 bit, asymmetric, one group of 16.  Signed code q[n, k] = (k + n) % 16 - 8,
    stored q + 8 = (k + n) % 16 packed along K:
      row 0: 0x76543210 0xFEDCBA98    row 1: 0x87654321 0x0FEDCBA9    row 7: 0xEDCBA987 0x6543210F
    Zero points zp = [-8,-1,0,7,3,-3,5,-5], stored zp + 8 = 0,7,8,F,B,5,D,3 packed along N (dim 0):
    one word 0x3D5BF870, shape [N/8, 1]."""
    n_, k_ = 8, 16
    u = (np.arange(k_)[None, :] + np.arange(n_)[:, None]) % 16
    q = u - 8
    zp = np.array([-8, -1, 0, 7, 3, -3, 5, -5])
    w = (S8[:, None] * (q - zp[:, None])).astype(np.float32)
    for strategy, sdt in (("group", "bfloat16"), ("channel", "float16")):
        t = ct.quantize_pack_quantized(
            w, 4, strategy=strategy, group_size=16, symmetric=False, scale_dtype=sdt
        )
        assert t["weight_packed"].shape == (8, 2) and t["weight_packed"].dtype == np.int32
        assert np.array_equal(t["weight_packed"][0], u32([0x76543210, 0xFEDCBA98]))
        assert np.array_equal(t["weight_packed"][1], u32([0x87654321, 0x0FEDCBA9]))
        assert np.array_equal(t["weight_packed"][7], u32([0xEDCBA987, 0x6543210F]))
        assert np.array_equal(t["weight_zero_point"], u32([[0x3D5BF870]]))
        assert t["weight_shape"].dtype == np.int64 and t["weight_shape"].tolist() == [8, 16]
        scale = t["weight_scale"]
        if sdt == "bfloat16":
            assert isinstance(scale, torch.Tensor) and scale.dtype == torch.bfloat16
        else:
            assert scale.dtype == np.float16
        assert tuple(scale.shape) == (8, 1)
        assert np.array_equal(ct.dequantize_pack_quantized(t, 4), w)
        assert np.array_equal(ct.unpack_int32(t["weight_packed"], 4, 16), q)
        assert np.array_equal(ct.unpack_int32(t["weight_zero_point"], 4, 8, axis=0)[:, 0], zp)


def test_ct_int8_zero_point_hand_word():
    # zp [-128, -1, 0, 127] + 128 = bytes 00, 7F, 80, FF along N -> 0xFF807F00
    assert np.array_equal(
        ct.pack_int32(np.array([[-128], [-1], [0], [127]]), 8, axis=0), u32([[0xFF807F00]])
    )
    # and along K for the weights: [1, -2, 3, -128] + 128 -> 81, 7E, 83, 00 -> 0x00837E81
    assert np.array_equal(
        ct.pack_int32(np.array([[1, -2, 3, -128]]), 8, axis=1), u32([[0x00837E81]])
    )


def test_ct_symmetric_has_no_zero_point_and_ragged_k_pads():
    w = rand_w(16, 250, seed=7)  # 250 = 31 words of 8 + 2 codes
    t = ct.quantize_pack_quantized(
        w, 4, strategy="group", group_size=50, symmetric=True, scale_dtype="float16"
    )
    assert set(t) == {"weight_packed", "weight_scale", "weight_shape"}
    assert t["weight_packed"].shape == (16, 32) and t["weight_scale"].shape == (16, 5)
    # padding codes are zero *after* the +8 offset: the top 24 bits of the last word are 0
    assert np.all(t["weight_packed"][:, -1].view(np.uint32) >> 8 == 0)
    deq = ct.dequantize_pack_quantized(t, 4)
    assert np.all(
        np.abs(deq - w)
        <= 0.5 * np.repeat(t["weight_scale"].astype(np.float64), 50, axis=1) * (1 + 1e-4)
    )


def test_ct_unpacked_zero_point_of_old_checkpoints():
    """compressed-tensors <= 0.9.3 saved the asymmetric zero point unpacked, int8 [N, K/G]."""
    w = rand_w(16, 64, seed=8)
    t = ct.quantize_pack_quantized(w, 4, strategy="group", group_size=32, symmetric=False)
    zp = ct.unpack_int32(t["weight_zero_point"], 4, 16, axis=0).astype(np.int8)
    old = {**t, "weight_zero_point": zp}
    assert np.array_equal(ct.dequantize_pack_quantized(old, 4), ct.dequantize_pack_quantized(t, 4))


CT_N, CT_K = 64, 256
# (bits, (strategy, group), sym, scale dtype): every bits x strategy x sym cell (they decide the
# packing, the groups and the zero point), each with one scale dtype, alternating so that each
# scale dtype meets every bits, strategy and sym value: the scale dtype only changes how the
# scales are rounded, which the packing and the slicing never see. 24 configs before, 12 now.
CT_STRATEGIES = (("group", 32), ("group", 128), ("channel", None))
CT_CONFIGS = [
    (nb, strategy, sym, ("bfloat16", "float16")[(b + k + (not sym)) % 2])
    for b, nb in enumerate((4, 8))
    for k, strategy in enumerate(CT_STRATEGIES)
    for sym in (True, False)
]


def _ct_id(c):
    nb, (strategy, g), sym, sdt = c
    return f"int{nb}-{strategy}{g or ''}-{'sym' if sym else 'asym'}-{sdt}"


def _ct_slice(t, n0, n1, k0, k1, nb, g):
    """Slice pack-quantized tensors to rows [n0, n1) and columns [k0, k1): weight_packed by rows
    and words, scale and zero point by groups (channel: replicated along K), zero point rows by
    words."""
    pf = 32 // nb
    out = {
        "weight_packed": t["weight_packed"][n0:n1, k0 // pf : math.ceil(k1 / pf)],
        "weight_shape": np.array([n1 - n0, k1 - k0], dtype=np.int64),
    }
    cols = slice(None) if g is None else slice(k0 // g, math.ceil(k1 / g))
    out["weight_scale"] = t["weight_scale"][n0:n1, cols]
    if "weight_zero_point" in t:
        out["weight_zero_point"] = t["weight_zero_point"][n0 // pf : math.ceil(n1 / pf), cols]
    return out


@pytest.mark.parametrize("cfg", CT_CONFIGS, ids=_ct_id)
def test_ct_pack_quantized(cfg):
    nb, (strategy, g), sym, sdt = cfg
    pf = 32 // nb
    w = rand_w(CT_N, CT_K, seed=zlib.crc32(repr(cfg).encode()))
    t = ct.quantize_pack_quantized(
        w, nb, strategy=strategy, group_size=g, symmetric=sym, scale_dtype=sdt
    )
    ng = 1 if g is None else CT_K // g
    assert t["weight_packed"].shape == (CT_N, CT_K // pf) and t["weight_packed"].dtype == np.int32
    assert tuple(t["weight_scale"].shape) == (CT_N, ng)
    if not sym:
        assert (
            t["weight_zero_point"].shape == (CT_N // pf, ng)
            and t["weight_zero_point"].dtype == np.int32
        )
    full = ct.dequantize_pack_quantized(t, nb)
    step = np.repeat(torch.as_tensor(t["weight_scale"]).double().numpy(), CT_K // ng, axis=1)
    assert np.all(np.abs(full - w) <= 0.5 * step * (1 + 1e-4))
    codes = ct.unpack_int32(t["weight_packed"], nb, CT_K)
    assert codes.min() >= -(2 ** (nb - 1)) and codes.max() < 2 ** (nb - 1)
    assert np.array_equal(ct.pack_int32(codes, nb), t["weight_packed"])
    # column-parallel: rows free for weight/scale; zero point rows are packed words (units of pf)
    for split in splits(CT_N, 1 if sym else pf) + ([[(0, 3), (3, CT_N)]] if sym else []):
        for n0, n1 in split:
            part = ct.dequantize_pack_quantized(_ct_slice(t, n0, n1, 0, CT_K, nb, g), nb)
            assert np.array_equal(part, full[n0:n1])
    # row-parallel: K on lcm(G, pf); channel scales and zero points replicated
    for split in splits(CT_K, lcm(g, pf) if g else pf):
        for k0, k1 in split:
            part = ct.dequantize_pack_quantized(_ct_slice(t, 0, CT_N, k0, k1, nb, g), nb)
            assert np.array_equal(part, full[:, k0:k1])


# ---------------------------------------------------------------------------------------------
# compressed-tensors float-quantized FP8


def test_fp8_hand_bytes():
    # amax 4 -> scale 4/448 = 1/112; w/scale = 112, -224, 28, 448 = 1.75 * 2**(6, 7, 4, 8):
    # e4m3fn sign|exp(bias 7)|mantissa 110 -> 0x6E, 0xF6, 0x5E, 0x7E
    w = np.array([[1, -2], [0.25, 4]], dtype=np.float32)
    t = ct.quantize_fp8(w, "tensor")
    assert t["weight"].dtype == torch.float8_e4m3fn
    assert t["weight"].view(torch.uint8).tolist() == [[0x6E, 0xF6], [0x5E, 0x7E]]
    assert t["weight_scale"].shape == (1,) and t["weight_scale"].dtype == np.float32
    assert np.allclose(ct.dequantize_fp8(t), w, rtol=1e-6)
    # older checkpoints store the per-tensor scale as a 0-d tensor: same result
    assert np.array_equal(
        ct.dequantize_fp8({**t, "weight_scale": t["weight_scale"].reshape(())}),
        ct.dequantize_fp8(t),
    )


FP8_N, FP8_K = 320, 400  # neither a multiple of 128: partial edge blocks


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block", "group"])
@pytest.mark.parametrize("sdt", ["float32", "bfloat16"])
def test_fp8(strategy, sdt):
    w = rand_w(FP8_N, FP8_K, seed=11)
    kw = {"group_size": 80} if strategy == "group" else {}
    t = ct.quantize_fp8(w, strategy, scale_dtype=sdt, **kw)
    shape = {"tensor": (1,), "channel": (FP8_N, 1), "block": (3, 4), "group": (FP8_N, 5)}[strategy]
    assert tuple(t["weight_scale"].shape) == shape
    assert t["weight"].dtype == torch.float8_e4m3fn and tuple(t["weight"].shape) == (FP8_N, FP8_K)
    deq = lambda x: ct.dequantize_fp8(x, strategy, **kw)  # noqa: E731
    full = deq(t)
    s = torch.as_tensor(t["weight_scale"]).double().numpy()
    if strategy == "tensor":
        s_el = np.full(w.shape, s.item())
    elif strategy == "block":
        s_el = np.repeat(np.repeat(s, 128, 0), 128, 1)[:FP8_N, :FP8_K]
    else:
        s_el = np.repeat(s, FP8_K // s.shape[1], axis=1)
    # e4m3: 3 mantissa bits (half-ulp 2**-4 relative); subnormal spacing 2**-9
    assert np.all(np.abs(full - w) <= np.abs(w) * 2**-4 * (1 + 1e-6) + s_el * 2**-10)
    if strategy == "group":
        return
    # column-parallel: rows (block: on 128 rows); row-parallel: columns (block: on 128)
    unit = 128 if strategy == "block" else 1
    for split in splits(FP8_N, unit) + ([[(0, 7), (7, FP8_N)]] if unit == 1 else []):
        for n0, n1 in split:
            sc = t["weight_scale"]
            if strategy == "channel":
                sc = sc[n0:n1]
            elif strategy == "block":
                sc = sc[n0 // 128 : math.ceil(n1 / 128)]
            assert np.array_equal(
                deq({"weight": t["weight"][n0:n1], "weight_scale": sc}), full[n0:n1]
            )
    for split in splits(FP8_K, unit) + ([[(0, 7), (7, FP8_K)]] if unit == 1 else []):
        for k0, k1 in split:
            sc = (
                t["weight_scale"][:, k0 // 128 : math.ceil(k1 / 128)]
                if strategy == "block"
                else t["weight_scale"]
            )
            assert np.array_equal(
                deq({"weight": t["weight"][:, k0:k1], "weight_scale": sc}), full[:, k0:k1]
            )


def test_fp8_block_scale_must_fit():
    t = ct.quantize_fp8(rand_w(256, 256, seed=2), "block")
    with pytest.raises(ValueError):
        # 128 rows need one scale row, not the full tensor's two: a sharder that forgot to slice it
        ct.dequantize_fp8({"weight": t["weight"][:128], "weight_scale": t["weight_scale"]}, "block")
