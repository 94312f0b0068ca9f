"""A client of a farm of ComfyUI workers behind HAProxy (deploy/haproxy.cfg), standard library only.

    python deploy/qi21_client.py route-key graph.json --input-dir DIR      the key alone (nodes/route_key.py)
    python deploy/qi21_client.py run graph.json --url http://127.0.0.1:8188 --images DIR --out OUT

One job, every request with `X-QI21-Route-Key`:
  1. `GET /ws?clientId=...` (the job's seat): HAProxy picks the worker by the key (consistent hashing, bounded
     load) and names it in `X-QI21-Worker`; the open websocket counts as one job on that worker;
  2. `POST /upload/image` for each LoadImage file (so the references land where the job runs), `POST /prompt`,
     then the websocket's messages until the prompt is done, `GET /history/<id>`, `GET /view` per image: all
     with `X-QI21-Worker` too, which pins them to the seat's worker;
  3. if the worker dies on the way (the websocket closes, a request fails, or an answer comes from another worker),
     the whole job is retried: a new seat on a live worker, the uploads again, the prompt again.
"""

import argparse
import base64
import hashlib
import importlib.util
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROUTE_HEADER, WORKER_HEADER = "X-QI21-Route-Key", "X-QI21-Worker"
_spec = importlib.util.spec_from_file_location("qi21_route_key", Path(__file__).resolve().parents[1] / "nodes" /
                                               "route_key.py")
route_key_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(route_key_module)


class WorkerLost(ConnectionError):
    """The job's worker stopped answering (or another one answered): the job is retried elsewhere."""


