"""docs/writing-a-method.md runs block by block (tests/test_docs.py's rules): a method file, its tests, a comparison
with a report, a plugin. A file of its own so that xdist can run its minutes beside the other pages'."""
from __future__ import annotations

from test_docs import ROOT, doc_env, run_blocks


def test_writing_a_method_tutorial_runs(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    doc = ROOT / "docs" / "writing-a-method.md"
    outputs = run_blocks(doc.name, doc.read_text(), work, doc_env(tmp_path))
    assert len(outputs) == 4
    # the blocks did what the tutorial says: a method file, its tests, a comparison with a report, a plugin
    assert "4 passed" in outputs[0]
    report = (work / "runs" / "la-vs-fedloge" / "report" / "report.md").read_text()
    assert "fedavg-la" in report and "fedloge" in report
    assert list((tmp_path / "site-packages").glob("fedavg_la-*.dist-info/entry_points.txt"))
    assert "(plugin fedavg-la 0.1.0)" in outputs[-1]
