"""S3 storage (boto3): datasets, models and reports published to and fetched from any S3-compatible endpoint.

Layout under ``s3://<storage.bucket>/<storage.prefix>/``::

    datasets/<name>/<digest>/...        a dataset directory, addressed by its content digest (dataset.json)
    datasets/<name>/LATEST              the digest pushed last under that name (what ``pull NAME`` fetches)
    models/<path below models/>/<id>/   a model directory; <id> = git commit, or commit-dirty-<UTC time>
    reports/<id>/<repo-relative path>   reports/benchmark.md, metrics/, plots/ of one run
    dvc/                                the DVC remote (``faceops data remote``)
    mlflow/                             the MLflow artifact store (``mlflow server --artifacts-destination``)

Every published directory carries ``faceops-index.json`` (relative path, sha256 and size of each file), written
after all its files, so its presence means the upload is complete; ``pull`` reads it to know what to fetch and
skips local files that are already identical. Each object also carries its sha256 as metadata
(``x-amz-meta-sha256``). A download lands in a temporary sibling, is checked against sha256 and size, and only
then renamed into place: a mismatch deletes it and raises naming the key and both digests.

Retries are botocore's (``storage.retry_mode`` standard/adaptive, ``storage.max_attempts`` attempts in total per
request): throttling (SlowDown, 503), other 5xx and connection errors. What still fails raises
:class:`StorageError` naming the endpoint, bucket and key and what to check. Credentials come only from the
environment (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN`` or ``AWS_PROFILE``): the
``storage`` section refuses anything that looks like one, and no message carries their values.

boto3, botocore and s3transfer are imported inside the functions that use them: importing this module (as the
params check does) stays cheap.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

from ml.config import from_mapping
from ml.errors import ConfigError, DataError, FaceopsError
from tasks.common import Paths, redact, section

log = logging.getLogger(__name__)

MiB = 1024 * 1024
S3_MIN_PART_MB = 5                 # S3 rejects multipart parts below 5 MiB (all but the last)
INDEX_NAME = "faceops-index.json"
INDEX_FORMAT = "faceops-index/1"
LATEST_NAME = "LATEST"
SHA256_META = "sha256"             # stored as x-amz-meta-sha256
_CREDENTIAL_KEY = re.compile(r"secret|passw|token|credential|access_?key|api_?key|private_?key", re.IGNORECASE)
_THROTTLING = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException"}
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}


class StorageError(FaceopsError, RuntimeError):
    """An S3 request failed after its retries, or a download did not match its checksum."""


@dataclass(frozen=True)
class StorageConfig:
    """``params.yaml`` section ``storage``. No credentials here: they come from the environment only."""

    CREDENTIALS_FROM: ClassVar[str] = ("the environment: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or "
                                       "the machine's instance role")

    bucket: str = ""                   # empty: the storage commands ask for it
    prefix: str = "faceops"            # every key lives under s3://bucket/prefix/
    endpoint_url: str = ""             # MinIO or another S3-compatible server; empty: AWS_ENDPOINT_URL, else AWS
    region: str = ""                   # empty: AWS_REGION / AWS_DEFAULT_REGION, else us-east-1
    multipart_threshold_mb: int = 64   # files above this go up in parts
    multipart_chunk_mb: int = 16       # part size (S3 minimum: 5)
    max_concurrency: int = 8           # parallel requests (files or parts)
    max_attempts: int = 5              # attempts per request in total, the first included
    retry_mode: Literal["standard", "adaptive"] = "standard"  # adaptive also slows the client after throttling
    connect_timeout: float = 5.0       # seconds
    read_timeout: float = 60.0         # seconds

    def __post_init__(self) -> None:
        if self.prefix != self.prefix.strip("/") or "//" in self.prefix:
            raise ConfigError(f"params key 'storage.prefix': {self.prefix!r} must not start or end with '/' "
                              f"nor contain '//'; write {self.prefix.strip('/')!r}.")
        if self.multipart_chunk_mb < S3_MIN_PART_MB:
            raise ConfigError(f"params key 'storage.multipart_chunk_mb': {self.multipart_chunk_mb} is below S3's "
                              f"minimum part size of {S3_MIN_PART_MB} MiB.")
        for key in ("multipart_threshold_mb", "max_concurrency", "max_attempts"):
            if getattr(self, key) < 1:
                raise ConfigError(f"params key 'storage.{key}': must be at least 1, got {getattr(self, key)}.")
        for key in ("connect_timeout", "read_timeout"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"params key 'storage.{key}': must be positive seconds, got {getattr(self, key)}.")
        if self.endpoint_url:
            _check_endpoint(self.endpoint_url, "params key 'storage.endpoint_url'")


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


def require_bucket(cfg: StorageConfig) -> StorageConfig:
    """``cfg`` when it names a bucket, else ConfigError saying where to set it."""
    if not cfg.bucket:
        raise ConfigError("params key 'storage.bucket' is empty: set the bucket to publish to in params.yaml "
                          "(and storage.endpoint_url or AWS_ENDPOINT_URL for MinIO and other S3-compatible servers).")
    return cfg


def resolve_endpoint(cfg: StorageConfig) -> str | None:
    """``storage.endpoint_url``, else ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, else None (AWS itself)."""
    if cfg.endpoint_url:
        return cfg.endpoint_url
    for env in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(env):
            _check_endpoint(os.environ[env], env)
            return os.environ[env]
    return None


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _bar(total: int, desc: str, progress: bool) -> Any:
    """A tqdm bar over files; only for transfers of more than one file."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="file", disable=not progress or total < 2, leave=False)


