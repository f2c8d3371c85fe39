"""The MLflow model registry as promotion sees it: the registered models and their aliases (``@candidate``,
``@champion``, ``@previous``), reaching the tracking server, downloading a version, and ``RegistryChange``, which
applies alias moves and version tags as one change (each step records its undo before it runs; a failure undoes
the steps before it). See ``ops/promote``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ml.errors import ConfigError, DataError, FaceopsError
from ops.run_store import configure, tracking_uri
from tasks import STAGES as STAGES_REGISTRY
from tasks.common import redact

# params section → registered model name; and the DVC stage that makes its promoted versions (tasks.STAGES)
MODELS: dict[str, str] = {s.section: s.model for s in STAGES_REGISTRY.values() if s.model and s.section}
STAGES: dict[str, str] = {s.section: s.model_stage or name for name, s in STAGES_REGISTRY.items()
                          if s.model and s.section}
CANDIDATE, CHAMPION, PREVIOUS = "candidate", "champion", "previous"


class PromotionError(FaceopsError):
    """The registry is not in a state the operation can start from (no candidate, nothing to roll back to, aliases
    moved meanwhile), or a failed change could not be undone."""


class RegistryUnreachable(FaceopsError):
    """The MLflow tracking server did not answer; the message names the endpoint (password masked)."""


def model_key(model: str) -> str:
    """``fr`` or ``faceops-fr`` → ``fr``; anything else → ConfigError listing the registered models."""
    key = model.removeprefix("faceops-")
    if key not in MODELS:
        raise ConfigError(f"unknown model {model!r}. Registered models: {', '.join(MODELS.values())} "
                          f"(or their short names {', '.join(MODELS)}).")
    return key


def check_tracking(uri: str, timeout_s: float = 5.0) -> None:
    """For an HTTP(S) tracking URI: the server must answer at all (any HTTP status; ``/health`` is asked), or
    RegistryUnreachable naming the endpoint. MLflow's own client would retry a refused connection for minutes
    before failing. Proxy settings apply as they do to MLflow's client. Local stores pass."""
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    try:
        requests.get(uri.rstrip("/") + "/health", timeout=timeout_s)
        return
    except requests.RequestException as exc:
        reason = type(exc).__name__
    raise RegistryUnreachable(
        f"MLflow tracking server {redact(uri)} is unreachable ({reason}). Start it, or point MLFLOW_TRACKING_URI at "
        "a running server (unset it to use the local mlflow.db)."
    )


def is_transient(exc: BaseException) -> bool:
    """Errors worth retrying: an unreachable tracking server, a dropped connection or a timeout."""
    if isinstance(exc, (RegistryUnreachable, ConnectionError, TimeoutError)):
        return True
    try:
        import requests

        if isinstance(exc, (requests.ConnectionError, requests.Timeout)):
            return True
    except ImportError:  # pragma: no cover - requests comes with MLflow
        pass
    text = str(exc)
    return "Max retries exceeded" in text or "Connection refused" in text


def connect(root: Path) -> str:
    """Check the tracking server answers, point MLflow at it; → its URI (password masked)."""
    uri = tracking_uri(Path(root))
    check_tracking(uri)
    configure(Path(root))
    return redact(uri)


def client_for(root: Path) -> Any:
    from mlflow import MlflowClient

    configure(Path(root))
    return MlflowClient()


@dataclass(frozen=True)
class RegistryState:
    """A registered model's aliases (alias → version) when it was read."""

    name: str
    aliases: dict
    candidate_alias: str = CANDIDATE

    @property
    def candidate(self) -> str | None:
        return self.aliases.get(self.candidate_alias)

    @property
    def champion(self) -> str | None:
        return self.aliases.get(CHAMPION)

    @property
    def previous(self) -> str | None:
        return self.aliases.get(PREVIOUS)


def _not_found(exc: Exception) -> bool:
    return getattr(exc, "error_code", "") == "RESOURCE_DOES_NOT_EXIST"


