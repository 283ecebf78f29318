"""JupyterLab + headless Chromium for tests/test_browser.py.

    JupyterLab        a `jupyter lab` server process group on localhost (token, no browser,
                      autosave off so the committed notebooks stay cleared)
    launch_chromium   Debian's /usr/bin/chromium driven by Playwright, fresh profile
    NotebookPage      one notebook open in the browser: run cells, wait, read what shows

Everything here reads the page the way a person would: prompts "[3]:", progress bars,
drawn chart marks, error outputs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1400, "height": 1500}

# JupyterLab user settings: no autosave (outputs never reach the repo), every cell in the
# DOM (no windowing), no news prompt.
LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false"},
}


def chromium_missing_message() -> str | None:
    """None when Chromium is installed, else what to run."""
    if CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK):
        return None
    return (
        f"{CHROMIUM} not found: the browser test drives Debian's chromium. "
        "Install it with `make browser` (apt-get install -y chromium)."
    )


def launch_chromium(playwright, profile_dir: Path):
    """A persistent Chromium context on a fresh profile (the closed network needs these flags)."""
    return playwright.chromium.launch_persistent_context(
        str(profile_dir),
        executable_path=str(CHROMIUM),
        headless=True,
        args=CHROMIUM_ARGS,
        viewport=VIEWPORT,
    )


def write_lab_settings(settings_dir: Path) -> None:
    """Write LAB_SETTINGS as JupyterLab user settings under settings_dir."""
    for rel, value in LAB_SETTINGS.items():
        path = settings_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


class JupyterLab:
    """A running `jupyter lab` in its own process group; stop() ends it and its kernels."""

    def __init__(self, root_dir: Path, state_dir: Path, port: int, env: dict[str, str]):
        self.root_dir, self.port = Path(root_dir), port
        self.token = os.urandom(16).hex()
        write_lab_settings(state_dir / "settings")
        env = {
            **os.environ,
            **env,
            "JUPYTERLAB_SETTINGS_DIR": str(state_dir / "settings"),
            "JUPYTERLAB_WORKSPACES_DIR": str(state_dir / "workspaces"),
            "JUPYTER_RUNTIME_DIR": str(state_dir / "runtime"),
        }
        self.log_path = state_dir / "jupyter.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyterlab",
                "--no-browser",
                f"--port={port}",
                "--ip=127.0.0.1",
                f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={self.root_dir}",
                "--ServerApp.open_browser=False",
                "--LabApp.news_url=None",
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                "--LabApp.extension_manager=readonly",
                *(["--allow-root"] if os.geteuid() == 0 else []),
            ],
            env=env,
            cwd=self.root_dir,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str, workspace: str) -> str:
        """The lab URL opening `path` in a fresh named workspace."""
        return f"{self.base}/lab/workspaces/{workspace}/tree/{path}?reset&token={self.token}"

    def api(self, path: str, method: str = "GET"):
        """Call the server's REST API; the decoded JSON (None for an empty body)."""
        req = urllib.request.Request(
            f"{self.base}/api/{path}",
            method=method,
            headers={"Authorization": f"token {self.token}"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def wait_ready(self, timeout: float = 120) -> None:
        """Block until /api/status answers; raise with the log tail if the server dies or hangs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"jupyter lab exited early:\n{self.log_tail()}")
            try:
                self.api("status")
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"jupyter lab not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def shutdown_kernels(self) -> None:
        """Shut down every running kernel through the REST API."""
        for kernel in self.api("kernels") or []:
            self.api(f"kernels/{kernel['id']}", method="DELETE")

    def log_tail(self, n: int = 30) -> str:
        """The last n lines of the server log."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        """Shut kernels down, SIGTERM the group, SIGKILL it and any leftover descendant."""
        import psutil

        try:
            descendants = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            descendants = []
        if self.process.poll() is None:
            try:
                self.shutdown_kernels()
            except OSError:
                pass
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=5)
        for child in descendants:  # kernels run in sessions of their own
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        self._log.close()


PROMPT_RE = re.compile(r"\[(\d+|\*| )\]:")


class NotebookPage:
    """One notebook open in JupyterLab in a Playwright page."""

    def __init__(self, page, lab: JupyterLab, path: str):
        self.page, self.lab, self.path = page, lab, path
        self.workspace = Path(path).stem.replace("_", "-")

    def open(self, timeout: float = 120) -> None:
        """Load the lab with the notebook and wait until its kernel is idle."""
        cells = len(self.lab.api(f"contents/{self.path}")["content"]["cells"])
        self.page.goto(self.lab.url(self.path, self.workspace), timeout=timeout * 1000)
        deadline = time.monotonic() + timeout
        while self.page.locator(".jp-NotebookPanel .jp-Cell").count() < cells:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.path}: cells not drawn after {timeout:.0f}s")
            time.sleep(0.5)
        self.wait_kernel_idle(timeout)
        self.page.locator(".jp-NotebookPanel .jp-Cell").first.click()  # focus the notebook

    @property
    def notebook(self):
        return self.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook").first

    def kernel_status(self) -> str:
        """The kernel status the status bar shows, lower-case ('idle', 'busy', ...)."""
        text = self.page.evaluate(
            """() => { const el = document.querySelector('.jp-StatusBar-TextItem[title^="Change kernel"]');
                       return el ? el.innerText : ''; }"""
        )
        return text.rsplit("|", 1)[-1].strip().lower()

    def wait_kernel_idle(self, timeout: float) -> None:
        """Poll until the kernel indicator says idle."""
        deadline = time.monotonic() + timeout
        while self.kernel_status() != "idle":
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.path}: kernel not idle after {timeout:.0f}s")
            time.sleep(0.5)

    def run_all(self, attempts: int = 3) -> None:
        """Run > Run All Cells, repeated until a cell starts (the first click can land early)."""
        for _ in range(attempts):
            self.menu("Run", "Run All Cells")
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                if any(p != " " for p in self.prompts()):
                    return
                time.sleep(0.5)
        raise AssertionError(f"{self.path}: Run All Cells started no cell")

    def menu(self, menu: str, item: str) -> None:
        """Click a main-menu entry, e.g. menu("Run", "Run All Cells")."""
        self.page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{menu}$")).click()
        entry = self.page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{item}$")).first
        entry.wait_for(state="visible", timeout=10_000)
        entry.click()

    def prompts(self) -> list[str]:
        """Each code cell's execution prompt text: '3', '*', or ' ' (never run)."""
        texts = self.page.locator(
            ".jp-NotebookPanel .jp-CodeCell .jp-InputArea-prompt"
        ).all_inner_texts()
        return [m.group(1) if (m := PROMPT_RE.search(t)) else " " for t in texts]

    def wait_all_run(self, timeout: float, poll=None, interval: float = 1.0) -> None:
        """Until every code cell has an execution count and the kernel is idle.

        poll: called every `interval` seconds meanwhile (e.g. to sample progress bars).
        Fails early when a cell shows an error (JupyterLab stops Run All there).
        """
        deadline = time.monotonic() + timeout
        while True:
            if poll is not None:
                poll()
            prompts = self.prompts()
            if prompts and all(p.isdigit() for p in prompts) and self.kernel_status() == "idle":
                return
            errors = self.errors()
            if errors and self.kernel_status() == "idle":
                raise AssertionError(f"{self.path}: a cell failed:\n{errors[0]}")
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.path}: cells not all run after {timeout:.0f}s; prompts {prompts}"
                )
            time.sleep(interval)

    def errors(self) -> list[str]:
        """Text of every error output and of stderr outputs mentioning Traceback/Error."""
        return self.page.evaluate(
            """() => {
              const out = [];
              for (const el of document.querySelectorAll('.jp-NotebookPanel .jp-OutputArea-output')) {
                const mime = el.getAttribute('data-mime-type') || '';
                const text = el.innerText || '';
                if (mime === 'application/vnd.jupyter.error') out.push(text);
                else if (mime === 'application/vnd.jupyter.stderr' && /Traceback|Error/.test(text)) out.push(text);
              }
              return out;
            }"""
        )

    def cell(self, index: int):
        """The code cell at `index` (0-based, code cells only)."""
        return self.page.locator(".jp-NotebookPanel .jp-CodeCell").nth(index)

    def screenshot(self, path: Path, cell_index: int | None = None) -> None:
        """Scroll a code cell to the top of the notebook (when given) and shoot the page."""
        if cell_index is not None:
            self.cell(cell_index).evaluate("el => el.scrollIntoView({block: 'start'})")
            time.sleep(0.5)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(path))


