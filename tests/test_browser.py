"""As a person would: JupyterLab in headless Chromium runs notebook 11 (its speedup sweep cut to one
width), changes the tier, presses Run.

Needs Debian's chromium and the playwright package (its own browser download is
not used: Playwright drives /usr/bin/chromium). Where they are missing the test
is skipped with the reason — except under CI=true, where a skip is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Flags from the machine's notes: no sandbox as root, and no background networking on a closed network.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def _missing() -> str | None:
    if not Path(CHROMIUM).exists():
        return "Debian's chromium is not installed (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed"
    return None


def with_a_one_width_sweep(path: Path) -> None:
    """Notebook 11 with its speedup sweep cut to one width: Run All must get past the prediction to the panel,
    and the full quick sweep (a minute of runs, checked in a kernel by test_notebooks) would only delay it."""
    nb = nbformat.read(path, as_version=4)
    widths = "widths = speedup.QUICK_WIDTHS if QUICK else speedup.DEFAULT_WIDTHS"
    cut = [c for c in nb.cells if widths in c.source]
    assert len(cut) == 2, "the prediction's and the sweep's cells both choose the widths"
    for cell in cut:
        cell.source = cell.source.replace(widths, "widths = (64,)")
    nbformat.write(nb, path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyter_lab(tmp_path):
    reason = _missing()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"browser test cannot run under CI: {reason}")
        pytest.skip(reason)
    work = tmp_path / "notebooks"
    shutil.copytree(ROOT / "notebooks", work)
    with_a_one_width_sweep(work / "11_compare.ipynb")
    # Render every cell (no windowing: the panel is far below the fold), start the notebook's kernel without a
    # dialog, and skip the news prompt.
    settings = tmp_path / "settings" / "@jupyterlab"
    (settings / "notebook-extension").mkdir(parents=True)
    (settings / "notebook-extension" / "tracker.jupyterlab-settings").write_text(
        '{"windowingMode": "none", "autoStartDefaultKernel": true}')
    (settings / "apputils-extension").mkdir(parents=True)
    (settings / "apputils-extension" / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    port, token = _free_port(), "dtlab-test-token"
    env = {**os.environ, "DTLAB_QUICK": "1", "JUPYTER_CONFIG_DIR": str(tmp_path / "jcfg"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "jrun")}
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={port}",
           "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}",
           f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}", f"--LabApp.user_settings_dir={tmp_path / 'settings'}"]
    log = open(tmp_path / "jupyter.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail("JupyterLab did not start:\n" + (tmp_path / "jupyter.log").read_text()[-3000:])
            time.sleep(0.5)
    yield url, token, work
    stop_group(proc)
    log.close()


def stop_group(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """End a server started in a session of its own, with its children: SIGTERM, then SIGKILL after ``grace_s``."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def start_kernel_session(url: str, token: str, notebook: str) -> None:
    """Start the notebook's kernel through the server's REST API, so the page attaches to it.

    Left to the page, a loaded machine can fetch the kernel list late and JupyterLab then asks
    which kernel to start, preselecting "No Kernel".
    """
    body = json.dumps({"path": notebook, "type": "notebook", "name": notebook, "kernel": {"name": "python3"}})
    request = urllib.request.Request(f"{url}/api/sessions?token={token}", data=body.encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert json.load(response)["kernel"]["name"] == "python3"


def kernel_of(url: str, token: str, notebook: str) -> str | None:
    """The id of the kernel the server's session for ``notebook`` runs now (None while it has none)."""
    with urllib.request.urlopen(f"{url}/api/sessions?token={token}", timeout=30) as response:
        sessions = [s for s in json.load(response) if s["path"].lstrip("/") == notebook]
    return sessions[0]["kernel"]["id"] if sessions and sessions[0].get("kernel") else None


def settled_kernel(url: str, token: str, notebook: str, quiet_s: float = 3.0, timeout_s: float = 60.0) -> str:
    """The notebook's kernel once its id has stayed the same for ``quiet_s``: the page can replace the kernel the
    test started right after it loads, and cells queued on the replaced one never run."""
    deadline = time.time() + timeout_s
    kernel, since = kernel_of(url, token, notebook), time.time()
    while time.time() < deadline:
        time.sleep(0.5)
        now = kernel_of(url, token, notebook)
        if now != kernel:
            kernel, since = now, time.time()
        elif kernel and time.time() - since >= quiet_s:
            return kernel
    raise AssertionError(f"the notebook's kernel did not settle within {timeout_s:g} s (last: {kernel})")


def panel_appears(page, url: str, token: str, notebook: str, kernel: str, timeout_s: float = 120.0) -> bool:
    """True once the panel is on the page; False as soon as the notebook's kernel is no longer ``kernel``."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            page.wait_for_selector(".dtlab-run", state="attached", timeout=5_000)
            return True
        except PlaywrightTimeout:
            if kernel_of(url, token, notebook) != kernel:
                print("the notebook's kernel was replaced while its cells were queued: running them again")
                return False
    return False


def dismiss_dialogs(page) -> list[str]:
    """Close JupyterLab's start-up dialogs (e.g. a kernel choice), pressing their default button; returns their text."""
    seen = []
    for _ in range(3):
        dialog = page.locator(".jp-Dialog")
        if not dialog.count() or not dialog.first.is_visible():
            break
        seen.append(dialog.first.inner_text())
        print("JupyterLab dialog:", seen[-1].replace("\n", " | "))
        # A kernel choice may come preselected with "No Kernel": pick Python, or Run All would do nothing.
        choice = dialog.first.locator("select")
        if choice.count():
            python = [t for t in choice.first.locator("option").all_inner_texts() if t.startswith("Python")]
            if python:
                choice.first.select_option(label=python[0])
        accept = dialog.first.locator(".jp-mod-accept")
        if accept.count():
            accept.first.click()
        else:
            page.keyboard.press("Escape")
        time.sleep(0.5)
    return seen


def run_all(page, attempts: int = 3) -> None:
    """Run > Run All Cells, until the kernel has taken the first cell (a fresh session can miss it)."""
    first_prompt = page.locator(".jp-CodeCell .jp-InputPrompt").first
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for _ in range(attempts):
        dismiss_dialogs(page)
        try:
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click(timeout=10_000)
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click(timeout=10_000)
        except PlaywrightTimeout:
            continue  # a dialog came up meanwhile: dismissed at the top of the loop
        deadline = time.time() + 20
        while time.time() < deadline:
            if any(mark in first_prompt.inner_text() for mark in ("[*]", "[1]")):
                return
            time.sleep(0.5)
    raise AssertionError(f"the notebook did not start running: first prompt {first_prompt.inner_text()!r}")


@pytest.mark.slow
def test_compare_notebook_runs_and_the_panel_runs_a_job(jupyter_lab, tmp_path):
    from playwright.sync_api import sync_playwright

    url, token, work = jupyter_lab
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            start_kernel_session(url, token, "11_compare.ipynb")
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/lab/tree/11_compare.ipynb?token={token}", timeout=60_000)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
            # The panel appears once every cell above it has run; it is below the fold. The page (or a kernel
            # chosen in a start-up dialog) can replace the kernel the queued cells were sent to: then run them
            # all again, at once rather than after the panel's whole timeout.
            for attempt in range(3):
                kernel = settled_kernel(url, token, "11_compare.ipynb")
                run_all(page)
                if panel_appears(page, url, token, "11_compare.ipynb", kernel):
                    break
                page.screenshot(path=str(tmp_path / f"no-panel-{attempt}.png"), full_page=True)
            else:
                raise AssertionError(f"the panel never appeared (screenshots in {tmp_path})")
            # Run All went past the prediction: its answer waits for a guess or the learner's say-so.
            show = page.locator("button", has_text="Show without guessing")
            assert show.count() == 1 and page.get_by_text("your guess:").count() == 0
            show.scroll_into_view_if_needed()
            show.click()
            page.get_by_text("your guess: (none)").wait_for(timeout=10_000)
            page.locator(".dtlab-run").scroll_into_view_if_needed()
            tier = page.locator(".widget-dropdown", has=page.locator("label", has_text="tier")).locator("select")
            tier.select_option("zero")
            page.wait_for_function("document.querySelector('.dtlab-run').disabled === false", timeout=10_000)
            page.locator(".dtlab-run").click()
            page.wait_for_selector(".dtlab-status:has-text('finished')", timeout=120_000)
            status = page.locator(".dtlab-status").inner_text()
            assert "finished" in status and "zero" in status
            assert page.locator(".dtlab-result img").count() >= 1
            assert page.locator(".jp-OutputArea-output [data-mime-type='application/vnd.jupyter.stderr']").filter(
                has_text="Traceback").count() == 0
            page.screenshot(path=str(tmp_path / "panel.png"), full_page=False)
        finally:
            browser.close()
    assert list((work / "results" / "history").glob("*-zero-w2/result.json"))
