"""One artifact store: the ``storage`` bucket as DVC remote and MLflow artifact store, and nothing beside them.

Every dataset, model and plot a stage writes is a DVC output, versioned by content hash in ``dvc.lock``; it goes to
and comes from ``s3://<storage.bucket>/<storage.prefix>/dvc`` with DVC's own ``push``/``pull``/``get``, which
upload only what the remote lacks, and download into DVC's cache and check each file's hash there before linking
it into the workspace (remote option ``verify``). A model is published *by name* through the MLflow registry
(``faceops promote``), whose artifact store is ``s3://<bucket>/<prefix>/mlflow``. So this module only turns the
``storage`` section into

* the DVC remote's settings (``.dvc/config.local``, not committed: the endpoint is machine-specific);
* the AWS SDK's own retry settings for the DVC process (``AWS_MAX_ATTEMPTS``, ``AWS_RETRY_MODE``: throttling,
  5xx and dropped connections are retried by botocore);
* one clear error for a DVC command that fails, naming the remote, the endpoint and what to check.

Credentials come only from the environment (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``
or ``AWS_PROFILE``): the section refuses anything that looks like one, and no message carries their values.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

from ml.config import from_mapping
from ml.errors import ConfigError, FaceopsError
from tasks.common import redact, section

REMOTE = "faceops"  # the DVC remote's name in .dvc/config.local
_CREDENTIAL_KEY = re.compile(r"secret|passw|token|credential|access_?key|api_?key|private_?key", re.IGNORECASE)


class StorageError(FaceopsError, RuntimeError):
    """A DVC transfer failed after the SDK's retries, or a download did not match its hash."""


@dataclass(frozen=True)
class StorageConfig:
    """``params.yaml`` section ``storage``. No credentials here: they come from the environment only."""

    CREDENTIALS_FROM: ClassVar[str] = ("the environment: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or "
                                       "the machine's instance role")
    bucket: str = ""                   # empty: the storage commands ask for it
    prefix: str = "faceops"            # keys under s3://bucket/prefix/: dvc/ (DVC remote), mlflow/ (MLflow artifacts)
    endpoint_url: str = ""             # MinIO or another S3-compatible server; empty: AWS_ENDPOINT_URL, else AWS
    region: str = ""                   # empty: AWS_REGION / AWS_DEFAULT_REGION, else us-east-1
    max_concurrency: int = 8           # parallel transfers (DVC's remote `jobs`)
    max_attempts: int = 5              # attempts per request in total, the first included (AWS_MAX_ATTEMPTS)
    retry_mode: Literal["standard", "adaptive"] = "standard"  # AWS_RETRY_MODE; adaptive also slows after throttling
    connect_timeout: float = 5.0       # seconds (rounded up to whole seconds for DVC)
    read_timeout: float = 60.0         # seconds

    def __post_init__(self) -> None:
        if self.prefix != self.prefix.strip("/") or "//" in self.prefix:
            raise ConfigError(f"params key 'storage.prefix': {self.prefix!r} must not start or end with '/' "
                              f"nor contain '//'; write {self.prefix.strip('/')!r}.")
        for key in ("max_concurrency", "max_attempts"):
            if getattr(self, key) < 1:
                raise ConfigError(f"params key 'storage.{key}': must be at least 1, got {getattr(self, key)}.")
        for key in ("connect_timeout", "read_timeout"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"params key 'storage.{key}': must be positive seconds, got {getattr(self, key)}.")
        if self.endpoint_url:
            _check_endpoint(self.endpoint_url, "params key 'storage.endpoint_url'")

    def url(self, area: Literal["dvc", "mlflow"]) -> str:
        """``s3://bucket/prefix/<area>``; ConfigError when no bucket is set."""
        if not self.bucket:
            raise ConfigError("params key 'storage.bucket' is empty: set the bucket in params.yaml (and "
                              "storage.endpoint_url or AWS_ENDPOINT_URL for MinIO and other S3-compatible servers).")
        return f"s3://{self.bucket}/{self.prefix + '/' if self.prefix else ''}{area}"

    def endpoint(self) -> str | None:
        """``storage.endpoint_url``, else ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, else None (AWS itself)."""
        if self.endpoint_url:
            return self.endpoint_url
        for env in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
            if os.environ.get(env):
                _check_endpoint(os.environ[env], env)
                return os.environ[env]
        return None

    def sdk_env(self) -> dict[str, str]:
        """The AWS SDK's own retry settings, for a process that talks to the bucket."""
        return {"AWS_MAX_ATTEMPTS": str(self.max_attempts), "AWS_RETRY_MODE": self.retry_mode}


