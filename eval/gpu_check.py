"""One-command GPU check of the tree-attention kernel: parity at real sizes, then timings against SDPA.

    python -m eagle_fsd.eval.gpu_check [--toy] [--out DIR] [--reps N]

On CUDA (meant for one H200, whole run well under 5 minutes):
  1. parity: bf16 at real sizes (Hq 32, Hkv 8, head_dim 128; prefixes up to 8k, trees up to 64 nodes, per-batch random
     trees, K/V as views of a preallocated cache, q as the transposed view transformers passes), plus fp16 / fp32 /
     head_dim 64 / no-split / fixed-config / causal-prefill / decode cases and a per-branch check, all against the
     float64 reference. Any failure prints "PARITY FAILURE" and makes the exit status 1.
  2. timing (CUDA events, L2 flushed before every rep, warm-up, median) of tree_attention against
     (a) SDPA with a dense 4-D bool mask (as transformers' sdpa path does it: repeat_kv + mask; and with enable_gqa) and
     (b) SDPA with no mask over the same q = N rows and all L keys (the cost floor),
     at prefix 512/2k/8k x tree 16/64 x batch 1/8, Hq 32, Hkv 8, head_dim 128, bf16.
  3. fused divergence (eagle_fsd.kernels.fused_divergence; gpu_check_divergence.py): parity of every name against
     eagle_fsd.divergence.divergence (64 nodes incl. edge rows, vocab 32000 / 128256, bf16; "PARITY FAILURE" and exit 1
     on a mismatch), then timings of kl_qp / kl_pq / jsd / tv against the torch reference (a second table; parity only
     with --skip-timing).
  Prints the tables and writes the raw numbers to DIR/gpu_check.json (and the table to DIR/gpu_check_table.txt);
  DIR defaults to $OUT if set, else ./gpu_check_out.

--toy runs the same code path at tiny sizes (fp32/fp16), on CPU under the Triton interpreter (re-executes itself with
TRITON_INTERPRET=1 if needed) and times with time.perf_counter; it exists so CI can exercise this script.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from eagle_fsd.eval.gpu_check_divergence import fused_divergence_table, table_header, table_row, time_fused_divergence
from eagle_fsd.kernels import is_interpreting, kernel_available, pack_tree_mask, tree_attention, tree_attention_reference

_ta = importlib.import_module("eagle_fsd.kernels.tree_attention")  # the module (the package exports a function too)

# Tolerances on ||out - ref|| / ||ref|| (Frobenius) and on max |out - ref| / max |ref|.
_REL_TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3, torch.float32: 2e-5}


# ----------------------------------------------------------------------------------------------------------------------
# Random trees and inputs (also used by tests/test_kernels.py)
# ----------------------------------------------------------------------------------------------------------------------


def random_parents(n: int, generator: torch.Generator) -> torch.Tensor:
    """Random topologically ordered tree: parent[0] = -1, parent[i] uniform in [0, i)."""
    parents = torch.full((n,), -1, dtype=torch.long)
    if n > 1:
        u = torch.rand(n - 1, generator=generator, dtype=torch.float64)
        parents[1:] = (u * torch.arange(1, n, dtype=torch.float64)).long()
    return parents


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self mask (N, N) bool from a parent array (-1 = root); vectorised over nodes, loops over depth."""
    n = parents.numel()
    mask = torch.eye(n, dtype=torch.bool)
    rows = torch.arange(n)
    cur = parents.clone()
    while bool((cur >= 0).any()):
        ok = cur >= 0
        mask[rows[ok], cur[ok]] = True
        cur = torch.where(ok, parents[cur.clamp(min=0)], cur)
    return mask


def random_tree_mask(n: int, generator: torch.Generator, batch: int | None = None) -> torch.Tensor:
    """(N, N), or (batch, N, N) with an independent tree per batch element."""
    if batch is None:
        return ancestor_mask(random_parents(n, generator))
    return torch.stack([ancestor_mask(random_parents(n, generator)) for _ in range(batch)])


def make_inputs(b, hq, hkv, prefix, n, d, dtype, device, generator, slack=37):
    """q as transformers passes it (a transposed (B, N, Hq, D) view), k/v as views [:, :, :L] of a bigger cache."""
    length = prefix + n

    def rnd(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)

    q = (rnd(b, n, hq, d) * 2.0).transpose(1, 2)  # sharper softmax than plain randn
    k_cache = rnd(b, hkv, length + slack, d)
    v_cache = rnd(b, hkv, length + slack, d)
    return q, k_cache[:, :, :length], v_cache[:, :, :length]


