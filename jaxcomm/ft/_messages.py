"""Small JSON requests over TCP, with a deadline on every socket operation.

The lighthouse and the replicas' state servers speak one JSON object per line:
a client connects, sends one request line, reads one reply line (and, for a
state transfer, the raw bytes that the reply announces), and closes. A
connection per request keeps a restarted peer or lighthouse from leaving a
half-open conversation behind.
"""

from __future__ import annotations

import json
import select
import socket
import time

MAX_LINE = 1 << 20
ALIVE_POLL_S = 0.5  # how often a request waiting for its reply asks ``alive()``


class Unreachable(ConnectionError):
    """A request got no reply: refused, closed, or past its deadline."""


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` as ``(host, port)``; ValueError naming the text otherwise."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    return host, int(port)


def send_line(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")


def recv_line(sock: socket.socket, reader=None) -> dict:
    """One JSON line from ``sock`` (through ``reader``, a buffered file, if given)."""
    reader = reader or sock.makefile("rb")
    line = reader.readline(MAX_LINE)
    if not line.endswith(b"\n"):
        raise ConnectionError("connection closed before a full line")
    return json.loads(line)


def recv_exact(reader, nbytes: int) -> bytearray:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        n = reader.readinto(view[got:])
        if not n:
            raise ConnectionError(f"connection closed after {got} of {nbytes} bytes")
        got += n
    return buf


def request(address: tuple[str, int], message: dict, *, timeout: float, payload=None, alive=None):
    """Sends ``message``, returns the reply (a dict), or ``(reply, bytes)`` with ``payload``.

    Args:
      address: ``(host, port)`` of the server.
      message: a JSON-able dict.
      timeout: seconds for the whole exchange, connect included.
      payload: if True, read the ``nbytes`` the reply announces after it.
      alive: optional, ``alive() -> bool``, asked every ``ALIVE_POLL_S`` while no
        reply has come: False gives up on the server before ``timeout``.

    Raises:
      Unreachable: no reply within ``timeout``, the server given up on, or the
        connection failed.
    """
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection(address, timeout=max(timeout, 1e-3)) as sock:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            send_line(sock, message)
            # A frozen server (SIGSTOP) accepts connections and never answers.
            while alive is not None:
                wait = min(ALIVE_POLL_S, deadline - time.monotonic())
                if wait <= 0:
                    raise TimeoutError("no reply before the deadline")
                if select.select([sock], [], [], wait)[0]:
                    break
                if not alive():
                    raise ConnectionError("no reply, and the server stopped sending heartbeats")
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            reader = sock.makefile("rb")
            reply = recv_line(sock, reader)
            if not payload:
                return reply
            data = recv_exact(reader, int(reply.get("nbytes", 0))) if "error" not in reply else b""
            return reply, data
    except (OSError, ValueError) as e:  # ValueError: a garbled line
        raise Unreachable(f"{address[0]}:{address[1]}: {type(e).__name__}: {e}") from e
