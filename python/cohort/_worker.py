"""One worker process of ``cohort.simulate``'s pool (``python -m cohort._worker``).

The Rust round engine starts the workers and talks to each over its standard input and
output with length-prefixed frames (a little-endian ``u32`` header length, a JSON
header, a ``u64`` body length, the body). On Linux the tensors themselves do not cross
the pipe: the engine shares memory with the worker (an inherited ``memfd``, its number in
``COHORT_WORKER_SHM_FD``), writes the worker's model there and names, in each task, the
slot the worker writes its update to. The worker moves those two streams out of the
way first, so a ``print`` in the user's code goes to standard error instead of
corrupting the protocol. It checks nothing of what the user returns beyond turning it
into bytes: the engine checks names, shapes, dtypes and values.

Not a public module: its protocol may change with any release.
"""

from __future__ import annotations

import importlib
import json
import mmap
import os
import pickle
import runpy
import signal
import struct
import sys
import threading
import time
import traceback
import types
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from ._tensors import _describe, _to_numpy_dict
from ._types import EvalResult, Task, TrainResult, _check_result


def _watch_parent() -> None:
    """Dies with the engine: a worker orphaned mid-``train`` must not keep a GPU or a
    core. (``PR_SET_PDEATHSIG`` would fire when the engine *thread* that started the
    worker ends, not the process, so the parent's pid is watched instead.)"""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.25)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="cohort-parent-watch", daemon=True).start()