def _errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    o, r = out.double(), ref.double()
    finite = bool(torch.isfinite(o).all())
    diff = (o - r).abs()
    return {
        "finite": finite,
        "max_abs": float(diff.max()) if finite else float("nan"),
        "max_rel": float(diff.max() / r.abs().max().clamp(min=1e-30)) if finite else float("nan"),
        "rel_fro": float(torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r).clamp(min=1e-30))
        if finite else float("nan"),
    }


# ----------------------------------------------------------------------------------------------------------------------
# 1. Parity
# ----------------------------------------------------------------------------------------------------------------------


def _parity_cases(toy: bool):
    # (name, B, Hq, Hkv, P, N, D, dtype, kwargs, mask kind)
    if toy:
        return [
            ("fp32 gqa2 per-batch trees", 2, 4, 2, 37, 17, 32, torch.float32, {}, "batch"),
            ("fp16 gqa4 P=0", 1, 4, 1, 0, 5, 16, torch.float16, {}, "shared"),
            ("fp16 decode N=1 split=2", 1, 2, 2, 23, 1, 16, torch.float16, {"num_splits": 2}, "shared"),
        ]
    bf = torch.bfloat16
    fixed = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    return [
        ("bf16 B1 P8190 N64", 1, 32, 8, 8190, 64, 128, bf, {}, "shared"),
        ("bf16 B8 P2047 N16 per-batch", 8, 32, 8, 2047, 16, 128, bf, {}, "batch"),
        ("bf16 B8 P511 N64 per-batch", 8, 32, 8, 511, 64, 128, bf, {}, "batch"),
        ("bf16 B2 P0 N64", 2, 32, 8, 0, 64, 128, bf, {}, "batch"),
        ("bf16 B1 P1000 N1 decode", 1, 32, 8, 1000, 1, 128, bf, {}, "shared"),
        ("bf16 B1 P0 N300 causal prefill", 1, 32, 8, 0, 300, 128, bf, {}, "causal"),
        ("bf16 B1 P8190 N64 no split", 1, 32, 8, 8190, 64, 128, bf, {"num_splits": 1}, "shared"),
        # fixed configs below keep the number of compiled variants (and the run time) down
        ("bf16 B2 P3000 N33 fixed config", 2, 32, 8, 3000, 33, 128, bf, {"config": fixed}, "batch"),
        ("bf16 D64 gqa1 B2 P1500 N40", 2, 16, 16, 1500, 40, 64, bf, {"config": fixed}, "batch"),
        ("fp16 B2 P777 N33", 2, 32, 8, 777, 33, 128, torch.float16, {"config": fixed}, "batch"),
        ("fp32 B2 P777 N33 (fixed small tiles)", 2, 32, 8, 777, 33, 128, torch.float32, {}, "batch"),
    ]


def _branch_check(q, k, v, mask, out, nodes):
    """Per-branch property: node i == plain attention over prefix + its root-to-i chain (batch 0)."""
    n = q.shape[2]
    prefix = k.shape[2] - n
    m = mask if mask.dim() == 2 else mask[0]
    worst = 0.0
    for i in nodes:
        chain = torch.nonzero(m[i].cpu()).flatten().to(k.device)  # ancestors-or-self, in index order (topological)
        idx = torch.cat([torch.arange(prefix, device=k.device), prefix + chain])
        ks, vs = k[:1].index_select(2, idx), v[:1].index_select(2, idx)
        chain_mask = torch.ones(1, 1, dtype=torch.bool, device=k.device)  # the node (last key) sees itself
        ref = tree_attention_reference(q[:1, :, i:i + 1], ks, vs, chain_mask)  # (1, 1, Hq, D)
        worst = max(worst, _errors(out[:1, i:i + 1], ref)["rel_fro"])
    return worst


