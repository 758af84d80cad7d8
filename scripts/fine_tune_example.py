"""The worked example of docs/fine_tuning.md, end to end: a tiny Llama-architecture checkpoint and a BPE tokenizer
made here (nothing downloaded), fine-tuned from the command line on text and then on instruction data, each result
loaded with ``from_pretrained``; prints the losses before and after on the same validation windows, the largest
logit difference between the written directory and the engine's checkpointed fp32 masters, and a greedy generation.

    python scripts/fine_tune_example.py WORKDIR [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_smartinf.checkpoint.export import consolidated_state_dict
from lightning_smartinf.data.corpus import TextDataModule
from lightning_smartinf.data.tokenizer import HFTokenizer
from lightning_smartinf.ecosystem.tiny import make_checkpoint, stdlib_texts
from lightning_smartinf.models.hf import HFCausalLM
from lightning_smartinf.models.loss import inputs, next_token_loss


def train(work: Path, name: str, *overrides: str) -> dict:
    cmd = ["smartinf-train", f"trainer.output_dir={work / name}", f"offload.nvme_path={work / 'state'}",
           "trainer.precision=32-true", *overrides]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    print("\n".join(line for line in done.stdout.splitlines() if line.startswith(("model:", "validation loss"))))
    return json.loads(next((work / name).glob("*/summary.json")).read_text())


def val_loss(model_dir: Path, data_path: Path, seq_len: int) -> float:
    """Mean next-token loss of ``from_pretrained(model_dir)`` on the data's validation windows."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    data = TextDataModule(str(data_path), seq_len, 8, train_samples=8, val_samples=32,
                          tokenizer=HFTokenizer(str(model_dir)))  # fmt: skip
    data.setup()
    with torch.no_grad():
        losses = [next_token_loss(model(input_ids=inputs(b)).logits, b) for b in data.val_dataloader()]
    return float(torch.stack(losses).mean())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("work", type=Path)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    work: Path = args.work
    base = make_checkpoint(work / "tiny-llama", "llama", vocab=512)
    text = work / "data" / "stdlib.txt"
    text.parent.mkdir(parents=True, exist_ok=True)
    text.write_text("".join(stdlib_texts(3_000_000)))
    rows = [{"prompt": f"What is {i} plus {j}? ", "response": f"{i} plus {j} is {i + j}."}
            for i in range(40) for j in range(40)]  # fmt: skip
    instruct = work / "data" / "sums.jsonl"
    instruct.write_text("".join(json.dumps(r) + "\n" for r in rows))

    steps = f"trainer.max_steps={args.steps}"
    text_run = train(work, "text", "model=hf", f"model.path={base}", f"data.path={text}", steps)
    tuned = Path(text_run["model"])
    print(f"text: validation loss {val_loss(base, text, 128):.4f} before, {val_loss(tuned, text, 128):.4f} after")

    engine = HFCausalLM(AutoModelForCausalLM.from_pretrained(tuned).config)
    masters, _ = consolidated_state_dict(Path(text_run["checkpoint"]))
    engine.load_state_dict(masters)
    loaded = AutoModelForCausalLM.from_pretrained(tuned)
    tokenizer = AutoTokenizer.from_pretrained(tuned)
    ids = tokenizer("import json\n\ndef ", return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (engine(ids) - loaded(input_ids=ids).logits).abs().max()
    print(f"from_pretrained logits vs the engine's fp32 masters: max |difference| {diff:.2e}")
    out = loaded.generate(ids, max_new_tokens=40, do_sample=False)
    print("greedy:", repr(tokenizer.decode(out[0])))

    sft = train(work, "instruct", "model=hf", f"model.path={tuned}", f"data.path={instruct}", "data.seq_len=32",
                steps, "optim.lr=3e-3")  # fmt: skip
    chat = AutoModelForCausalLM.from_pretrained(sft["model"])
    prompt = tokenizer("What is 12 plus 7? ", return_tensors="pt").input_ids
    answer = chat.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id)
    print("instruction-tuned greedy:", repr(tokenizer.decode(answer[0])))


if __name__ == "__main__":
    main()
