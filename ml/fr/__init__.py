"""Face recognition: ViT (with KP-RPE) and IResNet backbones (``backbones``), margin losses, PartialFC and the
LVFace schedule (``losses``), and their Lightning training (``config``, ``data``, ``module``, ``train``).

LVFace: https://arxiv.org/abs/2501.13420 (code: https://github.com/bytedance/LVFace); KP-RPE:
https://arxiv.org/abs/2403.14852 (code: https://github.com/mk-minchul/CVLface). Guide: docs/methods/recognition.md."""
