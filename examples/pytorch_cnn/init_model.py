#!/usr/bin/env python3
"""Writes the initial SmallCNN (PyTorch's default initialisation) as safetensors.

    python3 examples/pytorch_cnn/init_model.py --image-shape 1,8,8 --classes 10 \
        --seed 0 --out initial.safetensors
"""

import argparse
import sys

import torch
from safetensors.torch import save_file

from cnn import SmallCNN, parse_image_shape


def main(argv=None):
    parser = argparse.ArgumentParser(description="Write the initial SmallCNN as safetensors.")
    parser.add_argument("--image-shape", required=True, help="C,H,W of the images, e.g. 1,28,28")
    parser.add_argument("--classes", type=int, required=True, help="number of classes (labels 0..classes-1)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--out", required=True, help="file to write, e.g. initial.safetensors")
    args = parser.parse_args(argv)
    try:
        shape = parse_image_shape(args.image_shape)
    except ValueError as e:
        print(f"init_model.py: error: {e}", file=sys.stderr)
        return 2
    if args.classes < 2:
        print("init_model.py: error: --classes must be >= 2", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    model = SmallCNN(*shape, args.classes)
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    save_file(state, args.out, metadata={"architecture": f"SmallCNN {args.image_shape} -> {args.classes}"})
    parameters = sum(v.numel() for v in state.values())
    print(f"wrote {args.out}: {', '.join(f'{k} {list(v.shape)}' for k, v in state.items())}; "
          f"{parameters} parameters", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