def _widen_pipe(fd: int) -> None:
    """Raises the pipe's buffer from 64 KiB to 1 MiB (Linux's default ceiling for
    unprivileged processes): a 4 MB model then crosses in 4 wake-ups instead of 64."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (ImportError, OSError):
        pass  # not a pipe, or not Linux: the default buffer works, only slower


class _Channel:
    def __init__(self) -> None:
        # The protocol keeps private copies of fds 0 and 1; the user's code gets
        # /dev/null as input and standard error as output.
        self._in = os.fdopen(os.dup(0), "rb", buffering=1 << 20)
        self._out = os.fdopen(os.dup(1), "wb", buffering=1 << 20)
        _widen_pipe(self._in.fileno())
        _widen_pipe(self._out.fileno())
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def read(self) -> Optional[Tuple[Dict[str, Any], bytearray]]:
        raw = self._in.read(4)
        if len(raw) < 4:
            return None
        (n,) = struct.unpack("<I", raw)
        header = json.loads(self._read_exact(n))
        (m,) = struct.unpack("<Q", self._read_exact(8))
        body = bytearray(m)
        view = memoryview(body)
        got = 0
        while got < m:
            k = self._in.readinto(view[got:])
            if not k:
                raise EOFError("the engine closed the pipe mid-frame")
            got += k
        return header, body

    def _read_exact(self, n: int) -> bytes:
        data = self._in.read(n)
        if len(data) < n:
            raise EOFError("the engine closed the pipe mid-frame")
        return data

    def write(self, header: Dict[str, Any], parts: Tuple[Any, ...] = ()) -> None:
        h = json.dumps(header, allow_nan=True).encode()
        out = self._out
        out.write(struct.pack("<I", len(h)))
        out.write(h)
        out.write(struct.pack("<Q", sum(memoryview(p).nbytes for p in parts)))
        for p in parts:
            out.write(_raw(p))
        out.flush()


class _Shared:
    """The memory shared with the engine, mapped on first use and again when the engine
    has grown it. Older mappings stay alive as long as arrays view them."""

    def __init__(self, fd: Optional[int]) -> None:
        self.fd = fd
        self.mapping: Optional[mmap.mmap] = None
        self.size = 0

    def view(self, offset: int, nbytes: int) -> memoryview:
        if self.fd is None:
            raise RuntimeError("the engine named shared memory, but none was inherited")
        if self.mapping is None or offset + nbytes > self.size:
            size = os.fstat(self.fd).st_size
            if offset + nbytes > size:
                raise RuntimeError(f"shared memory of {size} bytes has no [{offset}, +{nbytes})")
            self.mapping = mmap.mmap(self.fd, size)
            self.size = size
        return memoryview(self.mapping)[offset : offset + nbytes]


def _write_slot(slot: memoryview, parts: Tuple[Any, ...]) -> Optional[int]:
    """Copies the update's bytes into its slot, one after another; ``None`` (nothing
    written) when they do not fit (float64, say), and the pipe carries them instead."""
    total = sum(memoryview(p).nbytes for p in parts)
    if total > slot.nbytes:
        return None
    offset = 0
    for p in parts:
        raw = _raw(p)
        slot[offset : offset + raw.nbytes] = raw
        offset += raw.nbytes
    return total


def _raw(part: Any) -> memoryview:
    """An array's bytes as a flat byte view (a tensor with a zero in its shape has none,
    and a view of it cannot be cast)."""
    view = memoryview(part)
    return view.cast("B") if view.nbytes else memoryview(b"")


class _Code:
    """The user's functions and data, however they were handed over."""

    def __init__(self) -> None:
        self.train: Callable[..., Any]
        self.evaluate: Optional[Callable[..., Any]] = None
        self.client_data: Optional[Callable[[int], Any]] = None
        self.test_data: Any = None
        self.initial_weights: Any = None
        self.partitions: Optional[list] = None
        self.dataset: Optional[Tuple[np.ndarray, np.ndarray]] = None
        payload = os.environ.get("COHORT_WORKER_PAYLOAD")
        target = os.environ.get("COHORT_WORKER_TARGET")
        if payload:
            self._load_payload(payload)
        elif target:
            self._load_module(target)
        else:
            raise RuntimeError("neither COHORT_WORKER_PAYLOAD nor COHORT_WORKER_TARGET is set")
        self._data_cache: Dict[int, Any] = {}
        # With a held-out split per client (``--client-holdout``), ``train`` gets the
        # rest of the client's data and ``evaluate`` the held-out part of it.
        self.holdout = float(os.environ.get("COHORT_WORKER_HOLDOUT") or 0.0)
        self.split_seed = int(os.environ.get("COHORT_WORKER_SPLIT_SEED") or 0)

    def _load_payload(self, path: str) -> None:
        with open(path, "rb") as f:
            preamble = pickle.load(f)
            for entry in reversed(preamble.get("sys_path") or []):
                if entry not in sys.path:
                    sys.path.insert(0, entry)
            if preamble.get("main_path"):
                _import_main(preamble["main_path"])
            spec = pickle.load(f)
        self.train = spec["train"]
        self.evaluate = spec.get("evaluate")
        self.client_data = spec.get("client_data")
        self.test_data = spec.get("test_data")
        self.initial_weights = spec.get("initial_weights")
        self.dataset = spec.get("dataset")
        self.partitions = spec.get("partitions")

    def _load_module(self, target: str) -> None:
        module_name, _, function = target.partition(":")
        if module_name.endswith(".py") or os.sep in module_name:
            path = os.path.abspath(module_name)
            sys.path.insert(0, os.path.dirname(path))
            module = types.ModuleType("__cohort_main__")
            module.__dict__.update(runpy.run_path(path, run_name="__cohort_main__"))
        else:
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
        name = function or "train"
        train = getattr(module, name, None)
        if not callable(train):
            raise AttributeError(f"{module_name} has no function `{name}`")
        self.train = train
        self.evaluate = getattr(module, "evaluate", None)
        self.client_data = getattr(module, "client_data", None)
        self.test_data = getattr(module, "test_data", None)
        init = getattr(module, "initial_weights", None)
        self.initial_weights = init

    def initial(self) -> Dict[str, np.ndarray]:
        init = self.initial_weights
        if callable(init):
            init = init()
        if init is None:
            raise ValueError("no initial weights: pass initial_weights (a dict of arrays, "
                             "a state_dict, or a function returning one)")
        return _to_numpy_dict(init, "initial_weights")

    def data_for(self, client: int) -> Any:
        """The data ``train`` gets for ``client``: all of it, or what it does not hold
        out."""
        return self._split(client)[0]

    def held_out(self, client: int) -> Any:
        """The part of ``client``'s data it holds out (``None``: nothing)."""
        return self._split(client)[1]

    def _split(self, client: int) -> Tuple[Any, Any]:
        if client in self._data_cache:
            return self._data_cache[client]
        if self.partitions is not None and self.dataset is not None:
            x, y = self.dataset
            idx = self.partitions[client]
            data: Any = (x[idx], y[idx])
        elif self.client_data is not None:
            data = self.client_data(client)
        else:
            data = None
        parts = _hold_out(data, self.holdout, self.split_seed, client) if self.holdout > 0 else (data, None)
        # A handful of clients per worker is the common case; a cohort of thousands
        # keeps the most recent ones only, so memory stays bounded.
        if len(self._data_cache) >= 256:
            self._data_cache.pop(next(iter(self._data_cache)))
        self._data_cache[client] = parts
        return parts

    def test(self) -> Any:
        data = self.test_data
        if callable(data):
            data = data()
            self.test_data = data
        return data


