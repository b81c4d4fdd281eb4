"""The exchange between replica groups: a deadline-bound ring allreduce over plain TCP.

Replica groups are independent processes (each its own JAX runtime) that meet only here, over a
slow network. One call sums a 1-D float32 vector over the members a coordinator named for the
round: a ring reduce-scatter, then a ring all-gather, one TCP connection per hop and round. It
must never hang: every socket operation is bounded by the caller's deadline, and any failure
closes the round's sockets so the neighbours fail fast too. Connections from another job or an
older epoch are refused. The result is bitwise identical on every member, because replicas
compare hashes of their parameters.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

import ml_dtypes
import numpy as np

__all__ = ["Endpoint", "ExchangeAborted", "Member"]

MAGIC = b"JXFT"
VERSION = 1
# magic, version, len(job_id), epoch, round, sender id, receiver id; then the job id itself.
_HEADER = struct.Struct("!4sHHqqqq")
_LEN = struct.Struct("!Q")
_WIRES = {None: None, "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}
_HANDSHAKE_S = 5.0  # a peer sends its header at once; a stranger may not
_POLL_S = 0.25  # cap on one blocking step that abort() or close() cannot interrupt
_MAX_HELD = 256


class ExchangeAborted(RuntimeError):
    """This member's exchange did not finish: a peer died or closed, the deadline passed, a peer
    refused us, or abort() was called. The message names the peer (replica id, address) and the
    cause."""


class Member(NamedTuple):
    """One member of a round: its replica id (unique within the job) and where it listens."""

    replica_id: int
    host: str
    port: int


def _pack_header(job: bytes, key: tuple[int, int], sender: int, receiver: int) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, len(job), *key, sender, receiver) + job


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def _peer_closed(watch: socket.socket, timeout: float = 0.0, sock: socket.socket | None = None):
    """Whether the peer closed ``watch``, waiting up to ``timeout`` or until ``sock`` is readable.

    Nothing arrives on a connection to the right neighbour after its ack, so readable means closed.
    """
    poll = select.poll()
    poll.register(watch, select.POLLIN)
    if sock is not None:
        poll.register(sock, select.POLLIN)
    return any(fd == watch.fileno() for fd, _ in poll.poll(int(timeout * 1000) + 1))


def _recv_exact(sock, view: memoryview, deadline: float, watch: socket.socket | None = None):
    got = 0
    while got < len(view):
        if watch is not None and _peer_closed(watch, _remaining(deadline), sock):
            raise ConnectionError("the right neighbour closed its connection")
        sock.settimeout(_remaining(deadline))
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("connection closed by the peer")
        got += n


def _round_trip(a: np.ndarray, wire: np.dtype | None) -> np.ndarray:
    return a.copy() if wire is None else a.astype(wire).astype(np.float32)


class Endpoint:
    """One replica group's end of the exchange: a listening socket and the rounds run on it.

    Args:
      job_id: names the job; connections that carry another job id are refused.
      replica_id: this replica group's id, unique within the job.
      host, port: where to listen; loopback and a free port unless asked otherwise.
    """

    def __init__(self, job_id: str, replica_id: int, *, host: str = "127.0.0.1", port: int = 0):
        self.job_id = job_id
        self._job = job_id.encode()
        if not self._job or len(self._job) > 0xFFFF:
            raise ValueError(f"job_id must be a non-empty string, got {job_id!r}")
        self.replica_id = int(replica_id)
        self.bytes_sent = 0
        self._cond = threading.Condition()
        self._refused: list[str] = []
        self._held: dict[tuple[int, int, int], socket.socket] = {}
        self._key: tuple[int, int] | None = None  # the last round started
        self._running = False
        self._aborted = False
        self._closed = False
        self._socks: list[socket.socket] = []  # this round's, for abort()
        self._busy = threading.Lock()
        self._buf = bytearray(0)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=64)
        self._listener.settimeout(_POLL_S)
        self._host = host
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True)
        self._acceptor.start()

    @property
    def address(self) -> tuple[str, int]:
        return self._host, self._listener.getsockname()[1]

    @property
    def refused(self) -> list[str]:
        with self._cond:
            return list(self._refused)

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def allreduce_sum(
        self,
        x: np.ndarray,
        *,
        epoch: int,
        round: int,
        members: Sequence[Member],
        deadline: float,
        wire_dtype: str | None = None,
    ) -> np.ndarray:
        """Sums ``x`` over ``members``; the result is bitwise the same on every member.

        Args:
          x: a 1-D float32 array.
          epoch, round: from the coordinator; each call must be newer than the last one here.
          members: every member of the round, this endpoint included once, in any order.
          deadline: absolute ``time.monotonic()`` after which the call gives up.
          wire_dtype: None, "bfloat16" or "float16": what travels on every hop.

        Returns:
          The float32 sum, a new array.

        Raises:
          ExchangeAborted: the exchange did not finish (the message says why and with whom).
        """
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 1:
            got = f"{x.dtype} array of shape {x.shape}" if isinstance(x, np.ndarray) else type(x)
            raise ValueError(f"x must be a 1-D float32 numpy array, got {got}")
        if wire_dtype not in _WIRES:
            raise ValueError(
                f"wire_dtype must be None, 'bfloat16' or 'float16', got {wire_dtype!r}"
            )
        ring = sorted((Member(*m) for m in members), key=lambda m: m.replica_id)
        ids = [m.replica_id for m in ring]
        if len(set(ids)) != len(ids) or self.replica_id not in ids:
            raise ValueError(f"members must hold distinct ids, {self.replica_id} among them: {ids}")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("another allreduce_sum is running on this Endpoint")
        key = (int(epoch), int(round))
        deadline = min(float(deadline), time.monotonic() + 1e6)  # socket timeouts overflow past it
        try:
            self._start(key)
            try:
                if len(ring) == 1:
                    return _round_trip(x, _WIRES[wire_dtype])
                return self._ring(x, key, ring, ids.index(self.replica_id), deadline, wire_dtype)
            finally:
                self._finish(key)
        finally:
            self._busy.release()

    def abort(self) -> None:
        """Makes the running allreduce_sum raise ExchangeAborted soon. Thread-safe."""
        with self._cond:
            if self._running:
                self._aborted = True
                self._shutdown_round()
                self._cond.notify_all()

    def close(self) -> None:
        """Aborts a running round, stops listening and drops held connections. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            held, self._held = list(self._held.values()), {}
        self.abort()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() at once on Linux
        self._acceptor.join()
        self._listener.close()
        for conn in held:
            conn.close()

    # Rounds.

    def _start(self, key: tuple[int, int]) -> None:
        with self._cond:
            if self._closed:
                raise ExchangeAborted(f"replica {self.replica_id}: the endpoint is closed")
            if self._key is not None and key <= self._key:
                why = "was aborted" if key == self._key and self._aborted else "ran"
                raise ExchangeAborted(
                    f"replica {self.replica_id}: epoch/round {key} is not newer than {self._key}, "
                    f"the last one that {why} here; a round cannot run twice"
                )
            self._key, self._running, self._aborted, self._socks = key, True, False, []
            self._drop_held(key, inclusive=False)

    def _finish(self, key: tuple[int, int]) -> None:
        with self._cond:
            self._running = False
            for sock in self._socks:
                sock.close()
            self._socks = []
            self._drop_held(key, inclusive=True)

    def _drop_held(self, key: tuple[int, int], *, inclusive: bool) -> None:
        # Held connections of rounds that will not run here any more: closing them makes the
        # peers that are waiting on them fail now rather than at their deadline.
        for k in [k for k in self._held if k[:2] < key or (inclusive and k[:2] == key)]:
            self._held.pop(k).close()

    def _shutdown_round(self) -> None:
        with self._cond:
            for sock in self._socks:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _error(self, peer: Member, key: tuple[int, int], doing: str, exc: BaseException | str):
        if self._aborted:
            cause = f"aborted while {doing}"
        elif isinstance(exc, TimeoutError):
            cause = f"deadline passed while {doing}"
        else:
            cause = f"{doing} failed: {exc}"
        return ExchangeAborted(
            f"replica {self.replica_id} (job {self.job_id!r}, epoch {key[0]}, round {key[1]}): "
            f"{cause} [peer replica {peer.replica_id} at {peer.host}:{peer.port}]"
        )

    def _ring(self, x, key, ring, me, deadline, wire_dtype) -> np.ndarray:
        n, wire = len(ring), _WIRES[wire_dtype]
        right, left = ring[(me + 1) % n], ring[(me - 1) % n]
        base, extra = divmod(x.size, n)
        starts = [c * base + min(c, extra) for c in range(n + 1)]
        itemsize = 4 if wire is None else wire.itemsize
        if len(self._buf) < (base + 1) * itemsize:
            self._buf = bytearray((base + 1) * itemsize)
        acc = x.copy()
        try:
            out = self._connect(right, key, deadline)
            inc = self._take(left, key, deadline, out, right)
            for phase in ("reduce-scatter", "all-gather"):
                for s in range(n - 1):
                    # Reduce-scatter leaves member me with chunk me + 1; the all-gather passes
                    # each owner's chunk around the ring.
                    send = (me - s) % n if phase == "reduce-scatter" else (me + 1 - s) % n
                    recv = (send - 1) % n
                    lo, hi = starts[recv], starts[recv + 1]
                    a = acc[starts[send] : starts[send + 1]]
                    payload = memoryview((a if wire is None else a.astype(wire)).view(np.uint8))
                    doing = f"{phase} step {s}"
                    # Until its last message the right neighbour cannot be done: it closing
                    # the connection means it failed.
                    watch = None if phase == "all-gather" and s == n - 2 else out
                    nbytes = (hi - lo) * itemsize
                    self._step(
                        out, inc, payload, nbytes, deadline, key, doing, watch, (right, left)
                    )
                    got = np.frombuffer(self._buf, wire or np.float32, hi - lo).astype(np.float32)
                    if phase == "reduce-scatter":
                        acc[lo:hi] += got
                    else:
                        acc[lo:hi] = got
                if phase == "reduce-scatter" and wire is not None:
                    # The owner keeps exactly what it sends, so that every member ends alike.
                    own = slice(starts[(me + 1) % n], starts[(me + 1) % n + 1])
                    acc[own] = _round_trip(acc[own], wire)
            return acc
        except ExchangeAborted:
            self._shutdown_round()
            raise
        except OSError as e:
            self._shutdown_round()
            raise self._error(left, key, "waiting for the left neighbour", e) from e

    def _connect(self, peer: Member, key: tuple[int, int], deadline: float) -> socket.socket:
        delay = 0.02
        while True:
            if self._aborted:
                raise self._error(peer, key, "connecting", "aborted")
            try:
                timeout = min(_remaining(deadline), _POLL_S)
            except TimeoutError as e:
                raise self._error(peer, key, "connecting", e) from e
            try:
                sock = socket.create_connection((peer.host, peer.port), timeout=timeout)
                break
            except (ConnectionRefusedError, TimeoutError):
                # The peer may not listen yet: retry until the deadline.
                time.sleep(min(delay, max(deadline - time.monotonic(), 0)))
                delay = min(2 * delay, 0.2)
            except OSError as e:
                raise self._error(peer, key, "connecting", e) from e
        with self._cond:
            self._socks.append(sock)
            if self._aborted:
                raise self._error(peer, key, "connecting", "aborted")
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(_remaining(deadline))
            header = _pack_header(self._job, key, self.replica_id, peer.replica_id)
            sock.sendall(header)
            self.bytes_sent += len(header)
            sock.settimeout(_remaining(deadline))
            reply = sock.recv(4097)  # b"A", or b"R" and why, and the peer closes
            if reply == b"A":
                return sock
            why = reply[1:].decode(errors="replace") if reply[:1] == b"R" else f"reply {reply!r}"
            cause = f"refused by the peer: {why}"
        except OSError as e:
            raise self._error(peer, key, "sending the header", e) from e
        raise self._error(peer, key, "handshake", cause)

    def _take(self, peer: Member, key, deadline: float, out, right: Member) -> socket.socket:
        with self._cond:
            while True:
                if self._aborted:
                    raise self._error(peer, key, "waiting for its connection", "aborted")
                conn = self._held.pop((*key, peer.replica_id), None)
                if conn is not None:
                    self._socks.append(conn)
                    return conn
                if _peer_closed(out):
                    raise self._error(right, key, "waiting", "it closed its connection")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._error(peer, key, "waiting for its connection", TimeoutError())
                self._cond.wait(min(left, 0.05))

    def _step(self, out, inc, payload, nbytes, deadline, key, doing, watch, peers) -> None:
        # Send and receive at once: big chunks would deadlock on full socket buffers otherwise.
        right, left = peers
        errors: list[BaseException] = []

        def send() -> None:
            try:
                out.settimeout(_remaining(deadline))
                out.sendall(_LEN.pack(len(payload)))
                out.sendall(payload)
                self.bytes_sent += _LEN.size + len(payload)
            except OSError as e:
                errors.append(e)
                self._shutdown_round()  # so that the receive below fails now

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        try:
            self._recv_msg(inc, nbytes, deadline, watch)
        except OSError as e:
            closed = "right neighbour" in str(e)
            failed, peer = (errors[0], right) if errors else (e, right if closed else left)
            self._shutdown_round()
            sender.join(1.0)
            raise self._error(peer, key, doing, failed) from failed
        sender.join(max(deadline - time.monotonic(), 0) + 0.5)
        if sender.is_alive() or errors:
            self._shutdown_round()
            sender.join(1.0)
            raise self._error(right, key, doing, errors[0] if errors else TimeoutError())

    def _recv_msg(self, inc, nbytes: int, deadline: float, watch) -> None:
        head = bytearray(_LEN.size)
        _recv_exact(inc, memoryview(head), deadline, watch)
        (length,) = _LEN.unpack(head)
        if length != nbytes:
            raise ConnectionError(f"protocol error: a message of {length} bytes, not {nbytes}")
        _recv_exact(inc, memoryview(self._buf)[:nbytes], deadline, watch)

    # Listening.

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if not self._closed:
                    time.sleep(_POLL_S)  # e.g. out of file descriptors
                continue
            threading.Thread(target=self._handshake, args=(conn, addr), daemon=True).start()

    def _handshake(self, conn: socket.socket, addr: tuple) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = time.monotonic() + _HANDSHAKE_S
            head = bytearray(_HEADER.size)
            _recv_exact(conn, memoryview(head), deadline)
            magic, version, jlen, epoch, rnd, sender, receiver = _HEADER.unpack(head)
            if magic != MAGIC:
                reason = f"bad magic {bytes(magic)!r}"
            elif version != VERSION:
                reason = f"protocol version {version}, not {VERSION}"
            else:
                job = bytearray(jlen)
                _recv_exact(conn, memoryview(job), deadline)
                reason = self._admit(conn, bytes(job), (epoch, rnd), sender, receiver)
        except OSError as e:
            reason = f"bad header: {e}"
        if reason is None:
            return
        with self._cond:
            self._refused.append(f"{addr[0]}:{addr[1]}: {reason}")
        with contextlib.suppress(OSError):
            conn.sendall(b"R" + reason.encode()[:4096])
        conn.close()

    def _admit(self, conn, job: bytes, key: tuple[int, int], sender: int, receiver: int):
        """Holds a connection for its round, or returns why it is refused."""
        with self._cond:
            if job != self._job:
                return f"job id {job!r}, not {self._job!r} (replica {sender}, epoch {key[0]})"
            if receiver != self.replica_id:
                return f"addressed to replica {receiver}, this is {self.replica_id}"
            if self._closed:
                return "endpoint closed"
            cur = self._key
            if cur is not None and key[0] < cur[0]:
                return f"old epoch {key[0]} from replica {sender}, this endpoint is at {cur[0]}"
            if cur is not None and (key < cur or (key == cur and not self._running)):
                return f"stale epoch/round {key} from replica {sender}, this endpoint is at {cur}"
            if (*key, sender) in self._held or len(self._held) >= _MAX_HELD:
                return f"duplicate or too many held connections (replica {sender}, {key})"
            conn.sendall(b"A")
            self._held[(*key, sender)] = conn
            self._cond.notify_all()
        return None
