"""What the Python benchmarks share: peak memory of the process tree read from /proc, an
in-process Flower ``Grid`` with a pool of worker threads, and the JSON/environment
bookkeeping.

The in-process grid follows ``LocalGrid`` of the Flower reference harness
(``shared/bench/flower/bench_secagg.py``): every message goes through a protobuf round
trip in both directions, as over a network, then to the ``ClientApp`` in this process.
The harness delivers the messages of a round one after another; here a pool of
``workers`` threads delivers them, so that in-process Flower uses as many cores as the
other engines' worker processes (with ``workers=1`` it is the harness's grid). Flower
is imported only when the grid is made, so the Cohort runs never load it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import threading
from typing import Any, Dict, List, Optional

PAGE = os.sysconf("SC_PAGE_SIZE")


def log(msg: str) -> None:
    """A human-readable line on standard error (standard output carries the JSON)."""
    print(msg, file=sys.stderr, flush=True)


def emit(record: Dict[str, Any]) -> None:
    """One JSON line on standard output."""
    print(json.dumps(record), flush=True)


def median(xs: List[float]) -> Optional[float]:
    return float(statistics.median(xs)) if xs else None


def env_info() -> Dict[str, Any]:
    """Versions and machine facts, to go with every record."""
    from importlib.metadata import PackageNotFoundError, version

    info: Dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "nproc": os.cpu_count(),
    }
    for pkg in ("cohort", "flwr", "ray", "torch", "numpy"):
        try:
            info[pkg] = version(pkg)
        except PackageNotFoundError:
            info[pkg] = None
    # A development build (`maturin develop`, `--profile=dev`) runs Cohort's own crates
    # at opt-level 1: its figures are not Cohort's.
    try:
        from cohort import _rust

        info["cohort_build"] = getattr(_rust, "BUILD_PROFILE", None)
    except ImportError:
        pass
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            info["loadavg_1_5_15"] = [float(v) for v in f.read().split()[:3]]
    except OSError:
        pass
    return info


# ------------------------------------------------------------------- memory of a tree


def _children_map() -> Dict[int, List[int]]:
    """Parent pid -> child pids, from /proc/PID/stat (field 4 after the command)."""
    out: Dict[int, List[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command (field 2) may hold spaces and parentheses: split after the last ')'.
        rest = stat[stat.rfind(b")") + 2 :].split()
        if len(rest) > 1:
            out.setdefault(int(rest[1]), []).append(int(name))
    return out


def tree_pids(root: int) -> List[int]:
    """``root`` and all its descendants."""
    children = _children_map()
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, ()))
    return pids


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


class TreeMemory:
    """Samples the memory of this process and all its descendants (the engine's worker
    processes, Ray's raylet, GCS and actors) from a thread, every ``interval`` seconds.

    Two sums are kept: RSS (each process's resident pages: shared libraries such as
    libtorch and shared memory count once per process that maps them) and PSS (shared
    pages divided among the processes sharing them: the tree's real footprint). Use
    :meth:`mark` to note the peak so far under a label (e.g. after round N)."""

    def __init__(self, interval: float = 0.2, pss_every: int = 2) -> None:
        self.interval = interval
        self.pss_every = pss_every
        self.root = os.getpid()
        self.peak_rss = 0
        self.peak_pss = 0
        self.peak_procs = 0
        self.samples = 0
        self.marks: Dict[str, Dict[str, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-memory", daemon=True)

    def start(self) -> "TreeMemory":
        self.sample(pss=True)
        self._thread.start()
        return self

    def sample(self, pss: bool) -> None:
        pids = tree_pids(self.root)
        rss = sum(_rss(p) for p in pids)
        pss_sum = sum(_pss(p) for p in pids) if pss else 0
        with self._lock:
            self.peak_procs = max(self.peak_procs, len(pids))
            self.peak_rss = max(self.peak_rss, rss)
            self.peak_pss = max(self.peak_pss, pss_sum)
            self.samples += 1

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(self.interval):
            n += 1
            self.sample(pss=n % self.pss_every == 0)

    def mark(self, label: str) -> None:
        with self._lock:
            self.marks[label] = {"peak_rss_mib": self.peak_rss / 2**20, "peak_pss_mib": self.peak_pss / 2**20}

    def stop(self) -> Dict[str, Any]:
        self._stop.set()
        self._thread.join()
        self.sample(pss=True)
        return {
            "peak_rss_mib": round(self.peak_rss / 2**20, 1),
            "peak_pss_mib": round(self.peak_pss / 2**20, 1),
            "peak_processes": self.peak_procs,
            "memory_samples": self.samples,
        }


# ------------------------------------------------------------ in-process Flower grid


def local_grid(app: Any, num_nodes: int, workers: int) -> Any:
    """A Flower ``Grid`` delivering messages to ``app`` in this process, ``workers`` at a
    time, to nodes ``1000 .. 1000 + num_nodes - 1`` whose ``node_config`` holds
    ``partition-id`` and ``num-partitions`` (as Flower's simulation gives them). Also
    sets the server task's identity as ``flwr.server.compat.app`` does."""
    from concurrent.futures import ThreadPoolExecutor
    from uuid import uuid4

    from flwr.app import Context, Message, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict
    from flwr.serverapp.grid import Grid
    from flwr.supercore.run import Run
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id = 1
    TaskIdentity.run_id = 1
    TaskIdentity.node_id = SUPERLINK_NODE_ID

    class LocalGrid(Grid):
        def __init__(self) -> None:
            self.app = app
            self.contexts = {
                1000 + i: Context(run_id=1, node_id=1000 + i,
                                  node_config={"partition-id": i, "num-partitions": num_nodes},
                                  state=RecordDict(), run_config={})
                for i in range(num_nodes)
            }
            self._run = Run.create_empty(1)
            self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="flwr-node")

        def set_run(self, run: Any) -> None:
            self._run = run

        @property
        def run(self) -> Any:
            return self._run

        def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # noqa: ANN001
            return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

        def get_node_ids(self):  # noqa: ANN201
            return list(self.contexts)

        def push_messages(self, messages):  # noqa: ANN001, ANN201
            raise NotImplementedError("LocalGrid only supports send_and_receive")

        def pull_messages(self, message_ids):  # noqa: ANN001, ANN201
            raise NotImplementedError("LocalGrid only supports send_and_receive")

        def _deliver(self, msg: Any) -> Any:
            msg.metadata.__dict__["_message_id"] = uuid4().hex
            pb = recorddict_to_proto(msg.content).SerializeToString()
            msg.content = recorddict_from_proto(ProtoRecordDict.FromString(pb))
            reply = self.app(msg, self.contexts[msg.metadata.dst_node_id])
            pb2 = recorddict_to_proto(reply.content).SerializeToString()
            reply.content = recorddict_from_proto(ProtoRecordDict.FromString(pb2))
            reply.metadata.__dict__["_message_id"] = uuid4().hex
            return reply

        def send_and_receive(self, messages, *, timeout=None):  # noqa: ANN001, ANN201
            return list(self.pool.map(self._deliver, list(messages)))

    return LocalGrid()


def server_context() -> Any:
    from flwr.app import Context, RecordDict

    return Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})


def run_flower_apps(engine: str, client_app: Any, server_app: Any, clients: int, workers: int) -> None:
    """Runs Flower's apps to the end: with Flower's own simulation engine (``flower-ray``)
    or through the in-process grid with ``workers`` threads."""
    if engine == "flower-ray":
        from flwr.simulation import run_simulation

        run_simulation(
            server_app=server_app, client_app=client_app, num_supernodes=clients,
            backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                            "init_args": {"num_cpus": workers, "include_dashboard": False}},
        )
    else:
        grid = local_grid(client_app, clients, workers)
        server_app(grid, server_context())
        grid.pool.shutdown()