@dataclass(frozen=True)
class Transfer:
    """What one push or pull did: ``files`` in the index, of which ``transferred`` moved and ``skipped`` were
    already identical at the other end; ``bytes`` moved."""

    uri: str
    files: int
    transferred: int
    skipped: int
    bytes: int


@dataclass(frozen=True)
class ObjectInfo:
    rel: str                           # key relative to storage.prefix
    size: int
    modified: datetime


def _safe_rel(rel: str, where: str) -> str:
    """A relative POSIX path that stays inside its directory, or StorageError (an index must not write elsewhere)."""
    path = PurePosixPath(rel)
    if not rel or path.is_absolute() or ".." in path.parts or "\\" in rel or str(path) != rel:
        raise StorageError(f"{where}: unsafe or non-canonical path {rel!r} in the index; refusing to write it.")
    return rel


def local_files(path: Path) -> dict[str, Path]:
    """``{relative POSIX path: file}`` for a file or every regular file below a directory, sorted."""
    if path.is_file():
        return {path.name: path}
    if not path.is_dir():
        raise DataError(f"{path}: no such file or directory to publish.")
    found = {}
    for folder, _, names in os.walk(path, followlinks=True):  # symlinked folders too (data on another disk)
        for name in names:
            file = Path(folder, name)
            if file.is_file():
                found[file.relative_to(path).as_posix()] = file
    return dict(sorted(found.items()))


def index_entries(files: Mapping[str, Path]) -> list[dict[str, Any]]:
    """The index's ``files``: path, sha256 and size of each file, sorted by path."""
    entries = []
    for rel in sorted(files):
        if PurePosixPath(rel).name == INDEX_NAME:
            raise DataError(f"{files[rel]}: a file named {INDEX_NAME} is reserved for faceops' own index; rename it.")
        entries.append({"path": rel, "sha256": file_sha256(files[rel]), "size": files[rel].stat().st_size})
    return entries


