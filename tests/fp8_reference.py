"""Independent reference for E4M3 block quantization, written with numpy and plain loops.

It shares no code with `fp8_align.quant`: the E4M3 grid is decoded from the bit layout here,
rounding is nearest-even done by hand, and scales use Python's `math.frexp`.
"""

from __future__ import annotations

import math

import numpy as np

E4M3_MAX = 448.0


def _e4m3_positive_grid() -> tuple[np.ndarray, np.ndarray]:
    """All finite non-negative E4M3 values (sorted) and whether each has an even mantissa."""
    values, even = [], []
    for exponent in range(16):
        for mantissa in range(8):
            if exponent == 15 and mantissa == 7:  # the NaN encoding
                continue
            if exponent == 0:
                value = mantissa / 8 * 2.0**-6
            else:
                value = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
            values.append(value)
            even.append(mantissa % 2 == 0)
    return np.array(values, dtype=np.float64), np.array(even)


_GRID, _EVEN = _e4m3_positive_grid()


def round_to_e4m3(v: np.ndarray) -> np.ndarray:
    """Round float values (already within +-448) to the nearest E4M3 value, ties to even."""
    mag = np.abs(v.astype(np.float64))
    hi = np.clip(np.searchsorted(_GRID, mag), 1, len(_GRID) - 1)
    lo = hi - 1
    d_lo, d_hi = mag - _GRID[lo], _GRID[hi] - mag
    take_lo = (d_lo < d_hi) | ((d_lo == d_hi) & _EVEN[lo])
    rounded = np.where(take_lo, _GRID[lo], _GRID[hi])
    return np.sign(v) * rounded


def reference_scale(amax: float, pow2: bool) -> np.float32:
    """amax / 448 in FP32 (1.0 for an all-zero group), or the next power of two up."""
    if amax == 0:
        return np.float32(1.0)
    scale = np.float32(np.float32(amax) / np.float32(E4M3_MAX))
    if pow2:
        mantissa, exponent = math.frexp(float(scale))
        scale = np.float32(2.0 ** (exponent - 1) if mantissa == 0.5 else 2.0**exponent)
    return scale


def reference_quantize_blocks(w: np.ndarray, bn: int, bk: int, pow2: bool) -> tuple[np.ndarray, np.ndarray]:
    """Loop over [bn, bk] blocks of a 2-D float32 array: (E4M3 values as float64, FP32 scales)."""
    n, k = w.shape
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    codes = np.zeros((n, k), dtype=np.float64)
    scales = np.zeros((nb, kb), dtype=np.float32)
    for i in range(nb):
        for j in range(kb):
            block = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].astype(np.float32)
            scale = reference_scale(float(np.abs(block).max()), pow2)
            scaled = np.clip(block / scale, -E4M3_MAX, E4M3_MAX)  # float32 division
            codes[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = round_to_e4m3(scaled)
            scales[i, j] = scale
    return codes, scales


def reference_blockwise_linear(
    x_codes: np.ndarray, x_scales: np.ndarray, w_codes: np.ndarray, w_scales: np.ndarray, group: int = 128
) -> np.ndarray:
    """float64 y[m, n] = sum over K-blocks b of (x_b . w_b) * x_scale[m, b] * w_scale[n // group, b]."""
    m, k = x_codes.shape
    n = w_codes.shape[0]
    y = np.zeros((m, n), dtype=np.float64)
    for b in range(math.ceil(k / group)):
        cols = slice(b * group, (b + 1) * group)
        partial = x_codes[:, cols] @ w_codes[:, cols].T
        w_scale_rows = np.repeat(w_scales[:, b].astype(np.float64), group)[:n]
        y += partial * x_scales[:, b : b + 1].astype(np.float64) * w_scale_rows[None, :]
    return y