def storage_config(params: Mapping[str, Any]) -> StorageConfig:
    """The ``storage`` section of ``params``; a key that looks like a credential is refused before anything else."""
    mapping = section(params, "storage")
    for key in mapping:
        if _CREDENTIAL_KEY.search(str(key)):
            raise ConfigError(
                f"params key 'storage.{key}' looks like a credential; params.yaml is committed and logged, so it "
                "never holds one. Remove the key and set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (plus "
                "AWS_SESSION_TOKEN for temporary credentials, or AWS_PROFILE) in the environment instead.")
    return from_mapping(StorageConfig, mapping, "storage")


def _check_endpoint(url: str, where: str) -> None:
    parts = urlsplit(url)
    if parts.username is not None or parts.password is not None:
        host = parts.hostname or "?"
        raise ConfigError(f"{where} carries a user name or password; remove it (use "
                          f"{parts.scheme}://{host}{':' + str(parts.port) if parts.port else ''}) and put the "
                          "credentials in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY instead.")
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{where}: {url!r} is not an http(s) URL, e.g. http://127.0.0.1:9000 for MinIO.")


# ── the DVC remote ────────────────────────────────────────────────────────────────────────────────────────────


def remote_settings(cfg: StorageConfig) -> dict[str, str]:
    """DVC's S3 remote options for ``cfg``: every download's hash is checked (``verify``)."""
    settings = {"url": cfg.url("dvc"), "jobs": str(cfg.max_concurrency), "verify": "true",
                "connect_timeout": str(math.ceil(cfg.connect_timeout)),
                "read_timeout": str(math.ceil(cfg.read_timeout))}
    if cfg.endpoint():
        settings["endpointurl"] = cfg.endpoint()
    if cfg.region:
        settings["region"] = cfg.region
    return settings


def dvc_remote_commands(cfg: StorageConfig, name: str = REMOTE) -> list[list[str]]:
    """``dvc remote`` commands that make the bucket's ``dvc/`` area the default remote in ``.dvc/config.local``."""
    settings = remote_settings(cfg)
    commands = [["remote", "add", "--local", "--default", "--force", name, settings.pop("url")]]
    return commands + [["remote", "modify", "--local", name, key, value] for key, value in settings.items()]


def configure_dvc_remote(cfg: StorageConfig, root: Path, name: str = REMOTE) -> list[list[str]]:
    """Write what :func:`dvc_remote_commands` would (one edit of ``.dvc/config.local`` through DVC's own config, where
    the commands start a DVC process each); returns them."""
    from dvc.config import Config

    with Config(str(root / ".dvc")).edit("local") as conf:
        conf["remote"][name] = remote_settings(cfg)
        conf["core"]["remote"] = name
    return dvc_remote_commands(cfg, name)


def mlflow_artifacts(cfg: StorageConfig) -> tuple[str, dict[str, str]]:
    """The ``--artifacts-destination`` for an MLflow server on the same bucket, and the environment it needs."""
    endpoint = cfg.endpoint()
    return cfg.url("mlflow"), {"MLFLOW_S3_ENDPOINT_URL": endpoint} if endpoint else {}


