"""Pure PyTorch / numpy / Lightning code: data, models, losses, training loops, metrics.

Nothing in this package imports prefect, mlflow, dvc, great_expectations or boto3
(docs/concepts.md, "Layers"); ``tests/unit/test_layers.py`` keeps it so.
"""