def _hold_out(data: Any, fraction: float, seed: int, client: int) -> Tuple[Any, Any]:
    """``data`` (a tuple or list of arrays of one length, such as ``(x, y)``) split into
    what the client trains on and what it holds out: ``fraction`` of its rows (at least
    one of each when it has two), drawn by the run's seed and the client, so the split
    is the same every round and in every worker."""
    if not isinstance(data, (tuple, list)) or not data:
        raise TypeError(
            "a held-out split per client (client_holdout, personalise) needs each client's "
            f"data as a tuple of arrays such as (x, y), got {type(data).__name__}"
        )
    arrays = [np.asarray(a) for a in data]
    n = len(arrays[0])
    if any(len(a) != n for a in arrays):
        raise ValueError("a client's data arrays must have one length to hold part of them out")
    held = min(max(int(round(fraction * n)), 1), n - 1) if n >= 2 else 0
    order = np.random.default_rng([seed, client]).permutation(n)
    keep, out = order[held:], order[:held]
    kind = type(data)
    train = kind(a[keep] for a in arrays)
    return train, (kind(a[out] for a in arrays) if held else None)


def _import_main(path: str) -> None:
    """Loads the user's script as ``__mp_main__`` and makes it ``__main__``, as
    multiprocessing's spawn start method does, so pickled ``__main__`` functions resolve.
    The script's ``if __name__ == "__main__":`` block does not run."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    module = types.ModuleType("__mp_main__")
    module.__file__ = path
    sys.modules["__mp_main__"] = module
    sys.modules["__main__"] = module
    code = compile(open(path, "rb").read(), path, "exec")
    exec(code, module.__dict__)  # noqa: S102 - the user's own script, as multiprocessing does


def _error_text(exc: BaseException) -> str:
    """The exception's message with the last frames of its traceback: enough to find the
    line, short enough for a log line and the coordinator's failure reason."""
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    text = "".join(tb[-3:]).strip()
    return text[-4000:]


