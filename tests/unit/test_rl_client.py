"""jaxstream/rl.py, the trainer's client, against a stand-in server (http.server in a thread) that
records each request and decodes pushed bodies with jaxstream.safetensors.decode."""

import json
import socket
import threading
from dataclasses import dataclass
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit

import ml_dtypes
import numpy as np
import pytest

from jaxstream import rl
from jaxstream.rl import WeightPushError
from jaxstream.safetensors import decode

OK = {"success": True, "message": "Succeeded to update parameter online."}


@dataclass
class Seen:
    method: str
    route: str
    query: dict[str, str]
    headers: Message
    body: bytes

    def tensors(self) -> list[tuple[str, np.ndarray]]:
        return decode(self.body)

    def json(self) -> dict:
        return json.loads(self.body)


class FakeServer(ThreadingHTTPServer):
    """Answers every route with `replies[route]` (status, JSON or bytes), else 200 and OK."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_port}"
        self.seen: list[Seen] = []
        self.replies: dict[str, tuple[int, object]] = {}


class Handler(BaseHTTPRequestHandler):
    server: FakeServer

    def do_GET(self) -> None:
        self.answer()

    def do_POST(self) -> None:
        self.answer()

    def answer(self) -> None:
        url = urlsplit(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.seen.append(Seen(self.command, url.path, dict(parse_qsl(url.query)), self.headers, body))
        status, reply = self.server.replies.get(url.path, (200, OK))
        data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # quiet
        pass


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("no_proxy", "*")  # a proxy in the environment must not take 127.0.0.1
    fake = FakeServer()
    # A short poll: shutdown() waits for the serving loop's next look, 0.5 s by default.
    thread = threading.Thread(target=fake.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    yield fake
    fake.shutdown()
    fake.server_close()


def sized(*nbytes: int) -> dict[str, np.ndarray]:
    """Tensors named t0, t1, ... of the given byte sizes."""
    return {f"t{i}": np.zeros(n, np.uint8) for i, n in enumerate(nbytes)}


# --- buckets ---


def test_buckets_fill_up_to_the_limit_in_order():
    assert rl.buckets(sized(40, 40, 40, 10), 100) == [["t0", "t1"], ["t2", "t3"]]
    assert rl.buckets(sized(50, 50, 0, 1), 100) == [["t0", "t1", "t2"], ["t3"]]  # exactly full, then over
    assert rl.buckets(sized(30, 30), 1 << 20) == [["t0", "t1"]]


def test_a_tensor_bigger_than_a_bucket_goes_alone():
    assert rl.buckets(sized(10, 500, 10), 100) == [["t0"], ["t1"], ["t2"]]
    assert rl.buckets(sized(500, 500), 100) == [["t0"], ["t1"]]


def test_buckets_need_a_positive_size():
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        rl.buckets(sized(1), 0)


# --- push_weights ---


def test_push_sends_every_tensor_once_in_order_and_flags_only_the_last_bucket(server):
    tensors = {
        "embed": np.arange(12, dtype=np.float32).reshape(3, 4),  # 48 bytes
        "norm": np.ones(8, ml_dtypes.bfloat16),  # 16 bytes
        "q": np.full((2, 5), 3, np.float16),  # 20 bytes
        "ids": np.arange(10, dtype=np.int64),  # 80 bytes: alone
    }
    reply = rl.push_weights(server.url, tensors, bucket_bytes=64, weight_version="step-7")
    assert reply == OK
    assert [(s.method, s.route) for s in server.seen] == [("POST", "/update_weights_from_tensor")] * 3
    assert [[name for name, _ in s.tensors()] for s in server.seen] == [["embed", "norm"], ["q"], ["ids"]]
    for seen in server.seen:
        assert seen.headers["Content-Type"] == "application/octet-stream"
        for name, array in seen.tensors():
            assert array.dtype == tensors[name].dtype
            np.testing.assert_array_equal(array, tensors[name])
    assert [s.query for s in server.seen] == [
        {"last_bucket": "false", "flush_cache": "true"},
        {"last_bucket": "false", "flush_cache": "true"},
        {"last_bucket": "true", "flush_cache": "true", "weight_version": "step-7"},
    ]
    assert "Authorization" not in server.seen[0].headers


def test_one_bucket_is_the_last_and_no_version_is_sent_when_none_is_given(server):
    rl.push_weights(server.url + "/", sized(4, 4), flush_cache=False, api_key="sk-admin")
    [seen] = server.seen
    assert seen.route == "/update_weights_from_tensor"  # the trailing slash of the url is not doubled
    assert seen.query == {"last_bucket": "true", "flush_cache": "false"}
    assert seen.headers["Authorization"] == "Bearer sk-admin"


def test_an_adapter_push_sends_its_config_with_every_bucket_and_the_version_with_the_last(server):
    a, b = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    tensors = {a: np.ones((2, 8), np.float32), b: np.zeros((8, 2), np.float32)}  # 64 bytes each
    rl.push_adapter(server.url, "math", tensors, rank=2, alpha=4, target_modules=["q_proj", "v_proj"], use_rslora=True,
                    weight_version="step-3", bucket_bytes=64, api_key="k")
    assert [(s.route, [n for n, _ in s.tensors()]) for s in server.seen] == [
        ("/load_lora_adapter_from_tensors", [a]), ("/load_lora_adapter_from_tensors", [b])]
    config = {"lora_name": "math", "r": "2", "lora_alpha": "4.0", "target_modules": "q_proj,v_proj", "use_rslora": "true"}
    assert [s.query for s in server.seen] == [{**config, "last_bucket": "false"},
                                              {**config, "last_bucket": "true", "weight_version": "step-3"}]
    assert server.seen[0].headers["Authorization"] == "Bearer k"


def test_a_refused_adapter_push_names_the_adapter(server):
    server.replies["/load_lora_adapter_from_tensors"] = (400, {"success": False, "message": "rank 64 is above worker.lora.max_rank 8"})
    with pytest.raises(WeightPushError, match="adapter 'math', bucket 1 of 1: .*HTTP 400: rank 64 is above"):
        rl.push_adapter(server.url, "math", sized(8), rank=64, alpha=8, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="lora_name"):
        rl.push_adapter(server.url, "", sized(8), rank=2, alpha=8, target_modules=["q_proj"])


def test_pushing_nothing_is_a_mistake(server):
    with pytest.raises(ValueError, match="no tensors"):
        rl.push_weights(server.url, {})
    assert not server.seen


def test_a_refused_bucket_stops_the_push_with_the_servers_message(server):
    message = "tensor 'q' has shape [2, 5], the model's is [5, 2]"
    server.replies["/update_weights_from_tensor"] = (400, {"error": {"message": message}})
    with pytest.raises(WeightPushError) as refused:
        rl.push_weights(server.url, sized(8, 8), bucket_bytes=8)
    assert str(refused.value) == f"bucket 1 of 2: POST /update_weights_from_tensor: HTTP 400: {message}"
    assert refused.value.status == 400
    assert len(server.seen) == 1


def test_success_false_is_an_error_too(server):
    server.replies["/update_weights_from_tensor"] = (200, {"success": False, "message": "paused? no: busy"})
    with pytest.raises(WeightPushError, match="bucket 1 of 1: POST /update_weights_from_tensor: paused\\? no: busy"):
        rl.push_weights(server.url, sized(8))


def test_a_reply_that_is_not_json_is_quoted(server):
    server.replies["/update_weights_from_tensor"] = (500, b"Internal Server Error")
    with pytest.raises(WeightPushError, match="HTTP 500: Internal Server Error"):
        rl.push_weights(server.url, sized(8))
    server.replies["/update_weights_from_tensor"] = (200, b"<html>a proxy</html>")
    with pytest.raises(WeightPushError, match="the reply is not a JSON object: <html>a proxy</html>"):
        rl.push_weights(server.url, sized(8))


def test_an_unreachable_server_is_named():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(WeightPushError, match=f"POST /update_weights_from_tensor: cannot reach {url}"):
        rl.push_weights(url, sized(8), timeout=5)


# --- the admin calls ---


def test_pause_and_continue(server):
    server.replies["/pause_generation"] = (200, {"message": "Generation paused.", "status": "ok"})
    assert rl.pause(server.url, api_key="k")["status"] == "ok"
    assert rl.continue_generation(server.url) == OK
    assert [(s.route, s.json()) for s in server.seen] == [("/pause_generation", {"mode": "retract"}),
                                                          ("/continue_generation", {})]
    assert server.seen[0].headers["Content-Type"] == "application/json"
    assert server.seen[0].headers["Authorization"] == "Bearer k"
    with pytest.raises(ValueError, match="pause mode must be one of"):
        rl.pause(server.url, mode="later")
    assert len(server.seen) == 2


def test_update_from_disk(server):
    reply = {"success": True, "message": "loaded", "num_paused_requests": 0}
    server.replies["/update_weights_from_disk"] = (200, reply)
    assert rl.update_from_disk(server.url, "/ckpt/step-9", weight_version="9") == reply
    assert server.seen[0].json() == {"model_path": "/ckpt/step-9", "flush_cache": True, "weight_version": "9"}
    server.replies["/update_weights_from_disk"] = (400, {"success": False, "message": "/nope: does not exist"})
    with pytest.raises(WeightPushError, match="POST /update_weights_from_disk: HTTP 400: /nope: does not exist"):
        rl.update_from_disk(server.url, "/nope")


def test_list_weights_and_weight_version(server):
    weights = [{"name": "model.norm.weight", "shape": [64], "dtype": "bfloat16"}]
    server.replies["/list_weights"] = (200, {"weights": weights})
    server.replies["/get_weight_version"] = (200, {"weight_version": "step-7"})
    assert rl.list_weights(server.url) == weights
    assert rl.weight_version(server.url) == "step-7"
    assert [(s.method, s.route, s.body) for s in server.seen] == [("GET", "/list_weights", b""),
                                                                  ("GET", "/get_weight_version", b"")]
    server.replies["/list_weights"] = (401, {"error": {"message": "a valid admin key is required"}})
    with pytest.raises(WeightPushError, match="GET /list_weights: HTTP 401: a valid admin key is required"):
        rl.list_weights(server.url)
