-- The faceops deployment's databases, created once when the PostgreSQL volume is first initialised
-- (docker-entrypoint-initdb.d runs as POSTGRES_USER, who owns them):
--   mlflow   MLflow tracking + model registry (MLFLOW_BACKEND_STORE_URI)
--   prefect  Prefect server (PREFECT_SERVER_DATABASE_NAME)
--   optuna   distributed sweeps: `--storage postgresql://USER@HOST:5432/optuna`
CREATE DATABASE mlflow;
CREATE DATABASE prefect;
CREATE DATABASE optuna;
