"""Operations services around the pipeline, beside its stages (``tasks/``) and the flows that run them (``flows/``).

- ``ops.promote`` (with ``promote_bench``, ``promote_decision``, ``promote_registry``): promotion to the MLflow
  registry — judge a model's ``@candidate`` against its ``@champion`` on a declared gate, move the aliases, roll back;
- ``ops.sweep`` (with ``sweep_config``, ``sweep_targets``, ``sweep_study``, ``sweep_trials``): Optuna sweeps over a
  stage's params, one study shared by many processes, every trial a nested MLflow run;
- ``ops.tracking``: the MLflow run of each stage execution and the relay that replays a stage's tracking journal
  into MLflow from the flow's process; ``ops.pyfunc``: the serving contract of a registered embedding model;
- ``ops.storage``: the ``storage`` bucket as DVC remote and MLflow artifact store.

The stages import ``ops.tracking``; nothing here imports ``flows`` or ``faceops``.
"""