def run_dvc(cfg: StorageConfig, root: Path, args: Sequence[str], *, verbose: bool = False) -> str:
    """``dvc ARGS`` in ``root`` with the SDK's retry settings; its stdout, or StorageError naming what to check.

    ``verbose`` passes DVC's (and botocore's) debug log through to stderr: each request and each retry."""
    env = {**os.environ, **cfg.sdk_env(), "DVC_NO_ANALYTICS": "1"}
    out = subprocess.run([sys.executable, "-m", "dvc", *args, *(["-v"] if verbose else [])], cwd=root, env=env,
                         capture_output=True, text=True)
    if verbose:
        sys.stderr.write(redact(out.stderr))
    if out.returncode != 0:
        raise StorageError(redact(explain(cfg, args, out.stderr + out.stdout)))
    return out.stdout


_CAUSES: tuple[tuple[str, str, str], ...] = (
    (r"Could not connect|EndpointConnectionError|ConnectTimeout|Connection refused|Cannot connect",
     "no answer from the endpoint after {attempts} attempt(s)",
     "Check that the server is running and reachable and that the endpoint is right (storage.endpoint_url in "
     "params.yaml, else AWS_ENDPOINT_URL); storage.max_attempts and storage.connect_timeout set how long to try."),
    (r"NoSuchBucket|bucket does not exist",
     "bucket '{bucket}' does not exist",
     "Create it (`aws s3 mb s3://BUCKET`, MinIO: `mc mb ALIAS/BUCKET`) or fix storage.bucket."),
    (r"AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch|ExpiredToken|Forbidden|403|NoCredentialsError|"
     r"Unable to locate credentials",
     "access denied or no usable credentials",
     "Check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment and the bucket's policy."),
    (r"SlowDown|reduce your request rate|InternalError|ServiceUnavailable|\b50[0-4]\b|failed to (push|pull|fetch)|"
     r"failed to (upload|download)",
     "the transfer failed after {attempts} attempt(s) per request",
     "The endpoint is throttling or failing: try again later, or raise storage.max_attempts (retry_mode: adaptive "
     "also slows the request rate). Files already transferred are kept; run the command again to finish."),
    (r"missing cache files|not in cache|is missing from",
     "the remote lacks files this version needs",
     "Push them from the machine that produced them (`faceops data push`), or reproduce them (`faceops run`)."),
)


def explain(cfg: StorageConfig, args: Sequence[str], output: str) -> str:
    """One message for a failed ``dvc ARGS``: remote, endpoint, what went wrong and what to check."""
    where = f"{cfg.url('dvc') if cfg.bucket else 'the DVC remote'} at {cfg.endpoint() or 'AWS'}"
    errors = [line.removeprefix("ERROR:").strip() for line in output.splitlines() if line.startswith("ERROR")]
    detail = errors[-1] if errors else (output.strip().splitlines() or ["no output"])[-1]
    for pattern, what, hint in _CAUSES:
        if re.search(pattern, output):
            what = what.format(attempts=cfg.max_attempts, bucket=cfg.bucket)
            return f"`dvc {args[0]}` on {where}: {what} ({detail}). {hint}"
    return f"`dvc {' '.join(args)}` on {where} failed: {detail}"


# ── what is versioned ─────────────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Entry:
    """One DVC-tracked output: its path, content hash, size and file count, and whether the remote holds it."""

    path: str
    md5: str
    size: int
    files: int
    pushed: bool | None  # None: not asked (no remote configured)


def catalog(cfg: StorageConfig, root: Path, *, remote: bool = True) -> list[Entry]:
    """Every cached output of the stages in ``root``'s ``dvc.lock`` (and ``*.dvc`` files); with ``remote``, whether
    the remote holds each (``dvc status --cloud``: an output with files the remote lacks is not pushed)."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        outs = [out for out in repo.index.outs if out.use_cache and out.hash_info and out.hash_info.value]
        rows = [(str(Path(out.fs_path).relative_to(root)), out.hash_info.value.removesuffix(".dir"),
                 int(out.meta.size or 0), int(out.meta.nfiles or 1)) for out in outs]
    missing: set[str] = set()
    if remote:
        status = json.loads(run_dvc(cfg, root, ["status", "--cloud", "--json"]) or "{}")
        missing = {path for path, state in status.items() if state != "deleted"}
    return [Entry(path, md5, size, files, None if not remote else path not in missing)
            for path, md5, size, files in sorted(rows)]
