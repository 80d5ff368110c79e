"""`make lab` starts JupyterLab on the course's notebooks, on loopback, and prints the URL to open."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.test_browser import _free_port, stop_group

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_make_lab_serves_the_notebooks_and_prints_the_url(tmp_path):
    port, token = _free_port(), "dtlab-lab-test"
    flags = f"--no-browser --port={port} --IdentityProvider.token={token}"
    # -o: the test's environment is already installed; PY: the interpreter running the tests
    cmd = ["make", "-s", "lab", "-o", ".venv/.dtlab-installed", f"PY={sys.executable}", f"LAB_FLAGS={flags}"]
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "run")}
    log = tmp_path / "lab.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            listing = None
            deadline = time.time() + 90
            while listing is None and time.time() < deadline and proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents?token={token}",
                                                timeout=2) as response:
                        listing = response.read().decode()
                except OSError:
                    time.sleep(0.5)
            assert listing is not None, "JupyterLab did not start:\n" + log.read_text()[-3000:]
            assert "00_overview.ipynb" in listing, "the server's root is notebooks/"
            url = f"http://127.0.0.1:{port}/lab?token="  # a token given on the command line is printed masked
            deadline = time.time() + 20  # the server prints its URL once every extension has loaded
            while url not in log.read_text() and time.time() < deadline:
                time.sleep(0.5)
            printed = log.read_text()
            assert url in printed
            assert "start at 00_overview.ipynb" in printed
        finally:
            stop_group(proc, grace_s=15)