class S3Store:
    """One bucket and prefix on one endpoint. Keys passed to its methods are relative to ``storage.prefix``."""

    def __init__(self, cfg: StorageConfig, *, client: Any = None) -> None:
        self.cfg = require_bucket(cfg)
        self.client = client if client is not None else _make_client(cfg)
        self.endpoint = self.client.meta.endpoint_url
        from boto3.s3.transfer import TransferConfig

        self._transfer_config = TransferConfig(
            multipart_threshold=cfg.multipart_threshold_mb * MiB, multipart_chunksize=cfg.multipart_chunk_mb * MiB,
            max_concurrency=cfg.max_concurrency, use_threads=True)

    # ── naming ────────────────────────────────────────────────────────────────────────────────────────────────
    def key(self, rel: str) -> str:
        rel = rel.lstrip("/")
        return f"{self.cfg.prefix}/{rel}" if self.cfg.prefix else rel

    def uri(self, rel: str = "") -> str:
        return f"s3://{self.cfg.bucket}/{self.key(rel)}"

    def _error(self, action: str, rel: str, exc: BaseException) -> StorageError:
        reason, hint = _explain(exc, self.cfg)
        return StorageError(redact(f"S3 {action} {self.uri(rel)} at {self.endpoint} failed: {reason}. {hint}"))

    @property
    def _s3_errors(self) -> tuple[type[BaseException], ...]:
        from botocore.exceptions import BotoCoreError, ClientError

        return (BotoCoreError, ClientError)

    # ── single objects ────────────────────────────────────────────────────────────────────────────────────────
    def put_bytes(self, rel: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.cfg.bucket, Key=self.key(rel), Body=data,
                                   Metadata={SHA256_META: hashlib.sha256(data).hexdigest()})
        except self._s3_errors as exc:
            raise self._error("upload to", rel, exc) from exc

    def get_bytes(self, rel: str, *, missing_ok: bool = False) -> bytes | None:
        """The object's bytes, checked against its sha256 metadata when it has one; None if absent and
        ``missing_ok``."""
        from botocore.exceptions import ClientError

        try:
            response = self.client.get_object(Bucket=self.cfg.bucket, Key=self.key(rel))
            data = response["Body"].read()
        except ClientError as exc:
            if missing_ok and exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise self._error("download of", rel, exc) from exc
        except self._s3_errors as exc:
            raise self._error("download of", rel, exc) from exc
        expected = response.get("Metadata", {}).get(SHA256_META)
        if expected and hashlib.sha256(data).hexdigest() != expected:
            raise StorageError(f"checksum mismatch for {self.uri(rel)} at {self.endpoint}: expected sha256 {expected}, "
                               f"got {hashlib.sha256(data).hexdigest()}. Publish it again.")
        return data

    def upload_file(self, path: Path, rel: str) -> str:
        """Upload one file (multipart above ``storage.multipart_threshold_mb``); returns its sha256."""
        sha = file_sha256(path)
        self._upload([(Path(path), rel, sha)], progress=False)
        return sha

    def download_file(self, rel: str, dest: Path, *, sha256: str | None = None, size: int | None = None) -> Path:
        """Download one object to ``dest`` through a verified temporary file. Without ``sha256``/``size`` they
        come from the object's metadata; an object without a sha256 cannot be verified and is refused."""
        if sha256 is None or size is None:
            try:
                head = self.client.head_object(Bucket=self.cfg.bucket, Key=self.key(rel))
            except self._s3_errors as exc:
                raise self._error("download of", rel, exc) from exc
            sha256 = sha256 or head.get("Metadata", {}).get(SHA256_META)
            size = head["ContentLength"] if size is None else size
            if not sha256:
                raise StorageError(f"{self.uri(rel)} at {self.endpoint} has no sha256 metadata (not published by "
                                   "faceops?), so the download cannot be verified; publish it with faceops data.")
        self._download([(rel, Path(dest), sha256, size)], progress=False)
        return Path(dest)

    def list(self, rel_prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``rel_prefix`` (relative to storage.prefix)."""
        base = self.key("")
        out = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.cfg.bucket,
                                                                          Prefix=self.key(rel_prefix))
            for page in pages:
                for obj in page.get("Contents", []):
                    out.append(ObjectInfo(obj["Key"][len(base):], obj["Size"], obj["LastModified"]))
        except self._s3_errors as exc:
            raise self._error("listing of", rel_prefix, exc) from exc
        return out

    def list_dirs(self, rel_prefix: str) -> list[str]:
        """The names one level below ``rel_prefix/`` (S3 common prefixes)."""
        rel_prefix = rel_prefix.rstrip("/") + "/"
        base = self.key(rel_prefix)
        names = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.cfg.bucket, Prefix=base,
                                                                          Delimiter="/")
            for page in pages:
                names += [p["Prefix"][len(base):].rstrip("/") for p in page.get("CommonPrefixes", [])]
        except self._s3_errors as exc:
            raise self._error("listing of", rel_prefix, exc) from exc
        return names

    # ── directories ───────────────────────────────────────────────────────────────────────────────────────────
    def read_index(self, rel_dir: str) -> dict[str, Any] | None:
        """The directory's ``faceops-index.json``, or None when nothing complete was published there."""
        rel = f"{rel_dir}/{INDEX_NAME}"
        data = self.get_bytes(rel, missing_ok=True)
        if data is None:
            return None
        try:
            index = json.loads(data)
            ok = index.get("format") == INDEX_FORMAT and all(
                isinstance(e.get("path"), str) and isinstance(e.get("sha256"), str) and isinstance(e.get("size"), int)
                for e in index["files"])
        except (ValueError, TypeError, KeyError, AttributeError):
            ok = False
        if not ok:
            raise StorageError(f"{self.uri(rel)} at {self.endpoint} is not a {INDEX_FORMAT} index; publish the "
                               "directory again.")
        return index

    def push_files(self, files: Mapping[str, Path], rel_dir: str, *, meta: Mapping[str, Any] | None = None,
                   entries: list[dict[str, Any]] | None = None, progress: bool = True, desc: str = "") -> Transfer:
        """Upload ``{relative path: file}`` under ``rel_dir`` and then its index (``entries``: the files'
        :func:`index_entries` when the caller has them already). Nothing is uploaded when the published index
        already lists exactly these contents."""
        entries = index_entries(files) if entries is None else entries
        remote = self.read_index(rel_dir)
        if remote is not None and remote["files"] == entries:
            log.info("%s: already published (%d files)", self.uri(rel_dir), len(entries))
            return Transfer(self.uri(rel_dir), len(entries), 0, len(entries), 0)
        self._upload([(files[e["path"]], f"{rel_dir}/{e['path']}", e["sha256"]) for e in entries],
                     progress=progress, desc=f"push {desc or rel_dir}")
        index = {"format": INDEX_FORMAT, **(meta or {}), "files": entries}
        self.put_bytes(f"{rel_dir}/{INDEX_NAME}", (json.dumps(index, indent=1, sort_keys=True) + "\n").encode())
        nbytes = sum(e["size"] for e in entries)
        log.info("%s: %d files, %d bytes uploaded", self.uri(rel_dir), len(entries), nbytes)
        return Transfer(self.uri(rel_dir), len(entries), len(entries), 0, nbytes)

    def push_dir(self, src: Path, rel_dir: str, *, meta: Mapping[str, Any] | None = None,
                 progress: bool = True) -> Transfer:
        return self.push_files(local_files(Path(src)), rel_dir, meta=meta, progress=progress)

    def pull_dir(self, rel_dir: str, dest: Path, *, progress: bool = True, desc: str = "") -> Transfer:
        """Fetch what ``rel_dir``'s index lists into ``dest``; files already identical locally are skipped. Local
        files the index does not list are left alone."""
        index = self.read_index(rel_dir)
        if index is None:
            raise StorageError(f"nothing complete is published at {self.uri(rel_dir)} ({self.endpoint}): no "
                               f"{INDEX_NAME} there (never pushed, or the push was interrupted); `faceops data ls` "
                               "lists what is.")
        dest = Path(dest)
        todo, skipped = [], 0
        for e in index["files"]:
            target = dest / _safe_rel(e["path"], self.uri(f"{rel_dir}/{INDEX_NAME}"))
            if target.is_file() and target.stat().st_size == e["size"] and file_sha256(target) == e["sha256"]:
                skipped += 1
            else:
                todo.append((f"{rel_dir}/{e['path']}", target, e["sha256"], e["size"]))
        self._download(todo, progress=progress, desc=f"pull {desc or rel_dir}")
        nbytes = sum(item[3] for item in todo)
        log.info("%s → %s: %d files fetched, %d already identical", self.uri(rel_dir), dest, len(todo), skipped)
        return Transfer(self.uri(rel_dir), len(index["files"]), len(todo), skipped, nbytes)

    # ── transfers ─────────────────────────────────────────────────────────────────────────────────────────────
    def _manager(self) -> Any:
        from s3transfer.manager import TransferManager

        return TransferManager(self.client, self._transfer_config)

    def _upload(self, items: Sequence[tuple[Path, str, str]], *, progress: bool, desc: str = "push") -> None:
        """``(file, rel key, sha256)`` each; one transfer manager, so small files go in parallel and large ones in
        parallel parts."""
        if not items:
            return
        with self._manager() as manager, _bar(len(items), desc, progress) as bar:
            futures = [(rel, manager.upload(str(path), self.cfg.bucket, self.key(rel),
                                            extra_args={"Metadata": {SHA256_META: sha}},
                                            subscribers=[_Tick(bar)]))
                       for path, rel, sha in items]
            for rel, future in futures:
                try:
                    future.result()
                except self._s3_errors as exc:
                    raise self._error("upload to", rel, exc) from exc

    def _download(self, items: Sequence[tuple[str, Path, str, int]], *, progress: bool, desc: str = "pull") -> None:
        """``(rel key, destination, sha256, size)`` each: into a temporary sibling, verified, then renamed."""
        if not items:
            return
        parts: list[Path] = []
        try:
            with self._manager() as manager, _bar(len(items), desc, progress) as bar:
                futures = []
                for rel, dest, sha, size in items:
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    part = dest.with_name(f".{dest.name}.part-{uuid.uuid4().hex[:8]}")
                    parts.append(part)
                    future = manager.download(self.cfg.bucket, self.key(rel), str(part),
                                              subscribers=[_Tick(bar)])
                    futures.append((rel, dest, sha, size, part, future))
                for rel, dest, sha, size, part, future in futures:
                    try:
                        future.result()
                    except self._s3_errors as exc:
                        raise self._error("download of", rel, exc) from exc
                    got_size, got_sha = part.stat().st_size, file_sha256(part)
                    if (got_sha, got_size) != (sha, size):
                        raise StorageError(
                            f"checksum mismatch for {self.uri(rel)} at {self.endpoint}: expected sha256 {sha} "
                            f"({size} bytes), got sha256 {got_sha} ({got_size} bytes). The object is corrupt or was "
                            f"changed after it was published; nothing was written to {dest}. Publish it again.")
                    os.replace(part, dest)
        finally:
            for part in parts:
                part.unlink(missing_ok=True)


class _Tick:
    """s3transfer subscriber: one step of the bar per finished file."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def on_queued(self, future: Any, **kwargs: Any) -> None:
        pass

    def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
        pass

    def on_done(self, future: Any, **kwargs: Any) -> None:
        self.bar.update(1)


def _make_client(cfg: StorageConfig) -> Any:
    import boto3
    from botocore.config import Config

    endpoint = resolve_endpoint(cfg)
    session = boto3.session.Session()
    options: dict[str, Any] = {}
    if endpoint:
        options["s3"] = {"addressing_style": "path"}  # MinIO and most S3-compatible servers: bucket in the path
    config = Config(retries={"total_max_attempts": cfg.max_attempts, "mode": cfg.retry_mode},
                    connect_timeout=cfg.connect_timeout, read_timeout=cfg.read_timeout,
                    max_pool_connections=max(10, cfg.max_concurrency + 2), **options)
    return session.client("s3", endpoint_url=endpoint, region_name=cfg.region or session.region_name or "us-east-1",
                          config=config)


def _explain(exc: BaseException, cfg: StorageConfig) -> tuple[str, str]:
    """(what went wrong, what to check) for a botocore error."""
    from botocore.exceptions import ClientError, ConnectionError, HTTPClientError, NoCredentialsError, \
        PartialCredentialsError

    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return ("no usable AWS credentials",
                "Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (plus AWS_SESSION_TOKEN for temporary credentials, "
                "or AWS_PROFILE) in the environment.")
    if isinstance(exc, (ConnectionError, HTTPClientError)):
        return (f"no answer after {cfg.max_attempts} attempt(s) ({type(exc).__name__}: {exc})",
                "Check that the server is running and reachable and that the endpoint is right "
                "(storage.endpoint_url in params.yaml, else AWS_ENDPOINT_URL); storage.max_attempts and "
                "storage.connect_timeout set how long faceops keeps trying.")
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        meta = exc.response.get("ResponseMetadata", {})
        code, status = error.get("Code", "?"), meta.get("HTTPStatusCode", 0)
        attempts = meta.get("RetryAttempts", 0) + 1
        if code in _THROTTLING or status >= 500:
            return (f"the server answered {status} {code} on all {attempts} attempt(s)",
                    "The endpoint is throttling or failing: try again later, or raise storage.max_attempts "
                    "(retry_mode: adaptive also slows the request rate).")
        if code == "NoSuchBucket":
            return (f"bucket '{cfg.bucket}' does not exist",
                    "Create it (`aws s3 mb s3://BUCKET`, MinIO: `mc mb ALIAS/BUCKET`) or fix storage.bucket.")
        if code in _DENIED or status == 403:
            return (f"access denied ({code})",
                    "Check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment and the bucket's policy.")
        if code in ("NoSuchKey", "404", "NotFound") or status == 404:
            return "no such object", "Nothing is published there; `faceops data ls` lists what is."
        return f"{status} {code}: {error.get('Message', '')}", "See the endpoint's documentation for this error."
    return f"{type(exc).__name__}: {exc}", ""


# ── what faceops publishes ────────────────────────────────────────────────────────────────────────────────────


def local_datasets(paths: Paths) -> dict[str, Path]:
    """Datasets that can be pushed, by name: every ``data/prepared/<name>``, plus ``synthetic`` and ``aligned``."""
    found = {}
    if paths.prepared.is_dir():
        found = {p.name: p for p in sorted(paths.prepared.iterdir()) if p.is_dir() and not p.name.startswith(".")}
    for path in (paths.synthetic_set, paths.aligned_set):
        if path.is_dir():
            found[path.name] = path
    return found


def dataset_home(paths: Paths, name: str) -> Path:
    """Where dataset ``name`` lives in a working copy (the default destination of ``pull``)."""
    return {"synthetic": paths.synthetic_set, "aligned": paths.aligned_set}.get(name, paths.prepared / name)


def content_digest(path: Path, entries: Sequence[Mapping[str, Any]]) -> str:
    """The digest a dataset is addressed by: ``dataset.json``'s, checked against the content; for a directory
    without one (``gfd``, ``verification``) the sha256 over its index lines ``path sha256 size``."""
    if (path / "dataset.json").is_file():
        from ml.data.dataset import dataset_digest, read_dataset_info

        declared, actual = read_dataset_info(path)["digest"], dataset_digest(path)
        if declared != actual:
            raise DataError(f"{path / 'dataset.json'}: digest {declared[:12]} but the directory's content digest is "
                            f"{actual[:12]}: the dataset changed after it was written; rebuild it (dvc repro) first.")
        return actual
    lines = "".join(f"{e['path']}\t{e['sha256']}\t{e['size']}\n" for e in entries)
    return hashlib.sha256(lines.encode()).hexdigest()


def push_dataset(store: S3Store, name: str, path: Path, *, progress: bool = True) -> tuple[str, Transfer]:
    """Publish a dataset directory under ``datasets/<name>/<digest>/`` and point ``datasets/<name>/LATEST`` at it."""
    files = local_files(path)
    entries = index_entries(files)
    digest = content_digest(path, entries)
    meta = {"kind": "dataset", "name": name, "digest": digest, "published": _now()}
    transfer = store.push_files(files, f"datasets/{name}/{digest}", meta=meta, entries=entries, progress=progress,
                                desc=name)
    store.put_bytes(f"datasets/{name}/{LATEST_NAME}", digest.encode())
    return digest, transfer


def resolve_digest(store: S3Store, name: str, digest: str | None = None) -> str:
    """The full digest for ``digest`` (a unique prefix is enough), or the one ``LATEST`` names."""
    if not digest:
        latest = store.get_bytes(f"datasets/{name}/{LATEST_NAME}", missing_ok=True)
        if latest is None:
            raise StorageError(f"no dataset '{name}' is published at {store.uri(f'datasets/{name}/')} "
                               f"({store.endpoint}); `faceops data push {name}` publishes it, `faceops data ls` "
                               "lists what is there.")
        return latest.decode().strip()
    published = store.list_dirs(f"datasets/{name}")
    matches = [d for d in published if d.startswith(digest)]
    if len(matches) != 1:
        what = "matches no" if not matches else "is ambiguous among the"
        raise StorageError(f"digest '{digest}' {what} published versions of dataset '{name}' at "
                           f"{store.uri(f'datasets/{name}/')}: {', '.join(d[:12] for d in published) or 'none'}.")
    return matches[0]


def pull_dataset(store: S3Store, name: str, dest: Path, *, digest: str | None = None,
                 progress: bool = True) -> tuple[str, Transfer]:
    """Fetch dataset ``name`` (``LATEST``, or the version ``digest`` names) into ``dest``."""
    digest = resolve_digest(store, name, digest)
    transfer = store.pull_dir(f"datasets/{name}/{digest}", dest, progress=progress, desc=name)
    info = dest / "dataset.json"
    if info.is_file() and json.loads(info.read_text()).get("digest") != digest:
        raise StorageError(f"{info}: its digest is not {digest[:12]} after the pull; the published index and its "
                           "dataset.json disagree, publish the dataset again.")
    return digest, transfer


def run_id(root: Path) -> str:
    """What a publication of models or reports is filed under: the git commit (12 hex digits), with
    ``-dirty-<UTC time>`` when tracked files have changes; just the UTC time outside git."""
    from tasks.tracking import git_commit

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    commit = git_commit(root)
    if commit == "unknown":
        return stamp
    if commit.endswith("-dirty"):
        return f"{commit[:12]}-dirty-{stamp}"
    return commit[:12]


def _model_dirs(path: Path) -> list[Path]:
    """``path`` itself when it is a model (a file, or a directory with config.json), else every model below it."""
    if path.is_file() or (path / "config.json").is_file():
        return [path]
    return sorted(p.parent for p in path.rglob("config.json"))


def publish(store: S3Store, root: Path, targets: Sequence[Path], *, run: str,
            progress: bool = True) -> list[Transfer]:
    """Models (paths below ``models/``) each to ``models/<path below models/>/<run>/``; everything else
    (``reports/benchmark.md``, ``metrics/``, ``plots/``, ...) together to ``reports/<run>/<repo-relative path>``."""
    root = Path(os.path.abspath(root))
    models: list[tuple[str, Path]] = []
    report_files: dict[str, Path] = {}
    for target in targets:
        path = Path(os.path.abspath(root / target))  # normalised, symlinks kept: models/ may live on another disk
        if not path.exists():
            raise DataError(f"{target}: no such file or directory to publish.")
        if not path.is_relative_to(root):
            raise DataError(f"{target}: outside the repository {root}; publish models/, reports/, metrics/, plots/.")
        rel = path.relative_to(root)
        if rel.parts[:1] == ("models",):
            found = _model_dirs(path)
            if not found:
                raise DataError(f"{target}: no model below it (a model directory has config.json).")
            models += [(d.relative_to(root / "models").as_posix(), d) for d in found]
        else:
            report_files.update({(rel / sub).as_posix() if path.is_dir() else rel.as_posix(): p
                                 for sub, p in local_files(path).items()})
    transfers = []
    for name, path in models:
        meta = {"kind": "model", "name": name, "run": run, "published": _now()}
        transfers.append(store.push_dir(path, f"models/{name}/{run}", meta=meta, progress=progress))
    if report_files:
        meta = {"kind": "report", "run": run, "published": _now()}
        transfers.append(store.push_files(report_files, f"reports/{run}", meta=meta, progress=progress))
    return transfers


@dataclass(frozen=True)
class Published:
    """One published directory: ``kind`` datasets|models|reports, ``name`` (dataset name or model path; empty for
    reports), ``version`` (digest or run id)."""

    kind: str
    name: str
    version: str
    files: int
    bytes: int
    modified: datetime
    latest: bool = False


def catalog(store: S3Store) -> list[Published]:
    """Every complete publication (a directory with an index) under datasets/, models/ and reports/."""
    found: list[Published] = []
    for kind in ("datasets", "models", "reports"):
        objects = store.list(f"{kind}/")
        dirs = {o.rel[: -len(INDEX_NAME) - 1] for o in objects if o.rel.endswith(f"/{INDEX_NAME}")}
        latest = {o.rel.split("/")[1]: store.get_bytes(o.rel, missing_ok=True) for o in objects
                  if kind == "datasets" and o.rel.count("/") == 2 and o.rel.endswith(f"/{LATEST_NAME}")}
        totals: dict[str, list[Any]] = {d: [0, 0, None] for d in dirs}
        for o in objects:
            owner = next((str(p) for p in PurePosixPath(o.rel).parents if str(p) in dirs), None)
            if owner is not None:
                t = totals[owner]
                t[0] += 1
                t[1] += o.size
                t[2] = max(t[2], o.modified) if t[2] else o.modified
        for d in sorted(dirs):
            parts = d.split("/")
            name, version = "/".join(parts[1:-1]), parts[-1]
            is_latest = (latest.get(name) or b"").decode().strip() == version
            found.append(Published(kind, name, version, totals[d][0] - 1, totals[d][1], totals[d][2], is_latest))
    return found


# ── the same bucket as DVC remote and MLflow artifact store ──────────────────────────────────────────────────


def dvc_remote_commands(cfg: StorageConfig, name: str = "faceops") -> list[list[str]]:
    """``dvc remote`` commands that make ``s3://bucket/prefix/dvc`` the default remote in ``.dvc/config.local``
    (not committed: the endpoint is machine-specific; credentials stay in the environment)."""
    store_url = f"s3://{require_bucket(cfg).bucket}/{cfg.prefix + '/' if cfg.prefix else ''}dvc"
    commands = [["remote", "add", "--local", "--default", "--force", name, store_url]]
    endpoint = resolve_endpoint(cfg)
    if endpoint:
        commands.append(["remote", "modify", "--local", name, "endpointurl", endpoint])
    if cfg.region:
        commands.append(["remote", "modify", "--local", name, "region", cfg.region])
    return commands


def configure_dvc_remote(cfg: StorageConfig, root: Path, name: str = "faceops") -> list[list[str]]:
    """Run :func:`dvc_remote_commands` in ``root``; returns them. A failing command raises naming it."""
    commands = dvc_remote_commands(cfg, name)
    for args in commands:
        out = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, capture_output=True, text=True,
                             env={**os.environ, "DVC_NO_ANALYTICS": "1"})
        if out.returncode != 0:
            raise StorageError(redact(f"`dvc {' '.join(args)}` failed in {root}: {out.stderr.strip() or out.stdout}"))
    return commands


def mlflow_artifacts(cfg: StorageConfig) -> tuple[str, dict[str, str]]:
    """The ``--artifacts-destination`` for an MLflow server on the same bucket, and the environment it needs."""
    endpoint = resolve_endpoint(cfg)
    env = {"MLFLOW_S3_ENDPOINT_URL": endpoint} if endpoint else {}
    return f"s3://{require_bucket(cfg).bucket}/{cfg.prefix + '/' if cfg.prefix else ''}mlflow", env


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
