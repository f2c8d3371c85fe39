"""Generalized category / face discovery (GCD, GFD): semi-supervised k-means, clustering baselines and
the known/unknown identity split. Metrics live in ``ml.eval.metrics`` (``cluster_accuracy``,
``nearest_neighbor_consistency``)."""
