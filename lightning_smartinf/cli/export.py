"""``smartinf-export CKPT OUT``: a smart_infinity checkpoint as safetensors for plain PyTorch, written one tensor
at a time (memory holds one block, whatever the model's size).

    smartinf-export smartinf_runs/.../checkpoints/step200.ckpt model.safetensors --dtype bf16
    smartinf-export CKPT hf_out/ --strip-prefix model. --max-shard-size 5GB     # save_pretrained's layout
    smartinf-export LORA_CKPT merged/ --merge --strip-prefix model.             # LoRA merged into its base
    smartinf-export LORA_CKPT adapters.safetensors --adapters-only              # the trained adapters alone

Every file of the checkpoint is verified against its manifest first. A LoRA run's checkpoint holds its base (the
frozen weights of the streamed blocks) beside the adapters, so it exports without the model or its base files.
Load the result without the strategy:

    module = GPTModule.from_safetensors("model.safetensors")
    # or, for your own module:  module.load_state_dict(safetensors.torch.load_file("model.safetensors"))
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning_smartinf.checkpoint.export import ADAPTERS, DTYPES, MERGED, WHOLE, export_safetensors
from lightning_smartinf.checkpoint.shards import parse_size
from lightning_smartinf.cli.report import reporting
from lightning_smartinf.models import gpt  # noqa: F401 - registers GPTConfig, which earlier checkpoints pickled
from lightning_smartinf.storage.space import human_bytes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="smartinf-export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint directory written by smart_infinity")
    parser.add_argument("out", type=Path, help="output .safetensors file, or a directory for model.safetensors")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="tensor dtype (default bf16)")
    parser.add_argument("--max-shard-size", default="2GB", help="largest file of a directory export (default 2GB)")
    parser.add_argument("--strip-prefix", default="", help="drop this from every name (model. for an HF model)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--merge", action="store_true",
                       help="LoRA adapters merged into their base weights, named as PEFT's merge_and_unload does")
    which.add_argument("--adapters-only", action="store_true", help="the trained parameters alone (LoRA adapters)")
    args = parser.parse_args(argv)
    mode = MERGED if args.merge else ADAPTERS if args.adapters_only else WHOLE
    with reporting("smartinf-export"):
        files, numel = export_safetensors(args.checkpoint, args.out, args.dtype, parse_size(args.max_shard_size),
                                          args.strip_prefix, mode)  # fmt: skip
    size = sum(f.stat().st_size for f in files)
    where = files[0] if len(files) == 1 else f"{args.out} ({len(files)} shards and model.safetensors.index.json)"
    print(f"wrote {where}: {numel:,} values in {args.dtype}, {human_bytes(size)}")
    print(f'load it with GPTModule.from_safetensors("{files[0]}"), load_state_dict(safetensors.torch.load_file(...)), '
          "or a library's from_pretrained (with --strip-prefix and its config.json beside it)")


if __name__ == "__main__":
    main()
