"""deploy/compose with TLS on (compose.yaml + compose.tls.yaml), its certificates made at test time by
deploy/compose/tls-certs.sh (a private CA, the head's and the workers' certificates):

- the OpenAI client answers a chat completion over HTTPS, trusting only the private CA, through the head,
  a prefill worker and a decode worker found by DNS discovery at https:// addresses;
- the KV of that completion moved between the workers (the prefill worker sent it, the decode worker
  received it): over TCP, on a port that speaks only mutual TLS;
- a stranger on the backend network that trusts the CA but has no certificate of its own is refused in the
  TLS handshake on a worker's RPC port and on its KV port, where a member (the workers' certificate)
  passes; the containers' own HEALTHCHECKs (`tandem probe https://…`) pass;
- a client that does not trust the CA is refused by the head.
"""

import ssl

import httpx
import openai
import pytest
import requests

from conftest import COMPOSE_DIR, CPU_IMAGE, MODEL_FILE, run

MODEL = MODEL_FILE.removesuffix(".gguf")
# A prompt past the head's local-prefill threshold (16 tokens), so a prefill worker computes it.
PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a "
          "goldsmith from Mainz, combined movable metal type with an oil-based ink and")


def from_backend(d, tls, script, member=False):
    """Runs `script` (sh) in a throwaway container of the image on the project's backend network, with
    the CA at /tls/ca.crt and, for a `member`, the workers' certificate as its cluster TLS."""
    mounts = ["-v", f"{tls / 'ca.crt'}:/tls/ca.crt:ro"]
    env = []
    if member:
        mounts += ["-v", f"{tls / 'worker.crt'}:/tls/tls.crt:ro", "-v", f"{tls / 'worker.key'}:/tls/tls.key:ro"]
        env = ["-e", "TANDEM_CLUSTER_TLS_CA=/tls/ca.crt", "-e", "TANDEM_CLUSTER_TLS_CERT=/tls/tls.crt",
               "-e", "TANDEM_CLUSTER_TLS_KEY=/tls/tls.key", "-e", "TANDEM_CLUSTER_TLS_SERVER_NAME=tandem-cluster"]
    return run(["docker", "run", "--rm", "--network", d.network("backend"), *mounts, *env,
                "-e", f"TANDEM_API_KEY={d.token}", "--entrypoint", "sh", CPU_IMAGE, "-c", script],
               check=False, timeout=60)


def test_tls_deployment_serves_and_refuses_strangers(deployment, tmp_path):
    tls = tmp_path / "tls"
    run(["bash", str(COMPOSE_DIR / "tls-certs.sh"), str(tls), "2"], timeout=60)
    d = deployment(["compose.yaml", "compose.tls.yaml"], "tls", tls_dir=tls)
    d.up()
    d.healthy()
    d.wait_workers(prefill=1, decode=1)
    for w in d.workers():
        assert w["url"].startswith("https://"), w["url"]

    # A chat completion over HTTPS, the client trusting only the private CA.
    with httpx.Client(verify=ssl.create_default_context(cafile=d.verify), timeout=60) as http:
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, http_client=http)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=4, temperature=0)
    assert r.choices[0].message.content.strip(), r
    assert r.usage.completion_tokens > 0

    # Its KV moved from the prefill worker to the decode worker over the mutual-TLS KV port.
    d.wait_for("the KV of the completion sent by the prefill worker and received by the decode worker",
               lambda: d.healthy_workers("prefill")[0]["load"]["kv"]["bytes_sent"] > 0
               and d.healthy_workers("decode")[0]["load"]["kv"]["bytes_received"] > 0, timeout=30)

    # A client without the CA is refused by the head (its certificate is not one it can check).
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(d.url + "/health", timeout=5)

    # A stranger that trusts the CA (so the handshake gets as far as the client certificate) but has no
    # certificate: refused on both of a worker's ports. Each probe prints its exit code after its output.
    probes = ("tandem probe --ca-cert /tls/ca.crt https://prefill:8100/health; echo rpc=$?; "
              "tandem probe --ca-cert /tls/ca.crt https://prefill:8200/; echo kv=$?")
    out = from_backend(d, tls, probes).stdout
    assert "rpc=1" in out and "kv=1" in out, out
    assert out.count("CertificateRequired") == 2, out
    # A member (the workers' certificate) passes the same port's handshake and is answered.
    out = from_backend(d, tls, "tandem probe https://prefill:8100/v1/worker/info; echo rpc=$?", member=True).stdout
    assert "rpc=0" in out, out

    # The images' HEALTHCHECK, `tandem probe https://127.0.0.1:…/health` with each container's certificate.
    for c in d.containers():
        d.wait_for(f"container {c}'s HEALTHCHECK over TLS",
                   lambda: d.state(c).get("Health", {}).get("Status") == "healthy", timeout=60)
