"""The built docs site (`make docs` -> site/) opened in headless Chromium, served over HTTP on loopback and from disk
(file://, as the README says to open it): the home page, a guide and the configuration reference render with
Material's navigation after its JavaScript ran, and nothing is loaded from another host (the site renders offline);
from disk, a navigation link leads to the page itself (not a folder listing) and search finds pages with no server and
no network. Screenshots of the home page and the configuration reference go to results/docs/. `make test-docs` builds
the site first; this skips in one line without chromium or site/.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urljoin, urlparse
from urllib.request import url2pathname

import pytest

pytestmark = pytest.mark.docs

ROOT = Path(__file__).parents[2]
SITE = ROOT / "site"
RESULTS = ROOT / "results" / "docs"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def missing() -> str | None:
    """Why these tests cannot run here (tests/docs/conftest.py skips them, in one line), or None."""
    if CHROMIUM is None:
        return "chromium not installed (apt-get install chromium); make test-docs opens the site in it"
    if not (SITE / "index.html").is_file():
        return "site/ not built: make test-docs builds it (make docs)"
    return None


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def base_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(SITE)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def chromium(tmp_path: Path, *args: str, budget_ms: int = 3000) -> str:
    """Run headless Chromium (its own throw-away profile; root needs --no-sandbox) and return its stdout."""
    done = subprocess.run(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}", f"--virtual-time-budget={budget_ms}", *args],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def dom(tmp_path: Path, url: str, budget_ms: int = 3000) -> str:
    """The page's DOM after load, with its scripts run."""
    html = chromium(tmp_path, "--dump-dom", url, budget_ms=budget_ms)
    assert "<html" in html, f"no DOM from {url}"
    return html


def check_material_page(html: str, static: str) -> None:
    # Material's layout with the site's navigation: header, the primary nav with every section, search
    assert 'class="md-header' in html and "md-nav--primary" in html and 'data-md-component="search"' in html
    for section in ("Getting started", "Guides", "Reference", "Troubleshooting"):
        assert re.search(rf'md-nav__(link|item)[^>]*>\s*(<[^>]+>\s*)*{section}', html), f"nav section {section}"
    # its JavaScript ran: code blocks got copy buttons, tables their scroll wrappers (neither is in the HTML file)
    if "<pre" in static:
        assert 'data-md-type="copy"' in html or "md-clipboard" in html
    if "<table" in static:
        assert "md-typeset__scrollwrap" in html and "md-typeset__scrollwrap" not in static
    # nothing from another host: no CDN scripts, styles or fonts
    external = re.findall(r'<(?:script|link|img)[^>]+(?:src|href)="(https?://[^"]+)"', html + static)
    assert not [u for u in external if not u.startswith("http://127.0.0.1")], external


def title(html: str) -> str:
    return re.search(r"<title>(.*?)</title>", html, re.S).group(1).strip()


def test_home_page(base_url, tmp_path):
    html = dom(tmp_path, base_url)
    check_material_page(html, (SITE / "index.html").read_text())
    assert title(html).startswith("mrl")
    assert '<h1' in html
    RESULTS.mkdir(parents=True, exist_ok=True)
    chromium(tmp_path, f"--screenshot={RESULTS / 'home.png'}", "--window-size=1280,1000", base_url)
    assert (RESULTS / "home.png").stat().st_size > 10_000


def test_grpo_guide(base_url, tmp_path):
    html = dom(tmp_path, base_url + "guides/grpo.html")
    check_material_page(html, (SITE / "guides" / "grpo.html").read_text())
    assert "grpo" in title(html).lower() and title(html).endswith("- mrl")
    # the guide is the current page of the navigation
    assert re.search(r'md-nav__link--active[^>]*href="grpo\.html"|href="grpo\.html"[^>]*md-nav__link--active', html)


def test_config_reference(base_url, tmp_path):
    html = dom(tmp_path, base_url + "reference/config.html")
    check_material_page(html, (SITE / "reference" / "config.html").read_text())
    assert title(html) == "Configuration - mrl"
    assert "Configuration reference" in html
    for key in ("run.seed", "policy.optimizer.lr", "generation.vllm.gpu_memory_utilization", "stages[].algorithm"):
        assert f"<code>{key}</code>" in html, key
    # the table of contents holds the sections
    assert 'aria-label="Table of contents"' in html and "policy.parallel" in html
    RESULTS.mkdir(parents=True, exist_ok=True)
    chromium(tmp_path, f"--screenshot={RESULTS / 'config-reference.png'}", "--window-size=1280,1000",
             base_url + "reference/config.html")
    assert (RESULTS / "config-reference.png").stat().st_size > 10_000


def nav_link(html: str, text: str) -> str:
    """The href of the primary navigation's link whose label is `text`."""
    found = re.search(rf'<a[^>]*href="([^"]+)"[^>]*class="md-nav__link[^"]*"[^>]*>\s*(<[^>]+>\s*)*{text}\s*<', html)
    assert found, f"no navigation link {text!r}"
    return found.group(1)


def test_opened_from_disk_a_navigation_link_leads_to_the_page(tmp_path):
    """What the README says to do: open site/index.html in a browser, no server. A link of the navigation must name a
    page file (with directory URLs it named a folder, which a browser shows as a file listing from disk)."""
    home = SITE.joinpath("index.html").as_uri()
    html = dom(tmp_path, home)
    check_material_page(html, (SITE / "index.html").read_text())
    href = nav_link(html, "Checkpoints and exact resume")
    target = urljoin(home, href)
    path = Path(url2pathname(urlparse(target).path))
    assert path.is_file() and path.suffix == ".html", f"the link {href!r} leads to {path}, not a page"
    page = dom(tmp_path, target)
    assert "Index of" not in title(page) and title(page).endswith("- mrl"), title(page)
    check_material_page(page, path.read_text())
    assert re.search(rf'href="{re.escape(path.name)}"[^>]*md-nav__link--active', page)


def test_opened_from_disk_search_finds_pages_offline(tmp_path):
    """Search from a file:// page, no server and no network: Material reads the query from ?q= on load, and its
    worker (in the iframe-worker shim's iframe) reads the inlined index (search/search_index.js)."""
    html = dom(tmp_path, SITE.joinpath("index.html").as_uri() + "?q=tensorboard", budget_ms=8000)
    meta = re.search(r'class="md-search-result__meta">\s*([^<]*?)\s*<', html)
    assert meta and re.fullmatch(r"(\d+) matching documents?", meta.group(1)), meta and meta.group(1)
    links = re.findall(r'<a href="([^"]+)" class="md-search-result__link"', html)
    assert links and all(".html" in link for link in links), links[:5]
