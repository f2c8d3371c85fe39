"""Forward-time cost of KP-RPE: the KP-RPE ViT against the plain ViT of the same size."""

from __future__ import annotations

import time

import torch

from ml.fr.backbones.kprpe import KPRPEViT
from ml.fr.backbones.vit import ViT

# vit_s sizes (112 px, patch 9 → 144 tokens, dim 512, depth 12, 8 heads); drop_path is off in eval anyway.
VIT_S = dict(img_size=112, patch_size=9, dim=512, depth=12, heads=8, embed_dim=512)


def _ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1000.0 * (time.perf_counter() - start)


def bench_kprpe_forward_ratio(batch: int = 64, repeats: int = 3, seed: int = 0, **sizes) -> dict:
    """Best-of-``repeats`` forward time (ms) of the plain ViT and of the KP-RPE ViT, and their ratio.

    Both models have ``vit_s`` sizes unless ``sizes`` overrides them, run in eval mode under
    ``torch.inference_mode`` on ``batch`` random 112×112 images (one untimed warm-up each, then
    ``repeats`` interleaved timed calls). The KP-RPE model gets random in-image landmarks and a
    non-zero keypoint Linear, so its bias is really built and added. Target: ratio ≤ 1.25.

    Returns:
        ``{"plain_ms", "kprpe_ms", "ratio", "batch", "threads"}``.
    """
    cfg = {**VIT_S, **sizes}
    torch.manual_seed(seed)
    plain = ViT(**cfg).eval()
    kprpe = KPRPEViT(**cfg).eval()
    kprpe.load_state_dict(plain.state_dict(), strict=False)
    torch.nn.init.normal_(kprpe.kprpe.linear.weight, std=0.1)
    size = cfg["img_size"]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, size, size, generator=gen)
    keypoints = torch.rand(batch, 5, 2, generator=gen) * size

    with torch.inference_mode():
        plain(x), kprpe(x, keypoints)  # warm-up: allocator, kernel selection
        # Interleaved, so that a change in machine load hits both models alike; best of each.
        times = [(_ms(lambda: plain(x)), _ms(lambda: kprpe(x, keypoints))) for _ in range(max(1, repeats))]
    plain_ms = min(p for p, _ in times)
    kprpe_ms = min(k for _, k in times)
    return {"plain_ms": plain_ms, "kprpe_ms": kprpe_ms, "ratio": kprpe_ms / plain_ms,
            "batch": batch, "threads": torch.get_num_threads()}


if __name__ == "__main__":
    r = bench_kprpe_forward_ratio()
    print(f"vit_s, batch {r['batch']}, {r['threads']} threads: plain {r['plain_ms']:.0f} ms, "
          f"KP-RPE {r['kprpe_ms']:.0f} ms, ratio {r['ratio']:.3f} (target ≤ 1.25)")
