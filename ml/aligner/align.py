"""Differentiable 5-point face alignment: least-squares similarity to the ArcFace template, then a warp.

Pixel coordinates put pixel centres at integers (the image spans ``[−0.5, W − 0.5]``), as OpenCV's ``warpAffine``,
the ArcFace template and ``ml.data.procedural`` do. For source points ``s_i`` and targets ``d_i`` (K ≥ 2), centred
``a_i = s_i − s̄``, ``b_i = d_i − d̄``, the similarity ``σR = [[p, −q], [q, p]]`` minimising ``Σ‖d_i − (σR s_i + t)‖²``
is ``p = Σ a_i·b_i / Σ‖a_i‖²``, ``q = Σ a_i × b_i / Σ‖a_i‖²``, ``t = d̄ − σR s̄``: Umeyama's solution with its reflection
correction, in closed form (no SVD, smooth gradients except at fully degenerate sources). A pixel matrix ``M`` (2×3)
maps input to output pixels; ``grid_sample`` gets ``θ = N_in · M⁻¹ · N_out⁻¹`` with the per-axis normalisation
``n = (2p + 1)/L − 1`` (``align_corners=False``) or ``n = 2p/(L − 1) − 1`` (True), the same result in pixels.

Differences from the reference: KP-RPE/DFA aligns on the CPU in numpy (skimage ``SimilarityTransform``, an SVD, then
``cv2.warpAffine``); here fit and warp are batched torch ops on any device, differentiable in landmarks and images;
the fit is the closed form above (same optimum); bilinear ``grid_sample`` (zero padding) may differ from OpenCV's
fixed-point kernel by about one grey level; ``template_for(size)`` scales the 112 template by ``size/112`` (as
insightface's ``estimate_norm`` does for multiples of 112).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ml.errors import DataError

__all__ = [
    "ARCFACE_TEMPLATE",
    "align_faces",
    "invert_affine",
    "similarity_transform",
    "template_for",
    "transform_points",
    "warp_affine",
]

# ArcFace 112×112 template, pixel x, y: left eye, right eye, nose tip, left mouth corner, right mouth corner.
ARCFACE_TEMPLATE = torch.tensor(
    [[38.2946, 51.6963], [73.5318, 51.5014], [56.0252, 71.7366], [41.5493, 92.3655], [70.7299, 92.2041]],
    dtype=torch.float32,
)


def template_for(size: int) -> torch.Tensor:
    """The ArcFace template for a ``size``×``size`` crop: ``ARCFACE_TEMPLATE · size/112``, (5, 2) float32."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 8:
        raise DataError(f"template_for(size={size!r}): the crop size must be an integer ≥ 8 pixels")
    return ARCFACE_TEMPLATE * (size / 112.0)


def _check_points(points: torch.Tensor, name: str) -> None:
    if not isinstance(points, torch.Tensor) or points.ndim != 3 or points.shape[-1] != 2 or points.shape[1] < 2:
        desc = tuple(points.shape) if isinstance(points, torch.Tensor) else type(points).__name__
        raise DataError(f"{name} must be a tensor (B, K, 2) of pixel x, y with K ≥ 2 points, got {desc}")


