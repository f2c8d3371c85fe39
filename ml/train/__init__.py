"""Training loops: ``ml.train.fr`` fits face-recognition backbones; ``ml.train.augment`` holds the batched,
landmark-aware augmentations they use."""
