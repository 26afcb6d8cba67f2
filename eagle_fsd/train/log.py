"""One log line format for every stage of `eagle-fsd train-head`."""
import sys
import time


def log(msg: str) -> None:
    print(f"[train-head {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