DRAWN_MARKS_JS = """(root) => {
  const charts = [];
  for (const embed of root.querySelectorAll('.vega-embed')) {
    // data marks only (vega's svg: <g class="mark-rect role-mark">), not axes, grid or legend
    const marks = Array.from(embed.querySelectorAll('svg g.role-mark > path, svg g.role-mark > rect'))
      .filter(el => el.tagName === 'rect' || (el.getAttribute('d') || '').length > 1).length;
    let inked = 0;
    for (const canvas of embed.querySelectorAll('canvas')) {
      if (!canvas.width || !canvas.height) continue;
      const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
      for (let i = 3; i < data.length; i += 4) if (data[i] > 0 && (data[i-1] < 250 || data[i-2] < 250 || data[i-3] < 250)) inked++;
    }
    charts.push({marks, inked, width: embed.getBoundingClientRect().width});
  }
  return charts;
}"""


def drawn_charts(locator) -> list[dict]:
    """Per vega-embed element under `locator`: svg mark count and non-white canvas pixels."""
    return locator.evaluate(DRAWN_MARKS_JS)


OVERRUN_JS = """(root) => {
  // bars (vega draws rects as svg paths) and text labels, each against its own view's plot
  // (the background of its nearest vega group); then each chart against every box that
  // clips it (an ancestor whose overflow is not visible, and its notebook cell)
  const out = [];
  const right = el => el.getBoundingClientRect().right;
  for (const [n, embed] of Array.from(root.querySelectorAll('.vega-embed')).entries()) {
    const svg = embed.querySelector('svg');
    if (!svg) { out.push({chart: n, not_svg: 'its marks cannot be measured'}); continue; }
    for (const el of svg.querySelectorAll('g.mark-rect.role-mark > path, g.mark-text.role-mark > text')) {
      const group = el.closest('g.mark-group');
      const plot = group && group.querySelector(':scope > g > path.background');
      if (plot && right(el) > right(plot) + 2)
        out.push({chart: n, mark: el.tagName, text: el.textContent, past: right(el) - right(plot)});
    }
    const cell = embed.closest('.jp-Cell');
    for (let box = svg.parentElement; box; box = box.parentElement) {
      const clips = getComputedStyle(box).overflowX !== 'visible' || box === cell;
      if (clips && right(svg) > right(box) + 1)
        out.push({chart: n, clipped_by: box.className, past: right(svg) - right(box)});
      if (box === cell) break;
    }
  }
  return out;
}"""


def overruns(locator) -> list[dict]:
    """Bars or labels past their chart's plot, and charts wider than a box that clips them."""
    return locator.evaluate(OVERRUN_JS)


PROGRESS_JS = """(root) => Array.from(root.querySelectorAll('.widget-hprogress')).map(el => {
  const bar = el.querySelector('.progress-bar');
  const track = bar ? bar.parentElement : null;
  return {
    label: (el.querySelector('.widget-label') || {}).innerText || '',
    fraction: bar && track && track.clientWidth ? bar.clientWidth / track.clientWidth : 0,
    width: bar ? bar.style.width : '',
    cls: bar ? bar.className : '',
  };
})"""


def progress_bars(locator) -> list[dict]:
    """Each ipywidgets progress bar under `locator`: label, drawn fraction, style classes."""
    return locator.evaluate(PROGRESS_JS)
