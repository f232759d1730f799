"""`python -m pipeline`: the stage dispatcher's own behaviour."""

import json
import subprocess
import sys


def test_a_stage_without_hparams_runs_without_importing_torch(tmp_path):
    # Evaluation, tables, plots and text run ~30 times in a table's DAG; torch's import is ~1.6 s of CPU each.
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("".join(json.dumps({"pair_id": f"p{i}", "split": "train", "captions": ["a red cube moved"]}) + "\n"
                                for i in range(3)))
    code = ("import sys; from pipeline.__main__ import main; "
            f"rc = main(['text', '--manifest', {str(manifest)!r}, '--out-dir', {str(tmp_path / 'text')!r}]); "
            "print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[-2:] == ["0", "False"]
    assert (tmp_path / "text" / "labels.h5").exists()
