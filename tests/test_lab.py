"""JupyterLab as `make lab` starts it: the book's sources round-trip through jupytext unchanged, pairing stays in
book/, and (slow) the live depth explorer of book/03_token_types.py works in a real browser.

The browser test starts its own JupyterLab (127.0.0.1, a free port, no token) on a repository-shaped copy in the
test's tmp dir: ``book/03_token_types.py`` (a byte copy of the source), ``jupytext.toml``, and the smoke profile's
work dir (notebooks 01 and 02, run here by the book runner) where the notebook's parameters look for it. It opens
the source by its URL (so JupyterLab's default viewer decides how), runs all cells in headless Chromium driven by
Selenium, moves the loop slider, switches the metric, types a sentence into the explorer's text box, clicks a token
of the passage, and checks that the passage and the trajectory figure changed, that nothing in the explorer scrolls
sideways and that the browser console has no errors; then it saves, opens the source in a text editor tab too,
returns to the notebook (the trajectory must still be drawn), reloads the page and checks that the explorer comes
back with the typed sentence and the clicked token. The kernel resolves the notebook's paths against
``$DRC_BOOK_ROOT`` (this site) and, not being run by the book runner, writes its results under ``runs/lab/``: the
site's copy of the committed results file must keep its bytes. Screenshots: ``<tmp>/screens/*.png``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import jupytext
import nbformat
import pytest
from jupytext.config import load_jupytext_configuration_file

from drc_book.paths import ROOT_ENV, RUN_ENV

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "book").glob("[0-9][0-9]_*.py"))
NOTEBOOK = "book/03_token_types.py"
SENTENCE = "The Congress shall have power to lay and collect taxes."


def repo_config():
    return load_jupytext_configuration_file(str(ROOT / "jupytext.toml"))


def lab_kernel_metadata() -> dict:
    """The notebook metadata JupyterLab sets once the venv's python3 kernel runs."""
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    return {"kernelspec": {"display_name": spec.display_name, "language": spec.language, "name": "python3"},
            "language_info": {"name": "python", "version": ".".join(map(str, sys.version_info[:3])),
                              "mimetype": "text/x-python", "file_extension": ".py"}}


def contents_manager(root: Path):
    """The contents manager JupyterLab uses (jupytext's, on top of jupyter_server's), rooted at ``root``."""
    from jupyter_server.services.contents.filemanager import FileContentsManager
    from jupytext.sync_contentsmanager import build_sync_jupytext_contents_manager_class

    return build_sync_jupytext_contents_manager_class(FileContentsManager)(root_dir=str(root))


def test_book_sources_exist() -> None:
    assert len(SOURCES) >= 6


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_jupytext_round_trip_is_a_no_op(src: Path) -> None:
    """py -> ipynb -> py with jupytext's API and the repository's jupytext.toml, with the kernel metadata that
    JupyterLab adds on opening (kernelspec and language_info of the venv's kernel) and the view state it adds to
    cells, gives the source back byte for byte."""
    config = repo_config()
    text = src.read_text()
    nb = jupytext.reads(text, fmt="py:percent", config=config)
    nb.metadata.update(lab_kernel_metadata())
    for cell in nb.cells:
        cell.metadata.update({"collapsed": False, "scrolled": True, "jupyter": {"outputs_hidden": False},
                              "execution": {"iopub.status.idle": "2026-01-01T00:00:00Z"}})
    ipynb = nbformat.reads(nbformat.writes(nb), as_version=4)
    assert jupytext.writes(ipynb, fmt="py:percent", config=config) == text


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_opening_and_saving_in_jupyterlab_keeps_the_source(tmp_path: Path, src: Path) -> None:
    """The contents manager's own get/save (what JupyterLab's open and save call) leaves the file unchanged."""
    (tmp_path / "book").mkdir()
    shutil.copy(ROOT / "jupytext.toml", tmp_path)
    shutil.copy(src, tmp_path / "book")
    cm = contents_manager(tmp_path)
    path = f"book/{src.name}"
    nb = cm.get(path)["content"]
    nb.metadata.update(lab_kernel_metadata())
    cm.save({"type": "notebook", "format": "json", "content": nb}, path)
    assert (tmp_path / path).read_bytes() == src.read_bytes()
    assert (tmp_path / "book" / f"{src.stem}.ipynb").is_file()  # paired: outputs go to the ignored .ipynb


