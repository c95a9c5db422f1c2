"""The rollout-tail notebook runs top to bottom on a small simulated run, so it never rots."""

from pathlib import Path

import matplotlib  # noqa: F401 - the notebook plots; a missing dev extra must fail here, not skip
import nbclient
import nbformat

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "rollout_tails.ipynb"


def test_rollout_tails_notebook_executes(tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_NB_STEPS", "3")
    monkeypatch.setenv("GYRE_NB_LOGS", str(tmp_path / "logs"))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                   for out in cell.outputs)
    assert "tail share" in text and "idle" in text
    images = sum("image/png" in out.get("data", {}) for cell in notebook.cells if cell.cell_type == "code"
                 for out in cell.outputs)
    assert images == 3
    assert (tmp_path / "logs" / "elastic").is_dir()
