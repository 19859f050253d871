"""Fixtures shared by the Python tests: a real ``cohort serve`` process.

The binary is ``$COHORT_BIN``, else ``target/debug/cohort`` at the repository's root.
Without it the tests that need a coordinator are skipped, or fail when
``COHORT_REQUIRE_SERVE=1`` (CI sets it, so that a missing build is not a silent pass).
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[2]

#: The admin token the tests give ``cohort serve`` (at least 32 characters).
ADMIN_TOKEN = "python-test-admin-token-0123456789abcdef"


def cohort_binary() -> str:
    """The ``cohort`` binary to run; skips (or fails, with ``COHORT_REQUIRE_SERVE=1``)
    the calling test when there is none."""
    path = os.environ.get("COHORT_BIN") or str(REPO / "target" / "debug" / "cohort")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        message = f"no cohort binary at {path} (build it with `cargo build`, or set COHORT_BIN)"
        if os.environ.get("COHORT_REQUIRE_SERVE") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> Dict[str, str]:
    """This process's environment without any ``COHORT_*`` setting (so that the
    caller's shell cannot change the server under test), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COHORT_")}
    env.update(extra)
    return env


@dataclass
class Serve:
    """A running ``cohort serve``: where it listens, its admin token, the dev CA to
    trust, its data directory and its log."""

    url: str
    token: str
    ca_cert: str
    data_dir: Path
    port: int
    binary: str
    process: subprocess.Popen
    log: Path
    children: List[subprocess.Popen] = field(default_factory=list)

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's output, for a failure message."""
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


def _healthy(url: str, ca_cert: Path) -> bool:
    if not ca_cert.exists():
        return False
    try:
        context = ssl.create_default_context(cafile=str(ca_cert))
        with urllib.request.urlopen(f"{url}/api/v1/health", context=context, timeout=2) as r:
            return r.status == 200
    except (OSError, ssl.SSLError, ValueError):
        return False


def start_serve(data_dir: Path, *args: str, attempts: int = 3) -> Serve:
    """Starts ``cohort serve --dev-tls`` on a free port with its data in ``data_dir`` and
    waits (up to 60 s) until it answers its health check over TLS."""
    binary = cohort_binary()
    data_dir.mkdir(parents=True, exist_ok=True)
    last = ""
    for attempt in range(attempts):
        port = free_port()
        log = data_dir / f"serve-{attempt}.log"
        url = f"https://127.0.0.1:{port}"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [binary, "serve", "--dev-tls", "--listen", f"127.0.0.1:{port}",
                 "--data-dir", str(data_dir), *args],
                env=clean_env(COHORT_ADMIN_TOKEN=ADMIN_TOKEN, RUST_LOG="warn"),
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            )
        ca = data_dir / "tls" / "ca.pem"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            if _healthy(url, ca):
                return Serve(url, ADMIN_TOKEN, str(ca), data_dir, port, binary, process, log)
            time.sleep(0.1)
        stop_process(process)
        last = log.read_text(errors="replace")[-4000:]
    pytest.fail(f"cohort serve did not come up; its output:\n{last}")


def stop_process(process: Optional[subprocess.Popen], grace: float = 10.0) -> None:
    """Terminates a process this test started (SIGTERM, then SIGKILL) and reaps it."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=grace)


@pytest.fixture(scope="session")
def cohort_serve(tmp_path_factory: pytest.TempPathFactory):
    """A ``cohort serve`` (SQLite, dev TLS) for the whole session, stopped at its end
    along with any process a test registered in ``children``."""
    serve = start_serve(tmp_path_factory.mktemp("cohort-serve"))
    try:
        yield serve
    finally:
        for child in serve.children:
            stop_process(child, grace=5.0)
        stop_process(serve.process)
