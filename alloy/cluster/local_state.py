"""What `alloy start` leaves on disk for `alloy stop` / `alloy status`, and the settings all three read.

Ray-free on purpose: `alloy stop` must signal the running `alloy start` at once. Importing Ray and Serve first
(alloy.control.local_run) takes seconds on a busy machine, and jobs that were active when the operator typed
`alloy stop` could finish before the graceful stop even began.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from alloy.config import Settings, load_settings

STATE_FILE = "run/alloy-start.json"
STOP_REQUEST_FILE = "run/stop-request.json"
PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class StopRequest:
    """What `alloy stop` asks of the foreground `alloy start` (written next to the state file, then SIGTERM)."""

    force: bool = False
    timeout_s: float | None = None  # None: lifecycle.shutdown_timeout_s


def write_stop_request(data_dir: Path, request: StopRequest) -> None:
    path = Path(data_dir) / STOP_REQUEST_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"force": request.force, "timeout_s": request.timeout_s}))


def take_stop_request(data_dir: Path) -> StopRequest:
    """The pending request (consumed), or a graceful stop with the configured timeout (SIGTERM, Ctrl-C)."""
    path = Path(data_dir) / STOP_REQUEST_FILE
    if not path.exists():
        return StopRequest()
    raw = json.loads(path.read_text())
    path.unlink(missing_ok=True)
    return StopRequest(force=bool(raw.get("force")), timeout_s=raw.get("timeout_s"))


def local_settings(config_path: str | Path | None = None) -> Settings:
    """The settings `alloy start/stop/status` use: the config file (``--config`` or ALLOY_CONFIG), with the data
    dir made absolute so every process opens the same database."""
    if config_path:
        os.environ["ALLOY_CONFIG"] = str(Path(config_path).resolve())
    settings = load_settings()
    # A data dir given by the user (--data-dir, ALLOY_DATA_DIR) is relative to where they are; one from the
    # config file is relative to the project root, as the Serve builder pins it: any folder finds the same data.
    anchor = Path.cwd() if "ALLOY_DATA_DIR" in os.environ else PROJECT_ROOT
    return load_settings(data_dir=str((anchor / settings.data_dir).resolve()))


def read_local_state(data_dir: Path) -> dict[str, Any] | None:
    state_file = Path(data_dir) / STATE_FILE
    if not state_file.exists():
        return None
    return json.loads(state_file.read_text())


def pid_alive(pid: int | None) -> bool:
    """Whether the process runs; a zombie (exited, not yet reaped by its parent) does not."""
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
