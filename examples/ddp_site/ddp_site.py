#!/usr/bin/env python3
"""A site with several devices under one Cohort client: data-parallel training
(PyTorch DistributedDataParallel) beneath the federated layer.

A hospital's site is often a server with several GPUs. Cohort does not know or care:
the site's ``train(weights, task)`` is one function, as for any client, and inside it
the site trains with DistributedDataParallel over ``$SITE_PROCESSES`` processes (2 by
default): NCCL on GPUs when there is one per process, gloo on CPUs otherwise — the same
code. Rank 0 is the process Cohort called: it starts the other ranks, trains as one of
them, and alone hands the trained weights back to Cohort (and so to the coordinator);
the other ranks only exchange gradients with it.

Every rank draws the same shuffled order (the task's seed) and takes every
``world``-th sample of each batch; its loss is the sum over its samples times
``world / batch``, so that DDP's mean of the ranks' gradients is the gradient of the
whole batch's mean loss: the step, and so the update, is the one a single process would
take on the same batches, up to floating-point rounding (the all-reduce adds in another
order).

    # 20 virtual sites on digits, each training over 2 gloo processes
    python examples/ddp_site/ddp_site.py simulate --clients 20 --rounds 10
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import traceback

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import cohort
from cohort.torch import from_state_dict, load_weights


class MLP(torch.nn.Module):
    """64 -> 32 -> 10 for the 8x8 digits."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 32)
        self.fc2 = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def processes() -> int:
    """Processes per site: ``$SITE_PROCESSES`` (default 2)."""
    return max(1, int(os.environ.get("SITE_PROCESSES") or 2))


