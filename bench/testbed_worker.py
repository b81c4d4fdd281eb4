"""What every process on the testbed shares: joining the job, rows, progress, examples.

The workers of ``bench/network.py`` (``network_worker.py``),
``bench/time_to_quality.py`` (``quality_worker.py``) and
``bench/diloco_overlap.py`` run one per host under ``bench/netbed.py``, with
the variables ``python -m jaxcomm.launch`` sets. Each imports this module,
never another worker: process 0 prints each result as one ``@row {json}``
line on stdout (``netbed.ROW_PREFIX``, which ``netbed.run_hosts`` reads),
progress goes to stderr, and the examples' programs are imported, not
copied. JAX is imported only inside the functions, so a driver may import a
worker for its names without starting JAX.

Example (one process, no testbed)::

    >>> import testbed_worker
    >>> testbed_worker.describe_error(ValueError("no\\n  such   size"))
    'ValueError: no such size'
"""

from __future__ import annotations

import importlib
import json
import os
import sys

from netbed import ROW_PREFIX

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def join(*, fail_rank: int | None = None, say_interface: bool = False):
    """Joins the job (``jaxcomm.distributed.initialize``) and says so; its settings.

    Args:
      fail_rank: this process exits with code 3 at once if it has this rank
        (the tests' failing host), as a crash would.
      say_interface: add the link's interface to the progress line.
    """
    import jaxcomm

    settings = jaxcomm.distributed.initialize()
    if fail_rank is not None and settings.process_id == fail_rank:
        print(f"process {settings.process_id}: failing on purpose (--fail-rank)", flush=True)
        # As a crash would: sys.exit would wait in jax.distributed's shutdown barrier.
        os._exit(3)
    line = f"{settings.num_processes} processes, coordinator {settings.coordinator_address}"
    if say_interface:
        line += f", interface {os.environ.get('JAXCOMM_SOCKET_IFNAME')}"
    progress(line)
    return settings


def emit(row: dict, rows: list | None = None):
    """Prints the row (process 0) and appends it to ``rows`` (every process)."""
    import jax

    if jax.process_index() == 0:
        print(ROW_PREFIX + json.dumps(row), flush=True)
    if rows is not None:
        rows.append(row)


def progress(message: str):
    """``message`` on stderr, from process 0 only (the others would repeat it)."""
    import jax

    if jax.process_index() == 0:
        print(message, file=sys.stderr, flush=True)


def describe_error(e: Exception) -> str:
    """The exception on one line, shortened: it goes into a table cell and a JSON row."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:400]}"


def data_mesh(axis: str):
    """Every device of every host on one axis, host by host, each in id order."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices, dtype=object), (axis,))


def placer(mesh):
    """``place(value, spec)``: a global array of ``value`` (NumPy or JAX), laid
    out as ``spec`` says on ``mesh``; every process holds the whole value."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    def place(value, spec):
        value = np.asarray(value)
        return jax.make_array_from_callback(
            value.shape, NamedSharding(mesh, spec), lambda i: value[i]
        )

    return place


def load_example(example: str, *modules: str) -> list:
    """Modules of ``examples/<example>`` (flat scripts importing each other by
    bare name), imported with its directory first on the path; the bare names
    leave ``sys.modules`` again so another example's cannot clash."""
    directory = os.path.join(EXAMPLES, example)
    names = {f[:-3] for f in os.listdir(directory) if f.endswith(".py")}
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    sys.path.insert(0, directory)
    try:
        return [importlib.import_module(m) for m in modules]
    finally:
        sys.path.remove(directory)
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)
