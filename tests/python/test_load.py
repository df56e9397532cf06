"""The CI-sized run of scripts/load_disconnects.py: 100 concurrent streaming clients against the embedded
P/D deployment, a third hanging up at random points, three rounds; the workers must end idle with no KV
block in use or pinned, no survivor's stream may carry an error, and memory must not grow in the last
round. The 1,000-client run and its figures are in docs/reliability.md."""

import json
import subprocess
import sys

from conftest import ROOT, TANDEM_BIN


def test_hundred_streaming_clients_a_third_hanging_up_leave_nothing_behind():
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "load_disconnects.py"), "--clients", "100", "--bin", TANDEM_BIN],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    stats = json.loads(run.stdout.strip().splitlines()[-1])
    assert stats["completed"] > 0 and stats["dropped"] > 0, stats
    assert stats["completed"] + stats["dropped"] == 300, stats
    assert all(w["kv_blocks_used"] == 0 and w["pinned_blocks"] == 0 for w in stats["workers"]), stats
