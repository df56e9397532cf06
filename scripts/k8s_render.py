"""Renders the tandem Helm chart offline with Helm's own engine (helm-python-sdk: Helm v4's Go library),
for machines without the `helm` command. Prints the manifests the way `helm template` does.
Usage: python k8s_render.py CHART RELEASE NAMESPACE [VALUES.yaml ...]"""

import sys

import helm_python
import yaml


def merge(base, over):
    """Later values files win key by key, maps merged deeply, like helm's -f -f (a null stays null, which
    the chart's defaults then lose, as with helm)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def main():
    chart_dir, release, namespace, *files = sys.argv[1:]
    values = {}
    for f in files:
        with open(f) as fh:
            values = merge(values, yaml.safe_load(fh) or {})
    chart = helm_python.Chart.load(chart_dir)
    try:
        rendered = chart.render(values, name=release, namespace=namespace, is_install=True)
    except helm_python.HelmError as e:
        sys.exit(f"k8s-render: {e}")
    for path in sorted(rendered):
        if path.endswith("NOTES.txt") or not rendered[path].strip():
            continue
        print(f"---\n# Source: {path}\n{rendered[path].strip()}")


if __name__ == "__main__":
    main()
