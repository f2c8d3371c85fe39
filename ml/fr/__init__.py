"""Face recognition: ViT (with KP-RPE) and IResNet backbones (``backbones``), margin losses, PartialFC and the
LVFace schedule (``losses``), and their Lightning training (``config``, ``data``, ``module``, ``train``)."""
