"""``smartinf-export CKPT OUT``: a smart_infinity checkpoint as one safetensors file for plain PyTorch.

    smartinf-export smartinf_runs/.../checkpoints/step200.ckpt model.safetensors --dtype bf16

Every file of the checkpoint is verified against its manifest first. Load the result without the strategy:

    module = GPTModule.from_safetensors("model.safetensors")
    # or, for your own module:  module.load_state_dict(safetensors.torch.load_file("model.safetensors"))
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_smartinf.checkpoint.export import DTYPES, export_safetensors
from lightning_smartinf.checkpoint.manifest import CheckpointError
from lightning_smartinf.storage.space import human_bytes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="smartinf-export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint directory written by smart_infinity")
    parser.add_argument("out", type=Path, help="output .safetensors file, or a directory for model.safetensors")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="tensor dtype (default bf16)")
    args = parser.parse_args(argv)
    try:
        target, numel = export_safetensors(args.checkpoint, args.out, args.dtype)
    except (CheckpointError, FileNotFoundError, ValueError) as err:
        sys.exit(f"smartinf-export: {err}")
    print(f"wrote {target}: {numel:,} values in {args.dtype}, {human_bytes(target.stat().st_size)}")
    print(f'load it with GPTModule.from_safetensors("{target}") or load_state_dict(safetensors.torch.load_file(...))')


if __name__ == "__main__":
    main()
