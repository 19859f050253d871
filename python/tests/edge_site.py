"""One site of the deployment tests: ``cohort.EdgeClient`` running the same softmax
``train`` as the simulation tests, on its own partition of the digits.

    python edge_site.py URL CA TOKEN STATE_DIR PARTITION MODE IDLE_EXIT

MODE: ``ok`` trains; ``raise`` raises in every train; ``slow`` sleeps 60 s in train (for
Ctrl-C); ``bad-shape`` returns a wrong shape; ``approved`` trains with its own code's hash
approved; ``unapproved`` approves another hash, so every task is refused;
``columns-shared`` shares the columns ``pixels`` and ``label``, ``columns-narrow`` only
``label``. Prints the client's report as JSON.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cohort  # noqa: E402
import softmax  # noqa: E402


def main():
    url, ca, token, state_dir, partition, mode, idle_exit = sys.argv[1:8]
    partition = int(partition)
    x, y, xt, yt = softmax.digits()
    parts = cohort.datasets.partition(y, "iid", clients=5, seed=0)
    data = (x[parts[partition]], y[parts[partition]])

    def train(weights, task):
        if mode == "raise":
            raise RuntimeError(f"site {task.partition_id}: the PACS export is locked")
        if mode == "slow":
            print("training", flush=True)
            time.sleep(60)
        if mode == "bad-shape":
            return cohort.TrainResult({"w": weights["w"][:3], "b": weights["b"]}, 10)
        return softmax.train(weights, task)

    approve = None
    if mode == "approved":
        approve = cohort.EdgeClient.trainer_hash(train, softmax.evaluate)
    elif mode == "unapproved":
        approve = "0" * 64
    client = cohort.EdgeClient(
        url,
        ca_cert=ca,
        enrol_token=token or None,
        state_dir=state_dir,
        data=data,
        partition_id=partition,
        seed=partition,
        idle_exit=float(idle_exit),
        approve_trainer=approve,
        columns={"columns-shared": ["pixels", "label"], "columns-narrow": ["label"]}.get(mode),
    )
    report = client.run(train, softmax.evaluate)
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
