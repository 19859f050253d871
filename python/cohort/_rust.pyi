"""Types of the private compiled module (see the Python modules for the public API)."""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

__version__: str
BUILD_PROFILE: str

def simulate(
    config_json: str,
    python: str,
    payload: str,
    workers: int,
    devices: Sequence[str],
    task_timeout: Optional[float],
    clients: int,
    hyperparameters_json: str,
    progress: bool,
) -> Dict[str, Any]: ...
def check_config(config_json: str) -> None: ...
def partition(labels: np.ndarray, clients: int, scheme: str, seed: int) -> List[np.ndarray]: ...
def load_dataset(name: str) -> Tuple[np.ndarray, np.ndarray, List[str]]: ...
def save_model(tensors: Sequence[Tuple[str, Sequence[int], np.ndarray]]) -> bytes: ...
def load_model(data: bytes) -> Dict[str, np.ndarray]: ...
def run_edge(
    coordinator: str,
    ca_pem: Optional[bytes],
    identity_pem: Optional[bytes],
    enrol_token: Optional[str],
    state_dir: str,
    seed: int,
    idle_exit: Optional[float],
    partition_id: Optional[int],
    handler: Callable[[str, Dict[str, np.ndarray], Dict[str, Any]], Tuple[int, Dict[str, float], Optional[List[Tuple[str, str, List[int]]]], bytes]],
    insecure_http: bool = ...,
    site: Optional[Dict[str, Any]] = ...,
) -> Dict[str, Any]: ...
def code_sha256(files: List[str]) -> str: ...
