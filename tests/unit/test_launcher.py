"""stack/launcher.py: how `jaxstream up` reads /health while the stack starts."""

import socket
import threading

from jaxstream.config import load_config
from stack.launcher import Stack


def test_something_that_does_not_speak_http_on_the_port_is_no_health_answer():
    # Seen in CI: the embedded Redis had been given the gateway's port, and `jaxstream up` died of
    # http.client.BadStatusLine on Redis's "-ERR ..." instead of waiting.
    with socket.create_server(("127.0.0.1", 0)) as server:
        def answer() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(b"-ERR wrong number of arguments for 'get' command\r\n")

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        stack = Stack(load_config(["worker=fake", f"server.port={server.getsockname()[1]}"]), [])
        assert stack.missing() is None
        thread.join(5)
