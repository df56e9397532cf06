"""deploy/grafana/tandem.json queries only metrics tandem exports.

Every metric name in every PromQL expression of the dashboard (panels and template variables) must be
exported by a live server: the head of the embedded P/D deployment (examples/pd.yaml), whose /metrics
carries the API's metrics and the cluster's, and a colocated `tandem serve`. Both serve a request first,
so series created on first use exist. `_bucket`, `_sum` and `_count` names count as their histogram.
P/D workers serve no /metrics of their own: the head reports their load and counters.
"""

import json
import re

import requests

from conftest import MODEL_NAME, ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "tandem.json"
METRIC = re.compile(r"\btandem:[A-Za-z0-9_:]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def expressions(dashboard):
    """(where, PromQL) of every query in the dashboard."""
    out = []

    def walk(panels):
        for panel in panels:
            for target in panel.get("targets", []):
                out.append((f"panel '{panel['title']}' {target['refId']}", target["expr"]))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append((f"variable ${var['name']}", query))
    return out


def exported(server):
    """Names a server's /metrics declares (# TYPE) and the sample names it carries."""
    text = requests.get(server.url + "/metrics", timeout=10).text
    types = {}
    samples = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line and not line.startswith("#"):
            samples.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return types, samples


def is_exported(name, types, samples):
    if name in samples or name in types:
        return True
    for suffix in HISTOGRAM_SUFFIXES:
        base = name[: -len(suffix)]
        if name.endswith(suffix) and types.get(base) == "histogram":
            return True
    return False


def serve_one(server, content):
    r = requests.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
    })
    assert r.status_code == 200, r.text


def test_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] == "tandem"
    assert {v["name"] for v in dashboard["templating"]["list"]} >= {"datasource", "instance"}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in dashboard["panels"]:
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys(), panel["title"]
        refs = [t["refId"] for t in panel.get("targets", [])]
        assert len(refs) == len(set(refs)), panel["title"]
        if panel["type"] != "row":
            assert refs, f"panel '{panel['title']}' has no query"
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    for where, expr in expressions(dashboard):
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), f"{where}: {expr}"
        assert METRIC.search(expr), f"{where} queries no tandem metric: {expr}"


def test_every_dashboard_metric_is_exported(pd_server, server):
    serve_one(pd_server, "Tell me about the history of lighthouses and their keepers, in detail please.")
    serve_one(server, "Hello there.")
    pd_types, pd_samples = exported(pd_server)
    co_types, co_samples = exported(server)
    assert "tandem:kv_transfer_bytes_total" in pd_types and "tandem:num_requests_running" in co_types
    missing = []
    queried = set()
    for where, expr in expressions(json.loads(DASHBOARD.read_text())):
        for name in METRIC.findall(expr):
            queried.add(name)
            if not (is_exported(name, pd_types, pd_samples) or is_exported(name, co_types, co_samples)):
                missing.append(f"{where}: {name}")
    assert not missing, "the dashboard queries metrics tandem does not export:\n" + "\n".join(missing)
    # The dashboard covers what the task asks of it: per-role throughput, latency percentiles, KV use,
    # transfer rate and failures, queue depth and routing decisions.
    for needed in ("tandem:worker_generation_tokens_total", "tandem:time_to_first_token_seconds_bucket",
                   "tandem:inter_token_latency_seconds_bucket", "tandem:worker_kv_blocks_used",
                   "tandem:kv_transfer_bytes_total", "tandem:kv_transfer_failures_total",
                   "tandem:role_queue_depth", "tandem:pd_requests_total"):
        assert needed in queried, needed
