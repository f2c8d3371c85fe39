"""FaceGCD: generalized face discovery, recognising known identities and clustering unknown ones.

Paper: Oh & Choi, "FaceGCD: Generalized Face Discovery via Dynamic Prefix Generation", BMVC 2025,
https://arxiv.org/abs/2507.22353; authors' code: https://github.com/yunseokddi/FaceGCD.

``facegcd`` holds the model (hypernetwork-generated attention prefixes on a face ViT), ``train`` and
``contrastive`` its training, ``ssk`` the semi-supervised k-means inference, ``split`` the known/unknown identity
split, ``protocol`` and ``baselines`` the evaluation and the label-free clustering baselines. Metrics live in
``ml.eval.metrics`` (``cluster_accuracy``, ``nearest_neighbor_consistency``).
"""
