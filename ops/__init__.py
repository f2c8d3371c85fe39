"""Operations services around the pipeline, beside its stages (``tasks/``) and the flows that run them (``flows/``).

- ``ops.promote``: promotion to the MLflow registry — judge a model's ``@candidate`` against its ``@champion`` on a
  declared gate, move the aliases, roll back;
- ``ops.sweep``: Optuna sweeps over a stage's params, one study shared by many processes, every trial a nested
  MLflow run;
- ``ops.tracking``: the MLflow run of each stage execution and the relay that replays a stage's tracking journal
  into MLflow from the flow's process; ``ops.run_store``: where those runs go (the project's own store, wherever the
  stage runs); ``ops.lineage``: DVC's hashes on the runs, and the parent run of a ``dvc exp run``;
  ``ops.run_config``: which configuration a run is (default, preset, custom) and whether it may move
  ``@candidate``; ``ops.pyfunc``: the serving contract of a registered embedding model;
- ``ops.remote``: the ``storage`` bucket as DVC remote and MLflow artifact store.

The stages import ``ops.tracking``; nothing here imports ``flows`` or ``faceops``.
"""
