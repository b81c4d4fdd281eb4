"""Hosts on a shaped network, on one machine: network namespaces, a bridge, tbf.

A bench on the testbed (``bench/network.py``, ``bench/time_to_quality.py``,
``bench/diloco_overlap.py``) re-runs itself through :func:`run_isolated`
inside fresh mount, network and PID namespaces (``unshare``), where it is
PID 1, and there hands its commands to :func:`run_testbed`. There a
:class:`Testbed` gives each host its own network namespace, joined to one
bridge by a veth pair whose two ends are both shaped with ``tc tbf`` to the
link rate, so every host's traffic is limited in both directions. Addresses
are private (``10.77.0.0/24``) and exist only inside these namespaces.

Nothing outlives the run: when PID 1 of the PID namespace exits, the kernel
kills every process in it, and with the last process go the namespaces and
with them the links, qdiscs, and the tmpfs mounts that hold ``ip netns``'
files. Teardown on a normal exit, a failing host, or SIGINT/SIGTERM is
explicit as well (:meth:`Testbed.close`, :func:`run_hosts`).

Run as a script it reruns one command of any of those benches alone: the
same command on every host, the same testbed, its rows printed (and written
to ``--json``); each bench says this line for every command it starts::

    python bench/netbed.py --hosts 2 --rate 1gbit -- \
        bench/network_worker.py --workload allreduce --paths ring --sizes-mib 1

Needs root (or CAP_SYS_ADMIN + CAP_NET_ADMIN), ``unshare`` (util-linux) and
``ip``/``tc`` (iproute2).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Set in the re-run copy: the namespaces exist, do not unshare again.
INSIDE_ENV = "JAXCOMM_NETBED_INSIDE"
SUBNET = "10.77.0"  # /24, host k at .{k + 1}; only inside our namespaces
COORDINATOR_PORT = 29500  # a fresh namespace: nothing else listens there
BRIDGE = "jcbr0"
# Worker stdout lines that carry a result row; everything else is progress.
ROW_PREFIX = "@row "
TBF_LATENCY = "20ms"  # queue a packet may wait before tbf drops it
TBF_MIN_BURST = 96 * 1024  # > 64 KiB GSO packets, so tbf need not split them
_PR_SET_PDEATHSIG = 1


class NetbedError(RuntimeError):
    """The namespaces, links or shaping could not be set up."""


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_RATE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_rate(text: str) -> int:
    """A link rate in bits per second from ``100mbit``, ``1gbit``, ``10gbit``, ``5e8``.

    Examples:
      >>> parse_rate("100mbit"), parse_rate("1gbit"), parse_rate("2.5Gbit"), parse_rate("5e8")
      (100000000, 1000000000, 2500000000, 500000000)
    """
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kmgKMG]?)(bit)?\s*", text)
    if not match:
        raise ValueError(f"rate {text!r} is not like 100mbit, 1gbit or 5e8")
    value = float(match.group(1)) * _RATE_UNITS[match.group(2).lower()]
    if value < 1e5:
        raise ValueError(f"rate {text!r} is below 100 kbit/s")
    return int(value)


def format_rate(rate_bps: float) -> str:
    """``1gbit``-style text for a rate in bits per second.

    Examples:
      >>> format_rate(1e8), format_rate(1e9), format_rate(2.5e9)
      ('100mbit', '1gbit', '2.5gbit')
    """
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate_bps >= scale:
            return f"{rate_bps / scale:g}{unit}"
    return f"{rate_bps:g}bit"


def tbf_args(rate_bps: int) -> list[str]:
    """``tc qdisc ... tbf`` arguments for ``rate_bps``.

    The burst must exceed the largest packet (else tbf drops or splits it;
    veths pass 64 KiB GSO packets) and is 1 ms of traffic at high rates, so
    tbf's timer need not fire more often than that. Small enough that a
    message of a few MiB still sees the rate, not the burst. 20 ms of queue
    absorbs TCP's bursts without turning into seconds of delay at low rates.

    Examples:
      >>> tbf_args(10**8)
      ['tbf', 'rate', '100000000bit', 'burst', '98304', 'latency', '20ms']
    """
    burst = tbf_burst(rate_bps)
    return ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst), "latency", TBF_LATENCY]


def tbf_burst(rate_bps: int) -> int:
    """Bytes a shaped link passes at full speed after a pause (see ``tbf_args``)."""
    return max(TBF_MIN_BURST, rate_bps // 8 // 1000)


def missing_tools() -> list[str]:
    return [tool for tool in ("unshare", "ip", "tc", "mount") if shutil.which(tool) is None]


def check_can_isolate() -> str | None:
    """Why namespaces cannot be made here, or ``None`` if they can."""
    if missing_tools():
        return f"missing tools: {', '.join(missing_tools())} (util-linux, iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN); run as root"
    probe = subprocess.run(
        ["unshare", "--mount", "--net", "--pid", "--fork", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        return f"unshare --mount --net --pid failed: {probe.stderr.strip() or probe.returncode}"
    return None


def _die_with_parent():
    # preexec_fn: unshare gets SIGKILL when we die, and its child (our PID 1)
    # gets SIGKILL from --kill-child, which empties the PID namespace.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _child_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def run_isolated(argv: Sequence[str], *, timeout_s: float, grace_s: float = 15.0) -> int:
    """Runs ``argv`` as PID 1 of new mount, network and PID namespaces; its exit code.

    SIGINT/SIGTERM here are passed on to it; past ``timeout_s`` (SIGTERM), or
    ``grace_s`` after a signal, it is killed, and with it the namespaces.
    """
    env = dict(os.environ, **{INSIDE_ENV: "1"})
    command = ["unshare", "--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]
    proc = subprocess.Popen([*command, *argv], env=env, preexec_fn=_die_with_parent)
    interrupted: list[int] = []

    def forward(signum, frame):
        del frame
        interrupted.append(signum)
        inner = _child_pid(proc.pid)
        if inner is not None:
            os.kill(inner, signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    deadline = time.monotonic() + timeout_s
    kill_at, timed_out = None, False
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if kill_at is None and now > deadline:
                print(f"network: past the {timeout_s:.0f} s limit; stopping", file=sys.stderr)
                timed_out = True
                forward(signal.SIGTERM, None)
            if kill_at is None and interrupted:
                kill_at = now + grace_s
            if kill_at is not None and now > kill_at:
                proc.kill()  # --kill-child takes PID 1, and the kernel everything under it
                break
            time.sleep(0.1)
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if timed_out:
        return 124
    if interrupted:
        return 128 + interrupted[0]
    return code if code >= 0 else 128 - code


def rerun_isolated(script: str, argv: Sequence[str], *, timeout_s: float, say) -> int:
    """Runs ``script`` again with ``argv`` through :func:`run_isolated` (a
    bench's driver, which then finds :data:`INSIDE_ENV` set); its exit code,
    or 2, said, where namespaces cannot be made here."""
    reason = check_can_isolate()
    if reason is not None:
        say(f"cannot make network namespaces here: {reason}")
        return 2
    return run_isolated([sys.executable, os.path.abspath(script), *argv], timeout_s=timeout_s)


def stopped(error: Exception, say) -> int:
    """The exit code of a run inside the namespaces that ``error`` stopped
    (:class:`Interrupted`: 128 + the signal; :class:`NetbedError`: 2), said."""
    if isinstance(error, Interrupted):
        say(f"got {error}; stopped every host and removed the namespaces")
        return 128 + error.signum
    say(f"could not build the testbed: {error}")
    return 2


def install_interrupt_handlers():
    """SIGINT/SIGTERM raise :class:`Interrupted` (PID 1 ignores them otherwise); once."""

    def handler(signum, frame):
        del frame
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        raise Interrupted(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise NetbedError(f"`{' '.join(command)}` failed: {done.stderr.strip()}")
    return done.stdout


def host_address(host: int) -> str:
    return f"{SUBNET}.{host + 1}"


@dataclasses.dataclass
class Testbed:
    """``hosts`` network namespaces on one bridge, every link shaped to ``rate_bps``.

    Host k lives in namespace ``jchost{k}`` with interface ``jcveth{k}``
    (address ``10.77.0.{k+1}``); its peer ``jcbr{k}`` sits on the bridge.
    Use inside the namespaces :func:`run_isolated` made, as a context manager.
    """

    hosts: int
    rate_bps: int
    workdir: str = "/run/jaxcomm-netbed"

    def namespace(self, host: int) -> str:
        return f"jchost{host}"

    def interface(self, host: int) -> str:
        return f"jcveth{host}"

    def bridge_port(self, host: int) -> str:
        return f"jcport{host}"

    def __enter__(self) -> Testbed:
        if os.environ.get(INSIDE_ENV) != "1":
            raise NetbedError("a Testbed is built only inside run_isolated's namespaces")
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _build(self):
        # Our own tmpfs on /run (private to this mount namespace): `ip netns`
        # keeps its files there and nothing is written to the host's /run.
        _run("mount", "-t", "tmpfs", "jaxcomm-netbed", "/run")
        os.makedirs(self.workdir, exist_ok=True)
        _run("ip", "link", "set", "lo", "up")
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "link", "set", BRIDGE, "up")
        for host in range(self.hosts):
            ns, veth, port = self.namespace(host), self.interface(host), self.bridge_port(host)
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", port)
            _run("ip", "link", "set", veth, "netns", ns)
            _run("ip", "link", "set", port, "master", BRIDGE)
            _run("ip", "link", "set", port, "up")
            _run("ip", "-n", ns, "addr", "add", f"{host_address(host)}/24", "dev", veth)
            _run("ip", "-n", ns, "link", "set", veth, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        self.set_rate(self.rate_bps, add=True)

    def set_rate(self, rate_bps: int, *, add: bool = False):
        """Shapes both directions of every host's link to ``rate_bps``."""
        verb = "add" if add else "change"
        for host in range(self.hosts):
            # Egress of the bridge-side end is the host's ingress.
            _run("tc", "qdisc", verb, "dev", self.bridge_port(host), "root", *tbf_args(rate_bps))
            _run(
                "ip", "netns", "exec", self.namespace(host),
                "tc", "qdisc", verb, "dev", self.interface(host), "root", *tbf_args(rate_bps),
            )  # fmt: skip
        self.rate_bps = rate_bps

    def qdiscs(self) -> str:
        """``tc qdisc show`` of every link end, for checks and logs."""
        text = [_run("tc", "qdisc", "show")]
        for host in range(self.hosts):
            text.append(_run("ip", "netns", "exec", self.namespace(host), "tc", "qdisc", "show"))
        return "".join(text)

    def close(self):
        """Deletes the namespaces and the bridge (their veths and qdiscs go with them)."""
        for host in range(self.hosts):
            subprocess.run(["ip", "netns", "del", self.namespace(host)], capture_output=True)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``host``, in its namespace. gloo binds to the
        host's link because the worker's environment names it
        (JAXCOMM_SOCKET_IFNAME, read by jaxcomm.distributed.initialize)."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]


@dataclasses.dataclass
class HostResult:
    """What a run of one command per host gave."""

    rows: list[dict]
    code: int
    failed: str | None  # "rank 1 exited with code 3" or None


def _pump(stream, host: int, events: queue.Queue):
    for raw in iter(stream.readline, b""):
        events.put(("line", host, raw.decode(errors="replace").rstrip("\n")))
    stream.close()


def run_hosts(
    bed: Testbed,
    argv: Sequence[str],
    env_for: Callable[[int], dict],
    *,
    deadline: float,
    grace_s: float = 5.0,
    on_line: Callable[[int, str], None] | None = None,
) -> HostResult:
    """Runs ``argv`` once per host with ``env_for(host)``; stops all on the first failure.

    Lines starting with ``@row `` on host 0's stdout are JSON rows; every other
    line goes to ``on_line`` (stderr with a ``[host k]`` prefix by default).
    Past ``deadline`` (``time.monotonic()``) every host is stopped.
    Raises :class:`Interrupted` after stopping them on SIGINT/SIGTERM.
    """
    from jaxcomm import launch

    if on_line is None:

        def on_line(host, line):
            print(f"[host {host}] {line}", file=sys.stderr, flush=True)

    events: queue.Queue = queue.Queue()
    procs: list[subprocess.Popen] = []
    threads = []
    rows, failed, code = [], None, 0
    try:
        for host in range(bed.hosts):
            proc = subprocess.Popen(
                bed.command(host, argv),
                env=env_for(host),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: stop_all signals the whole tree
            )
            procs.append(proc)
            thread = threading.Thread(target=_pump, args=(proc.stdout, host, events), daemon=True)
            thread.start()
            threads.append(thread)
        running = set(range(bed.hosts))
        while running:
            try:
                kind, host, line = events.get(timeout=0.2)
            except queue.Empty:
                for host in sorted(running):
                    returncode = procs[host].poll()
                    if returncode is None:
                        continue
                    running.discard(host)
                    if returncode != 0 and failed is None:
                        failed = launch.describe(host, returncode)
                        code = launch.exit_code(returncode)
                        on_line(host, f"{failed}; stopping the other hosts")
                        launch.stop_all(procs, grace_s)
                        running.clear()
                if time.monotonic() > deadline and running:
                    failed, code = "past the time limit", 124
                    on_line(0, "past the time limit; stopping every host")
                    launch.stop_all(procs, grace_s)
                    running.clear()
                continue
            if host == 0 and line.startswith(ROW_PREFIX):
                rows.append(json.loads(line[len(ROW_PREFIX) :]))
            else:
                on_line(host, line)
    finally:
        launch.stop_all(procs, grace_s)
        for thread in threads:
            thread.join(timeout=grace_s)
    while not events.empty():
        _, host, line = events.get()
        if host == 0 and line.startswith(ROW_PREFIX):
            rows.append(json.loads(line[len(ROW_PREFIX) :]))
        else:
            on_line(host, line)
    return HostResult(rows, code, failed)


def measure_link(bed: Testbed, *, seconds: float = 3.0) -> float:
    """Bits per second of one TCP stream from host 1 to host 0 through the shaped links."""
    server = (
        "import socket,sys,time\n"
        f"s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('{host_address(0)}', 5201)); s.listen(1); c, _ = s.accept()\n"
        "n = 0; t = None\n"
        "while True:\n"
        "    b = c.recv(1 << 20)\n"
        "    if not b: break\n"
        "    if t is None: t = time.monotonic()\n"
        "    else: n += len(b)\n"
        "print(n * 8 / (time.monotonic() - t))\n"
    )
    client = (
        "import socket,time\n"
        "for attempt in range(100):  # until the receiver listens\n"
        "    try:\n"
        f"        s = socket.create_connection(('{host_address(0)}', 5201)); break\n"
        "    except ConnectionRefusedError: time.sleep(0.05)\n"
        "b = b'x' * (1 << 16)\n"
        f"end = time.monotonic() + {seconds}\n"
        "while time.monotonic() < end: s.sendall(b)\n"
        "s.close()\n"
    )
    ns = ["ip", "netns", "exec"]
    receiver = subprocess.Popen(
        [*ns, bed.namespace(0), sys.executable, "-c", server], stdout=subprocess.PIPE, text=True
    )
    try:
        subprocess.run(
            [*ns, bed.namespace(1), sys.executable, "-c", client], check=True, timeout=seconds + 30
        )
        out, _ = receiver.communicate(timeout=30)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    return float(out.strip())


def worker_env(bed: Testbed, host: int, *, devices_per_host: int) -> dict:
    """The environment of ``host``'s process: what ``python -m jaxcomm.launch``
    sets for it (the coordinator on host 0's link address), this checkout
    first on ``PYTHONPATH``, and the host's link as gloo's interface."""
    from jaxcomm import launch

    base = {k: v for k, v in os.environ.items() if k != INSIDE_ENV}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, base.get("PYTHONPATH")]))
    env = launch.process_env(
        base,
        rank=host,
        num_processes=bed.hosts,
        port=COORDINATOR_PORT,
        devices_per_process=devices_per_host,
    )
    env["JAXCOMM_COORDINATOR"] = f"{host_address(0)}:{COORDINATOR_PORT}"
    env["JAXCOMM_SOCKET_IFNAME"] = bed.interface(host)  # gloo's interface
    return env


