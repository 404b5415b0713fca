"""Tokenizing a corpus larger than one wants in memory: peak RSS and tokens/s on a locally
generated corpus of >= 1 GB, against one a tenth of its size, side by side. Bounded means the
peak does not grow with the corpus.

The corpora are .txt files of ~64 MB (each one document, so each is streamed in pieces) made of
the Python standard library's sources in a seeded shuffle; both are tokenized by the same
byte-level BPE (vocabulary 32,000, trained once on the small corpus first), each in a fresh
process that does what a rank does (`build_shards`, streaming into shard files). The OS page
cache holds what was written, which RSS does not count.

    python benchmarks/tokenize_large.py [--gb 1.1] [--dir /tmp/dstrain-tokenize]
"""

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from cpu import cpu_label

FILE_BYTES = 64 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.1, help="size of the large corpus")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/dstrain-tokenize"))
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--child", nargs=3, metavar=("CORPUS", "CACHE", "TOKENIZER"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_tokenize(*map(Path, args.child))))
        return
    print(f"CPU: {cpu_label()}")
    root = args.dir
    shutil.rmtree(root, ignore_errors=True)
    sizes = {"small": int(args.gb * 1e9 / 10), "large": int(args.gb * 1e9)}
    for name, size in sizes.items():
        started = time.perf_counter()
        _generate(root / name, size)
        print(f"generated {name}: {size / 1e9:.2f} GB in {time.perf_counter() - started:.0f} s")
    tokenizer = _train_tokenizer(root / "small", root / "tokenizer.json", args.vocab)
    results = {}
    for name in sizes:
        cache = root / f"cache-{name}"
        child = [sys.executable, __file__, "--child", str(root / name), str(cache), tokenizer]
        done = subprocess.run(child, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"{name} failed:\n{done.stderr}")
        results[name] = json.loads(done.stdout.splitlines()[-1])
        shutil.rmtree(cache, ignore_errors=True)
    print("corpus   GB     tokens (M)   seconds   tokens/s    MB/s   RSS before MB   peak RSS MB")
    for name, r in results.items():
        print(
            f"{name:<7} {r['bytes'] / 1e9:5.2f} {r['tokens'] / 1e6:13.1f} {r['seconds']:9.1f} "
            f"{r['tokens'] / r['seconds']:10,.0f} {r['bytes'] / 1e6 / r['seconds']:7.2f} "
            f"{r['rss_before_mb']:15.0f} {r['peak_rss_mb']:13.0f}"
        )
    small, large = results["small"], results["large"]
    print(
        f"large / small: corpus {large['bytes'] / small['bytes']:.1f}x, peak RSS "
        f"{large['peak_rss_mb'] / small['peak_rss_mb']:.2f}x, tokens/s "
        f"{(large['tokens'] / large['seconds']) / (small['tokens'] / small['seconds']):.2f}x"
    )
    shutil.rmtree(root, ignore_errors=True)


def _generate(folder: Path, total: int) -> None:
    """.txt files of ~FILE_BYTES: the stdlib's .py sources in a seeded shuffle, repeated."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(p for p in stdlib.glob("**/*.py") if "site-packages" not in p.parts)
    texts = [p.read_bytes().decode("utf-8", errors="replace").encode() for p in sources]
    folder.mkdir(parents=True)
    rng = random.Random(0)
    written, index = 0, 0
    while written < total:
        size = min(FILE_BYTES, total - written)
        with (folder / f"part-{index:04d}.txt").open("wb") as out:
            filled = 0
            while filled < size:
                text = rng.choice(texts)
                text = text[: size - filled].decode(errors="ignore").encode()  # whole characters
                out.write(text)
                filled += len(text)
        written += size
        index += 1


def _train_tokenizer(corpus: Path, path: Path, vocab: int) -> str:
    from dstrain.data.corpus import open_corpus
    from dstrain.data.tokenizer import BPETokenizer

    started = time.perf_counter()
    texts = open_corpus(str(corpus), cache_dir=path.parent / "train-cache").documents()
    BPETokenizer.train(texts, vocab, f"bpe-{vocab}").save(path)
    print(f"trained the BPE ({vocab} ids) in {time.perf_counter() - started:.0f} s")
    return str(path)


def _tokenize(corpus: Path, cache: Path, tokenizer: Path) -> dict:
    """In a fresh process: tokenize `corpus` into `cache` as a rank does."""
    from dstrain.data.corpus import open_corpus
    from dstrain.data.shards import build_shards
    from dstrain.data.tokenizer import build_tokenizer

    opened = open_corpus(str(corpus), cache_dir=cache)
    tok = build_tokenizer(str(tokenizer), 1 << 20, opened, cache)
    rss_before = _rss_mb()
    started = time.perf_counter()
    shards = build_shards(opened, tok, cache)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "bytes": opened.num_bytes,
        "tokens": shards.total_tokens,
        "seconds": seconds,
        "rss_before_mb": rss_before,
        "peak_rss_mb": peak,
    }


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


if __name__ == "__main__":
    main()