def run_parity(device, toy: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rows, ok = [], True
    for name, b, hq, hkv, p, n, d, dtype, kwargs, kind in _parity_cases(toy):
        row = {"case": name, "B": b, "Hq": hq, "Hkv": hkv, "P": p, "N": n, "D": d, "dtype": str(dtype).split(".")[-1]}
        try:
            q, k, v = make_inputs(b, hq, hkv, p, n, d, dtype, device, gen)
            if kind == "causal":
                mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
            else:
                mask = random_tree_mask(n, gen, batch=b if kind == "batch" else None)
            mask = mask.to(device)
            out = torch.full((b, n, hq, d), float("nan"), dtype=dtype, device=device)  # poisoned
            tree_attention(q, k, v, mask, out=out, **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            ref = tree_attention_reference(q, k, v, mask)
            row.update(_errors(out, ref))
            tol = _REL_TOL[dtype]
            if n > 1 and kind != "causal":
                row["branch_rel_fro"] = _branch_check(q, k, v, mask, out, sorted({0, n // 2, n - 1}))
            row["ok"] = bool(row["finite"] and row["rel_fro"] <= tol and row["max_rel"] <= 4 * tol
                             and row.get("branch_rel_fro", 0.0) <= tol)
            row["splits"], row["config"], row["autotuned"] = (str(x) for x in _ta.last_launch)
        except Exception as exc:  # keep going; report every case
            row.update({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        if not row["ok"]:
            ok = False
            print(f"PARITY FAILURE: {row}", flush=True)
        else:
            print(f"parity ok   {name:34s} rel_fro={row['rel_fro']:.2e} max_abs={row['max_abs']:.2e}"
                  + (f" branch={row['branch_rel_fro']:.2e}" if "branch_rel_fro" in row else ""), flush=True)
        rows.append(row)
    return rows, ok


# ----------------------------------------------------------------------------------------------------------------------
# 2. Timing
# ----------------------------------------------------------------------------------------------------------------------


class Bench:
    """Median time of fn(): CUDA events with an L2 flush before each rep on CUDA, time.perf_counter on CPU."""

    def __init__(self, device, warmup: int, reps: int):
        self.device, self.warmup, self.reps = device, warmup, reps
        self.flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=device) if device.type == "cuda" else None

    def __call__(self, fn) -> dict:
        for _ in range(self.warmup):
            fn()
        times = []
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
            for s, e in zip(starts, ends):
                self.flush.zero_()
                s.record()
                fn()
                e.record()
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
        else:
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        return {"median_us": statistics.median(times), "min_us": min(times)}


def _repeat_kv(x, n_rep):
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def _sdpa_providers(q, k, v, mask4d, g):
    def sdpa_mask():  # transformers' sdpa path with a mask: repeat_kv, dense mask, then (B, N, Hq, D)
        o = F.scaled_dot_product_attention(q, _repeat_kv(k, g), _repeat_kv(v, g), attn_mask=mask4d)
        return o.transpose(1, 2).contiguous()

    def sdpa_mask_gqa():
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask4d, enable_gqa=True)
        return o.transpose(1, 2).contiguous()

    def sdpa_plain():  # same N x L work, no mask: the cost floor
        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return o.transpose(1, 2).contiguous()

    return {"sdpa_mask": sdpa_mask, "sdpa_mask_gqa": sdpa_mask_gqa, "sdpa_plain": sdpa_plain}


def _timing_cases(toy: bool):
    if toy:  # (B, Hq, Hkv, P, N, D, dtype)
        return [(1, 4, 2, 37, 5, 32, torch.float32), (2, 4, 2, 64, 17, 32, torch.float16)]
    return [(b, 32, 8, p, n, 128, torch.bfloat16) for p in (512, 2048, 8192) for n in (16, 64) for b in (1, 8)]


def run_timing(device, toy: bool, bench: Bench, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for b, hq, hkv, p, n, d, dtype in _timing_cases(toy):
        q, k, v = make_inputs(b, hq, hkv, p, n, d, dtype, device, gen)
        mask = random_tree_mask(n, gen, batch=b).to(device)
        packed = pack_tree_mask(mask)
        mask4d = torch.ones(b, 1, n, p + n, dtype=torch.bool, device=device)
        mask4d[:, 0, :, p:] = mask
        out = torch.empty(b, n, hq, d, dtype=dtype, device=device)
        g = hq // hkv
        providers = {
            "tree": lambda: tree_attention(q, k, v, packed, out=out),
            "tree_nosplit": lambda: tree_attention(q, k, v, packed, out=out, num_splits=1),
            "pack_mask": lambda: pack_tree_mask(mask),
            **_sdpa_providers(q, k, v, mask4d, g),
        }
        row = {"B": b, "Hq": hq, "Hkv": hkv, "P": p, "N": n, "D": d, "dtype": str(dtype).split(".")[-1]}
        for name, fn in providers.items():
            try:
                row[name + "_us"] = bench(fn)["median_us"]
            except Exception as exc:  # e.g. a backend refusing enable_gqa with a mask
                row[name + "_us"] = None
                row[name + "_error"] = f"{type(exc).__name__}: {exc}"[:300]
            if name == "tree":
                row["splits"], row["tree_config"], row["autotuned"] = (x if isinstance(x, int) else str(x)
                                                                       for x in _ta.last_launch)
                # spot check of the timed (autotuned) kernel against SDPA with the dense mask
                ref = providers["sdpa_mask"]()
                row["max_abs_vs_sdpa_mask"] = float((out.double() - ref.double()).abs().max())
        masked = [row.get(x) for x in ("sdpa_mask_us", "sdpa_mask_gqa_us") if row.get(x)]
        if row.get("tree_us"):
            row["speedup_vs_sdpa_mask"] = min(masked) / row["tree_us"] if masked else None
            row["ratio_vs_sdpa_plain"] = row["sdpa_plain_us"] / row["tree_us"] if row.get("sdpa_plain_us") else None
        rows.append(row)
        print(table_row(row, _COLS), flush=True)
    return rows


_COLS = [("B", 3), ("P", 6), ("N", 4), ("splits", 6), ("tree_us", 9), ("tree_nosplit_us", 9), ("pack_mask_us", 9),
         ("sdpa_mask_us", 9), ("sdpa_mask_gqa_us", 9), ("sdpa_plain_us", 9), ("speedup_vs_sdpa_mask", 8),
         ("ratio_vs_sdpa_plain", 8)]
_HEAD = ["B", "P", "N", "splits", "tree", "nosplit", "pack", "sdpa_msk", "sdpa_gqa", "sdpa_pln", "x_mask", "x_plain"]


# ----------------------------------------------------------------------------------------------------------------------


def _versions():
    out = {"python": platform.python_version()}
    for pkg in ("torch", "triton", "transformers", "numpy"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m eagle_fsd.eval.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--toy", action="store_true", help="tiny sizes, CPU/interpreter allowed (for CI)")
    ap.add_argument("--out", default=None, help="results folder (default: $OUT, else ./gpu_check_out)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement")
    ap.add_argument("--skip-timing", action="store_true")
    return ap.parse_args(argv)


def _pick_device(toy: bool):
    """CUDA, or (--toy) the CPU under the Triton interpreter, re-executing with it chosen before import; None when
    neither can run."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not is_interpreting():
        if toy and os.environ.get("TRITON_INTERPRET") != "1":
            env = dict(os.environ, TRITON_INTERPRET="1")
            os.execve(sys.executable, [sys.executable, "-m", "eagle_fsd.eval.gpu_check", *sys.argv[1:]], env)
        print("gpu_check: no CUDA device and the Triton interpreter is off; use --toy (CPU, interpreter)",
              file=sys.stderr)
        return None
    if not toy:
        print("gpu_check: no CUDA device; only --toy can run here", file=sys.stderr)
        return None
    return torch.device("cpu")


def _meta(device, toy: bool) -> dict:
    cuda = device.type == "cuda"
    return {"versions": _versions(), "device": torch.cuda.get_device_name(device) if cuda else "cpu (interpreter)",
            "interpreting": is_interpreting(), "toy": toy,
            "autotune": getattr(_ta, "_autotuned", None) is not None
            and os.environ.get("EAGLE_FSD_TREE_ATTN_AUTOTUNE", "1") != "0"}


def _run_checks(device, args) -> tuple[dict, str]:
    """Parts 1-3: (results, the printed tables)."""
    print("== 1. parity ==", flush=True)
    parity, parity_ok = run_parity(device, args.toy)
    timing, table, bench = [], "", None
    if not args.skip_timing:
        print("== 2. timing (median us) ==", flush=True)
        reps = args.reps or (2 if args.toy else 50)
        bench = Bench(device, warmup=1 if args.toy else 10, reps=reps)
        print(table_header(_HEAD, _COLS), flush=True)
        timing = run_timing(device, args.toy, bench)
        table = "\n".join([table_header(_HEAD, _COLS)] + [table_row(r, _COLS) for r in timing])
    print("== 3. fused divergence: parity" + ("" if bench is None else " + timing (median us)") + " ==", flush=True)
    fused = time_fused_divergence(device, args.toy, bench)  # bench None (--skip-timing): parity only
    fused_table = fused_divergence_table(fused)
    if fused_table:
        table = f"{table}\n\n{fused_table}" if table else fused_table
    return {"parity_ok": parity_ok, "parity": parity, "timing": timing, "fused_divergence": fused,
            "fused_divergence_parity_ok": all(r["parity_ok"] for r in fused)}, table


def main(argv=None) -> int:
    args = _parse_args(argv)
    device = _pick_device(args.toy)
    if device is None:
        return 2
    assert kernel_available(device)
    out_dir = args.out or os.environ.get("OUT") or "gpu_check_out"
    os.makedirs(out_dir, exist_ok=True)
    t_start = time.perf_counter()
    meta = _meta(device, args.toy)
    print(f"gpu_check: {meta}", flush=True)
    checks, table = _run_checks(device, args)
    results = {"meta": meta, **checks, "wall_s": time.perf_counter() - t_start}
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(out_dir, "gpu_check_table.txt"), "w") as f:
        f.write(table + "\n")
    if table:
        print("\n" + table)
    all_ok = results["parity_ok"] and results["fused_divergence_parity_ok"]
    verdict = "GPU CHECK PASSED" if all_ok else "GPU CHECK FAILED: parity (see PARITY FAILURE lines)"
    print(f"\n{verdict}; wall {results['wall_s']:.1f}s; results in {os.path.join(out_dir, 'gpu_check.json')}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