def write_json(path: str | None, rows: list[dict]):
    """``rows`` to ``path`` as one JSON list, where a path is given."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def rerun_line(*, hosts: int, rate_bps: int, devices_per_host: int, argv: Sequence[str]) -> str:
    """The command line that runs ``argv`` alone on the same testbed (this
    file as a script), paths relative to the checkout.

    Examples:
      >>> rerun_line(hosts=2, rate_bps=10**9, devices_per_host=1,
      ...            argv=[sys.executable, f"{REPO}/bench/w.py", "--steps", "3"])
      'python bench/netbed.py --hosts 2 --rate 1gbit -- bench/w.py --steps 3'
    """
    words = list(argv[1:] if argv and argv[0] == sys.executable else argv)
    words = [os.path.relpath(w, REPO) if w.startswith(REPO + os.sep) else w for w in words]
    devices = f" --devices-per-host {devices_per_host}" if devices_per_host != 1 else ""
    return (
        f"python bench/netbed.py --hosts {hosts} --rate {format_rate(rate_bps)}{devices} -- "
        + shlex.join(words)
    )


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a run on the testbed is laid out as.

    Attributes:
      hosts: processes, one per network namespace.
      rates: link rates in bits per second, run one after another.
      devices_per_host: CPU devices of each process.
      timeout_s: seconds for the whole run; past it every host is stopped (124).
      json_path: where the rows go after each command, or None.
    """

    hosts: int
    rates: tuple[int, ...]
    devices_per_host: int = 1
    timeout_s: float = 3600.0
    json_path: str | None = None

    @classmethod
    def of(cls, args) -> Layout:
        """From a bench's parsed arguments: ``hosts``, ``rates``,
        ``devices_per_host``, ``timeout`` and ``json``, as every bench on the
        testbed names them."""
        return cls(args.hosts, tuple(args.rates), args.devices_per_host, args.timeout, args.json)


