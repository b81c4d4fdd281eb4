"""Independent references for the collectives: NumPy, float64, or NumPy
float32 arithmetic replaying a schedule step by step."""

from __future__ import annotations

import ml_dtypes
import numpy as np

EPS = {
    np.dtype(np.float32): 2.0**-24,
    np.dtype(np.float16): 2.0**-11,
    np.dtype(ml_dtypes.bfloat16): 2.0**-8,
    np.dtype(np.float64): 2.0**-53,
}


def allreduce64(xs: np.ndarray, op: str) -> np.ndarray:
    """Exact-ish reference: float64 sum (or mean) over the leading axis."""
    total = xs.astype(np.float64).sum(axis=0)
    return total / xs.shape[0] if op == "mean" else total


def error_bound(xs: np.ndarray, op: str, wire, out_dtype) -> np.ndarray:
    """Elementwise bound on |result - allreduce64| for any schedule.

    Each of the <= N adds (and casts to the wire type) of a partial sum is off
    by at most one wire ulp of that partial sum, itself bounded by sum_i |x_i|;
    the final cast to the output type adds half an output ulp. Factor 2 for
    the prescale rounding and float32 accumulation.
    """
    n = xs.shape[0]
    mag = np.abs(xs.astype(np.float64)).sum(axis=0)
    eps_w = max(EPS[np.dtype(wire)], EPS[np.dtype(np.float32)])
    bound = 2.0 * (n + 1) * eps_w * mag + 2.0 * EPS[np.dtype(out_dtype)] * mag
    if op == "mean":
        bound = bound / n
    return bound + 1e-30


def _chunk(n: int, parts: int, c: int) -> slice:
    per = -(-n // parts)
    return slice(min(n, per * c), min(n, per * (c + 1)))


def saturate(v: np.ndarray, wire, prescale) -> np.ndarray:
    """A prescaled (mean) partial sum about to be rounded to the wire: finite
    values clamped to the wire's largest finite value (ReduceSpec::saturate)."""
    if prescale == 1.0:
        return v
    hi = v.dtype.type(float(ml_dtypes.finfo(wire).max))
    return np.where(np.isinf(v), v, np.clip(v, -hi, hi))


def direct_float32(xs: np.ndarray, wire, prescale=1.0, postscale=1.0) -> np.ndarray:
    """The direct schedule in NumPy float32: owner c sums chunk c over ranks
    0..N-1 (each value sent as `wire`), casts to wire, everyone reads it."""
    n_ranks, n = xs.shape
    acc_t = np.float32
    if n_ranks == 1:  # nothing travels, so nothing is rounded to the wire type
        return xs[0].astype(acc_t) * acc_t(prescale * postscale)
    contributions = (xs.astype(acc_t) * acc_t(prescale)).astype(wire)
    out = np.empty(n, acc_t)
    for c in range(n_ranks):
        s = _chunk(n, n_ranks, c)
        total = contributions[0, s].astype(acc_t)
        for j in range(1, n_ranks):
            total = total + contributions[j, s].astype(acc_t)
        out[s] = (saturate(total, wire, prescale) * acc_t(postscale)).astype(wire).astype(acc_t)
    return out


def ring_float32(xs: np.ndarray, wire, prescale=1.0, postscale=1.0) -> np.ndarray:
    """The ring reduce-scatter of xla_ffi/algorithm/schedule.cc in NumPy
    float32: chunk c starts at rank c+1 and travels right, each hop sending
    the partial sum as `wire` and adding it to the receiver's own value."""
    n_ranks, n = xs.shape
    acc_t = np.float32
    if n_ranks == 1:
        return xs[0].astype(acc_t) * acc_t(prescale * postscale)
    acc = xs.astype(acc_t) * acc_t(prescale)
    out = np.empty(n, acc_t)
    for c in range(n_ranks):
        s = _chunk(n, n_ranks, c)
        partial = acc[(c + 1) % n_ranks, s]
        for hop in range(2, n_ranks + 1):
            receiver = (c + hop) % n_ranks
            sent = saturate(partial, wire, prescale).astype(wire)
            partial = acc[receiver, s] + sent.astype(acc_t)
        out[s] = (saturate(partial, wire, prescale) * acc_t(postscale)).astype(wire).astype(acc_t)
    return out


# -- optax's optimizers rewritten in float64, on dicts of NumPy arrays --------


class Sgd:
    """optax.sgd(lr, momentum): ``trace <- g + momentum trace``, step ``-lr trace``."""

    def __init__(self, lr: float, momentum: float = 0.0):
        self.lr, self.momentum = lr, momentum

    def init(self, shapes: dict):
        return {k: np.zeros(s) for k, s in shapes.items()}

    def update(self, g: dict, trace: dict):
        trace = {k: g[k] + self.momentum * trace[k] for k in g}
        return {k: -self.lr * trace[k] for k in g}, trace


class Adam:
    """optax.adam(lr): bias-corrected moments, ``eps`` outside the root."""

    b1, b2, eps = 0.9, 0.999, 1e-8

    def __init__(self, lr: float):
        self.lr = lr

    def init(self, shapes: dict):
        zeros = {k: np.zeros(s) for k, s in shapes.items()}
        return 0, zeros, dict(zeros)

    def update(self, g: dict, state):
        t, mu, nu = state
        t += 1
        mu = {k: self.b1 * mu[k] + (1 - self.b1) * g[k] for k in g}
        nu = {k: self.b2 * nu[k] + (1 - self.b2) * g[k] ** 2 for k in g}
        u = {
            k: -self.lr
            * (mu[k] / (1 - self.b1**t))
            / (np.sqrt(nu[k] / (1 - self.b2**t)) + self.eps)
            for k in g
        }
        return u, (t, mu, nu)
