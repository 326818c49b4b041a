"""A stand-in for seven inference engines: each one's documented HTTP API, load delay and SIGTERM behaviour.

Standard library only: it runs in a minimal Debian container that has nothing but python3. Which engine it
plays is chosen by ``STANDIN_ENGINE`` (vllm, tgi, sglang, ollama, llamacpp, lmdeploy, openai). It accepts
the engine's own command line as arguments (so a container made by an engine driver runs it unchanged) and
reads the port, the served model name and the metrics flags from it.

Environment:
  STANDIN_ENGINE              the engine to play (required)
  STANDIN_PORT                port to listen on (default: from the command line, else the engine's)
  STANDIN_HOST                address to bind (default 0.0.0.0)
  STANDIN_MODEL               served model name (default: from the command line, else "standin-model")
  STANDIN_LOAD_SECONDS        how long "loading the model" takes (default 0)
  STANDIN_NEVER_READY=1       never finish loading
  STANDIN_COMPLETION_SECONDS  how long each completion takes (default 0); a request's "standin_seconds"
                              field overrides it
  STANDIN_SLOTS               requests processed at once; the rest wait (default 4)

While loading, readiness fails the way the engine's does: vllm, tgi, lmdeploy, ollama and openai do not
listen yet; sglang listens half-way through and answers /health with 503 until loaded; llamacpp listens at
once and answers 503 "Loading model". On SIGTERM, vllm, ollama and openai drop the requests in flight and
exit; tgi and lmdeploy stop accepting connections, finish the requests in flight and exit; sglang answers
/health and new requests with 503, finishes the requests in flight and exits; llamacpp closes its listener
and, with requests in flight, never answers them and never exits (only SIGKILL ends it), idle it exits at once
(measured on Debian's llama-server 0.7.0: tests/system/e2e/test_real_engine.py).

Test hooks (no engine has them): GET /standin/in-flight answers {"running": n, "waiting": m}; SIGUSR1 lets
every request in flight finish now, so tests can hold requests for as long as they need, then release them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ENGINES = ("vllm", "tgi", "sglang", "ollama", "llamacpp", "lmdeploy", "openai")
DEFAULT_PORTS = {
    "vllm": 8000,
    "tgi": 80,
    "sglang": 30000,
    "ollama": 11434,
    "llamacpp": 8080,
    "lmdeploy": 23333,
    "openai": 8000,
}
# (running gauge, waiting gauge) in each engine's own names; ollama and the generic server publish none.
GAUGES = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    "tgi": ("tgi_batch_current_size", "tgi_queue_size"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    "llamacpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
    "lmdeploy": ("lmdeploy:num_requests_running", "lmdeploy:num_requests_waiting"),
}
ABORTS_ON_SIGTERM = frozenset({"vllm", "ollama", "openai"})
HANGS_ON_SIGTERM = frozenset({"llamacpp"})
LISTENS_WHILE_LOADING = frozenset({"llamacpp"})
PORT_FLAGS = ("--port", "--server-port", "-p")
NAME_FLAGS = ("--served-model-name", "--alias", "-a", "--model-name", "--model-id")
LLAMACPP_LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


def log(message: str) -> None:
    sys.stderr.write(f"standin: {message}\n")
    sys.stderr.flush()


def flag_value(argv: list[str], flags: tuple[str, ...]) -> str | None:
    for index, arg in enumerate(argv):
        for flag in flags:
            if arg == flag and index + 1 < len(argv):
                return argv[index + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return None


class Config:
    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        engine = env.get("STANDIN_ENGINE", "")
        if engine not in ENGINES:
            raise SystemExit(f"standin: STANDIN_ENGINE must be one of {', '.join(ENGINES)}, not {engine!r}")
        self.engine = engine
        self.host = env.get("STANDIN_HOST", "0.0.0.0")
        self.port = int(env.get("STANDIN_PORT") or self._port_from(argv, env) or DEFAULT_PORTS[engine])
        self.model = env.get("STANDIN_MODEL") or flag_value(argv, NAME_FLAGS) or "standin-model"
        self.load_seconds = float(env.get("STANDIN_LOAD_SECONDS", "0"))
        self.never_ready = env.get("STANDIN_NEVER_READY") == "1"
        self.completion_seconds = float(env.get("STANDIN_COMPLETION_SECONDS", "0"))
        self.slots = max(1, int(env.get("STANDIN_SLOTS", "4")))
        self.metrics = self._metrics_enabled(argv, env)

    def _port_from(self, argv: list[str], env: dict[str, str]) -> str | None:
        if self.engine == "ollama":
            host = env.get("OLLAMA_HOST", "")
            return host.rsplit(":", 1)[1] if ":" in host else None
        return flag_value(argv, PORT_FLAGS)

    def _metrics_enabled(self, argv: list[str], env: dict[str, str]) -> bool:
        if self.engine not in GAUGES:
            return False
        if self.engine == "llamacpp":
            return "--metrics" in argv or env.get("LLAMA_ARG_ENDPOINT_METRICS") == "1"
        if self.engine == "sglang":
            return "--enable-metrics" in argv
        if self.engine == "lmdeploy":
            return "--disable-metrics" not in argv
        return True


class State:
    """What the engine is doing: loading, serving, draining or aborting, and the requests in flight."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.started = time.monotonic()
        self.lock = threading.Lock()
        self.slots = threading.Semaphore(config.slots)
        self.running = 0
        self.waiting = 0
        self.served = 0
        self.draining = False
        self.release_epoch = 0  # bumped by SIGUSR1: requests that arrived before it finish at once
        self.aborting = threading.Event()
        self.hanging = threading.Event()  # llamacpp after SIGTERM: requests in flight are never answered
        self.stop = threading.Event()

    def loaded(self) -> bool:
        if self.config.never_ready:
            return False
        return time.monotonic() - self.started >= self.config.load_seconds

    def in_flight(self) -> int:
        with self.lock:
            return self.running + self.waiting