def run_testbed(
    commands: Callable[[int, list[dict]], Iterable[tuple[str, Sequence[str]]]],
    layout: Layout,
    *,
    say: Callable[[str], None],
    link_s: float = 2.0,
    row_for: Callable[[dict, int], dict] | None = None,
    on_rows: Callable[[list[dict]], None] | None = None,
    on_line: Callable[[int, str], None] | None = None,
    keep_going: bool = False,
) -> int:
    """Runs commands on a testbed, inside :func:`run_isolated`'s namespaces; the exit code.

    Builds the layout's namespaces and, rate by rate, shapes the links,
    measures one TCP stream (a ``"link"`` row) and runs each of
    ``commands(rate, rows)`` on every host, one after another
    (:func:`run_hosts`). Every row so far goes to the layout's JSON path
    after each command. SIGINT/SIGTERM or a testbed that cannot be built stop
    the run (:func:`stopped`).

    Args:
      commands: ``(rate_bps, rows so far) -> (name, argv)`` pairs: the
        commands to run at that rate, ``name`` for messages.
      layout: hosts, rates, devices, time limit and JSON path (:class:`Layout`).
      say: progress messages (stderr).
      link_s: seconds of the link measurement.
      row_for: ``(row, rate_bps) -> row`` as stored; default the row with
        ``rate_bps`` first.
      on_rows: called with one command's stored rows, after it ran.
      on_line: a host's output lines (:func:`run_hosts`).
      keep_going: after a failing command, run the rest (the code is the
        last failure's); else stop. A timeout always stops.

    Example (as a bench's ``run_inside`` calls it)::

      run_testbed(
          lambda rate, rows: [("dense", [sys.executable, "bench/quality_worker.py", ...])],
          Layout(hosts=2, rates=(10**9,), json_path="rows.json"),
          say=say,
      )
    """
    if row_for is None:

        def row_for(row, rate_bps):
            return {"rate_bps": rate_bps, **row}

    install_interrupt_handlers()
    deadline = time.monotonic() + layout.timeout_s
    rows: list[dict] = []
    code = 0
    hosts, devices_per_host = layout.hosts, layout.devices_per_host
    try:
        say(f"{hosts} hosts x {devices_per_host} CPU devices, tbf on both link ends")
        with Testbed(hosts, layout.rates[0]) as bed:
            for rate in layout.rates:
                bed.set_rate(rate)
                measured = measure_link(bed, seconds=link_s)
                rows.append(
                    {
                        "rate_bps": rate,
                        "hosts": hosts,
                        "config": "link",
                        "measured_bps": measured,
                        "link_fraction": measured / rate,
                    }
                )
                print(
                    f"\n== {format_rate(rate)} per host: one TCP stream measured "
                    f"{measured / 1e6:.1f} Mbit/s ({100 * measured / rate:.1f}% of the rate)",
                    flush=True,
                )
                for name, argv in commands(rate, rows):
                    started = time.monotonic()
                    say(f"{format_rate(rate)} {name}: starting")
                    alone = rerun_line(
                        hosts=hosts, rate_bps=rate, devices_per_host=devices_per_host, argv=argv
                    )
                    say(f"alone: {alone}")
                    result = run_hosts(
                        bed,
                        argv,
                        lambda host: worker_env(bed, host, devices_per_host=devices_per_host),
                        deadline=deadline,
                        on_line=on_line,
                    )
                    done = [row_for(r, rate) for r in result.rows]
                    rows.extend(done)
                    write_json(layout.json_path, rows)
                    if on_rows is not None:
                        on_rows(done)
                    say(
                        f"{format_rate(rate)} {name}: "
                        f"{'done' if not result.code else result.failed} "
                        f"in {time.monotonic() - started:.0f} s"
                    )
                    if result.code == 124 or (result.code and not keep_going):
                        return result.code
                    code = result.code or code
    except (Interrupted, NetbedError) as stop:
        code = stopped(stop, say)
    write_json(layout.json_path, rows)
    return code


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The options before ``--`` and, as ``command``, the host's command after it."""
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        description="Runs one command on every host of a shaped testbed (bench/netbed.py).",
        usage="python bench/netbed.py [options] -- script.py [its arguments]",
    )
    parser.add_argument("--hosts", type=int, default=2, help="processes, one per namespace (2)")
    parser.add_argument("--rate", default="1gbit", help="link rate(s), comma-separated (1gbit)")
    parser.add_argument("--devices-per-host", type=int, default=1, help="CPU devices (1)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds (3600)")
    args = parser.parse_args(argv[:split])
    args.command = argv[split + 1 :]
    if not args.command:
        parser.error("no command: put the host's command after --")
    if args.hosts < 2:
        parser.error(f"--hosts {args.hosts}: need at least 2")
    try:
        args.rates = [parse_rate(r) for r in args.rate.split(",") if r.strip()]
    except ValueError as e:
        parser.error(str(e))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/netbed.py --hosts H --rate R -- script.py ...``: each
    row the command prints on host 0 (``@row {json}``), as a JSON line."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)

    def say(message: str):
        print(f"netbed: {message}", file=sys.stderr, flush=True)

    if os.environ.get(INSIDE_ENV) != "1":
        return rerun_isolated(__file__, argv, timeout_s=args.timeout + 60, say=say)
    command = list(args.command)
    if command[0].endswith(".py"):
        command = [sys.executable, os.path.abspath(command[0]), *command[1:]]

    def show(rows: list[dict]):
        for row in rows:
            print(json.dumps(row), flush=True)

    name = os.path.basename(command[1] if command[0] == sys.executable else command[0])
    return run_testbed(lambda rate, rows: [(name, command)], Layout.of(args), say=say, on_rows=show)


if __name__ == "__main__":
    sys.path[:0] = [REPO]  # jaxcomm of this checkout, as the benches run it
    sys.exit(main())
