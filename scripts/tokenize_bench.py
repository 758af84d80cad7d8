"""Tokenizing throughput and the token cache's effect on start-up (docs/fine_tuning.md): a corpus of GB made
locally (this Python's standard library source, repeated into files), tokenized by a BPE made locally; each run in
its own process, timing the data module's set-up and reading its peak RSS.

    python scripts/tokenize_bench.py WORKDIR [--gb 1.0]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from lightning_smartinf.ecosystem.tiny import make_tokenizer, stdlib_texts

FILE_BYTES = 64 << 20


def make_corpus(directory: Path, total: int) -> int:
    """Files of FILE_BYTES each, the standard library's text repeated, until ``total`` bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    source = "".join(stdlib_texts(40_000_000)).encode()
    written = 0
    for i in range(-(-total // FILE_BYTES)):
        path = directory / f"part{i:03d}.txt"
        if not path.is_file():
            with path.open("wb") as f:
                left = FILE_BYTES
                while left > 0:
                    f.write(source[:left])
                    left -= len(source[:left])
        written += path.stat().st_size
    return written


def setup_once(corpus: str, tokenizer: str, cache: str) -> None:
    """One process: set up the data module (tokenizing on the first run) and print seconds and peak RSS."""
    import logging

    from lightning_smartinf.data.corpus import TextDataModule
    from lightning_smartinf.data.tokenizer import HFTokenizer

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.perf_counter()
    data = TextDataModule(corpus, 1024, 8, tokenizer=HFTokenizer(tokenizer), cache_dir=cache)
    data.setup()
    first = data.train[0]  # type: ignore[index]
    seconds = time.perf_counter() - started
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tokens = len(data.train.tokens) + len(data.val.tokens)  # type: ignore[union-attr]
    print(json.dumps({"seconds": seconds, "peak_rss": rss, "tokens": tokens, "window": int(first.numel())}))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        setup_once(*sys.argv[2:5])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("work", type=Path)
    parser.add_argument("--gb", type=float, default=1.0)
    args = parser.parse_args()
    corpus, tokenizer, cache = args.work / "corpus", args.work / "tokenizer", args.work / "cache"
    size = make_corpus(corpus, int(args.gb * 1e9))
    if not (tokenizer / "tokenizer.json").is_file():
        make_tokenizer(tokenizer, vocab=8192)
    runs = []
    for name in ("first (tokenizes)", "second (cached)"):
        done = subprocess.run([sys.executable, __file__, "--child", str(corpus), str(tokenizer), str(cache)],
                              capture_output=True, text=True, check=True)  # fmt: skip
        result = json.loads(done.stdout.strip().splitlines()[-1])
        runs.append(result)
        print(f"{name}: {result['seconds']:.1f} s, peak RSS {result['peak_rss'] / 2**20:.0f} MiB, "
              f"{result['tokens']:,} tokens")  # fmt: skip
        print("  " + "\n  ".join(line for line in done.stderr.splitlines() if line.startswith("tokeniz")))
    print(f"corpus {size / 1e9:.2f} GB; tokenizing {size / runs[0]['seconds'] / 1e6:.1f} MB/s, "
          f"{runs[0]['tokens'] / runs[0]['seconds']:,.0f} tokens/s; start-up {runs[0]['seconds']:.1f} s -> "
          f"{runs[1]['seconds']:.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()
