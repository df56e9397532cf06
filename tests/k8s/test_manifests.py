"""tandem's Helm chart (deploy/helm/tandem): every profile of scripts/k8s-render.sh (`--list`; Helm's
engine renders it, as `helm template` would) is checked:

- every object against the Kubernetes 1.31 JSON schemas in strict mode (kubernetes-validate, bundled
  schemas, no network); the ServiceMonitor is a CRD without a bundled schema, so it is checked structurally
  here instead (API version, kind, a selector and port that match the head's Service, the /metrics path);
  any other kind without a schema fails;
- the wiring the schemas cannot see: the head's config (the ConfigMap's tandem.yaml) names the headless
  Services and ports the workers serve on, the workers' --model/--block-size/--transport agree with it,
  POD_IP comes from the downward API, probes ask /health, the termination grace period covers the preStop
  sleep plus the worker's drain, PodDisruptionBudgets select each pool, prefill and decode repel each other
  per node, the head stays off GPU nodes, GPU workers ask for nvidia.com/gpu; the cluster token's Secret
  exists (random, made by the chart) unless clusterToken.existingSecret names one, and the head and both
  pools take TANDEM_CLUSTER_TOKEN from it;
- the ConfigMap's tandem.yaml with `tandem serve --check-config FILE` ($TANDEM_BIN, default
  target/release/tandem). A binary that reports the flag unknown (built before the flag existed) skips that
  one check, saying so; any other failure fails.
"""

import base64
import json
import os
import pathlib
import re
import subprocess

import kubernetes_validate
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "tandem"
RENDER = ROOT / "scripts" / "k8s-render.sh"
TANDEM_BIN = os.environ.get("TANDEM_BIN", str(ROOT / "target" / "release" / "tandem"))
K8S_VERSION = "1.31.0"
PROFILES = subprocess.run(["bash", str(RENDER), "--list"], capture_output=True, text=True, check=True).stdout.split()
ROLES = ("prefill", "decode")
# The worker's drain on SIGTERM lasts at most drain_grace_secs (default 30) and the pod's grace period
# must cover the preStop sleep, that and some margin for the exit.
DEFAULT_DRAIN_GRACE_SECS = 30
MIN_MARGIN_SECS = 5

_rendered = {}