class Seat:
    """The job's websocket (RFC 6455, text frames only read; previews and pings handled), opened through HAProxy."""

    def __init__(self, url: str, client_id: str, headers: dict, timeout: float):
        parsed = urllib.parse.urlsplit(url)
        self.sock = socket.create_connection((parsed.hostname, parsed.port or 80), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        lines = [f"GET /ws?clientId={urllib.parse.quote(client_id)} HTTP/1.1", f"Host: {parsed.netloc}",
                 "Upgrade: websocket", "Connection: Upgrade", f"Sec-WebSocket-Key: {key}",
                 "Sec-WebSocket-Version: 13", *(f"{k}: {v}" for k, v in headers.items())]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise WorkerLost("the websocket closed during its handshake")
            head += chunk
        head, self.buffer = head.split(b"\r\n\r\n", 1)
        status, *header_lines = head.decode("latin-1").split("\r\n")
        if " 101 " not in status + " ":
            raise WorkerLost(f"the websocket was refused: {status}")
        self.headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines if ":" in h)}
        self.worker = self.headers.get(WORKER_HEADER.lower())

    def _read(self, count: int) -> bytes:
        while len(self.buffer) < count:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise WorkerLost("the worker closed the job's websocket")
            self.buffer += chunk
        out, self.buffer = self.buffer[:count], self.buffer[count:]
        return out

    def message(self):
        """The next text message as JSON (None for a binary one, e.g. a preview)."""
        first, second = self._read(2)
        opcode, length = first & 0x0F, second & 0x7F
        if length == 126:
            length = int.from_bytes(self._read(2), "big")
        elif length == 127:
            length = int.from_bytes(self._read(8), "big")
        mask = self._read(4) if second & 0x80 else None
        payload = self._read(length)
        if mask:
            payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        if opcode == 8:
            raise WorkerLost("the worker closed the job's websocket")
        if opcode == 9:  # ping: answer with a masked pong
            mask = os.urandom(4)
            self.sock.sendall(bytes([0x8A, 0x80 | len(payload)]) + mask +
                              bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
            return None
        return json.loads(payload) if opcode == 1 else None

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


@dataclass
class JobResult:
    prompt_id: str
    worker: str
    attempts: int
    history: dict
    images: list = field(default_factory=list)  # PNG bytes, in the order of /history's outputs
    workers_tried: list = field(default_factory=list)


class Farm:
    def __init__(self, url: str, timeout: float = 600, retries: int = 3):
        self.url, self.timeout, self.retries = url.rstrip("/"), timeout, retries
        self.on_queued = None  # callback(worker, prompt_id): a test kills a worker here

    def _request(self, path: str, headers: dict, worker: str, body: bytes | None = None,
                 content_type: str = "application/json") -> bytes:
        request = urllib.request.Request(self.url + path, data=body, headers={**headers, WORKER_HEADER: worker,
                                                                             "Content-Type": content_type})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                served_by, data = response.headers.get(WORKER_HEADER), response.read()
        except urllib.error.HTTPError as error:
            if error.code in (502, 503, 504):  # HAProxy: no worker answered
                raise WorkerLost(f"{path}: HTTP {error.code}") from None
            raise RuntimeError(f"{path}: HTTP {error.code}: {error.read().decode(errors='replace')[:500]}") from None
        except OSError as error:
            raise WorkerLost(f"{path}: {error}") from None
        if served_by != worker:
            raise WorkerLost(f"{path} was answered by {served_by}, not by the job's worker {worker}")
        return data

    def upload(self, headers: dict, worker: str, name: str, data: bytes) -> None:
        boundary = uuid.uuid4().hex
        parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="overwrite"\r\n\r\ntrue\r\n'.encode(),
                 f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="{name}"\r\n'
                 f'Content-Type: application/octet-stream\r\n\r\n'.encode() + data + b"\r\n",
                 f"--{boundary}--\r\n".encode()]
        self._request("/upload/image", headers, worker, b"".join(parts), f"multipart/form-data; boundary={boundary}")

    def attempt(self, graph: dict, images: dict, key: str) -> JobResult:
        headers, client_id = {ROUTE_HEADER: key}, uuid.uuid4().hex
        seat = Seat(self.url, client_id, headers, self.timeout)
        try:
            worker = seat.worker
            if not worker:
                raise RuntimeError(f"no {WORKER_HEADER} in the websocket's answer: is HAProxy configured with "
                                   "deploy/haproxy.cfg?")
            for name, data in images.items():
                self.upload(headers, worker, name, data)
            body = json.dumps({"prompt": graph, "client_id": client_id}).encode()
            answer = json.loads(self._request("/prompt", headers, worker, body))
            if answer.get("node_errors"):
                raise RuntimeError(f"the worker refused the prompt: {answer}")
            prompt_id = answer["prompt_id"]
            if self.on_queued is not None:
                self.on_queued(worker, prompt_id)
            deadline = time.monotonic() + self.timeout
            while time.monotonic() < deadline:
                message = seat.message()
                if not message or message.get("data", {}).get("prompt_id") != prompt_id:
                    continue
                kind, data = message.get("type"), message["data"]
                if kind == "execution_error":
                    raise RuntimeError(f"the prompt failed on {worker}: {data.get('exception_message')}")
                if kind == "execution_success" or (kind == "executing" and data.get("node") is None):
                    break
            else:
                raise TimeoutError(f"prompt {prompt_id} did not finish within {self.timeout} s")
            history = self.history(headers, worker, prompt_id)
            pictures = []
            for output in history.get("outputs", {}).values():
                for image in output.get("images", []):
                    query = urllib.parse.urlencode({k: image.get(k, "") for k in ("filename", "subfolder", "type")})
                    pictures.append(self._request(f"/view?{query}", headers, worker))
            return JobResult(prompt_id, worker, 1, history, pictures)
        finally:
            seat.close()

    def history(self, headers: dict, worker: str, prompt_id: str) -> dict:
        """The prompt's /history entry. ComfyUI announces the end of a prompt on the websocket a moment before it
        files the entry, so an empty answer is asked again (a dead worker fails the request instead)."""
        deadline = time.monotonic() + 60
        while True:
            entry = json.loads(self._request(f"/history/{prompt_id}", headers, worker)).get(prompt_id)
            if entry:
                return entry
            if time.monotonic() > deadline:
                raise WorkerLost(f"{worker} filed no history of prompt {prompt_id} within 60 s")
            time.sleep(0.05)

    def run(self, graph: dict, images: dict) -> JobResult:
        """Run `graph` with `images` (LoadImage file name -> bytes), retrying on another worker if its own dies."""
        hashes = {name: hashlib.sha256(data).hexdigest() for name, data in images.items()}
        key = route_key_module.route_key(graph, None, hashes)
        tried = []
        for attempt in range(1, self.retries + 2):
            try:
                result = self.attempt(graph, images, key)
            except WorkerLost as error:
                tried.append(str(error))
                if attempt > self.retries:
                    raise
                time.sleep(0.5 * attempt)  # the health check takes the dead worker out meanwhile
                continue
            result.attempts, result.workers_tried = attempt, tried
            return result
        raise AssertionError("unreachable")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["route-key"]:  # all its arguments, --help included, are route_key.py's (REMAINDER drops --help)
        return route_key_module.main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("route-key", help="print the graph's route key (nodes/route_key.py's arguments)")
    run = commands.add_parser("run", help="run one job through the farm")
    run.add_argument("graph", type=Path)
    run.add_argument("--url", default="http://127.0.0.1:8188")
    run.add_argument("--images", type=Path, default=Path("."), help="the folder holding the LoadImage files")
    run.add_argument("--out", type=Path, default=Path("out"))
    args = parser.parse_args(argv)
    graph = json.loads(args.graph.read_text())
    graph = graph.get("prompt", graph) if isinstance(graph.get("prompt"), dict) else graph
    names = {n["inputs"]["image"] for n in graph.values() if n.get("class_type") == "LoadImage"}
    result = Farm(args.url).run(graph, {name: (args.images / name).read_bytes() for name in sorted(names)})
    args.out.mkdir(parents=True, exist_ok=True)
    for index, png in enumerate(result.images):
        (args.out / f"{result.prompt_id}_{index}.png").write_bytes(png)
    print(json.dumps({"prompt_id": result.prompt_id, "worker": result.worker, "attempts": result.attempts,
                      "images": len(result.images)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
