"""The CPU profile's pods, run under Docker the way the kubelet would run them: each container's own
command and args with $(POD_IP)/$(POD_NAME) expanded, its runAsUser/runAsGroup, all capabilities dropped,
no privilege escalation, the ConfigMap's tandem.yaml mounted where the head reads it, the model read-only at
/models, on a private network where the headless Services' names resolve to the pools' container IPs (Docker
network aliases, the same DNS answer a headless Service gives), and each secretKeyRef filled from the rendered
Secret. It then checks what the manifests promise:
the workers advertise their pod IP, every probe path answers 200 once up, the head discovers the pools and
serves a chat completion, and a worker stopped with the pod's termination grace period exits 0.

Opt-in, since it needs the image: TANDEM_K8S_DOCKER_IMAGE=tandem:cpu (built by scripts/images.sh) and the
model in models/ (TANDEM_MODELS to name another folder). Without that variable the module is skipped,
saying so. Bounded: every wait has a deadline, and the containers and network are removed at the end.
"""

import base64
import json
import os
import pathlib
import random
import re
import subprocess
import time
import urllib.error
import urllib.request

import pytest


from test_manifests import Manifests, flag

IMAGE = os.environ.get("TANDEM_K8S_DOCKER_IMAGE")
ROOT = pathlib.Path(__file__).resolve().parents[2]
MODELS = pathlib.Path(os.environ.get("TANDEM_MODELS", ROOT / "models"))
STARTUP_S = 180

pytestmark = pytest.mark.skipif(
    not IMAGE, reason="set TANDEM_K8S_DOCKER_IMAGE=tandem:cpu to run the CPU profile's pods under Docker"
)


def docker(*args, check=True, timeout=120):
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed ({out.returncode}):\n{out.stderr}")
    return out


def get(url, timeout=3, headers=None):
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return None, b""


def wait_for(url, what, deadline_s=STARTUP_S, logs_of=None, headers=None):
    end = time.monotonic() + deadline_s
    status = None
    while time.monotonic() < end:
        status, body = get(url, headers=headers)
        if status == 200:
            return body
        time.sleep(1)
    logs = docker("logs", "--tail", "40", logs_of, check=False).stderr if logs_of else ""
    raise AssertionError(f"{what}: {url} never answered 200 in {deadline_s} s (last: {status})\n{logs}")


class Cluster:
    """A Docker network standing in for the pod network, and the containers started on it."""

    def __init__(self, tmp):
        self.tag = f"tk8s-{os.getpid()}-{random.randrange(1 << 16):04x}"
        self.tmp = tmp
        self.containers = []
        for _ in range(8):
            self.prefix = f"172.29.{random.randrange(16, 250)}"
            out = docker("network", "create", "--subnet", f"{self.prefix}.0/24", self.tag, check=False)
            if out.returncode == 0:
                break
        else:
            raise AssertionError(f"cannot create a Docker network: {out.stderr}")
        self.next_ip = 10

    def run_pod(self, m, component, service, extra_mounts=()):
        """Starts the pod of `component` as the kubelet would; returns (name, ip)."""
        spec = m.deployment(component)["spec"]["template"]["spec"]
        c = m.container(component)
        ip = f"{self.prefix}.{self.next_ip}"
        name = f"{self.tag}-{component}-{self.next_ip}"
        self.next_ip += 1
        values = {"POD_IP": ip, "POD_NAME": name}
        env = {e["name"] for e in c.get("env", [])}
        args = [re.sub(r"\$\((\w+)\)", lambda g: values[g.group(1)] if g.group(1) in env else g.group(0), a) for a in c["args"]]
        sc = spec["securityContext"]
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        cmd = [
            "run", "-d", "--name", name, "--network", self.tag, "--ip", ip, "--network-alias", service,
            "--user", f"{sc['runAsUser']}:{sc['runAsGroup']}", "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges", "--entrypoint", c["command"][0],
            "-v", f"{MODELS}:/models:ro",
        ]
        for host, target in extra_mounts:
            cmd += ["-v", f"{host}:{target}:ro"]
        for e in c.get("env", []):
            if "value" in e:
                cmd += ["-e", f"{e['name']}={e['value']}"]
            elif e["name"] in values:
                cmd += ["-e", f"{e['name']}={values[e['name']]}"]
            elif "secretKeyRef" in e.get("valueFrom", {}):
                cmd += ["-e", f"{e['name']}={secret_value(m, e['valueFrom']['secretKeyRef'])}"]
        docker(*cmd, IMAGE, *args)
        self.containers.append(name)
        return name, ip

    def close(self):
        for name in self.containers:
            docker("rm", "-f", name, check=False)
        docker("network", "rm", self.tag, check=False)


