"""Concatenate the Python sources under a directory into N text files (a real-code corpus).

Usage: python scripts/py_corpus.py SRC_DIR OUT_DIR [--max_mb 100] [--files 16]
Files are taken in sorted path order (deterministic), each prefixed with its relative path.
"""

import argparse
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--max_mb", type=float, default=100)
    ap.add_argument("--files", type=int, default=16)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget, total, shards = int(args.max_mb * 2**20), 0, [[] for _ in range(args.files)]
    for i, path in enumerate(sorted(Path(args.src).rglob("*.py"))):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        shards[i % args.files].append(f"# {path.relative_to(args.src)}\n{text}\n")
        total += len(text)
        if total >= budget:
            break
    for k, docs in enumerate(shards):
        (out / f"py_{k:02d}.txt").write_text("".join(docs), encoding="utf-8")
    print(f"py_corpus: {total / 2**20:.1f} MB of Python in {args.files} files -> {out}")


if __name__ == "__main__":
    main()
