"""The gateway's listening socket, made before anything serves on it, so that a busy port is one clear
line (naming `server.port=`) both from `jaxstream up`, before it starts anything, and from the gateway
run alone, instead of a bind failure deep inside the HTTP server."""

from __future__ import annotations

import errno
import socket

from jaxstream.config import ConfigError


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port, made as uvicorn makes its own (SO_REUSEADDR: a port left in
    TIME_WAIT is free). ConfigError when the port is taken or the host is not this machine's."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        sock = socket.create_server((host, port), family=family, backlog=2048)
        # Accepted connections inherit it. Without it a response written in two sends (headers, then
        # body) waited for the client's delayed ACK of the first: ~40 ms on every request of a kept-alive
        # connection (the openai client keeps them), /health included.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"server.port: {host}:{port} is already in use (another server?); stop it, "
                              f"or choose another port with server.port={port + 1}") from None
        raise ConfigError(f"server.host: cannot listen on {host}:{port} ({exc.strerror or exc})") from None