def main() -> None:
    _watch_parent()
    # Ctrl-C goes to the whole process group; the engine decides, and stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel = _Channel()
    try:
        code = _Code()
    except BaseException as exc:  # noqa: BLE001 - reported, then the worker exits
        channel.write({"ok": False, "error": _error_text(exc)})
        return
    channel.write({"ok": True, "pid": os.getpid(), "evaluate": code.evaluate is not None})
    index = int(os.environ.get("COHORT_WORKER_INDEX", "0"))
    shm_fd = os.environ.get("COHORT_WORKER_SHM_FD")
    shared = _Shared(int(shm_fd) if shm_fd else None)
    global_weights: Dict[str, np.ndarray] = {}
    while True:
        frame = channel.read()
        if frame is None:
            return
        header, body = frame
        op = header.get("op")
        try:
            if op == "model":
                where = header.get("shm")
                if where is not None:
                    body = shared.view(int(where["offset"]), int(where["bytes"]))
                global_weights = _views(header["tensors"], body)
                continue
            if op == "initial":
                tensors, parts = _describe(code.initial())
                channel.write({"ok": True, "tensors": tensors}, parts)
            elif op == "train":
                client = int(header["client"])
                task = Task(
                    round=int(header["round"]),
                    seed=int(header["seed"]),
                    partition_id=client,
                    config=header.get("config") or {},
                    hyperparameters=header.get("hyperparameters") or {},
                    data=code.data_for(client),
                    worker=index,
                )
                result = code.train(global_weights, task)
                result = _check_result(result, TrainResult, "train")
                weights = _to_numpy_dict(result.weights, "TrainResult.weights")
                tensors, parts = _describe(weights)
                reply = {
                    "ok": True,
                    "num_examples": int(result.num_examples),
                    "metrics": _finite_metrics(result.metrics),
                    "tensors": tensors,
                }
                slot = header.get("slot")
                written = None
                if slot is not None:
                    written = _write_slot(shared.view(int(slot["offset"]), int(slot["bytes"])), parts)
                if written is None:
                    channel.write(reply, parts)
                else:
                    reply["slot_bytes"] = written
                    channel.write(reply)
            elif op == "evaluate":
                if code.evaluate is None:
                    channel.write({"ok": True, "none": True})
                    continue
                task = Task(
                    round=int(header["round"]),
                    seed=0,
                    partition_id=None,
                    config={},
                    hyperparameters=header.get("hyperparameters") or {},
                    data=code.test(),
                    worker=index,
                )
                result = _check_result(code.evaluate(global_weights, task), EvalResult, "evaluate")
                channel.write(
                    {
                        "ok": True,
                        "loss": float(result.loss),
                        "num_examples": int(result.num_examples),
                        "metrics": _finite_metrics(result.metrics),
                    }
                )
            elif op == "evaluate_client":
                client = int(header["client"])
                held = code.held_out(client)
                if code.evaluate is None or held is None:
                    channel.write({"ok": True, "none": True})
                    continue
                task = Task(
                    round=0,
                    seed=0,
                    partition_id=client,
                    config={},
                    hyperparameters=header.get("hyperparameters") or {},
                    data=held,
                    worker=index,
                )
                result = _check_result(code.evaluate(global_weights, task), EvalResult, "evaluate")
                channel.write(
                    {
                        "ok": True,
                        "loss": float(result.loss),
                        "num_examples": int(result.num_examples),
                        "metrics": _finite_metrics(result.metrics),
                    }
                )
            else:
                channel.write({"ok": False, "error": f"unknown request {op!r}"})
        except Exception as exc:  # noqa: BLE001 - the task fails; the worker carries on
            channel.write({"ok": False, "error": _error_text(exc)})


def _finite_metrics(metrics: Dict[str, Any]) -> Dict[str, float]:
    out = {}
    for k, v in (metrics or {}).items():
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if f == f and f not in (float("inf"), float("-inf")):
            out[str(k)] = f
    return out


def _views(tensors: list, body: Any) -> Dict[str, np.ndarray]:
    """Read-only NumPy views into the model's bytes (the frame's body, or the worker's
    model area in shared memory): no copy, and a ``train`` that changes its input in
    place gets an error instead of corrupting the next client's starting point. Views of
    shared memory show the worker's current model: keep a copy to keep an older one."""
    flat = np.frombuffer(body, dtype="<f4")
    out = {}
    offset = 0
    for t in tensors:
        shape = tuple(t["shape"])
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        arr = flat[offset : offset + n].reshape(shape)
        arr.flags.writeable = False
        out[t["name"]] = arr
        offset += n
    return out


if __name__ == "__main__":
    main()
