# SDPA against matmul-softmax-matmul (grouped heads read in place) at drafter (fp32) and exact-target (fp64) shapes,
# 2 threads, median of 5 rounds of 300 calls.
#     python benchmarks/attention_matmul_probe.py
import time, torch, torch.nn.functional as F
torch.set_num_threads(2); torch.set_grad_enabled(False)

def manual(q, k, v, mask, scale):
    # q (1, H, N, D), k/v (1, Hkv, L, D): grouped heads as (Hkv, H/Hkv * N, D) so no copy of k/v
    b, h, n, d = q.shape; hkv = k.shape[1]; g = h // hkv
    qg = q.reshape(b, hkv, g * n, d)
    s = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale)  # (1, hkv, g*n, L)
    s = s.view(b, hkv, g, n, -1).masked_fill_(~mask.view(b, 1, 1, n, -1), float("-inf"))
    p = torch.softmax(s, -1).view(b, hkv, g * n, -1)
    return torch.matmul(p, v).view(b, h, n, d)

def bench(fn, reps=300):
    for _ in range(20): fn()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps): fn()
        ts.append((time.perf_counter() - t) / reps * 1e6)
    return sorted(ts)[2]

for name, h, hkv, d, dtype in (("drafter fp32", 14, 2, 64, torch.float32), ("target fp64", 12, 2, 128, torch.float64)):
    for n in (1, 3, 8):
        for L in (300, 1000):
            q = torch.randn(1, h, n, d, dtype=dtype); k = torch.randn(1, hkv, L, d, dtype=dtype); v = torch.randn(1, hkv, L, d, dtype=dtype)
            mask = torch.ones(1, 1, n, L, dtype=torch.bool); mask[..., -n:] = torch.ones(n, n, dtype=torch.bool).tril()
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=d ** -0.5)
            out = manual(q, k, v, mask, d ** -0.5)
            err = (ref - out).abs().max().item()
            a = bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=d ** -0.5))
            b = bench(lambda: manual(q, k, v, mask, d ** -0.5))
            print(f"{name} N={n} L={L}: sdpa {a:.0f} us, manual {b:.0f} us, max diff {err:.1e}", flush=True)