def registry_state(client: Any, name: str, candidate_alias: str = CANDIDATE) -> RegistryState:
    """Read ``name``'s aliases; a model that is not registered is a PromotionError saying which stage registers it."""
    from mlflow.exceptions import MlflowException

    try:
        model = client.get_registered_model(name)
    except MlflowException as exc:
        if _not_found(exc):
            stage = STAGES[model_key(name)]
            raise PromotionError(f"{name} is not in the MLflow registry: run `faceops run --stage {stage}` (or "
                                 f"`dvc repro {stage}`) to register a candidate first.") from None
        raise
    return RegistryState(name, {str(a): str(v) for a, v in (model.aliases or {}).items()}, candidate_alias)


def require_candidate(state: RegistryState) -> str:
    if state.candidate is None:
        stage = STAGES[model_key(state.name)]
        aliases = ", ".join(f"@{a} v{v}" for a, v in sorted(state.aliases.items())) or "none"
        raise PromotionError(f"{state.name} has no @{state.candidate_alias} version (aliases: {aliases}): run "
                             f"`faceops run --stage {stage}` to register one, or name another alias.")
    return state.candidate


def find_model_dir(local: Path, what: str) -> Path:
    """The one directory under ``local`` holding ``model.safetensors`` + ``config.json`` (a pyfunc model keeps it
    under ``artifacts/``, a registered run artifact is it)."""
    found = sorted({p.parent for p in Path(local).rglob("model.safetensors") if (p.parent / "config.json").is_file()})
    if len(found) != 1:
        raise DataError(f"{what}: expected one faceops model directory (model.safetensors + config.json) in its "
                        f"artifacts, found {len(found)} under {local}.")
    return found[0]


def download_version(name: str, version: str, dst: Path) -> Path:
    """Download registered version ``name`` v``version`` into ``dst`` → its model directory."""
    import mlflow

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    local = mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}", dst_path=str(dst))
    return find_model_dir(Path(local), f"{name} v{version}")


class RegistryChange:
    """Alias moves and version tags of one registered model applied as one change.

    Each step records how to undo itself before it runs; if a step raises, the steps before it (and the failing one,
    in case it took effect) are undone in reverse order and the error propagates. If undoing fails too, a
    PromotionError lists what to restore by hand.
    """

    def __init__(self, client: Any, name: str, aliases: Mapping[str, str]):
        self.client, self.name = client, name
        self.aliases: dict[str, str] = dict(aliases)
        self._undo: list[tuple[str, Callable[[], None]]] = []

    def __enter__(self) -> "RegistryChange":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            return False
        failed = []
        for what, undo in reversed(self._undo):
            try:
                undo()
            except Exception as err:  # keep undoing the rest; report all
                failed.append(f"{what} ({type(err).__name__}: {err})")
        if failed:
            raise PromotionError(f"{self.name}: a registry change failed ({exc}) and could not be fully undone; "
                                 f"restore by hand: {'; '.join(failed)}") from exc
        return False

    def set_alias(self, alias: str, version: str) -> None:
        before = self.aliases.get(alias)
        self._undo.append((f"@{alias} → {'v' + before if before else 'unset'}", lambda: self._put(alias, before)))
        self.client.set_registered_model_alias(self.name, alias, str(version))
        self.aliases[alias] = str(version)

    def delete_alias(self, alias: str) -> None:
        before = self.aliases.get(alias)
        self._undo.append((f"@{alias} → {'v' + before if before else 'unset'}", lambda: self._put(alias, before)))
        self._put(alias, None)
        self.aliases.pop(alias, None)

    def set_version_tags(self, version: str, tags: Mapping[str, str]) -> None:
        old = dict(self.client.get_model_version(self.name, str(version)).tags or {})
        for key, value in tags.items():
            before = old.get(key)
            self._undo.append((f"v{version} tag {key} → {before!r}", lambda k=key, b=before: self._tag(version, k, b)))
            self.client.set_model_version_tag(self.name, str(version), key, str(value))

    def _put(self, alias: str, version: str | None) -> None:
        from mlflow.exceptions import MlflowException

        if version is not None:
            self.client.set_registered_model_alias(self.name, alias, version)
            return
        try:
            self.client.delete_registered_model_alias(self.name, alias)
        except MlflowException as exc:
            if not _not_found(exc):
                raise

    def _tag(self, version: str, key: str, value: str | None) -> None:
        if value is None:
            self.client.delete_model_version_tag(self.name, str(version), key)
        else:
            self.client.set_model_version_tag(self.name, str(version), key, value)
