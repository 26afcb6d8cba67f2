"""gpu_check part 3: the fused divergence kernel (eagle_fsd.kernels.fused_divergence) against FSD's torch divergences
(eagle_fsd.divergence.divergence): parity of every name, then timings. Also the table helpers gpu_check shares."""

from __future__ import annotations

import importlib

import torch

from eagle_fsd.divergence import DIVERGENCES, divergence
from eagle_fsd.kernels import fused_divergence

fd_mod = importlib.import_module("eagle_fsd.kernels.divergence")  # the module: its last_launch

_FD_TIMED = ("kl_qp", "kl_pq", "jsd", "tv")  # timed; parity covers every name
_FD_SIZES = {True: (8, (300,)), False: (64, (32000, 128256))}  # toy -> (rows, vocabs); Llama-2/Vicuna and Llama-3
_FD_RTOL, _FD_ATOL = 5e-4, 5e-5  # both sides read the same bf16 values and compute in float32
_FD_COLS = [("V", 7), ("name", 9), ("fused_splits", 6), ("fused_us", 9), ("fused_nosplit_us", 9), ("fused_alt_us", 9),
            ("torch_us", 9), ("speedup_vs_torch", 8), ("fused_GBps_1read", 8), ("fused_max_abs_err", 9)]
_FD_HEAD = ["V", "name", "splits", "fused", "nosplit", "alt", "torch", "x_torch", "GB/s", "max_err"]


def table_header(heads, cols) -> str:
    return " ".join(h.rjust(w) for h, (_, w) in zip(heads, cols))


def table_row(row, cols) -> str:
    """One right-aligned line: ratios to 2 decimals, errors in e-notation, times to 1 decimal, '-' where missing."""
    cells = []
    for key, w in cols:
        val = row.get(key)
        if val is None:
            cells.append("-".rjust(w))
        elif isinstance(val, float):
            fmt = ".2f" if key.startswith(("speedup", "ratio")) else ".1e" if key.endswith("err") else ".1f"
            cells.append(format(val, fmt).rjust(w))
        else:
            cells.append(str(val).rjust(w))
    return " ".join(cells)


