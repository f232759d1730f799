"""The HTML report (issue 17, item 3): attention maps read from the models, and `snakemake --report` for the
tiny configuration's Spot-the-Diff table, opened in headless Chromium where Debian's `chromium` is installed."""

import base64
import json
import re
import shutil
import subprocess
import zipfile

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from pipeline.attention_maps import attention_maps, decoder_cross_attention
from pipeline.models import attention_kind, build_model
from pipeline.text import START
from tests.test_workflow import TEST_CONFIG, smk

TABLE = "spot_the_diff"
ITEMS = f"results/report/{TABLE}/items.txt"
FIGURES = {f"results/report/{TABLE}/{f}" for f in ("qualitative.png", "by_type.png", "table.html")} | {
    f"results/{TABLE}/plots/{f}" for f in ("scorer_cbr.png", "dirl_ccr.png", f"{TABLE}_val_cider.png")} | {
    f"results/tables/{TABLE}.csv", f"results/tables/{TABLE}_by_type.csv"}


def tiny_model(method, vocab=12, feat_dim=32):
    hp = yaml.safe_load(TEST_CONFIG.read_text())["methods"][method]["model"]
    torch.manual_seed(0)
    return build_model(method, vocab, feat_dim, hp).eval()


def test_attention_kinds():
    assert attention_kind("duda") == "dual"
    assert {attention_kind(m) for m in ("scorer", "scorer_cbr", "rr", "dirl", "dirl_ccr", "transformer")} == {"token"}
    assert attention_kind("clip4idc") is None and attention_kind("idc_pcl") is None and attention_kind("nope") is None


@pytest.mark.parametrize("method", ["duda", "scorer_cbr", "dirl_ccr"])
def test_attention_maps_are_the_model_s_own(method):
    model = tiny_model(method)
    torch.manual_seed(1)
    before, after = torch.randn(3, 32, 4, 4), torch.randn(3, 32, 4, 4)
    want = model.generate(before, after, 8)
    out = attention_maps(method, model, before, after, 8)
    assert torch.equal(out["caption"], want)  # reading the maps leaves the caption as decoding gave it
    if method == "duda":
        assert out["before"].shape == out["after"].shape == (3, 4, 4)
        assert ((out["before"] >= 0) & (out["before"] <= 1)).all()  # sigmoid maps
        return
    assert out["tokens"].shape == (3, 4, 4)
    torch.testing.assert_close(out["tokens"].sum((1, 2)), torch.ones(3))  # a distribution over the grid
    # the probabilities are those the decoder's last cross-attention weighs the memory with
    memory = model.encode(model.embed(before), model.embed(after))
    memory = memory[0] if isinstance(memory, tuple) else memory
    inputs = torch.cat([torch.full((3, 1), START), want[:, :-1]], 1)
    with torch.no_grad():
        p, dec = decoder_cross_attention(model.decoder, inputs, memory)
        last = model.decoder.layers[-1].cross_attn
        v = last.project_kv(memory)[1]
        attended = last.out_proj((p @ v).transpose(1, 2).reshape(3, inputs.size(1), -1))
    torch.testing.assert_close(attended, dec.attended)


@pytest.fixture(scope="module")
def built(tiny_dag):
    """The report in the tiny DAG's folder: its Spot-the-Diff runs are those tests/test_workflow.py's table uses."""
    wd = tiny_dag
    smk(wd, ITEMS)
    smk(wd, "--report", str(wd / "report.html"), ITEMS)
    smk(wd, "--report", str(wd / "report.zip"), ITEMS)
    return wd


def report_results(html: str) -> dict:
    return json.loads(re.search(r"var results = (\{.*?\});\n", html, flags=re.S).group(1))


@pytest.mark.slow
def test_report_holds_the_figures_and_tables(built):
    assert set((built / ITEMS).read_text().split()) >= FIGURES - {f"results/tables/{TABLE}_by_type.csv"}
    results = report_results((built / "report.html").read_text())
    assert set(results) == FIGURES
    for path, r in results.items():
        assert base64.b64decode(r["data_uri"].split(",", 1)[1]) == (built / path).read_bytes(), path
        assert r["caption"], path  # every item has its caption from workflow/report/
    assert results[f"results/report/{TABLE}/qualitative.png"]["mime_type"] == "image/png"
    page = (built / f"results/report/{TABLE}/table.html").read_text()
    assert page.count("<table") == 3 and "scorer_cbr" in page and "nearest_neighbour" in page
    img = np.asarray(Image.open(built / f"results/report/{TABLE}/qualitative.png").convert("L"), dtype=float)
    assert img.shape[0] > 300 and img.std() > 20
    with zipfile.ZipFile(built / "report.zip") as z:
        names = z.namelist()
    assert "report/report.html" in names and sum(n.endswith("qualitative.png") for n in names) == 1


def screenshot(html, out, size=(1400, 1000)):
    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--virtual-time-budget=8000", f"--window-size={size[0]},{size[1]}", f"--screenshot={out}",
                    html.as_uri()], check=True, capture_output=True, timeout=120)
    return np.asarray(Image.open(out).convert("RGB"), dtype=float)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="Debian's `chromium` is not installed (scripts/setup.sh installs it): no screenshot")
def test_report_screenshot_in_headless_chromium_shows_the_figures(built):
    html = (built / "report.html").read_text()
    home = screenshot(built / "report.html", built / "home.png")
    assert home.shape == (1000, 1400, 3) and home.std() > 20  # the app rendered: menu, description, rule graph
    # the report's own viewer showing the qualitative figure (what a click on it in the menu does)
    path = f"results/report/{TABLE}/qualitative.png"
    show = (f"<script>setTimeout(() => app.setView({{content: 'img', resultPath: '{path}', "
            f"contentPath: results['{path}'].data_uri}}), 200);</script></body>")
    head, _, tail = html.rpartition("</body>")  # the page's own closing tag (scripts hold the string too)
    (built / "figure.html").write_text(head + show + tail)
    fig = screenshot(built / "figure.html", built / "figure.png")
    assert fig.std() > 20
    # the figure's pixels are on screen: the screenshot holds many of the figure's colours (attention overlays)
    colours = len(np.unique(fig.reshape(-1, 3).astype(np.uint8) // 16, axis=0))
    assert colours > len(np.unique(home.reshape(-1, 3).astype(np.uint8) // 16, axis=0)) and colours > 200
