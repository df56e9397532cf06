"""The images themselves: metadata, the CPU image serving the model with a passing HEALTHCHECK, and the
CUDA image starting and refusing `serve --device cuda` clearly on a host without a GPU."""

import json
import os
import re
import time

import pytest
import requests

from conftest import CPU_IMAGE, CUDA_IMAGE, MODEL_FILE, MODELS, free_port, image_config, require_image, require_model, run


@pytest.mark.parametrize("image", [CPU_IMAGE, CUDA_IMAGE])
def test_image_metadata(image):
    require_image(image)
    c = image_config(image)
    assert c["User"] == "tandem:tandem", c["User"]
    assert c["Entrypoint"] == ["tandem"]
    assert c["Healthcheck"]["Test"][:3] == ["CMD", "tandem", "probe"], c["Healthcheck"]
    assert set(c["ExposedPorts"]) == {"8000/tcp", "8100/tcp", "8200/tcp"}
    assert "/models" in c["Volumes"]
    labels = c["Labels"]
    for key in ("title", "description", "version", "revision", "created", "licenses", "base.name"):
        assert labels.get(f"org.opencontainers.image.{key}"), f"label {key} missing: {labels}"
    assert labels["org.opencontainers.image.revision"] != "unknown"
    # The health check's subcommand is there and reads TANDEM_PROBE_URL.
    p = run(["docker", "run", "--rm", image, "probe", "--help"], timeout=60)
    assert "TANDEM_PROBE_URL" in p.stdout
    # Nothing runs as root: the user exists in the image with its own uid.
    p = run(["docker", "run", "--rm", "--entrypoint", "id", image], timeout=60)
    assert p.stdout.startswith("uid=10001(tandem)"), p.stdout


def test_cpu_image_serves_and_reports_healthy():
    require_image(CPU_IMAGE)
    require_model()
    port = free_port()
    name = f"tandemct{os.getpid()}cpu"
    run(["docker", "run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000",
         "-v", f"{MODELS}:/models:ro", "--health-interval", "1s", "--health-start-period", "60s", CPU_IMAGE],
        timeout=60)
    try:
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline:
            state = json.loads(run(["docker", "inspect", name], timeout=30).stdout)[0]["State"]
            if state["Status"] != "running":
                pytest.fail(f"the container stopped: {state}\n{run(['docker', 'logs', name], check=False).stdout[-3000:]}")
            status = state["Health"]["Status"]
            if status == "healthy":
                break
            time.sleep(1)
        logs = run(["docker", "logs", name], check=False).stdout
        assert status == "healthy", f"HEALTHCHECK status {status}:\n{logs[-3000:]}"
        url = f"http://127.0.0.1:{port}"
        assert requests.get(url + "/health", timeout=5).ok
        models = requests.get(url + "/v1/models", timeout=5).json()["data"]
        assert [m["id"] for m in models] == [MODEL_FILE.removesuffix(".gguf")], models
        r = requests.post(url + "/v1/chat/completions", timeout=60, json={
            "model": models[0]["id"], "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8, "temperature": 0})
        assert r.ok, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"].strip(), body
        assert body["usage"]["completion_tokens"] > 0
        # The health check reads TANDEM_PROBE_URL: pointed at a port nothing serves, it fails.
        p = run(["docker", "exec", "-e", "TANDEM_PROBE_URL=http://127.0.0.1:9/health", name, "tandem", "probe"],
                check=False, timeout=60)
        assert p.returncode == 1, p.stdout
        assert "127.0.0.1:9" in p.stdout, p.stdout
    finally:
        run(["docker", "rm", "-f", "-v", name], check=False, timeout=60)


def test_cuda_image_starts_and_refuses_cuda_without_a_gpu():
    require_image(CUDA_IMAGE)
    require_model()
    # It starts: the binary runs and is the `cuda` build (its hidden CUDA tools exist).
    p = run(["docker", "run", "--rm", CUDA_IMAGE, "--version"], timeout=60)
    assert p.stdout.startswith("tandem "), p.stdout
    run(["docker", "run", "--rm", CUDA_IMAGE, "cuda-check", "--help"], timeout=60)
    # The libraries it loads are where LD_LIBRARY_PATH says (checked at build time too).
    p = run(["docker", "run", "--rm", "--entrypoint", "sh", CUDA_IMAGE, "-c",
             "ls /opt/cuda/lib /opt/nixl/.nixl_cu13.mesonpy.libs; echo LD=$LD_LIBRARY_PATH"], timeout=60)
    for lib in ("libnvrtc.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcudart.so.13", "libnixl_capi.so"):
        assert lib in p.stdout, p.stdout
    # Without a GPU (no driver here) serving on CUDA fails, soon, saying why.
    start = time.monotonic()
    p = run(["docker", "run", "--rm", "-v", f"{MODELS}:/models:ro", CUDA_IMAGE, "serve", "--device", "cuda"],
            check=False, timeout=120)
    took = time.monotonic() - start
    assert p.returncode != 0, p.stdout
    assert took < 60, f"took {took:.0f}s"
    out = p.stdout
    assert "libcuda.so" in out and "driver" in out.lower(), out[-3000:]
    assert "panicked" not in out, out[-3000:]


def test_cuda_image_loads_nixl():
    """NIXL, as the CUDA image carries it, loads: a CPU prefill worker with `--transport nixl` creates its
    NIXL agent (UCX backend) and registers its staging memory at start-up, or fails naming why."""
    require_image(CUDA_IMAGE)
    require_model()
    name = f"tandemct{os.getpid()}nixl"
    run(["docker", "run", "-d", "--name", name, "-v", f"{MODELS}:/models:ro",
         "-e", "TANDEM_PROBE_URL=http://127.0.0.1:8100/v1/worker/info", CUDA_IMAGE,
         "worker", "--role", "prefill", "--transport", "nixl", "--host", "127.0.0.1", "--port", "8100",
         "--kv-port", "8200"], timeout=60)
    try:
        deadline = time.monotonic() + 90
        logs = ""
        while time.monotonic() < deadline:
            logs = run(["docker", "logs", name], check=False, timeout=30).stdout
            state = json.loads(run(["docker", "inspect", name], timeout=30).stdout)[0]["State"]
            if "TANDEM_WORKER_READY" in logs or state["Status"] != "running":
                break
            time.sleep(1)
        assert "TANDEM_WORKER_READY" in logs, logs[-3000:]
        plain = re.sub(r"\x1b\[[0-9;]*m", "", logs)
        assert "NIXL agent ready" in plain and "backend=UCX" in plain, plain[-3000:]
        run(["docker", "exec", name, "tandem", "probe"], timeout=60)
    finally:
        run(["docker", "rm", "-f", "-v", name], check=False, timeout=60)