def _fd_inputs(rows: int, vocab: int, dtype, device, gen):
    """(target, draft) logits: random rows at scales 1..10 with draft = target + noise (1e-3..3 times the scale), then
    6 edge rows: identical, disjoint supports, NaN in target, +inf in draft, all -inf draft, target zeros (-inf) where
    the draft has mass. The draft is a view of a wider buffer (row stride V + 64)."""
    n_rand = rows - 6
    scale = torch.linspace(1.0, 10.0, n_rand)[:, None]
    level = torch.tensor([1e-3, 1e-2, 0.1, 0.3, 1.0, 3.0])[torch.arange(n_rand) % 6][:, None]
    t = torch.randn(rows, vocab, generator=gen)
    t[:n_rand] *= scale
    noise = torch.randn(rows, vocab, generator=gen)
    d = t.clone()
    d[:n_rand] += level * scale * noise[:n_rand]
    e = n_rand
    d[e] = t[e]  # identical -> exactly 0
    half = vocab // 2
    t[e + 1, half:] = float("-inf")  # disjoint supports
    d[e + 1] = noise[e + 1]
    d[e + 1, :half] = float("-inf")
    t[e + 2, vocab // 3] = float("nan")
    d[e + 3, vocab // 5] = float("inf")
    d[e + 4] = float("-inf")
    t[e + 5, : vocab // 4] = float("-inf")  # KL(q||p) = inf, legacy_js = inf
    wide = torch.empty(rows, vocab + 64, dtype=dtype)  # 16-byte aligned rows, as an lm_head output slice would be
    wide[:, :vocab] = d.to(dtype)
    return t.to(device=device, dtype=dtype), wide.to(device)[:, :vocab]


def _fd_compare(got: torch.Tensor, ref: torch.Tensor, identical_row: int) -> dict:
    g, r = got.double().cpu(), ref.double().cpu()
    fin = torch.isfinite(r) & torch.isfinite(g)
    err = (g[fin] - r[fin]).abs()
    ratio = err / (_FD_ATOL + _FD_RTOL * r[fin].abs())  # <= 1 passes
    ok = (torch.equal(torch.isnan(g), torch.isnan(r)) and torch.equal(torch.isposinf(g), torch.isposinf(r))
          and bool((ratio <= 1.0).all()) and float(g[identical_row]) == 0.0)
    return {"ok": ok, "max_abs_err": float(err.max()) if err.numel() else 0.0,
            "max_tol_ratio": float(ratio.max()) if err.numel() else 0.0}


def _variants(toy: bool) -> dict:
    """Launch variants checked for parity: default, one split, an alternative config."""
    alt = {"config": {"BLOCK_V": 128, "num_warps": 4}, "num_splits": 2} if toy else \
        {"config": {"BLOCK_V": 4096, "num_warps": 8}}
    return {"fused": {}, "fused_nosplit": {"num_splits": 1}, "fused_alt": alt}


def _parity(row: dict, t, d, name: str, variants: dict, identical_row: int) -> None:
    ref = divergence(t, d, name)
    row["parity_ok"] = True
    for var, kw in variants.items():
        cmp = _fd_compare(fused_divergence(t, d, name, **kw), ref, identical_row)
        row[var + "_splits"] = fd_mod.last_launch[0]
        row[var + "_max_abs_err"] = cmp["max_abs_err"]
        row[var + "_max_tol_ratio"] = cmp["max_tol_ratio"]
        row["parity_ok"] &= cmp["ok"]


def _timing(row: dict, t, d, name: str, variants: dict, timed_variants, bench) -> None:
    providers = {var: (lambda kw=variants[var]: fused_divergence(t, d, name, **kw)) for var in timed_variants}
    providers["torch"] = lambda: divergence(t, d, name)
    for var, fn in providers.items():
        row[var + "_us"] = bench(fn)["median_us"]
    # effective bandwidth of one read of both inputs (the kernel reads them twice; pass 2 mostly hits L2)
    nbytes = 2 * t.shape[0] * t.shape[1] * t.element_size()
    row["fused_GBps_1read"] = nbytes / (row["fused_us"] * 1e-6) / 1e9
    row["speedup_vs_torch"] = row["torch_us"] / row["fused_us"]


def _print_row(row: dict, timed: bool, variants: dict, header_printed: bool) -> bool:
    """One line per (vocab, name); returns whether the timing table's header has been printed."""
    if not row["parity_ok"]:
        print(f"PARITY FAILURE: fused_divergence {row}", flush=True)
    elif not timed:
        print(f"fused_divergence parity ok {row['name']:9s} V={row['V']} max_abs_err="
              f"{max(row[v + '_max_abs_err'] for v in variants):.2e}", flush=True)
    else:
        if not header_printed:
            print(table_header(_FD_HEAD, _FD_COLS), flush=True)
        print(table_row(row, _FD_COLS), flush=True)
        return True
    return header_printed


def time_fused_divergence(device, toy: bool, bench):
    """Parity (every name, default / one-split / alternative config) and timings (kl_qp, kl_pq, jsd, tv) of
    fused_divergence against the torch reference: 64 tree nodes x vocab 32000 / 128256, bf16 logits (toy: 8 x 300 on
    the interpreter). One dict per (vocab, name); bench None: parity only. Parity failures print "PARITY FAILURE"."""
    gen = torch.Generator().manual_seed(2)
    rows, vocabs = _FD_SIZES[toy]
    variants = _variants(toy)
    timed_variants = ("fused",) if toy else tuple(variants)  # the interpreter is slow; parity runs every variant
    out_rows, header_printed = [], False
    for vocab in vocabs:
        t, d = _fd_inputs(rows, vocab, torch.bfloat16, device, gen)
        for name in DIVERGENCES:
            row = {"name": name, "N": rows, "V": vocab, "dtype": "bfloat16", "alt_config": str(variants["fused_alt"])}
            timed = bench is not None and name in _FD_TIMED
            try:
                _parity(row, t, d, name, variants, identical_row=rows - 6)
                if timed:
                    _timing(row, t, d, name, variants, timed_variants, bench)
            except Exception as exc:  # keep going; report every case
                row.update({"parity_ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]})
            header_printed = _print_row(row, timed, variants, header_printed)
            out_rows.append(row)
    return out_rows


def fused_divergence_table(rows) -> str:
    timed = [r for r in rows or [] if r.get("fused_us") is not None]
    if not timed:
        return ""
    title = f"fused divergence, N={timed[0]['N']} nodes, bf16 (median us)"
    return "\n".join([title, table_header(_FD_HEAD, _FD_COLS)] + [table_row(r, _FD_COLS) for r in timed])