def render_with(args, env=None):
    out = subprocess.run(
        ["bash", str(RENDER), *args], capture_output=True, text=True, timeout=120,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, f"k8s-render.sh {' '.join(args)} failed:\n{out.stderr}"
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert docs, f"k8s-render.sh {' '.join(args)} printed no objects"
    return docs


def render(profile):
    if profile not in _rendered:
        _rendered[profile] = render_with([profile])
    return _rendered[profile]


class Manifests:
    def __init__(self, profile, docs=None, prefix="tandem"):
        self.profile = profile
        self.prefix = prefix
        self.docs = docs if docs is not None else render(profile)

    def all(self, kind):
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind, name):
        found = [d for d in self.docs if d["kind"] == kind and d["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.profile}: expected one {kind} {name}, found {len(found)}"
        return found[0]

    def deployment(self, component):
        return self.get("Deployment", f"{self.prefix}-{component}")

    def service(self, name):
        return self.get("Service", name)

    def container(self, component):
        containers = self.deployment(component)["spec"]["template"]["spec"]["containers"]
        assert len(containers) == 1, f"{component}: one container expected"
        return containers[0]

    def config_map(self):
        maps = [d for d in self.all("ConfigMap") if d["metadata"]["name"] == f"{self.prefix}-config"]
        assert len(maps) == 1, f"{self.profile}: expected one tandem-config ConfigMap"
        return maps[0]

    def tandem_config(self):
        return yaml.safe_load(self.config_map()["data"]["tandem.yaml"])


@pytest.fixture(params=PROFILES)
def m(request):
    return Manifests(request.param)


def flag(args, name):
    """The value of `--name VALUE` in a container's args (None when absent)."""
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]
    assert len(values) <= 1, f"{name} given twice: {args}"
    return values[0] if values else None


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def pod_labels(m, component):
    return m.deployment(component)["spec"]["template"]["metadata"]["labels"]


def test_there_are_profiles():
    assert {"cpu", "gpu"} <= set(PROFILES), PROFILES


def test_render_refuses_an_unknown_profile():
    out = subprocess.run(["bash", str(RENDER), "no-such-profile"], capture_output=True, text=True)
    assert out.returncode != 0 and "no profile 'no-such-profile'" in out.stderr, out.stderr


def without_random_tokens(docs):
    """The objects with each Secret's data blanked: the chart's cluster token is random at every render."""
    return [{**d, "data": "(random)"} if d["kind"] == "Secret" else d for d in docs]


def test_render_defaults_to_the_cpu_profile():
    out = subprocess.run(["bash", str(RENDER)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert without_random_tokens(rendered) == without_random_tokens(render("cpu"))


def test_strict_validation_rejects_an_unknown_field():
    """Guards the schema test itself: strict 1.31 validation must refuse a misspelt field."""
    deployment = Manifests("cpu").deployment("decode")
    bad = yaml.safe_load(yaml.safe_dump(deployment))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/health"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def check_service_monitor(m, sm):
    """ServiceMonitor is the Prometheus Operator's CRD: no schema is bundled, so its shape is checked here."""
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(sm) <= {"apiVersion", "kind", "metadata", "spec"}, sorted(sm)
    spec = sm["spec"]
    assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}, sorted(spec)
    head = m.service(f"{m.prefix}-head")
    selector = spec["selector"]["matchLabels"]
    assert selects(selector, head["metadata"]["labels"]), "the ServiceMonitor must select the head's Service"
    for other in ROLES:
        assert not selects(selector, m.service(f"{m.prefix}-{other}")["metadata"]["labels"])
    ports = {p["name"] for p in head["spec"]["ports"]}
    assert spec["endpoints"], "no endpoints"
    for ep in spec["endpoints"]:
        assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}, sorted(ep)
        assert ep["port"] in ports, f"endpoint port {ep['port']} is not a port of tandem-head ({ports})"
        assert ep["path"] == "/metrics"


def test_every_object_is_valid_kubernetes_1_31_strict(m):
    failures = []
    for doc in m.docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "ServiceMonitor":
            check_service_monitor(m, doc)
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            failures.append(f"{name}: {e.message} at {'/'.join(map(str, e.path))}")
        except kubernetes_validate.SchemaNotFoundError:
            failures.append(f"{name}: no Kubernetes {K8S_VERSION} schema for {doc['apiVersion']} {doc['kind']}")
    assert not failures, f"{m.profile}:\n" + "\n".join(failures)


def test_the_objects_are_there(m):
    kinds = sorted({d["kind"] for d in m.docs})
    assert {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"} <= set(kinds), kinds
    for component in ("head",) + ROLES:
        m.deployment(component)
        m.get("PodDisruptionBudget", f"{m.prefix}-{component}")
    assert m.service(f"{m.prefix}-head")["spec"].get("clusterIP") != "None"


def cluster_token_ref(m, component):
    """The secretKeyRef a component's TANDEM_CLUSTER_TOKEN comes from."""
    env = {e["name"]: e for e in m.container(component).get("env", [])}
    assert "TANDEM_CLUSTER_TOKEN" in env, f"{m.profile} {component}: no TANDEM_CLUSTER_TOKEN"
    return env["TANDEM_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]


def test_the_cluster_token_secret_exists_and_every_pod_reads_it(m):
    """Workers bind 0.0.0.0 and refuse to start without a token: with none given, the chart makes a Secret
    with a random one, and the head and both pools read TANDEM_CLUSTER_TOKEN from it."""
    name = f"{m.prefix}-cluster-token"
    secret = m.get("Secret", name)
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) >= 32 and token.isalnum(), f"{m.profile}: a weak or unprintable token"
    for component in ("head",) + ROLES:
        assert cluster_token_ref(m, component) == {"name": name, "key": "token"}, component


def test_an_existing_secret_replaces_the_charts_own(tmp_path):
    f = values_file(tmp_path, {"clusterToken": {"existingSecret": "my-cluster-token", "key": "secret"}})
    m = Manifests("custom", render_with(["cpu", "-f", f]))
    assert not m.all("Secret"), "the chart made a Secret beside the one it was given"
    for component in ("head",) + ROLES:
        assert cluster_token_ref(m, component) == {"name": "my-cluster-token", "key": "secret"}, component
    test_every_object_is_valid_kubernetes_1_31_strict(m)


def cluster_tls_env(m, component):
    return {e["name"]: e.get("value") for e in m.container(component).get("env", []) if "CLUSTER_TLS" in e["name"]}


def test_cluster_tls_is_off_by_default(m):
    for component in ("head",) + ROLES:
        assert not cluster_tls_env(m, component), f"{m.profile} {component}"
    assert not m.all("Certificate")


def test_cluster_tls_from_a_secret_reaches_every_pod(tmp_path):
    """clusterTls with an existing Secret: every pod mounts it and names its files in TANDEM_CLUSTER_TLS_*
    (with the one server name peers check), and the workers' probes run `tandem probe https://...` in the pod,
    since their port asks for a cluster certificate the kubelet does not have."""
    f = values_file(tmp_path, {"clusterTls": {"enabled": True, "existingSecret": "my-tls", "serverName": "tandem.internal"}})
    m = Manifests("custom", render_with(["cpu", "-f", f]))
    for component in ("head",) + ROLES:
        env = cluster_tls_env(m, component)
        assert env == {
            "TANDEM_CLUSTER_TLS_CA": "/etc/tandem-tls/ca.crt",
            "TANDEM_CLUSTER_TLS_CERT": "/etc/tandem-tls/tls.crt",
            "TANDEM_CLUSTER_TLS_KEY": "/etc/tandem-tls/tls.key",
            "TANDEM_CLUSTER_TLS_SERVER_NAME": "tandem.internal",
        }, component
        spec = m.deployment(component)["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["cluster-tls"]["secret"]["secretName"] == "my-tls", component
        mounts = {v["name"]: v for v in m.container(component)["volumeMounts"]}
        assert mounts["cluster-tls"]["mountPath"] == "/etc/tandem-tls" and mounts["cluster-tls"]["readOnly"]
    for role in ROLES:
        c = m.container(role)
        rpc = flag(c["args"], "--port")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["exec"]["command"] == ["tandem", "probe", f"https://127.0.0.1:{rpc}/health"], probe
    assert not m.all("Certificate"), "a Certificate beside the Secret given"
    test_every_object_is_valid_kubernetes_1_31_strict(m)
    test_every_command_line_parses_with_the_binary(m)


def test_cluster_tls_from_cert_manager(tmp_path):
    f = values_file(tmp_path, {"clusterTls": {"enabled": True, "certManager": {"enabled": True, "issuerRef": {"name": "tandem-ca"}}}})
    m = Manifests("custom", render_with(["cpu", "-f", f]))
    cert = m.get("Certificate", "tandem-cluster-tls")
    assert cert["apiVersion"] == "cert-manager.io/v1"
    spec = cert["spec"]
    assert spec["secretName"] == "tandem-cluster-tls"
    assert spec["dnsNames"] == ["tandem-cluster"]
    assert {"server auth", "client auth"} <= set(spec["usages"])
    assert spec["issuerRef"] == {"name": "tandem-ca", "kind": "Issuer", "group": "cert-manager.io"}
    for component in ("head",) + ROLES:
        volumes = {v["name"]: v for v in m.deployment(component)["spec"]["template"]["spec"]["volumes"]}
        assert volumes["cluster-tls"]["secret"]["secretName"] == "tandem-cluster-tls", component


def test_cluster_tls_needs_a_source_of_certificates(tmp_path):
    for values, wanted in (
        ({"clusterTls": {"enabled": True}}, "clusterTls.existingSecret or clusterTls.certManager.enabled"),
        ({"clusterTls": {"enabled": True, "certManager": {"enabled": True}}}, "clusterTls.certManager.issuerRef.name"),
    ):
        out = subprocess.run(
            ["bash", str(RENDER), "cpu", "-f", values_file(tmp_path, values)], capture_output=True, text=True, timeout=120
        )
        assert out.returncode != 0 and wanted in out.stderr, (values, out.stderr)


def test_pdbs_select_their_pool(m):
    for component in ("head",) + ROLES:
        pdb = m.get("PodDisruptionBudget", f"{m.prefix}-{component}")
        labels = pod_labels(m, component)
        assert selects(pdb["spec"]["selector"]["matchLabels"], labels), component
        others = [c for c in ("head",) + ROLES if c != component]
        assert not any(selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(m, o)) for o in others)
        # Never a budget that blocks every eviction of a one-pod pool.
        assert "maxUnavailable" in pdb["spec"] or m.deployment(component)["spec"]["replicas"] > pdb["spec"]["minAvailable"]


def test_head_config_discovers_the_headless_services(m):
    cfg = m.tandem_config()
    dep = cfg["deployment"]
    assert dep["mode"] == "pd"
    assert dep["discovery"]["mode"] == "dns"
    for role in ROLES:
        assert dep[role]["replicas"] == 0, f"{role}: the head must start no workers of its own"
        host, port = dep["discovery"][role].rsplit(":", 1)
        svc = m.service(host)
        assert svc["spec"]["clusterIP"] == "None", f"{host} must be headless (one DNS record per pod)"
        assert svc["spec"].get("publishNotReadyAddresses", False) is False
        assert selects(svc["spec"]["selector"], pod_labels(m, role)), f"{host} does not select the {role} pods"
        assert not any(selects(svc["spec"]["selector"], pod_labels(m, o)) for o in ("head",) + ROLES if o != role)
        by_port = {p["port"]: p for p in svc["spec"]["ports"]}
        assert int(port) in by_port, f"{host} has no port {port}"
        c = m.container(role)
        assert flag(c["args"], "--port") == port, f"{role} worker serves on {flag(c['args'], '--port')}, head dials {port}"
        named = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert named[by_port[int(port)]["targetPort"]] == int(port)


def test_head_serves_its_config(m):
    cfg = m.tandem_config()
    c = m.container("head")
    assert c["args"][:1] == ["serve"]
    cfg_path = flag(c["args"], "--config")
    mounts = {v["mountPath"]: v["name"] for v in c["volumeMounts"]}
    volumes = {v["name"]: v for v in m.deployment("head")["spec"]["template"]["spec"]["volumes"]}
    config_volume = volumes[mounts[str(pathlib.PurePosixPath(cfg_path).parent)]]
    assert config_volume["configMap"]["name"] == m.config_map()["metadata"]["name"]
    assert pathlib.PurePosixPath(cfg_path).name in m.config_map()["data"]
    assert cfg["server"]["host"] == "0.0.0.0", "the head must listen beyond its loopback"
    port = cfg["server"]["port"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["http"] == port
    svc_ports = m.service(f"{m.prefix}-head")["spec"]["ports"]
    assert any(p["targetPort"] == "http" for p in svc_ports)


def test_workers_agree_with_the_head(m):
    cfg = m.tandem_config()
    block_size = cfg.get("engine", {}).get("block_size")
    transport = cfg["deployment"].get("kv_transfer", {}).get("transport", "tcp")
    for role in ROLES:
        args = m.container(role)["args"]
        assert args[0] == "worker" and flag(args, "--role") == role
        assert flag(args, "--model") == cfg["model"], f"{role} --model differs from the head's model"
        if block_size is not None or flag(args, "--block-size") is not None:
            assert flag(args, "--block-size") == str(block_size), f"{role} --block-size differs from engine.block_size"
        assert (flag(args, "--transport") or "tcp") == transport, f"{role} --transport differs from kv_transfer.transport"
        assert flag(args, "--host") == "0.0.0.0"
        assert flag(args, "--kv-port") is not None


def test_model_volume_is_mounted_read_only(m):
    cfg = m.tandem_config()
    for component in ("head",) + ROLES:
        c = m.container(component)
        model_mounts = [v for v in c["volumeMounts"] if cfg["model"].startswith(v["mountPath"].rstrip("/") + "/")]
        assert len(model_mounts) == 1, f"{component}: the model {cfg['model']} is on no mounted volume"
        assert model_mounts[0].get("readOnly") is True
        volumes = {v["name"]: v for v in m.deployment(component)["spec"]["template"]["spec"]["volumes"]}
        source = volumes[model_mounts[0]["name"]]
        assert ("persistentVolumeClaim" in source) != ("hostPath" in source), source


def test_workers_advertise_their_pod_ip(m):
    for role in ROLES:
        c = m.container(role)
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert flag(c["args"], "--advertise-host") == "$(POD_IP)"
        # $(VAR) is only expanded for variables defined in env.
        for ref in re.findall(r"\$\((\w+)\)", " ".join(c["args"])):
            assert ref in env, f"{role}: $({ref}) in args but not in env"


def test_probes_and_drain(m):
    for role in ROLES:
        spec = m.deployment(role)["spec"]["template"]["spec"]
        c = m.container(role)
        rpc = flag(c["args"], "--port")
        ports = {p["name"]: str(p["containerPort"]) for p in c["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = c[probe]["httpGet"]
            assert get["path"] == "/health", f"{role} {probe}"
            assert ports.get(get["port"], str(get["port"])) == rpc, f"{role} {probe} port"
        pre_stop = c["lifecycle"]["preStop"]
        sleep = pre_stop["sleep"]["seconds"] if "sleep" in pre_stop else 0
        grace = int(flag(c["args"], "--drain-grace-secs") or DEFAULT_DRAIN_GRACE_SECS)
        need = sleep + grace + MIN_MARGIN_SECS
        assert spec["terminationGracePeriodSeconds"] >= need, (
            f"{role}: terminationGracePeriodSeconds {spec['terminationGracePeriodSeconds']} < preStop {sleep} + "
            f"drain {grace} + {MIN_MARGIN_SECS}"
        )
    head = m.container("head")
    assert head["readinessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("startupProbe", "livenessProbe"):
        assert probe in head
    # The head waits for its open requests on SIGTERM: its grace outlasts its preStop sleep by 30 s or more.
    head_sleep = head["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert m.deployment("head")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= head_sleep + 30


def test_prefill_and_decode_never_share_a_node(m):
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        spec = m.deployment(role)["spec"]["template"]["spec"]
        anti = spec["affinity"]["podAntiAffinity"]
        # Required in the shipped profiles; a profile may relax it to preferred (single-node clusters).
        if m.profile in ("cpu", "gpu"):
            assert set(anti) == {"requiredDuringSchedulingIgnoredDuringExecution"}, anti
        terms = anti.get("requiredDuringSchedulingIgnoredDuringExecution", []) + [
            t["podAffinityTerm"] for t in anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])
        ]
        assert any(
            t["topologyKey"] == "kubernetes.io/hostname"
            and selects(t["labelSelector"]["matchLabels"], pod_labels(m, other))
            for t in terms
        ), f"{role} pods do not repel {other} pods per node"
        spreads = spec["topologySpreadConstraints"]
        assert any(selects(s["labelSelector"]["matchLabels"], pod_labels(m, role)) for s in spreads)


def test_the_head_runs_on_cpu_nodes(m):
    spec = m.deployment("head")["spec"]["template"]["spec"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert all(
        {"key": "nvidia.com/gpu.present", "operator": "DoesNotExist"} in t["matchExpressions"] for t in terms
    )
    c = m.container("head")
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert not c["image"].endswith(":cuda")
    assert not any(t.get("key") == "nvidia.com/gpu" for t in spec.get("tolerations", []))


def test_gpu_workers_ask_for_a_gpu(m):
    cfg = m.tandem_config()
    for role in ROLES:
        c = m.container(role)
        on_gpu = flag(c["args"], "--device") == "cuda"
        gpus = int(c["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        assert on_gpu == (gpus >= 1), f"{role}: --device cuda and nvidia.com/gpu go together"
        assert on_gpu == c["image"].endswith(":cuda"), f"{role}: --device cuda needs the CUDA image"
        if flag(c["args"], "--transport") == "nixl":
            assert on_gpu, f"{role}: nixl is the GPU profile's transport"
    if m.profile.startswith("gpu"):
        assert flag(m.container("prefill")["args"], "--device") == "cuda"
        assert cfg["deployment"]["kv_transfer"]["transport"] == "nixl"


def test_efa_only_on_gpu_workers(m):
    for role in ROLES:
        c = m.container(role)
        efa = c["resources"].get("limits", {}).get("vpc.amazonaws.com/efa")
        if "efa" in m.profile:
            assert efa is not None and int(efa) >= 1, f"{role}: an EFA profile without EFA"
        if efa is not None:
            assert int(efa) >= 1 and flag(c["args"], "--device") == "cuda", f"{role}: EFA on a CPU worker"
    assert "vpc.amazonaws.com/efa" not in m.container("head")["resources"].get("limits", {})


def expand(args, env):
    """Kubernetes' $(VAR) expansion of container args, with stand-in values for the downward API."""
    values = {"POD_IP": "10.0.0.7", "POD_NAME": "tandem-decode-5d9c7b-x2k8q"}
    names = {e["name"] for e in env}
    return [re.sub(r"\$\((\w+)\)", lambda g: values[g.group(1)] if g.group(1) in names else g.group(0), a) for a in args]


def test_every_command_line_parses_with_the_binary(m):
    """Each container's command line, given to the release binary with --help appended: clap rejects an
    unknown flag or a value it cannot parse before it gets to --help, so exit 0 means every flag and value
    of the manifests is one the binary takes (nothing runs)."""
    if not os.path.exists(TANDEM_BIN):
        pytest.fail(f"{TANDEM_BIN} not found: build it (cargo build --release -p tandem) or set TANDEM_BIN")
    for component in ("head",) + ROLES:
        c = m.container(component)
        assert c["command"] == ["tandem"], component
        args = expand(c["args"], c.get("env", []))
        out = subprocess.run([TANDEM_BIN, *args, "--help"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, f"{m.profile} {component}: tandem {' '.join(args)}\n{out.stderr}"


def check_config_result(path):
    out = subprocess.run(
        [TANDEM_BIN, "serve", "--check-config", str(path)], capture_output=True, text=True, timeout=60
    )
    return out.returncode, out.stdout + out.stderr


def test_the_configmap_passes_check_config(m, tmp_path):
    if not os.path.exists(TANDEM_BIN):
        pytest.fail(f"{TANDEM_BIN} not found: build it (cargo build --release -p tandem) or set TANDEM_BIN")
    path = tmp_path / "tandem.yaml"
    path.write_text(m.config_map()["data"]["tandem.yaml"])
    rc, out = check_config_result(path)
    if rc != 0 and re.search(r"unexpected argument '--check-config'", out):
        pytest.skip(f"{TANDEM_BIN} has no `serve --check-config` yet (it reports the flag unknown)")
    assert rc == 0, f"{m.profile}: tandem serve --check-config failed ({rc}):\n{out}"


def test_check_config_refuses_a_bad_key(tmp_path):
    """The same check must be able to fail: an unknown key is refused, naming it."""
    if not os.path.exists(TANDEM_BIN):
        pytest.fail(f"{TANDEM_BIN} not found: build it (cargo build --release -p tandem) or set TANDEM_BIN")
    cfg = Manifests("cpu").tandem_config()
    cfg["deployment"]["discovery"]["intervall_secs"] = 3
    path = tmp_path / "tandem.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc, out = check_config_result(path)
    if rc != 0 and re.search(r"unexpected argument '--check-config'", out):
        pytest.skip(f"{TANDEM_BIN} has no `serve --check-config` yet (it reports the flag unknown)")
    assert rc != 0 and "intervall_secs" in out, f"rc {rc}:\n{out}"


def values_file(tmp_path, values):
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def test_one_value_moves_the_head_and_the_workers_together(tmp_path):
    """block_size, the model, the transport and the RPC port are each one value: the config and the
    workers' flags change together, and the discovery names follow the release name."""
    f = values_file(tmp_path, {
        "engine": {"block_size": 32},
        "model": {"path": "/models/other.gguf"},
        "workers": {"rpcPort": 9100},
    })
    m = Manifests("custom", render_with(["cpu", "-f", f], {"TANDEM_RELEASE": "llm"}), prefix="llm-tandem")
    cfg = m.tandem_config()
    assert cfg["engine"]["block_size"] == 32 and cfg["model"] == "/models/other.gguf"
    assert cfg["deployment"]["discovery"]["decode"] == "llm-tandem-decode:9100"
    test_workers_agree_with_the_head(m)
    test_head_config_discovers_the_headless_services(m)
    test_every_object_is_valid_kubernetes_1_31_strict(m)


def test_a_pool_overrides_the_shared_worker_values():
    m = Manifests("eks-example")
    decode, prefill = m.container("decode")["args"], m.container("prefill")["args"]
    assert flag(decode, "--kv-cache-memory") == "64GiB" and flag(prefill, "--kv-cache-memory") == "32GiB"
    assert flag(decode, "--max-num-seqs") == "128" and flag(prefill, "--max-num-seqs") is None
    spec = lambda role: m.deployment(role)["spec"]["template"]["spec"]
    assert spec("decode")["nodeSelector"] != spec("prefill")["nodeSelector"]
    assert m.deployment("decode")["spec"]["replicas"] == 4 and m.deployment("prefill")["spec"]["replicas"] == 2
    assert m.tandem_config()["served_model_name"] == "llama-3.1-8b"


def test_the_grace_period_follows_the_drain(tmp_path):
    f = values_file(tmp_path, {"workers": {"drainGraceSecs": 120}})
    m = Manifests("custom", render_with(["cpu", "-f", f]))
    assert m.deployment("decode")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 5 + 120 + 10


def test_a_config_change_rolls_the_heads(tmp_path):
    f = values_file(tmp_path, {"discovery": {"intervalSecs": 5}})
    before = Manifests("cpu").deployment("head")["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    m = Manifests("custom", render_with(["cpu", "-f", f]))
    assert m.deployment("head")["spec"]["template"]["metadata"]["annotations"]["checksum/config"] != before


def test_the_grafana_dashboard_ships_as_a_sidecar_configmap(tmp_path):
    """grafanaDashboard.enabled (on in the gpu-efa profile, off by default) puts deploy/grafana/tandem.json,
    unchanged, in a ConfigMap labelled for Grafana's dashboard sidecar."""
    name = "tandem-grafana-dashboard"
    assert not [d for d in Manifests("cpu").all("ConfigMap") if d["metadata"]["name"] == name]
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "tandem.json").read_text())
    cm = Manifests("gpu-efa").get("ConfigMap", name)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "tandem"}
    assert json.loads(cm["data"]["tandem.json"]) == dashboard
    f = values_file(tmp_path, {"grafanaDashboard": {"enabled": True, "labels": {"dashboards": "tandem"}}})
    cm = Manifests("custom", render_with(["cpu", "-f", f])).get("ConfigMap", name)
    assert cm["metadata"]["labels"]["dashboards"] == "tandem" and "annotations" not in cm["metadata"]
    assert json.loads(cm["data"]["tandem.json"]) == dashboard


def test_bad_values_are_refused_naming_them(tmp_path):
    for values, key in (
        ({"model": {"volume": {"type": "nfs"}}}, "/model/volume/type"),
        ({"workers": {"antiAffinity": "sometimes"}}, "/workers/antiAffinity"),
        ({"decode": {"replica": 3}}, "'replica'"),
        ({"head": {"servce": {"type": "LoadBalancer"}}}, "'servce'"),
        ({"workers": {"device": "tpu"}}, "/workers/device"),
        ({"grafanaDashboard": {"enable": True}}, "'enable'"),
    ):
        out = subprocess.run(
            ["bash", str(RENDER), "cpu", "-f", values_file(tmp_path, values)], capture_output=True, text=True, timeout=120
        )
        assert out.returncode != 0 and key in out.stderr, (values, out.stderr)


@pytest.mark.parametrize("values_files", [[], ["values-gpu.yaml"]])
def test_helm_lint_strict(values_files):
    """`helm lint --strict` (Helm's own linter, through its engine): no warning and no error; an
    informational note (e.g. "icon is recommended") is allowed."""
    import helm_python

    values = {}
    for f in values_files:
        values.update(yaml.safe_load((CHART / f).read_text()))
    report = helm_python.lint(str(CHART), values, strict=True, kube_version="v" + K8S_VERSION)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


def test_render_runs_the_helm_command_where_there_is_one(tmp_path):
    """With `helm` on PATH (a user's machine) the script hands the profile's values files, then the user's,
    to `helm template`; a stand-in `helm` records the command line."""
    fake = tmp_path / "bin" / "helm"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    mine = values_file(tmp_path, {"decode": {"replicas": 3}})
    out = subprocess.run(
        ["bash", str(RENDER), "gpu-efa", "-f", mine], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "TANDEM_RELEASE": "llm"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:-1] == [
        "template", "llm", str(CHART), "--namespace", "default", "--kube-version", "1.31.0",
        "-f", str(CHART / "values-gpu.yaml"), "-f", str(CHART / "ci" / "efa-monitoring-values.yaml"), "-f", mine,
    ]


def test_autoscaling_is_off_by_default_and_keda_scales_each_pool_when_on(tmp_path):
    """autoscaling.enabled (off by default) adds one KEDA ScaledObject per pool: it targets the pool's
    Deployment (which then carries no replica count of its own), within the bounds, on the heads'
    per-role token rate (the planner's tokens per replica as threshold) and queue depth, with the HPA's
    stabilization windows as hysteresis. KEDA's CRD has no bundled schema: its shape is checked here."""
    assert not Manifests("cpu").all("ScaledObject")
    for role in ROLES:
        assert Manifests("cpu").deployment(role)["spec"]["replicas"] >= 1
    f = values_file(tmp_path, {"autoscaling": {"enabled": True,
                                               "decode": {"minReplicas": 2, "maxReplicas": 6,
                                                          "tokensPerSecondPerReplica": 320}}})
    m = Manifests("custom", render_with(["cpu", "-f", f]))
    for role in ROLES:
        so = m.get("ScaledObject", f"{m.prefix}-{role}")
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        assert set(so) <= {"apiVersion", "kind", "metadata", "spec"}, sorted(so)
        spec = so["spec"]
        assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval",
                             "cooldownPeriod", "advanced", "triggers"}, sorted(spec)
        target = spec["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", f"{m.prefix}-{role}")
        assert "replicas" not in m.deployment(role)["spec"], f"{role}: the HPA owns the replica count"
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] > behavior["scaleUp"]["stabilizationWindowSeconds"]
        assert behavior["scaleDown"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 300}]
        tokens, queue = spec["triggers"]
        assert tokens["type"] == queue["type"] == "prometheus"
        metric = "tandem:worker_prompt_tokens_total" if role == "prefill" else "tandem:worker_generation_tokens_total"
        assert metric in tokens["metadata"]["query"] and 'service="tandem-head"' in tokens["metadata"]["query"]
        assert f'tandem:role_queue_depth{{role="{role}"' in queue["metadata"]["query"]
        # The HPA's own object (built by KEDA) must be valid Kubernetes: check the behavior section.
        hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "x"},
               "spec": {"scaleTargetRef": target, "minReplicas": spec["minReplicaCount"],
                        "maxReplicas": spec["maxReplicaCount"], "behavior": behavior}}
        kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    decode = m.get("ScaledObject", f"{m.prefix}-decode")["spec"]
    assert (decode["minReplicaCount"], decode["maxReplicaCount"]) == (2, 6)
    assert decode["triggers"][0]["metadata"]["threshold"] == "320"
    bad = values_file(tmp_path, {"autoscaling": {"enabled": True, "decode": {"minReplicas": 5, "maxReplicas": 2}}})
    out = subprocess.run(["bash", str(RENDER), "cpu", "-f", bad], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "autoscaling.decode.minReplicas" in out.stderr, out.stderr
    bad = values_file(tmp_path, {"autoscaling": {"decode": {"maxReplica": 2}}})
    out = subprocess.run(["bash", str(RENDER), "cpu", "-f", bad], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "'maxReplica'" in out.stderr, out.stderr