def test_pairing_applies_to_book_only(tmp_path: Path) -> None:
    shutil.copy(ROOT / "jupytext.toml", tmp_path)
    (tmp_path / "book").mkdir()
    cm = contents_manager(tmp_path)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")])
    for path in ["scratch.ipynb", "book/new.ipynb"]:
        cm.save({"type": "notebook", "format": "json", "content": nb}, path)
    assert not (tmp_path / "scratch.py").exists()
    assert (tmp_path / "book" / "new.py").is_file()


def test_lab_settings_open_python_files_as_notebooks() -> None:
    """jupyter/overrides.json (installed into the venv by `make venv`) makes jupytext's notebook view the default
    viewer of Python files; the browser test checks that JupyterLab honours it."""
    settings = json.loads((ROOT / "jupyter" / "overrides.json").read_text())
    assert settings["@jupyterlab/docmanager-extension:plugin"]["defaultViewers"]["python"] == "Jupytext Notebook"
    installed = Path(sys.prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.d" / "drc-book.json"
    assert installed.is_file() and json.loads(installed.read_text()) == settings, "run `make venv`"


# --- the live explorer in a real JupyterLab ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check: Callable[[], object], timeout: float, what: str, every: float = 0.25):
    """Poll ``check`` until it returns something truthy; fail naming ``what`` after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


@pytest.fixture
def lab_site(tmp_path: Path) -> Path:
    """A repository-shaped directory for JupyterLab: a copy of the source, jupytext.toml, the smoke profile's work
    dir under the path the notebook's parameters name, and the prepared corpus (read only, via a link).

    The notebook's parameters are paths relative to the repository root and the kernel starts in book/: the
    notebook resolves them with drc_book.paths.at_root, against $DRC_BOOK_ROOT, which the JupyterLab fixture
    points at this site (so nothing resolves against the real repository).
    """
    data = tmp_path / "smoke"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "drc_book", "--out", str(data / "runs"), "run", "--profile",
                          "smoke", "--only", "01_training", "02_convergence", "--quiet", "--set",
                          f"work_dir={data / 'work'}", "--set", f"results_dir={data / 'results'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    site = tmp_path / "site"
    (site / "book").mkdir(parents=True)
    shutil.copy(ROOT / NOTEBOOK, site / NOTEBOOK)
    shutil.copy(ROOT / "jupytext.toml", site)
    (site / "runs" / "book").mkdir(parents=True)
    (site / "runs" / "book" / "reference").symlink_to(data / "work")  # the notebook's default work_dir
    # the committed result the notebook's default results_dir names: an interactive run must leave it alone
    committed = site / "papermill_runs" / "reference" / "results"
    committed.mkdir(parents=True)
    shutil.copy(ROOT / "papermill_runs" / "reference" / "results" / "03_token_types.json", committed)
    (site / "data" / "corpus").mkdir(parents=True)
    (site / "data" / "corpus" / "default").symlink_to(ROOT / "data" / "corpus" / "default")
    return site


@pytest.fixture
def jupyterlab(lab_site: Path, tmp_path: Path) -> Iterator[str]:
    """JupyterLab on 127.0.0.1 at a free port without a token, as its own process group; stopped at the end.
    User settings, workspaces and runtime files live in the tmp dir; the venv's settings (overrides.d) apply."""
    port = free_port()
    home = tmp_path / "jupyter-home"
    env = {**os.environ, "OMP_NUM_THREADS": "1", ROOT_ENV: str(lab_site), "JUPYTER_CONFIG_DIR": str(home / "config"),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces")}
    env.pop("PLOTLY_RENDERER", None)  # JupyterLab picks plotly's mimetype renderer itself
    env.pop(RUN_ENV, None)  # an interactive session, not the book runner
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", "--IdentityProvider.token=", f"--ServerApp.root_dir={lab_site}",
           "--LabApp.expose_app_in_browser=True"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = (tmp_path / "jupyterlab.log").open("w")
    proc = subprocess.Popen(cmd, cwd=lab_site, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"JupyterLab exited with {proc.returncode}: see {tmp_path / 'jupyterlab.log'}")
        try:
            with urllib.request.urlopen(f"{url}/api/status", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        wait_for(up, 90, "JupyterLab to answer")
        yield url
    finally:
        # shut the kernels down first, then the server
        with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(f"{url}/api/kernels", timeout=5) as r:
            for k in json.load(r):
                req = urllib.request.Request(f"{url}/api/kernels/{k['id']}", method="DELETE")
                urllib.request.urlopen(req, timeout=10).close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


@pytest.fixture
def browser():
    """Headless Debian Chromium through Selenium and chromium-driver (`apt-get install chromium chromium-driver`,
    which .ci/run does), 1280 px wide, with the browser console recorded."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    from drc_book.runner import find_browser

    driver_path = shutil.which("chromedriver")
    chromium = find_browser()
    if not (driver_path and chromium):
        pytest.skip("needs Debian's chromium and chromium-driver: `apt-get install chromium chromium-driver` "
                    "(.ci/run installs them)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1600"]:
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


# JavaScript run in the page: the open notebook panel, and the live explorer's passage and trajectory figure
_PANEL = "const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
_EXPLORER = "const ex = document.querySelector('.jp-Notebook .drc-depth-explorer');"
# the passage: the header (loop, legend) and each token button's text and colour
PASSAGE_JS = _EXPLORER + """
const h = ex && ex.querySelector('.drc-explorer-header .widget-html-content');
const toks = ex ? [...ex.querySelectorAll('.drc-token')] : [];
if (!h || !toks.length) return null;
return JSON.stringify({header: h.innerHTML,
                       tokens: toks.map(b => [b.textContent.replace(/\u00a0/g, ' '), b.style.backgroundColor])});
"""
FIGURE_JS = _EXPLORER + """
const p = ex && ex.querySelector('.widget-output .js-plotly-plot');
if (!p || !p.data || !p.querySelector('.main-svg')) return null;
return JSON.stringify({title: p.layout.title && p.layout.title.text, shapes: p.layout.shapes,
                       y: p.data.map(t => Array.from(t.y || []))});
"""
# elements of the explorer's output (up to the output area) that scroll sideways
OVERFLOW_JS = _EXPLORER + """
const out = [];
for (let e = ex; e; e = e.parentElement) { if (e.classList.contains('jp-OutputArea-output')) { out.push(e); break; } }
return [ex, ...ex.querySelectorAll('*'), ...out].filter(e => e.scrollWidth > e.clientWidth + 1
  && ['auto', 'scroll'].includes(getComputedStyle(e).overflowX)).map(e => e.className || e.tagName);
"""
WIDGET_ERRORS_JS = """return [...document.querySelectorAll('.jp-Notebook .jp-OutputArea-output')]
  .map(o => o.textContent).filter(s => s.includes('Error displaying widget'));"""
RUN_STATE_JS = _PANEL + """
const cells = w.content.widgets.filter(c => c.model.type === 'code');
return {status: w.sessionContext.session && w.sessionContext.session.kernel
                ? w.sessionContext.session.kernel.status : null,
        counts: cells.map(c => c.model.executionCount),
        errors: cells.flatMap(c => c.model.outputs.toJSON()).filter(o => o.output_type === 'error')
                     .map(o => o.ename + ': ' + o.evalue)};
"""


@pytest.mark.slow
def test_live_explorer_in_a_real_jupyterlab(jupyterlab: str, browser, lab_site: Path, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    t0 = time.monotonic()
    shots = tmp_path / "screens"
    shots.mkdir()
    tracked = [ROOT / "papermill_runs" / "reference" / "results" / "03_token_types.json",
               lab_site / "papermill_runs" / "reference" / "results" / "03_token_types.json"]
    tracked_before = [p.read_bytes() for p in tracked]
    source_before = (lab_site / NOTEBOOK).read_bytes()
    d = browser

    def shot(name: str) -> None:
        d.save_screenshot(str(shots / f"{name}.png"))

    # 1. the source opens as a notebook by default (jupytext's viewer, from the venv's settings)
    d.get(f"{jupyterlab}/lab/tree/{NOTEBOOK}")
    opened = wait_for(lambda: d.execute_script(
        _PANEL + "return w && w.context && w.context.path === arguments[0] && w.context.isReady ? [w.node.classList"
                 ".contains('jp-NotebookPanel'), w.content.widgets ? w.content.widgets.length : 0] : null;", NOTEBOOK),
        120, f"{NOTEBOOK} to open")
    shot("01_opened")
    assert opened[0] and opened[1] > 5, f"{NOTEBOOK} did not open as a notebook: {opened}"
    assert d.execute_script("return window.jupyterapp.docRegistry.defaultWidgetFactory(arguments[0]).name;",
                            NOTEBOOK) == "Jupytext Notebook"

    # 2. Run All against the smoke work dir: every code cell runs, none raises
    wait_for(lambda: d.execute_script(RUN_STATE_JS)["status"] == "idle", 120, "the kernel to start")
    d.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells');")
    state = wait_for(lambda: (s := d.execute_script(RUN_STATE_JS))["errors"] or (
        s["status"] == "idle" and all(c is not None for c in s["counts"])) and s, 300, "Run All to finish")
    shot("02_ran_all")
    assert state["errors"] == [], state["errors"]

    # 3. the live explorer: passage and trajectory present
    passage0 = wait_for(lambda: d.execute_script(PASSAGE_JS), 60, "the explorer's passage")
    figure0 = wait_for(lambda: d.execute_script(FIGURE_JS), 60, "the explorer's trajectory figure")
    explorer = d.execute_script(_EXPLORER + "return ex;")
    d.execute_script("arguments[0].scrollIntoView({block: 'center'});", explorer)
    shot("03_explorer")
    assert d.execute_script(OVERFLOW_JS) == []  # no sideways scroll bar in the explorer's output

    # the loop slider spans the output: at least 12 px per loop (the was 124 px for 32 loops)
    track = explorer.find_element(By.CSS_SELECTOR, ".widget-slider .noUi-target")
    handle = explorer.find_element(By.CSS_SELECTOR, ".widget-slider .noUi-handle")
    n_loops = int(float(handle.get_attribute("aria-valuemax"))) - int(float(handle.get_attribute("aria-valuemin")))
    assert track.size["width"] >= 12 * n_loops, (track.size, n_loops)
    # (keyboard on its handle, as a user would after clicking it)
    loop0 = int(float(handle.get_attribute("aria-valuenow")))
    handle.click()
    for _ in range(3):
        handle.send_keys(Keys.ARROW_RIGHT)
    loop1 = loop0 + 3
    wait_for(lambda: int(float(handle.get_attribute("aria-valuenow"))) == loop1, 20, f"the slider to reach {loop1}")
    # every step redraws; wait for the last one: the passage at loop1, the figure's loop marker at loop1
    passage1 = wait_for(lambda: (p := d.execute_script(PASSAGE_JS)) and f"loop {loop1} of" in p and p, 20,
                        "the passage to follow the slider")
    figure1 = wait_for(lambda: (f := d.execute_script(FIGURE_JS)) and [sh.get("x0") for sh in json.loads(f)["shapes"]]
                       == [loop1] and f, 20, "the trajectory's loop marker to follow the slider")
    assert passage1 != passage0 and figure1 != figure0
    assert json.loads(passage1)["tokens"] != json.loads(passage0)["tokens"]  # recoloured
    shot("04_slider_moved")

    # the metric toggle
    button = next(b for b in explorer.find_elements(By.CSS_SELECTOR, ".widget-toggle-buttons button")
                  if b.text.strip() == "state change")
    button.click()
    wait_for(lambda: (p := d.execute_script(PASSAGE_JS)) != passage1 and p, 20, "the passage to recolour")
    assert "mod-active" in button.get_attribute("class")
    shot("05_metric_state_change")

    # a sentence of one's own, typed into the text box: traced and shown in the same explorer
    box = explorer.find_element(By.CSS_SELECTOR, ".widget-text input")
    box.click()
    box.send_keys(SENTENCE + Keys.ENTER)
    typed = wait_for(lambda: (p := d.execute_script(PASSAGE_JS)) and "".join(
        tok for tok, _ in json.loads(p)["tokens"]) == SENTENCE and p, 60, "the typed sentence as the passage")
    assert "loop 2 of" in json.loads(typed)["header"]  # a new passage starts at loop 2
    shot("06_typed_sentence")

    # a token, by clicking it in the passage
    tokens = explorer.find_elements(By.CSS_SELECTOR, ".drc-token")
    pos = len(tokens) - 1
    tokens[pos].click()
    figure2 = wait_for(lambda: (f := d.execute_script(FIGURE_JS))
                       and (json.loads(f)["title"] or "").startswith(f"pos {pos} ") and f, 20,
                       f"the trajectory of the clicked token {tokens[pos].text!r}")
    assert json.loads(figure2)["title"] != json.loads(figure1)["title"]
    shot("07_token_clicked")

    # 4. a clean browser console
    errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors

    # the widget state survives a browser reload, with the source also open in a text editor tab (the issue's
    # "Error displaying widget: model not found" case): save, open the editor, back to the notebook, reload; the
    # same passage and trajectory come back
    d.execute_script("window.jupyterapp.commands.execute('docmanager:save');")
    wait_for(lambda: d.execute_script(_PANEL + "return !w.context.model.dirty;"), 30, "the save")
    d.execute_script("window.jupyterapp.commands.execute('docmanager:open', {path: arguments[0], factory: 'Editor'});",
                     NOTEBOOK)
    wait_for(lambda: d.execute_script(_PANEL + "return w && w.node.classList.contains('jp-FileEditor') || "
                                      "(w && w.content && w.content.node.classList.contains('jp-FileEditor'));"),
             30, "the source in an editor tab")
    d.execute_script("window.jupyterapp.commands.execute('docmanager:open', {path: arguments[0], "
                     "factory: 'Jupytext Notebook'});", NOTEBOOK)
    notebook_ready = _PANEL + ("return w && w.node.classList.contains('jp-NotebookPanel') && w.context.path === "
                               "arguments[0] && w.context.isReady;")
    wait_for(lambda: d.execute_script(notebook_ready, NOTEBOOK), 30, "the notebook tab again")
    tabs = d.execute_script("return [...window.jupyterapp.shell.widgets('main')].map(w => w.node.className);")
    assert len(tabs) == 2 and any("jp-NotebookPanel" in c for c in tabs), tabs
    shot("08_editor_tab_open")
    # the trajectory is still drawn (JupyterLab's plotly renderer once left it 0 px high after a tab switch)
    height = d.execute_script(_EXPLORER + "const p = ex && ex.querySelector('.widget-output .js-plotly-plot');"
                                          "return p ? p.getBoundingClientRect().height : 0;")
    assert height > 200, height
    d.refresh()
    wait_for(lambda: d.execute_script(notebook_ready, NOTEBOOK), 120, f"{NOTEBOOK} to open again after the reload")
    after = wait_for(lambda: d.execute_script(WIDGET_ERRORS_JS) or d.execute_script(PASSAGE_JS), 60,
                     "the explorer after the reload")
    assert not isinstance(after, list), after  # "Error displaying widget: model not found"
    assert json.loads(after)["tokens"] == json.loads(d.execute_script(PASSAGE_JS))["tokens"]
    assert "".join(tok for tok, _ in json.loads(after)["tokens"]) == SENTENCE
    figure3 = wait_for(lambda: d.execute_script(FIGURE_JS), 60, "the trajectory after the reload")
    assert json.loads(figure3)["title"] == json.loads(figure2)["title"]
    d.execute_script("arguments[0].scrollIntoView({block: 'center'});", d.execute_script(_EXPLORER + "return ex;"))
    shot("09_after_reload")
    errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors

    # 5. saving the unedited notebook leaves the source byte-identical; no tracked result was touched
    d.execute_script("window.jupyterapp.commands.execute('docmanager:save');")
    wait_for(lambda: d.execute_script(_PANEL + "return !w.context.model.dirty;"), 30, "the save")
    assert (lab_site / NOTEBOOK).read_bytes() == source_before
    assert [p.read_bytes() for p in tracked] == tracked_before
    interactive = lab_site / "runs" / "lab" / "papermill_runs" / "reference" / "results" / "03_token_types.json"
    assert json.loads(interactive.read_text())["profile"] == "reference"  # the run's results went here instead
    print(f"live explorer test: {time.monotonic() - t0:.1f} s in the browser; screenshots in {shots}")
