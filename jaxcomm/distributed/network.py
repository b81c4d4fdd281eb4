"""Where a job's sockets listen: gloo's network interface, and the coordinator's address.

Across processes on CPU, JAX's collectives run over gloo (TCP). Left alone,
gloo listens on the address this host's name resolves to, which on a host
with several networks may be the wrong one (or, with a name that resolves to
127.0.0.1, no network at all). :func:`resolve_interface` reads the interface
(``eth1``) or address to use instead, as PyTorch's ``GLOO_SOCKET_IFNAME``
does, and :func:`use_gloo_endpoint` hands it to JAX's CPU backend.

Process 0 also runs JAX's coordination service: a key-value store and
heartbeat server without authentication, which JAX binds on every interface
by default. :func:`resolve_bind_address` binds it where the other processes
reach it and no wider.

jaxcomm's own CPU collectives across processes (``backend="ffi"``) listen
where gloo does: :func:`collective_address`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
from collections.abc import Mapping

from jaxcomm import _jax_compat

__all__ = [
    "ENV_COORDINATOR_BIND_ADDRESS",
    "ENV_SOCKET_IFNAME",
    "GlooEndpoint",
    "collective_address",
    "resolve_bind_address",
    "resolve_interface",
    "use_gloo_endpoint",
]

ENV_SOCKET_IFNAME = "JAXCOMM_SOCKET_IFNAME"
ENV_COORDINATOR_BIND_ADDRESS = "JAXCOMM_COORDINATOR_BIND_ADDRESS"
JAX_ENV_COORDINATOR_BIND_ADDRESS = "JAX_COORDINATOR_BIND_ADDRESS"


@dataclasses.dataclass(frozen=True)
class GlooEndpoint:
    """Where gloo listens: a network interface by name, or an IP address of this host.

    Attributes:
      interface: an interface name (``"eth1"``); gloo uses its address.
      address: an IP address of this host (``"10.0.0.2"``).
    """

    interface: str | None = None
    address: str | None = None


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.removeprefix("[").removesuffix("]"))
    except ValueError:
        return None


def _is_local(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether this host holds ``address``: a socket can bind to it only then."""
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((str(address), 0))
        except OSError:
            return False
    return True


def resolve_interface(
    interface: str | None = None, *, environ: Mapping[str, str] | None = None
) -> GlooEndpoint | None:
    """The network interface or address gloo should listen on, checked; starts nothing.

    Args:
      interface: an interface name or an IP address of this host; when
        ``None``, ``JAXCOMM_SOCKET_IFNAME`` is read (the argument wins).
      environ: the environment to read; ``os.environ`` by default.

    Returns:
      A :class:`GlooEndpoint`, or ``None`` when neither is set (gloo then
      listens where this host's name resolves).

    Raises:
      ValueError: no interface of that name on this host, and not an address
        of it either; the message names the argument or variable.

    Examples:
      >>> resolve_interface("lo")
      GlooEndpoint(interface='lo', address=None)
      >>> resolve_interface(environ={"JAXCOMM_SOCKET_IFNAME": "127.0.0.1"})
      GlooEndpoint(interface=None, address='127.0.0.1')
      >>> resolve_interface(environ={}) is None
      True
    """
    env = os.environ if environ is None else environ
    source = "interface"
    if interface is None:
        source, interface = ENV_SOCKET_IFNAME, env.get(ENV_SOCKET_IFNAME) or None
        if interface is None:
            return None
    if not isinstance(interface, str) or not interface.strip():
        raise ValueError(
            f"{source}={interface!r} must name a network interface (e.g. 'eth0') or an "
            "IP address of this host"
        )
    names = [name for _, name in socket.if_nameindex()]
    if interface in names:
        return GlooEndpoint(interface=interface)
    address = _ip(interface)
    if address is None:
        raise ValueError(
            f"{source}={interface!r}: this host has no network interface of that name "
            f"(it has {', '.join(names)}), and it is not an IP address"
        )
    if not _is_local(address):
        raise ValueError(
            f"{source}={interface!r} is not an address of this host; give one of its "
            f"addresses or interfaces ({', '.join(names)})"
        )
    return GlooEndpoint(address=str(address))


def _host_port(host: str, port: str) -> str:
    ip = _ip(host)
    return f"[{ip}]:{port}" if ip is not None and ip.version == 6 else f"{host}:{port}"