def similarity_transform(src: torch.Tensor, dst: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Least-squares similarity mapping ``src`` (B, K, 2) onto ``dst`` (K, 2) or (B, K, 2): (B, 2, 3).

    ``dst_i ≈ M[:, :2]·src_i + M[:, 2]`` with ``M[:, :2] = [[p, −q], [q, p]]`` (rotation, uniform scale, no
    reflection); see the module docstring for the closed form. Differentiable in both arguments; a source
    whose points all coincide has no defined rotation and gives ``p = q = 0`` (its spread is clamped to
    ``eps``) instead of NaN.
    """
    _check_points(src, "similarity_transform src")
    if dst.ndim == 2:
        dst = dst.unsqueeze(0).expand(src.shape[0], -1, -1)
    _check_points(dst, "similarity_transform dst")
    if dst.shape[1:] != src.shape[1:] or dst.shape[0] != src.shape[0]:
        raise DataError(
            f"similarity_transform: dst {tuple(dst.shape)} must match src {tuple(src.shape)} (same number of points)"
        )
    dst = dst.to(src.dtype)
    ms, md = src.mean(dim=1, keepdim=True), dst.mean(dim=1, keepdim=True)  # (B, 1, 2)
    a, b = src - ms, dst - md  # (B, K, 2)
    spread = (a * a).sum(dim=(1, 2)).clamp_min(eps)  # Σ‖a_i‖², (B,)
    p = (a * b).sum(dim=(1, 2)) / spread  # σ cos θ
    q = (a[..., 0] * b[..., 1] - a[..., 1] * b[..., 0]).sum(dim=1) / spread  # σ sin θ
    lin = torch.stack([torch.stack([p, -q], -1), torch.stack([q, p], -1)], 1)  # (B, 2, 2)
    t = md.squeeze(1) - (lin @ ms.transpose(1, 2)).squeeze(-1)  # (B, 2)
    return torch.cat([lin, t.unsqueeze(-1)], dim=2)


def transform_points(points: torch.Tensor, matrices: torch.Tensor) -> torch.Tensor:
    """Apply affine ``matrices`` (B, 2, 3) to ``points`` (B, K, 2): ``p' = A p + t`` → (B, K, 2)."""
    _check_points(points, "transform_points points")
    if matrices.ndim != 3 or matrices.shape[1:] != (2, 3) or matrices.shape[0] != points.shape[0]:
        raise DataError(f"matrices must be (B={points.shape[0]}, 2, 3), got {tuple(matrices.shape)}")
    return points @ matrices[:, :, :2].transpose(1, 2) + matrices[:, :, 2].unsqueeze(1)


def invert_affine(matrices: torch.Tensor) -> torch.Tensor:
    """Inverse of affine maps (B, 2, 3): ``[A⁻¹ | −A⁻¹t]``, e.g. to map aligned-crop landmarks back."""
    lin_inv = torch.linalg.inv(matrices[:, :, :2])  # (B, 2, 2)
    return torch.cat([lin_inv, -(lin_inv @ matrices[:, :, 2:])], dim=2)


def _pixel_to_norm(length: int, align_corners: bool, ref: torch.Tensor) -> torch.Tensor:
    """Per-axis scale and offset (2,) for n = k·p + c on an axis of ``length`` pixels."""
    if align_corners:
        k = 2.0 / max(length - 1, 1)
        return torch.tensor([k, -1.0], dtype=ref.dtype, device=ref.device)
    return torch.tensor([2.0 / length, 1.0 / length - 1.0], dtype=ref.dtype, device=ref.device)


def _homogeneous(sx: torch.Tensor, sy: torch.Tensor) -> torch.Tensor:
    """3×3 diagonal-plus-offset matrix from per-axis (scale, offset) pairs."""
    out = torch.zeros(3, 3, dtype=sx.dtype, device=sx.device)
    out[0, 0], out[0, 2] = sx[0], sx[1]
    out[1, 1], out[1, 2] = sy[0], sy[1]
    out[2, 2] = 1.0
    return out


def _out_hw(out_size: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(out_size, int) and not isinstance(out_size, bool):
        out_size = (out_size, out_size)
    if (
        not isinstance(out_size, tuple)
        or len(out_size) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in out_size)
    ):
        raise DataError(f"out_size must be a positive int or (height, width), got {out_size!r}")
    return out_size


def warp_affine(
    images: torch.Tensor,
    matrices: torch.Tensor,
    out_size: int | tuple[int, int],
    *,
    align_corners: bool = False,
    mode: str = "bilinear",
    padding_mode: str = "zeros",
) -> torch.Tensor:
    """Warp ``images`` (B, C, H, W) by pixel-coordinate ``matrices`` (B, 2, 3) into (B, C, S_h, S_w).

    Output pixel ``o`` takes the input at ``M⁻¹·o`` (as ``cv2.warpAffine(img, M, (S_w, S_h))``).
    ``align_corners`` only picks grid_sample's normalisation; the pixel-space result is the same.
    """
    if not isinstance(images, torch.Tensor) or images.ndim != 4:
        desc = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise DataError(f"warp_affine images must be a float tensor (B, C, H, W), got {desc}")
    if not images.is_floating_point():
        raise DataError(f"warp_affine images must be floating point, got {images.dtype}; convert with .float()")
    b, _, h, w = images.shape
    if matrices.ndim != 3 or matrices.shape != (b, 2, 3):
        raise DataError(f"warp_affine matrices must be (B={b}, 2, 3), got {tuple(matrices.shape)}")
    oh, ow = _out_hw(out_size)
    m = matrices.to(images.dtype)
    inv = invert_affine(m)  # output pixel → input pixel, (B, 2, 3)
    inv3 = torch.cat([inv, inv.new_tensor([0.0, 0.0, 1.0]).expand(b, 1, 3)], dim=1)  # (B, 3, 3)
    n_in = _homogeneous(_pixel_to_norm(w, align_corners, m), _pixel_to_norm(h, align_corners, m))
    n_out = _homogeneous(_pixel_to_norm(ow, align_corners, m), _pixel_to_norm(oh, align_corners, m))
    theta = (n_in @ inv3 @ torch.linalg.inv(n_out))[:, :2]  # normalised out → normalised in, (B, 2, 3)
    grid = F.affine_grid(theta, [b, images.shape[1], oh, ow], align_corners=align_corners)
    return F.grid_sample(images, grid, mode=mode, padding_mode=padding_mode, align_corners=align_corners)


def align_faces(
    images: torch.Tensor,
    landmarks: torch.Tensor,
    out_size: int = 112,
    *,
    template: torch.Tensor | None = None,
    align_corners: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Align faces to the ArcFace template: ``(aligned (B, C, S, S), matrices (B, 2, 3))``.

    ``landmarks`` (B, 5, 2) are pixel x, y in ``images`` (B, C, H, W) in ArcFace order; ``template``
    defaults to ``template_for(out_size)``. ``matrices`` map input pixels to aligned pixels, so
    ``transform_points(landmarks, matrices)`` are the landmarks in the crop. Differentiable in both the
    images and the landmarks. Non-finite landmarks raise a ``DataError`` (a NaN would silently blank
    the crop).
    """
    _check_points(landmarks, "align_faces landmarks")
    if images.ndim != 4 or images.shape[0] != landmarks.shape[0]:
        raise DataError(
            f"align_faces: images {tuple(images.shape)} must be (B, C, H, W) with B = {landmarks.shape[0]} "
            "(one set of landmarks per image)"
        )
    bad = (~torch.isfinite(landmarks.detach()).all(dim=2).all(dim=1)).nonzero().flatten()
    if bad.numel():
        raise DataError(
            f"align_faces: {bad.numel()} of {landmarks.shape[0]} landmark sets are not finite (e.g. rows "
            f"{bad[:5].tolist()}); drop those faces or fill them with an aligner's predictions"
        )
    if template is None:
        template = template_for(out_size)
    template = template.to(device=landmarks.device, dtype=landmarks.dtype)
    if template.shape != landmarks.shape[1:]:
        raise DataError(
            f"align_faces: template {tuple(template.shape)} must match landmarks {tuple(landmarks.shape[1:])}"
        )
    matrices = similarity_transform(landmarks, template)
    aligned = warp_affine(images, matrices.to(images.dtype), out_size, align_corners=align_corners)
    return aligned, matrices
