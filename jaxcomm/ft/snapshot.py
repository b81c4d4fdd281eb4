"""A committed state on the host: what a member rolls back to and a joiner pulls.

``shared`` is what every live member holds bitwise after a committed round
(the global params and outer optimizer state of DiLoCo; params and optimizer
state of per-step data parallelism); its hash, with the round, is what members
compare. ``private`` is a group's own (DiLoCo's inner optimizer state): sent
to a joiner as its starting point, never compared.
"""

from __future__ import annotations

import hashlib
import json
from typing import NamedTuple

import ml_dtypes
import numpy as np


class Snapshot(NamedTuple):
    """The last committed state of one member.

    Attributes:
      round: committed rounds so far.
      shared: numpy arrays, the same on every live member (hashed).
      private: numpy arrays of this group alone (not hashed).
      meta: JSON-able dict, e.g. the data position (not hashed).
    """

    round: int
    shared: tuple
    private: tuple = ()
    meta: dict = {}

    def hash(self) -> str:
        """SHA-256 of the round and the shared arrays' dtype names, shapes and bytes."""
        h = hashlib.sha256(str(int(self.round)).encode())
        for a in self.shared:
            a = np.asarray(a)  # not ascontiguousarray: it turns a 0-d array into shape (1,)
            h.update(f"{a.dtype.name}{a.shape}".encode())
            h.update(a.tobytes())
        return h.hexdigest()[:32]

    def encode(self) -> tuple[dict, bytes]:
        """(header, body): the arrays' layout as JSON and their bytes, for the wire."""
        arrays = [np.asarray(a) for a in (*self.shared, *self.private)]
        header = {
            "round": int(self.round),
            "hash": self.hash(),
            "meta": self.meta,
            "n_shared": len(self.shared),
            # Names, not dtype.str: ml_dtypes' bfloat16 and float8 types have the str "<V2"/"<V1".
            "arrays": [[a.dtype.name, list(a.shape)] for a in arrays],
        }
        body = b"".join(a.tobytes() for a in arrays)
        header["nbytes"] = len(body)
        return header, body

    @staticmethod
    def decode(header: dict, body) -> Snapshot:
        """The inverse of :meth:`encode`; ValueError if the body does not match its hash."""
        arrays, offset = [], 0
        for name, shape in header["arrays"]:
            dtype = np.dtype(getattr(ml_dtypes, name, name))
            n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            arrays.append(
                np.frombuffer(bytes(body[offset : offset + n]), dtype).reshape(tuple(shape))
            )
            offset += n
        if offset != len(body):
            raise ValueError(f"state body has {len(body)} bytes, its header describes {offset}")
        k = int(header["n_shared"])
        snap = Snapshot(
            int(header["round"]), tuple(arrays[:k]), tuple(arrays[k:]), dict(header["meta"])
        )
        if snap.hash() != header["hash"]:
            raise ValueError(
                f"state of round {snap.round} hashes to {snap.hash()}, "
                f"its sender said {header['hash']}"
            )
        return snap


def meta_json(meta: dict) -> dict:
    """``meta`` checked to survive a JSON round trip (ValueError naming it otherwise)."""
    try:
        return json.loads(json.dumps(meta))
    except TypeError as e:
        raise ValueError(f"meta must be JSON-able: {e}") from e
