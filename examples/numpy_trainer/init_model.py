#!/usr/bin/env python3
"""Writes the initial MLP for train.py as a safetensors file.

    python3 examples/numpy_trainer/init_model.py --features 64 --classes 10 \
        --hidden 32 --seed 0 --out initial.safetensors

Layers fc1, fc2, ... (weight [out, in], bias [out], F32), initialised like PyTorch's
nn.Linear: weight and bias uniform in +-1/sqrt(in) (Kaiming-uniform with a = sqrt(5)).
No --hidden gives logistic regression (one layer); repeat it for more hidden layers.
"""

import argparse
import sys

import numpy as np

import st


def main(argv=None):
    parser = argparse.ArgumentParser(description="Write the initial MLP as safetensors.")
    parser.add_argument("--features", type=int, required=True, help="input features (CSV columns other than 'label')")
    parser.add_argument("--classes", type=int, required=True, help="number of classes (labels 0..classes-1)")
    parser.add_argument("--hidden", type=int, action="append", default=[], help="width of a hidden layer; repeat for more")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--out", required=True, help="file to write, e.g. initial.safetensors")
    args = parser.parse_args(argv)
    sizes = [args.features, *args.hidden, args.classes]
    if any(n < 1 for n in sizes) or args.classes < 2:
        print("init_model.py: error: sizes must be >= 1 and --classes >= 2", file=sys.stderr)
        return 2

    rng = np.random.default_rng(args.seed)
    tensors = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:]), start=1):
        bound = 1.0 / np.sqrt(fan_in)
        tensors[f"fc{i}.weight"] = rng.uniform(-bound, bound, (fan_out, fan_in)).astype(np.float32)
        tensors[f"fc{i}.bias"] = rng.uniform(-bound, bound, fan_out).astype(np.float32)
    st.save(tensors, args.out, metadata={"architecture": "mlp:" + "-".join(map(str, sizes))})
    parameters = sum(t.size for t in tensors.values())
    print(f"wrote {args.out}: MLP {'-'.join(map(str, sizes))}, {parameters} parameters", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