@pytest.fixture
def cluster(tmp_path):
    if not (MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file():
        pytest.fail(f"no model in {MODELS}: run scripts/fetch-model.sh or set TANDEM_MODELS")
    docker("image", "inspect", IMAGE)
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


def secret_value(m, ref):
    """What the kubelet puts in an env var from a secretKeyRef: the rendered Secret's value, decoded."""
    return base64.b64decode(m.get("Secret", ref["name"])["data"][ref["key"]]).decode()


def probe_url(ip, container, probe):
    get_ = container[probe]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    return f"http://{ip}:{ports.get(get_['port'], get_['port'])}{get_['path']}"


def test_the_cpu_profile_serves_under_docker(cluster, tmp_path):
    m = Manifests("cpu")
    cfg = m.tandem_config()
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    (config_dir / "tandem.yaml").write_text(m.config_map()["data"]["tandem.yaml"])
    config_dir.chmod(0o755)
    (config_dir / "tandem.yaml").chmod(0o644)

    # The workers' control routes need the cluster token (the chart's Secret).
    ref = next(e for e in m.container("head")["env"] if e["name"] == "TANDEM_CLUSTER_TOKEN")
    member = {"Authorization": f"Bearer {secret_value(m, ref['valueFrom']['secretKeyRef'])}"}
    workers = {}
    for role in ("prefill", "decode"):
        host, _ = cfg["deployment"]["discovery"][role].rsplit(":", 1)
        name, ip = cluster.run_pod(m, role, host)
        workers[role] = (name, ip)
    for role, (name, ip) in workers.items():
        c = m.container(role)
        info = json.loads(wait_for(f"http://{ip}:{flag(c['args'], '--port')}/v1/worker/info", role, logs_of=name,
                                   headers=member))
        stranger, _ = get(f"http://{ip}:{flag(c['args'], '--port')}/v1/worker/info")
        assert stranger == 401, f"{role}: /v1/worker/info answered {stranger} without the token"
        assert info["worker_id"] == name and info["role"] == role
        if role == "prefill":
            assert info["kv_endpoint"] == f"{ip}:{flag(c['args'], '--kv-port')}", info
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            wait_for(probe_url(ip, c, probe), f"{role} {probe}", deadline_s=30, logs_of=name)

    config_mount = str(pathlib.PurePosixPath(flag(m.container("head")["args"], "--config")).parent)
    head, head_ip = cluster.run_pod(m, "head", "tandem-head", [(config_dir, config_mount)])
    hc = m.container("head")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        wait_for(probe_url(head_ip, hc, probe), f"head {probe}", logs_of=head)
    port = cfg["server"]["port"]
    body = json.dumps(
        {
            "model": json.loads(wait_for(f"http://{head_ip}:{port}/v1/models", "models"))["data"][0]["id"],
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8,
            "temperature": 0,
        }
    ).encode()
    req = urllib.request.Request(
        f"http://{head_ip}:{port}/v1/chat/completions", body, {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        answer = json.loads(r.read())
    assert answer["choices"][0]["finish_reason"] in ("stop", "length"), answer
    assert answer["usage"]["completion_tokens"] >= 1

    # A pod's deletion: SIGTERM, then SIGKILL after terminationGracePeriodSeconds (the preStop sleep is the
    # kubelet's, not the container's). The worker drains and exits 0 well within it.
    grace = m.deployment("decode")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    name, _ = workers["decode"]
    docker("stop", "-t", str(grace), name, timeout=grace + 30)
    code = docker("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip()
    assert code == "0", f"the decode worker exited {code} on SIGTERM\n{docker('logs', '--tail', '20', name).stderr}"