def _backend(world: int) -> str:
    """NCCL with a GPU for every rank, gloo (CPUs) otherwise."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"


def _train_rank(rank, world, store, state, data, config, seed, out_path):
    """One rank's local training. ``world == 1`` is the plain single-process loop (no
    process group): the reference the data-parallel run must match.

    The ranks meet through a file store in the task's own folder rather than a TCP
    port: no port to find free (and lose to another process before it is bound), and no
    store server thread in rank 0 that a helper could still be talking to when rank 0
    tears it down, which aborted helpers on loaded machines."""
    torch.set_num_threads(1)
    backend = _backend(world)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if world > 1:
        dist.init_process_group(
            backend,
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(minutes=5),
        )
    try:
        model = MLP().to(device)
        model.load_state_dict(state)
        net = model
        if world > 1:
            net = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[rank] if backend == "nccl" else None
            )
        opt = torch.optim.SGD(
            net.parameters(),
            lr=config["lr"],
            momentum=config["momentum"],
            weight_decay=config["weight_decay"],
        )
        x, y = (torch.as_tensor(a).to(device) for a in data)
        n, batch = len(y), config["batch_size"]
        generator = torch.Generator().manual_seed(seed)
        loss_sum = 0.0
        for _ in range(config["local_epochs"]):
            order = torch.randperm(n, generator=generator).to(device)
            loss_sum = 0.0
            for start in range(0, n, batch):
                idx = order[start : start + batch]
                mine = idx[rank::world]
                # Summed and scaled, so that DDP's mean over ranks is the batch's mean
                # (also when the batch does not split evenly).
                loss = F.cross_entropy(net(x[mine]), y[mine], reduction="sum") * world / len(idx)
                opt.zero_grad()
                loss.backward()
                opt.step()
                loss_sum += loss.item() * len(idx) / world
        if world > 1:
            total = torch.tensor([loss_sum], device=device)
            dist.all_reduce(total)
            loss_sum = total.item()
        if rank == 0:
            torch.save({"state": model.state_dict(), "loss": loss_sum / max(n, 1)}, out_path)
        if world > 1:
            # Nobody leaves while another rank may still need it.
            dist.barrier()
    finally:
        if world > 1 and rank > 0:
            dist.destroy_process_group()


def _helper_rank(*args):
    """A helper rank's process: trains, then leaves without the interpreter's
    finalization. Its work is done once the group's last barrier has passed (rank 0
    holds the weights), and finalizing Python while gloo's C++ worker threads still hold
    tensors aborts the process now and then (SIGABRT, "terminate called without an
    active exception"; pytorch/pytorch#179291), which rank 0 would read as a failed
    rank. ``os._exit`` skips that teardown; a failure still says what it was."""
    code = 0
    try:
        _train_rank(*args)
    except BaseException:  # noqa: BLE001 - any failure is reported, then the exit code
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def train_site(weights, data, config, seed, world):
    """Trains `weights` on `data` over `world` processes; the trained weights (rank 0's)
    and the mean training loss of the last epoch."""
    model = MLP()
    load_weights(model, weights)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x, y = data
    data = (np.ascontiguousarray(x, dtype=np.float32), np.ascontiguousarray(y, dtype=np.int64))
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank0.pt")
        store = os.path.join(tmp, "store")
        context = mp.get_context("spawn")
        helpers = [
            context.Process(
                target=_helper_rank, args=(rank, world, store, state, data, config, seed, out_path)
            )
            for rank in range(1, world)
        ]
        for p in helpers:
            p.start()
        try:
            _train_rank(0, world, store, state, data, config, seed, out_path)
        finally:
            for p in helpers:
                p.join()
            # Rank 0 leaves the group last, once every helper has exited.
            if world > 1 and dist.is_initialized():
                dist.destroy_process_group()
        if any(p.exitcode != 0 for p in helpers):
            raise RuntimeError(f"a data-parallel rank failed: exit codes {[p.exitcode for p in helpers]}")
        out = torch.load(out_path)
    model.load_state_dict(out["state"])
    return from_state_dict(model), out["loss"]


def _config(task) -> dict:
    c = task.config
    return {
        "local_epochs": int(c["local_epochs"]),
        "batch_size": int(c["batch_size"]),
        "lr": float(c["lr"]),
        "momentum": float(c.get("momentum") or 0.0),
        "weight_decay": float(c.get("weight_decay") or 0.0),
    }


def train(weights, task):
    """The site's training: data parallel over :func:`processes` processes."""
    trained, loss = train_site(weights, task.data, _config(task), task.seed, processes())
    return cohort.TrainResult(trained, len(task.data[1]), {"loss": loss})


def train_single(weights, task):
    """The same training in one process: what :func:`train` must match."""
    trained, loss = train_site(weights, task.data, _config(task), task.seed, 1)
    return cohort.TrainResult(trained, len(task.data[1]), {"loss": loss})


@torch.no_grad()
def evaluate(weights, task):
    model = MLP()
    load_weights(model, weights)
    x, y = task.data
    logits = model(torch.as_tensor(np.asarray(x, dtype=np.float32)))
    y = torch.as_tensor(np.asarray(y, dtype=np.int64))
    loss = F.cross_entropy(logits, y).item()
    return cohort.EvalResult(loss, len(y), {"accuracy": float((logits.argmax(1) == y).float().mean())})


def digits():
    """The shipped digits, pixels scaled to 0-1."""
    ds = cohort.datasets.load("digits")
    return (
        (ds.x_train / 16.0).astype(np.float32),
        ds.y_train.astype(np.int64),
        (ds.x_test / 16.0).astype(np.float32),
        ds.y_test.astype(np.int64),
    )


def initial_weights(seed: int = 0):
    torch.manual_seed(seed)
    return from_state_dict(MLP())


def simulate(trainer, clients, rounds, seed, out=None, workers=2):
    x, y, xt, yt = digits()
    return cohort.simulate(
        trainer,
        evaluate,
        initial_weights=initial_weights(seed),
        client_data=(x, y),
        test_data=(xt, yt),
        clients=clients,
        clients_per_round=max(1, clients // 2),
        rounds=rounds,
        partition="dirichlet:0.5",
        local_epochs=2,
        batch_size=16,
        lr=0.1,
        momentum=0.9,
        workers=workers,
        seed=seed,
        out=out,
        progress=False,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="virtual sites, each data parallel")
    sim.add_argument("--clients", type=int, default=20)
    sim.add_argument("--rounds", type=int, default=10)
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--single", action="store_true", help="one process per site instead")
    sim.add_argument("--out", default=None)
    args = parser.parse_args()
    result = simulate(train_single if args.single else train, args.clients, args.rounds, args.seed, args.out)
    print(f"final accuracy {result.accuracy:.4f} after {len(result.rounds)} rounds; results in {result.out}")
    sys.exit(0)
