"""A rendered report as a browser shows it: headless Chromium takes a screenshot (not blank), every figure decodes
from its embedded data URI, and every format is named on the page. Skipped where no chromium binary exists
(Debian: apt-get install chromium)."""
import base64
import re
import shutil
import subprocess

import pytest

from kvarn.report import build_report
from kvarn.report.fixtures import DEMO_FORMATS, write_demo_results
from kvarn.report.plots import label

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome", "chrome")
                 if shutil.which(n)), None)
pytestmark = [pytest.mark.browser, pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary")]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
         "--no-first-run", "--virtual-time-budget=8000"]
# marks each <img> 1 once the browser has decoded it (complete with a width), 0 otherwise
PROBE = ("<script>window.addEventListener('load',function(){document.body.setAttribute('data-loaded',"
         "Array.prototype.map.call(document.images,function(i){return i.complete&&i.naturalWidth>0?1:0}).join(''))})"
         "</script></body>")


def _chromium(*args, timeout=120):
    return subprocess.run([CHROMIUM, *FLAGS, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def demo_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    write_demo_results(root / "res", models=(("qwen3-8b", 1), ("qwen3-32b", 2)), bursts=(4096, 16384), repeats=1)
    return build_report(root / "res", root / "rep", illustrative=True)


def test_screenshot_is_not_blank(demo_report, tmp_path):
    from PIL import Image, ImageStat

    shot = tmp_path / "page.png"
    r = _chromium(f"--screenshot={shot}", "--window-size=1400,2600", demo_report.html.as_uri())
    assert shot.is_file(), r.stderr[-2000:]
    img = Image.open(shot).convert("L")
    assert img.size == (1400, 2600)
    dark = sum(img.histogram()[:200]) / (img.size[0] * img.size[1])  # pixels clearly darker than the background
    assert ImageStat.Stat(img).stddev[0] > 10 and dark > 0.02


def test_every_figure_loads_and_every_format_is_named(demo_report, tmp_path):
    page = tmp_path / "probe.html"
    page.write_text(demo_report.html.read_text(encoding="utf-8").replace("</body>", PROBE), encoding="utf-8")
    r = _chromium("--dump-dom", page.as_uri())
    dom = r.stdout
    assert "<main>" in dom, r.stderr[-2000:]
    srcs = re.findall(r'<img[^>]*\ssrc="([^"]*)"', dom)
    assert len(srcs) == len(demo_report.pngs) >= 5
    for s in srcs:
        assert s.startswith("data:image/png;base64,")
        assert base64.b64decode(s.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    loaded = re.search(r'data-loaded="([01]*)"', dom)
    assert loaded and loaded.group(1) == "1" * len(srcs), loaded and loaded.group(1)
    text = re.sub(r"<[^>]+>", " ", re.sub(r'src="data:[^"]*"', "", dom))
    for kv in DEMO_FORMATS:
        assert label(kv) in text, kv
