"""Category-discovery models: ``FaceGCD`` (hypernetwork-generated attention prefixes on a face ViT)."""

from ml.models.discovery.facegcd import FaceGCD, load_facegcd, save_facegcd

__all__ = ["FaceGCD", "load_facegcd", "save_facegcd"]
