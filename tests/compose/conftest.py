"""Helpers for the container tests: the images (tandem:cpu, tandem:cuda) and the compose deployment.

Nothing is built here: the images come from scripts/images.sh and the model from scripts/fetch-model.sh
(models/). Each deployment runs under its own compose project name (so its own networks and
containers), on a free loopback port, and is always taken down (`down -v`), also when a test fails.
Every docker command has a time limit, so no test can hang.

Environment: TANDEM_CPU_IMAGE / TANDEM_CUDA_IMAGE (default tandem:cpu / tandem:cuda), TANDEM_MODELS (the
models folder, default models/), TANDEM_COMPOSE_TIMEOUT (seconds a deployment may take to become ready,
default 180).
"""

import json
import os
import pathlib
import secrets
import shutil
import socket
import subprocess
import time

import pytest
import requests

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"
CPU_IMAGE = os.environ.get("TANDEM_CPU_IMAGE", "tandem:cpu")
CUDA_IMAGE = os.environ.get("TANDEM_CUDA_IMAGE", "tandem:cuda")
MODELS = pathlib.Path(os.environ.get("TANDEM_MODELS", str(ROOT / "models"))).resolve()
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
READY_TIMEOUT_S = float(os.environ.get("TANDEM_COMPOSE_TIMEOUT", "180"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, timeout=120, check=True, env=None, cwd=None):
    """Runs a command with a time limit; returns the CompletedProcess (stdout and stderr merged)."""
    try:
        p = subprocess.run(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            env=env,
            cwd=cwd,
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"`{' '.join(map(str, args))}` ran past {timeout}s:\n{out[-3000:]}")
    if check and p.returncode != 0:
        pytest.fail(f"`{' '.join(map(str, args))}` exited {p.returncode}:\n{p.stdout[-3000:]}")
    return p


def compose_command() -> list:
    """`docker compose` (the v2 plugin) where it exists, else Docker's older `docker-compose`."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.fail("neither `docker compose` nor `docker-compose` is installed")


def require_image(image: str):
    if run(["docker", "image", "inspect", image], check=False, timeout=30).returncode != 0:
        pytest.fail(f"image {image} is missing: build it with scripts/images.sh")


def require_model():
    if not (MODELS / MODEL_FILE).is_file():
        pytest.fail(f"{MODELS / MODEL_FILE} is missing: run scripts/fetch-model.sh")


def image_config(image: str) -> dict:
    return json.loads(run(["docker", "image", "inspect", image], timeout=30).stdout)[0]["Config"]


class Deployment:
    """One compose project made of `files` (relative to deploy/compose/), on a free loopback port. With
    `tls_dir` (the certificates deploy/compose/tls-certs.sh made, for compose.tls.yaml) the head is
    reached over HTTPS, trusting that folder's ca.crt."""

    def __init__(self, files, name, head_config=None, tls_dir=None):
        require_image(CPU_IMAGE)
        require_model()
        self.compose = compose_command()
        self.project = f"tandemct{os.getpid()}{name}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # What `requests` checks the head's certificate against (its default roots without TLS).
        self.verify = True
        # The cluster token compose.yaml requires, and the bearer of the tests' calls to control routes.
        self.token = secrets.token_hex(32)
        self.auth = {"Authorization": f"Bearer {self.token}"}
        self.env = dict(os.environ, TANDEM_PORT=str(self.port), TANDEM_MODELS=str(MODELS),
                        TANDEM_IMAGE=CPU_IMAGE, TANDEM_HEAD_IMAGE=CPU_IMAGE, TANDEM_CLUSTER_TOKEN=self.token)
        if head_config:
            # The head's YAML (TANDEM_HEAD_CONFIG in compose.yaml), e.g. tests/compose/head-faults.yaml.
            self.env["TANDEM_HEAD_CONFIG"] = str(pathlib.Path(head_config).resolve())
        if tls_dir:
            self.env["TANDEM_TLS_DIR"] = str(pathlib.Path(tls_dir).resolve())
            self.url = f"https://127.0.0.1:{self.port}"
            self.verify = str(pathlib.Path(tls_dir).resolve() / "ca.crt")
        # Containers started beside the project (`docker run` on its network): removed before `down`,
        # which could not remove the network while they are attached to it.
        self.extra = []
        self.base = [*self.compose, "-p", self.project]
        for f in files:
            self.base += ["-f", str(COMPOSE_DIR / f)]

    def __call__(self, *args, timeout=180, check=True):
        return run([*self.base, *args], timeout=timeout, check=check, env=self.env)

    def up(self, *services, scale=None):
        args = ["up", "-d"]
        for service, n in (scale or {}).items():
            args += ["--scale", f"{service}={n}"]
        self(*args, *services)

    def down(self):
        # Always runs (finalizers); failures here are reported but the test's own result stands.
        for c in self.extra:
            run(["docker", "rm", "-f", "-v", c], timeout=60, check=False)
        p = self("down", "-v", "--remove-orphans", "--timeout", "10", timeout=120, check=False)
        if p.returncode != 0:
            print(f"compose down failed ({p.returncode}):\n{p.stdout[-2000:]}")

    def logs(self, n=4000) -> str:
        return self("logs", "--no-color", "--tail", "200", timeout=60, check=False).stdout[-n:]

    def containers(self, service=None) -> list:
        """Ids of this project's containers (of one service), running or not."""
        args = ["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            args += ["--filter", f"label=com.docker.compose.service={service}"]
        return run(args, timeout=30).stdout.split()

    def state(self, container) -> dict:
        return json.loads(run(["docker", "inspect", container], timeout=30).stdout)[0]["State"]

    def network(self, suffix="backend") -> str:
        nets = run(["docker", "network", "ls", "--format", "{{.Name}}", "--filter",
                    f"label=com.docker.compose.project={self.project}"], timeout=30).stdout.split()
        match = [n for n in nets if n.endswith("_" + suffix)]
        assert len(match) == 1, f"networks of {self.project}: {nets}"
        return match[0]

    def ip(self, container, suffix="backend") -> str:
        """A container's address on one of the project's networks ('' when not attached)."""
        net = self.network(suffix)
        nets = json.loads(run(["docker", "inspect", "--format", "{{json .NetworkSettings.Networks}}", container],
                              timeout=30).stdout)
        return (nets.get(net) or {}).get("IPAddress", "")

    def metrics(self) -> dict:
        """The head's /metrics as {name{labels}: value}."""
        r = requests.get(self.url + "/metrics", timeout=5, verify=self.verify)
        r.raise_for_status()
        out = {}
        for line in r.text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                try:
                    out[key] = float(value)
                except ValueError:
                    pass
        return out

    def fail(self, message):
        pytest.fail(f"{message}\n--- compose logs ({self.project}) ---\n{self.logs()}")

    def wait_for(self, what, predicate, timeout=READY_TIMEOUT_S, interval=1.0):
        """Polls `predicate` (truthy = done) until `timeout`; fails with the logs otherwise. A head
        container that exited meanwhile fails at once with its logs."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                got = predicate()
                if got:
                    return got
                last = got
            except (requests.RequestException, ValueError) as e:
                last = e
            for c in self.containers("head"):
                s = self.state(c)
                if s["Status"] == "exited" or s.get("Restarting"):
                    self.fail(f"the head container exited (code {s['ExitCode']}) while waiting for {what}")
            time.sleep(interval)
        self.fail(f"{what}: not within {timeout:.0f}s (last: {last!r})")

    def healthy(self):
        return self.wait_for("the head's /health",
                             lambda: requests.get(self.url + "/health", timeout=3, verify=self.verify).ok)

    def workers(self) -> list:
        r = requests.get(self.url + "/v1/cluster/workers", headers=self.auth, timeout=5, verify=self.verify)
        r.raise_for_status()
        return r.json()

    def healthy_workers(self, role) -> list:
        return [w for w in self.workers() if w["info"]["role"] == role and w["healthy"]]

    def wait_workers(self, prefill, decode, timeout=120):
        """Waits until the head lists exactly `prefill` and `decode` healthy workers of each role."""
        return self.wait_for(f"{prefill} prefill and {decode} decode workers healthy",
                             lambda: len(self.healthy_workers("prefill")) == prefill
                             and len(self.healthy_workers("decode")) == decode, timeout=timeout)


@pytest.fixture
def deployment(request):
    """Factory: deployment(files, name[, head_config, tls_dir]) -> an up-able Deployment, taken down after
    the test."""
    made = []

    def make(files, name, head_config=None, tls_dir=None):
        d = Deployment(files, name, head_config, tls_dir)
        made.append(d)
        return d

    yield make
    for d in made:
        d.down()


def dns_discovery_supported():
    """Whether this image's tandem accepts deploy/compose/head.yaml (`discovery: dns`, replicas 0).
    Returns (bool, why). Uses `serve --check-config` where it exists; otherwise starts the head alone,
    without a network, for a few seconds: a config it refuses ends it at once, naming the key."""
    require_image(CPU_IMAGE)
    require_model()
    base = ["docker", "run", "--rm", "--network", "none",
            "-v", f"{MODELS}:/models:ro", "-v", f"{COMPOSE_DIR / 'head.yaml'}:/etc/tandem/head.yaml:ro"]
    p = run([*base, CPU_IMAGE, "serve", "--config", "/etc/tandem/head.yaml", "--check-config"],
            timeout=60, check=False)
    if p.returncode == 0:
        return True, ""
    if "--check-config" not in p.stdout:
        return False, p.stdout.strip()[-800:]
    name = f"tandemct{os.getpid()}probe"
    proc = subprocess.Popen([*base[:3], "--name", name, *base[3:], CPU_IMAGE, "serve", "--config",
                             "/etc/tandem/head.yaml"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=8)
        return False, out.strip()[-800:]
    except subprocess.TimeoutExpired:
        return True, ""
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="session")
def require_dns_discovery():
    ok, why = dns_discovery_supported()
    if not ok:
        pytest.fail(
            "deploy/compose/head.yaml (deployment.discovery: dns, replicas 0) is refused by the tandem in "
            f"{CPU_IMAGE}, which has no DNS discovery yet; the scalable compose deployment needs it. "
            f"tandem said:\n{why}"
        )
