"""Bytes a step puts on the wire, per wire dtype, for a 1M-parameter model.

One process, 8 CPU devices: this shows what the compiled program sends, not
how fast. For each wire, one step of ``allreduce_gradients`` (backend xla,
one collective per leaf) reports ``get_stats``' payload_bytes and bytes_sent,
and the compiled HLO's collectives are summed the same way (a device sends
(N-1)/N of an all-to-all's or all-gather's result; an all-reduce's operand
counts 2(N-1)/N, the ring's share). They agree, except that XLA's CPU
all-reduce widens a bfloat16 psum to float32: the HLO column shows it.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/wire_bytes.py
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm

SHAPES = {"w1": (1000, 900), "b1": (900,), "w2": (900, 110), "b2": (100,)}  # 1,000,000
WIRES = ("float32", "bfloat16", "float8_e4m3fn", "int8", "int4")
_ITEM = {"f32": 4, "bf16": 2, "f16": 2, "u8": 1, "s8": 1, "f8e4m3fn": 1}


def _hlo_bytes_sent(hlo: str, n: int) -> float:
    ops = "all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter"
    sent = 0.0
    for types, op in re.findall(rf"= (\([^()]*\)|[^ ]+) ({ops})(?:-start)?\(", hlo):
        total = sum(
            _ITEM[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
            for t, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", types)
        )
        sent += total * (2 * (n - 1) / n if op == "all-reduce" else (n - 1) / n)
    return sent


def main():
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    params = {k: jnp.ones(s, jnp.float32) for k, s in SHAPES.items()}
    elements = sum(int(np.prod(s)) for s in SHAPES.values())
    rng = np.random.default_rng(0)
    grads = {k: rng.standard_normal((n, *s)).astype(np.float32) for k, s in SHAPES.items()}
    grads = jax.device_put(grads, NamedSharding(mesh, P("data")))
    print(f"{elements} parameters, N = {n}, one collective per leaf (backend='xla')")
    print("| wire | payload_bytes | bytes_sent | per element | vs float32 | HLO, CPU |")
    print("|---|---:|---:|---:|---:|---:|")
    base = None
    for wire in WIRES:
        tx = jaxcomm.allreduce_gradients(
            "data", wire_dtype=None if wire == "float32" else wire, backend="xla"
        )
        state = tx.init(params)

        def step(s, g, tx=tx):
            return tx.update(jax.tree.map(lambda a: a[0], g), s)

        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
        hlo = _hlo_bytes_sent(f.lower(state, grads).compile().as_text(), n)
        _, state = jax.block_until_ready(f(state, grads))
        stats = jaxcomm.get_stats(state)
        sent = float(stats.bytes_sent)
        if wire != "bfloat16":
            assert abs(sent - hlo) <= 1e-6 * hlo, (wire, sent, hlo)
        base = base or sent
        print(
            f"| {wire} | {float(stats.payload_bytes):,.0f} | {sent:,.0f} | "
            f"{sent / elements:.4f} | {sent / base:.3f} | {hlo:,.0f} |"
        )


if __name__ == "__main__":
    main()
