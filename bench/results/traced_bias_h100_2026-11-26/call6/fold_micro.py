# ruff: noqa  (a diagnostic kept as it ran; run from the repository root on the GPU machine)
import os

import torch
import torch.nn.functional as F

out = open(os.path.join(os.environ.get("OUT", "/tmp"), "fold_micro.txt"), "w")
def p(*a):
    print(*a); print(*a, file=out); out.flush()
def t(fn, n=50):
    for _ in range(5): fn()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda.synchronize(); s.record()
    for _ in range(n): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n * 1e3
for M, N, K in ((32768, 3456, 512), (32768, 4096, 512), (32768, 4096, 432)):
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    p(f"M {M} N {N} K {K}: dY^T X {t(lambda: dy.t().mm(x)):.1f} us, sum {t(lambda: dy.sum(0)):.1f} us, "
      f"sum fp32 acc {t(lambda: dy.sum(0, dtype=torch.float32)):.1f}")
    for ke in sorted({-(-(K + 1) // 8) * 8, -(-(K + 1) // 16) * 16, -(-(K + 1) // 64) * 64, -(-(K + 1) // 128) * 128}):
        xe = torch.zeros(M, ke, device="cuda", dtype=torch.bfloat16)
        tail = torch.zeros(1, ke - K, device="cuda", dtype=torch.bfloat16); tail[:, 0].fill_(1)
        def cat(): return torch.cat((x, tail.expand(M, -1)), 1)
        def two():
            y = torch.empty(M, ke, device="cuda", dtype=torch.bfloat16); y[:, :K].copy_(x); y[:, K:].copy_(tail.expand(M, -1)); return y
        def pad():
            y = F.pad(x, (0, ke - K)); y[:, K].fill_(1); return y
        p(f"   Ke {ke}: dY^T Xe {t(lambda: dy.t().mm(xe)):.1f} us, (Xe^T dY)^T {t(lambda: xe.t().mm(dy)):.1f} us; "
          f"cat {t(cat):.1f}, empty+2 copies {t(two):.1f}, pad+fill {t(pad):.1f}")
