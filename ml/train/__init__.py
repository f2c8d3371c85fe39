"""Training loops: ``ml.train.fr`` fits face-recognition backbones."""
