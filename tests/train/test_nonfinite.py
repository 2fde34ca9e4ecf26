"""Non-finite loss policy: `skip` drops the update (weights, optimizer and prior untouched) and
aborts after `train.max_nonfinite` in a row; `abort` stops at once, keeping the last finite state."""

import subprocess
import sys

from tests.conftest import ROOT
from tests.train.helpers import env, metrics

WORKER = ROOT / "tests" / "train" / "nonfinite_worker.py"


def _run(tmp_path, policy, steps):
    return subprocess.run([sys.executable, str(WORKER), str(tmp_path), policy, steps], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=600)


def test_skip_policy_skips_update(tmp_path):
    proc = _run(tmp_path, "skip", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[1].get("skipped") == 1 and "prior_probs" not in rows[1]
    assert all(r.get("skipped") is None for r in rows[2:])


def test_consecutive_nonfinite_aborts_and_keeps_last_finite_state(tmp_path):
    proc = _run(tmp_path, "skip", "2,3")
    assert proc.returncode == 3
    assert "non-finite loss at step 3" in proc.stderr
    assert (tmp_path / "checkpoints" / "step_00000002" / "megaloop.json").is_file()


def test_abort_policy(tmp_path):
    proc = _run(tmp_path, "abort", "2")
    assert proc.returncode == 3 and "non-finite loss at step 2" in proc.stderr
    # the saved state is the one before the bad step was counted: steps completed = 1
    assert (tmp_path / "checkpoints" / "step_00000001" / "megaloop.json").is_file()