class Handler(BaseHTTPRequestHandler):
    server: StandinServer
    protocol_version = "HTTP/1.0"  # one request per connection: nothing idles in a keep-alive at shutdown

    def log_message(self, format: str, *args: Any) -> None:
        log(f"{self.command} {self.path} -> {args[1] if len(args) > 1 else '?'}")

    @property
    def state(self) -> State:
        return self.server.state

    @property
    def config(self) -> Config:
        return self.server.state.config

    # answers -------------------------------------------------------------------------------------

    def send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_json(self, status: int, payload: object) -> None:
        self.send(status, json.dumps(payload).encode(), "application/json")

    def send_text(self, status: int, text: str) -> None:
        self.send(status, text.encode(), "text/plain; charset=utf-8")

    def not_found(self) -> None:
        self.send_json(404, {"error": {"message": f"no route {self.command} {self.path}", "code": 404}})

    # routing -------------------------------------------------------------------------------------

    def do_HEAD(self) -> None:
        if self.config.engine == "ollama" and self.path in ("/", "/api/tags", "/api/version"):
            self.send_response(200)
            self.end_headers()
        else:
            self.not_found()

    def do_GET(self) -> None:
        engine, path = self.config.engine, self.path.split("?", 1)[0]
        if engine == "llamacpp" and not self.state.loaded() and path != "/standin/in-flight":
            # llama.cpp answers every route with 503 until the model is loaded.
            self.send_json(503, LLAMACPP_LOADING)
            return
        if path == "/standin/in-flight":
            # Test hook, not an engine route: lets tests see requests in flight on engines without metrics.
            with self.state.lock:
                counts = {"running": self.state.running, "waiting": self.state.waiting}
            self.send_json(200, counts)
        elif path == "/metrics":
            self.metrics()
        elif engine == "ollama":
            self.ollama_get(path)
        elif path in ("/health", "/v1/health") or (engine == "tgi" and path == "/"):
            self.health()
        elif path == "/v1/models":
            self.send_json(200, self.model_list())
        elif engine == "tgi" and path == "/info":
            self.send_json(200, {"model_id": self.config.model})
        else:
            self.not_found()

    def do_POST(self) -> None:
        engine, path = self.config.engine, self.path.split("?", 1)[0]
        if engine == "llamacpp" and not self.state.loaded():
            self.send_json(503, LLAMACPP_LOADING)
            return
        request = self.read_json()
        if request is None:
            return
        if path in ("/v1/completions", "/v1/chat/completions"):
            self.complete(request, chat=path.endswith("chat/completions"))
        elif engine == "ollama" and path in ("/api/generate", "/api/chat"):
            self.complete(request, chat=path == "/api/chat", ollama=True)
        elif engine == "tgi" and path == "/generate":
            self.complete(request, chat=False, tgi=True)
        else:
            self.not_found()

    # endpoints -----------------------------------------------------------------------------------

    def health(self) -> None:
        engine = self.config.engine
        if engine == "sglang" and (self.state.draining or not self.state.loaded()):
            self.send(503, b"", "text/plain")
        elif engine == "llamacpp":
            self.send_json(200, {"status": "ok"})
        elif engine == "lmdeploy":
            self.send_json(200, {"status": "healthy"})
        else:
            self.send(200, b"", "text/plain")

    def ollama_get(self, path: str) -> None:
        if path == "/":
            self.send_text(200, "Ollama is running")
        elif path == "/api/tags":
            name = self.config.model
            self.send_json(200, {"models": [{"name": name, "model": name, "size": 0, "digest": "0" * 64}]})
        elif path == "/api/version":
            self.send_json(200, {"version": "0.0.0-standin"})
        elif path == "/v1/models":
            self.send_json(200, self.model_list())
        else:
            self.not_found()

    def model_list(self) -> dict[str, object]:
        model = {"id": self.config.model, "object": "model", "created": 0, "owned_by": self.config.engine}
        return {"object": "list", "data": [model]}

    def metrics(self) -> None:
        engine = self.config.engine
        if not self.config.metrics:
            if engine == "llamacpp":
                self.send_json(501, {"error": {"code": 501, "message": "Start it with `--metrics`"}})
            else:
                self.not_found()
            return
        running_name, waiting_name = GAUGES[engine]
        with self.state.lock:
            running, waiting, served = self.state.running, self.state.waiting, self.state.served
        labels = {
            "vllm": f'{{engine="0",model_name="{self.config.model}"}}',
            "sglang": f'{{model_name="{self.config.model}"}}',
            "lmdeploy": f'{{engine="0",model_name="{self.config.model}"}}',
        }.get(engine, "")
        lines = [
            f"# HELP {running_name} Requests being processed.",
            f"# TYPE {running_name} gauge",
            f"{running_name}{labels} {float(running)}",
            f"# HELP {waiting_name} Requests waiting to be processed.",
            f"# TYPE {waiting_name} gauge",
            f"{waiting_name}{labels} {float(waiting)}",
            "# HELP standin_requests_served_total Requests answered.",
            "# TYPE standin_requests_served_total counter",
            f"standin_requests_served_total {served}",
        ]
        self.send(200, ("\n".join(lines) + "\n").encode(), "text/plain; version=0.0.4")

    def read_json(self) -> dict[str, Any] | None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b"{}"
        try:
            request = json.loads(raw or b"{}")
        except ValueError:
            self.send_json(400, {"error": {"message": "request body is not JSON", "code": 400}})
            return None
        if not isinstance(request, dict):
            self.send_json(400, {"error": {"message": "request body must be a JSON object", "code": 400}})
            return None
        return request

    def complete(self, request: dict[str, Any], *, chat: bool, ollama: bool = False, tgi: bool = False) -> None:
        state = self.state
        if state.draining:
            self.send_json(503, {"error": {"message": "server is shutting down", "code": 503}})
            return
        seconds = float(request.get("standin_seconds", self.config.completion_seconds))
        epoch = state.release_epoch
        with state.lock:
            state.waiting += 1
        acquired = False
        try:
            while not (acquired := state.slots.acquire(timeout=0.05)):
                if state.aborting.is_set():
                    break
            with state.lock:
                state.waiting -= 1
                if acquired:
                    state.running += 1
            if not acquired or not self.generate(seconds, epoch):
                # Aborted by SIGTERM: the engine drops the request; the client sees the connection close.
                self.close_connection = True
                return
            # The request is finished before its answer goes out, as in an engine's scheduler: a client
            # holding its response never sees itself still counted in the gauges.
            with state.lock:
                state.served += 1
                number = state.served
                state.running -= 1
            state.slots.release()
            acquired = False
            self.send_json(200, self.completion_body(request, number, chat=chat, ollama=ollama, tgi=tgi))
        finally:
            if acquired:
                with state.lock:
                    state.running -= 1
                state.slots.release()

    def generate(self, seconds: float, epoch: int) -> bool:
        """Take ``seconds`` (or until released); False when SIGTERM aborts the request first."""
        state = self.state
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and state.release_epoch == epoch:
            if state.aborting.wait(timeout=0.02):
                return False
        while state.hanging.is_set():
            time.sleep(1)  # never answered: the client's connection ends with the process, at SIGKILL
        return not state.aborting.is_set()

    def completion_body(
        self, request: dict[str, Any], number: int, *, chat: bool, ollama: bool, tgi: bool
    ) -> dict[str, Any]:
        text = f"stand-in completion {number}"
        model = str(request.get("model") or self.config.model)
        if tgi:
            return {"generated_text": text}
        if ollama:
            if chat:
                return {"model": model, "message": {"role": "assistant", "content": text}, "done": True}
            return {"model": model, "response": text, "done": True}
        usage = {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
            kind = "text_completion"
        return {
            "id": f"standin-{number}",
            "object": kind,
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": usage,
        }


class StandinServer(ThreadingHTTPServer):
    # Handler threads are joined by server_close(), so "finish in flight, then exit" really waits.
    daemon_threads = False
    block_on_close = True

    def __init__(self, state: State) -> None:
        self.state = state
        super().__init__((state.config.host, state.config.port), Handler)


def wait_for_stop(state: State, seconds: float) -> bool:
    """Wait up to ``seconds`` (inf: for ever) for SIGTERM; True once it came.

    The wait wakes every 0.1 s: a signal the kernel delivers to another thread only runs its Python handler
    when the main thread executes bytecode again, so a blocking wait could miss it for ever.
    """
    deadline = time.monotonic() + seconds
    while not state.stop.wait(timeout=0.1):
        if time.monotonic() >= deadline:
            return False
    return True


def serve(state: State) -> int:
    config = state.config
    if config.engine not in LISTENS_WHILE_LOADING:
        # Engines that load before listening: nothing answers on the port until then (sglang listens
        # half-way and answers /health with 503 until loaded).
        listen_after = config.load_seconds / 2 if config.engine == "sglang" else config.load_seconds
        if config.never_ready and config.engine != "sglang":
            listen_after = float("inf")
        if wait_for_stop(state, listen_after):
            log("stopped while loading")
            return 0
    server = StandinServer(state)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    log(f"{config.engine} listening on {config.host}:{server.server_address[1]} serving {config.model!r}")
    wait_for_stop(state, float("inf"))
    if config.engine in ABORTS_ON_SIGTERM:
        log(f"SIGTERM: aborting {state.in_flight()} request(s) in flight")
        state.aborting.set()
    elif config.engine in HANGS_ON_SIGTERM:
        state.hanging.set()
        server.shutdown()
        server.server_close()
        if state.in_flight():
            log(f"SIGTERM: listener closed, {state.in_flight()} request(s) in flight never answered; awaiting SIGKILL")
            while True:
                time.sleep(1)
    elif config.engine == "sglang":
        with state.lock:
            state.draining = True
        while state.in_flight() > 0:
            log(f"SIGTERM: gracefully exiting, {state.in_flight()} request(s) left")
            time.sleep(0.05)
    else:
        log(f"SIGTERM: no new connections, finishing {state.in_flight()} request(s) in flight")
    server.shutdown()
    server.server_close()
    log("exited")
    return 0


def main(argv: list[str]) -> int:
    state = State(Config(argv, dict(os.environ)))

    def on_signal(signum: int, frame: object) -> None:
        state.stop.set()

    def on_release(signum: int, frame: object) -> None:
        state.release_epoch += 1

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGUSR1, on_release)
    return serve(state)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