def _explicit_bind_address(value: str, source: str, port: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{source}={value!r} must be an address or host, with or without :port")
    if _ip(value) is not None:  # a bare address, IPv6 ones included
        return _host_port(value.removeprefix("[").removesuffix("]"), port)
    if re.fullmatch(r".+:\d+", value):
        return value
    return _host_port(value, port)


def _own_address(host: str) -> str | None:
    """``host`` when it names this host on a network the others can reach;
    ``None`` when that cannot be told here (an address this host does not
    hold, behind NAT; a name this host resolves to loopback, as Debian's
    ``/etc/hosts`` does with its own name, while the other hosts resolve it
    to a network address)."""
    address = _ip(host)
    if address is not None:
        return str(address) if _is_local(address) else None
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return None
    addresses = [ipaddress.ip_address(a.partition("%")[0]) for a in found]
    if addresses and all(_is_local(a) and not a.is_loopback for a in addresses):
        return host  # gRPC binds every address the name resolves to
    return None


def resolve_bind_address(
    coordinator_address: str,
    bind_address: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> str:
    """Where process 0's coordination service listens (``host:port``); starts nothing.

    In this order:

    1. ``bind_address``, else ``JAXCOMM_COORDINATOR_BIND_ADDRESS``, else JAX's
       own ``JAX_COORDINATOR_BIND_ADDRESS``; a host without a port gets the
       coordinator's port. ``0.0.0.0`` or ``[::]`` listens everywhere.
    2. A loopback coordinator (``localhost``, ``127.x.y.z``, ``::1``, as
       ``python -m jaxcomm.launch`` gives): that address; the other processes
       are on this host.
    3. A coordinator address that this host holds (an IP address, or a name
       whose addresses are all this host's and none loopback): that address.
    4. Otherwise ``[::]`` (every interface, JAX's default): the coordinator
       address cannot be told to be this host's from here (behind NAT, or a
       host name that this host resolves to loopback and the others do not).
       Pass ``bind_address`` then to narrow it.

    Args:
      coordinator_address: ``host:port`` that the processes connect to.
      bind_address: an address or host, with or without ``:port``.
      environ: the environment to read; ``os.environ`` by default.

    Returns:
      ``host:port`` (IPv6 addresses in brackets).

    Examples:
      >>> resolve_bind_address("127.0.0.1:1234", environ={})
      '127.0.0.1:1234'
      >>> resolve_bind_address("head:1234", "10.0.0.1", environ={})
      '10.0.0.1:1234'
      >>> resolve_bind_address("[::1]:99", environ={})
      '[::1]:99'
      >>> resolve_bind_address("192.0.2.250:99", environ={})  # not this host's: everywhere
      '[::]:99'
    """
    env = os.environ if environ is None else environ
    host, _, port = coordinator_address.rpartition(":")
    for source, value in (
        ("coordinator_bind_address", bind_address),
        (ENV_COORDINATOR_BIND_ADDRESS, env.get(ENV_COORDINATOR_BIND_ADDRESS) or None),
        (JAX_ENV_COORDINATOR_BIND_ADDRESS, env.get(JAX_ENV_COORDINATOR_BIND_ADDRESS) or None),
    ):
        if value is not None:
            return _explicit_bind_address(value, source, port)
    host = host.removeprefix("[").removesuffix("]")
    address = _ip(host)
    if host == "localhost" or (address is not None and address.is_loopback):
        return _host_port(host, port)
    own = _own_address(host)
    return _host_port(own, port) if own is not None else f"[::]:{port}"


# The endpoint use_gloo_endpoint handed to JAX, for collective_address.
_gloo_endpoint: GlooEndpoint | None = None


def _interface_address(interface: str) -> str:
    """The IPv4 address of a network interface (Linux)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(
                sock.fileno(), siocgifaddr, struct.pack("256s", interface[:15].encode())
            )
        except OSError as error:
            raise ValueError(f"network interface {interface!r} has no IPv4 address") from error
    return socket.inet_ntoa(packed[20:24])


def collective_address(
    coordinator_address: str | None, *, environ: Mapping[str, str] | None = None
) -> str:
    """The IP address this process's ``ffi`` collectives listen on: where gloo listens.

    In this order: the interface or address given to
    :func:`jaxcomm.distributed.initialize` (else ``JAXCOMM_SOCKET_IFNAME``);
    a loopback coordinator's address (``python -m jaxcomm.launch``); else
    the address this host's name resolves to, as gloo uses by default.
    Never the wildcard address: only the job's own network is listened on.

    Examples:
      >>> collective_address("127.0.0.1:1234", environ={})
      '127.0.0.1'
      >>> collective_address("head:1234", environ={"JAXCOMM_SOCKET_IFNAME": "127.0.0.1"})
      '127.0.0.1'
    """
    endpoint = _gloo_endpoint or resolve_interface(environ=environ)
    if endpoint is not None:
        return endpoint.address or _interface_address(endpoint.interface)
    host = (coordinator_address or "").rpartition(":")[0].removeprefix("[").removesuffix("]")
    address = _ip(host)
    if host == "localhost":
        return "127.0.0.1"
    if address is not None and address.is_loopback:
        return str(address)
    return socket.gethostbyname(socket.gethostname())


def use_gloo_endpoint(endpoint: GlooEndpoint) -> None:
    """Makes JAX's CPU backend create its gloo collectives on ``endpoint``.

    Call it after ``jax.distributed.initialize`` and before anything starts a
    backend. jax 0.10.2 creates gloo in ``xla_bridge.make_cpu_client`` with
    neither host name nor interface and has no option for them, while
    jaxlib's ``make_gloo_tcp_collectives`` takes both and ``make_cpu_client``
    takes the collectives to use. So the CPU backend's factory is replaced by
    one that passes them (private JAX: ``jaxcomm._jax_compat``).
    """
    _jax_compat.register_gloo_cpu_backend(endpoint.address, endpoint.interface)
    global _gloo_endpoint
    _gloo_endpoint = endpoint
