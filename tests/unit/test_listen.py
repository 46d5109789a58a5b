"""jaxstream/listen.py: the gateway's socket. Its accepted connections send at once (TCP_NODELAY):
with Nagle's algorithm, a response written in two sends waited for the client's delayed ACK, ~40 ms
on every request of a kept-alive connection (measured: /health 44 ms -> 0.5 ms)."""

import socket

import pytest

from jaxstream.config import ConfigError
from jaxstream.listen import listen


def test_accepted_connections_send_without_delay():
    server = listen("127.0.0.1", 0)
    with server, socket.create_connection(server.getsockname()) as client:
        accepted, _ = server.accept()
        with accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_a_taken_port_names_the_config_key():
    with listen("127.0.0.1", 0) as taken:
        with pytest.raises(ConfigError, match="server.port"):
            listen("127.0.0.1", taken.getsockname()[1])
