"""Fixtures that start a real `tandem serve` (built beforehand) on a free loopback port.

The binary comes from $TANDEM_BIN (default: target/release/tandem) and the model from $TANDEM_MODEL
(default: the server's own default model). Nothing is built here.
"""

import os
import pathlib
import socket
import subprocess
import tempfile
import time

import openai
import pytest
import requests

ROOT = pathlib.Path(__file__).resolve().parents[2]
TANDEM_BIN = os.environ.get("TANDEM_BIN", str(ROOT / "target" / "release" / "tandem"))
STARTUP_TIMEOUT_S = float(os.environ.get("TANDEM_STARTUP_TIMEOUT", "300"))
MODEL_NAME = "tandem-test"
API_KEY = "test-secret-key"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running tandem server process."""

    def __init__(self, extra_args, api_key=None):
        if not os.path.exists(TANDEM_BIN):
            pytest.fail(f"{TANDEM_BIN} not found: build it with `cargo build --release -p tandem` or set TANDEM_BIN")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile(prefix="tandem-", suffix=".log", delete=False)
        args = [TANDEM_BIN, "serve"]
        if os.environ.get("TANDEM_MODEL"):
            args.append(os.environ["TANDEM_MODEL"])
        args += ["--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", MODEL_NAME, *extra_args]
        if api_key:
            args += ["--api-key", api_key]
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def log_tail(self, n=4000) -> str:
        self.log.flush()
        return pathlib.Path(self.log.name).read_text(errors="replace")[-n:]

    def _wait_ready(self):
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"tandem exited with {self.proc.returncode} during startup:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.25)
        self.stop()
        pytest.fail(f"tandem not healthy after {STARTUP_TIMEOUT_S}s:\n{self.log_tail()}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def metrics(self) -> dict:
        """Parses /metrics into {"name" or "name{labels}": value}."""
        text = requests.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
        return out


@pytest.fixture(scope="session")
def server():
    s = Server(["--kv-cache-memory", "512MiB"])
    yield s
    s.stop()


@pytest.fixture(scope="session")
def auth_server():
    s = Server(["--kv-cache-memory", "64MiB", "--max-num-seqs", "4"], api_key=API_KEY)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def pd_server():
    """The embedded P/D deployment of examples/pd.yaml: a head with one prefill and one decode worker,
    each its own process (the head's /health answers 200 once it has a decode worker)."""
    s = Server(["--config", "examples/pd.yaml"])
    yield s
    s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture
def async_client(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
