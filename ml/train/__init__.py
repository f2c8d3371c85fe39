"""Training loops: ``ml.fr.train`` fits face-recognition backbones; ``ml.train.augment`` holds the batched,
landmark-aware augmentations they use."""
