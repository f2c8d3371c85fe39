"""infra/: the team deployment's compose file, worker image and Kubernetes GPU work-pool template, checked at the
level `docker compose config` and Prefect's work-pool validation check them, without a container engine.
`docker compose config` itself runs when a docker binary with the compose plugin is installed."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from faceops.stack import compose as local
from faceops.stack.compose import VARIABLE, interpolate

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
COMPOSE = INFRA / "docker-compose.yml"
ENV_EXAMPLE = INFRA / ".env.example"
DOCKERFILE = INFRA / "Dockerfile"
TEMPLATE = INFRA / "k8s" / "gpu-work-pool.json"

SECRET_KEY = re.compile(r"PASSWORD|SECRET|TOKEN|ACCESS_KEY")
SERVICE_KEYS = {  # the compose specification's service attributes
    "annotations", "attach", "blkio_config", "build", "cap_add", "cap_drop", "cgroup", "cgroup_parent", "command",
    "configs", "container_name", "cpu_count", "cpu_percent", "cpu_period", "cpu_quota", "cpu_rt_period",
    "cpu_rt_runtime", "cpu_shares", "cpus", "cpuset", "credential_spec", "depends_on", "deploy", "develop",
    "device_cgroup_rules", "devices", "dns", "dns_opt", "dns_search", "domainname", "entrypoint", "env_file",
    "environment", "expose", "extends", "external_links", "extra_hosts", "gpus", "group_add", "healthcheck",
    "hostname", "image", "init", "ipc", "isolation", "labels", "links", "logging", "mac_address", "mem_limit",
    "mem_reservation", "mem_swappiness", "memswap_limit", "network_mode", "networks", "oom_kill_disable",
    "oom_score_adj", "pid", "pids_limit", "platform", "ports", "post_start", "pre_stop", "privileged", "profiles",
    "pull_policy", "read_only", "restart", "runtime", "scale", "secrets", "security_opt", "shm_size", "stdin_open",
    "stop_grace_period", "stop_signal", "storage_opt", "sysctls", "tmpfs", "tty", "ulimits", "user", "userns_mode",
    "uts", "volumes", "volumes_from", "working_dir",
}
HEALTHCHECK_KEYS = {"test", "interval", "timeout", "retries", "start_period", "start_interval", "disable"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def example_env() -> dict[str, str]:
    pairs = (line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines() if "=" in line
             and not line.lstrip().startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _compose_lines() -> str:
    """The compose file without its comment lines (what compose interpolates)."""
    return "\n".join(line for line in COMPOSE.read_text().splitlines() if not line.lstrip().startswith("#"))


# ── docker-compose.yml ────────────────────────────────────────────────────────────────────────────────────────────


def test_compose_has_the_deployment_services(compose):
    assert {"postgres", "minio", "minio-init", "mlflow", "prefect-server", "cpu-worker", "gpu-worker", "ray-head",
            "ray-gpu-node"} <= set(compose["services"])
    assert set(compose) <= {"name", "services", "volumes", "networks", "configs", "secrets"} | {
        k for k in compose if k.startswith("x-")}


def test_services_use_only_compose_attributes(compose):
    for name, service in compose["services"].items():
        assert set(service) <= SERVICE_KEYS, f"{name}: unknown keys {set(service) - SERVICE_KEYS}"
        assert "image" in service or "build" in service, name
        assert service.get("restart", "no") in ("no", "always", "on-failure", "unless-stopped"), name
        if "healthcheck" in service:
            check = service["healthcheck"]
            assert set(check) <= HEALTHCHECK_KEYS, name
            assert check["test"][0] in ("CMD", "CMD-SHELL"), name
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if not source.startswith((".", "/")):
                assert source in (compose.get("volumes") or {}), f"{name}: undeclared named volume {source}"
            elif source.startswith("."):
                assert (COMPOSE.parent / source).exists(), f"{name}: bind-mounted {source} does not exist"


def test_dependencies_are_services_and_wait_for_health(compose):
    services = compose["services"]
    for name, service in services.items():
        for dep, spec in (service.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on {dep!r}, which is not a service"
            condition = spec["condition"]
            assert condition in ("service_healthy", "service_completed_successfully"), (name, dep, condition)
            if condition == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}'s health, but {dep} has no healthcheck"
            else:
                assert services[dep].get("restart") == "no", f"{dep} is waited on to finish but restarts"
    order: list[str] = []  # a topological order exists: no dependency cycle
    pending = dict(services)
    while pending:
        ready = [n for n, s in pending.items() if set(s.get("depends_on") or {}) <= set(order)]
        assert ready, f"dependency cycle among {sorted(pending)}"
        order += ready
        for n in ready:
            del pending[n]
    assert order.index("postgres") < order.index("mlflow") < order.index("cpu-worker")


def test_long_running_services_have_healthchecks(compose):
    for name, service in compose["services"].items():
        if service.get("restart") != "no":
            assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"


def test_servers_store_in_postgres_and_minio(compose):
    mlflow = _env(compose["services"]["mlflow"])
    assert mlflow["MLFLOW_BACKEND_STORE_URI"].startswith("postgresql://")
    assert "@postgres:5432/mlflow" in mlflow["MLFLOW_BACKEND_STORE_URI"]
    assert mlflow["MLFLOW_ARTIFACTS_DESTINATION"].startswith("s3://")
    assert mlflow["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    prefect = _env(compose["services"]["prefect-server"])
    assert prefect["PREFECT_SERVER_DATABASE_DRIVER"] == "postgresql+asyncpg"
    assert prefect["PREFECT_SERVER_DATABASE_HOST"] == "postgres" and prefect["PREFECT_SERVER_DATABASE_NAME"] == "prefect"
    init = (INFRA / "postgres" / "init.sql").read_text()
    for database in ("mlflow", "prefect", "optuna"):
        assert f"CREATE DATABASE {database};" in init


def test_workers_poll_their_pools_and_the_gpu_worker_reserves_nvidia_gpus(compose):
    services = compose["services"]
    for name, pool in (("cpu-worker", "cpu"), ("gpu-worker", "gpu")):
        command = services[name]["command"]
        assert command[:3] == ["prefect", "worker", "start"]
        assert command[command.index("--pool") + 1] == pool
        env = _env(services[name])
        assert env["PREFECT_API_URL"] == "http://prefect-server:4200/api"
        assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    devices = services["gpu-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert "deploy" not in services["cpu-worker"]


def test_the_ray_cluster_joins_its_head_and_the_workers_flows_find_it(compose):
    """`faceops launch` places training nodes on the Ray cluster: a head that takes no work, GPU nodes joining it
    with every GPU of their host, and the Prefect workers' flow runs told where it is."""
    head, node = compose["services"]["ray-head"], compose["services"]["ray-gpu-node"]
    assert head["command"][:3] == ["ray", "start", "--head"] and "--num-cpus" in head["command"]
    assert node["command"][:3] == ["ray", "start", "--address"] and "ray-head:6379" in node["command"][3]
    assert node["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert head["profiles"] == node["profiles"] == ["ray"]
    for worker in ("cpu-worker", "gpu-worker"):
        assert "ray-head:6379" in _env(compose["services"][worker])["RAY_ADDRESS"]


def test_no_literal_secrets_in_compose(compose, example_env):
    text = COMPOSE.read_text()  # comments included: no secret in a comment either
    for name, service in compose["services"].items():
        for key, value in _env(service).items():
            if SECRET_KEY.search(key):
                assert VARIABLE.fullmatch(value), f"{name}: {key} must come from ${{VAR}}, not a literal"
    for key, value in example_env.items():
        if SECRET_KEY.search(key):
            assert value not in text, f"the example value of {key} is written into the compose file"
    masked = VARIABLE.sub("VAR", text)
    for credentials in re.findall(r"://[^\s/@:]+:([^\s/@]+)@", masked):  # user:password@ in URLs
        assert credentials == "VAR", f"a literal password in a URL: {credentials}"


def test_every_variable_is_documented_or_defaulted(compose, example_env):
    for m in VARIABLE.finditer(_compose_lines()):
        name, op = m.group(1), m.group(2) or ""
        if op.endswith("?") or not op:
            assert name in example_env, f"${{{name}}} is required but not in infra/.env.example"
        else:
            assert op.endswith("-")
    assert ".env" in (INFRA / ".gitignore").read_text().split(), "infra/.env (real secrets) must be git-ignored"


def test_published_ports_bind_to_loopback(compose, example_env):
    published = 0
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            for env in ({}, example_env):  # the file's defaults, and the documented settings
                host_ip = interpolate(str(port), env).rsplit(":", 2)[0]
                assert host_ip == "127.0.0.1", f"{name} publishes {port} on {host_ip!r}"
            published += 1
    assert published >= 4  # prefect, mlflow, minio (API + console)


# ── faceops stack: the compose file's services as local processes ──────────────────────────────────────────────


def test_every_compose_service_has_a_local_counterpart_or_a_reason(compose):
    """`faceops stack` wraps the compose file: a service added there must be given its local stand-in."""
    assert set(compose["services"]) == set(local.LOCAL), (
        f"faceops/stack/compose.py LOCAL lacks {set(compose['services']) - set(local.LOCAL)} "
        f"and names {set(local.LOCAL) - set(compose['services'])} the file does not have")
    for name, (runs, _) in local.LOCAL.items():
        if runs:  # its command runs as a local process: an entry point this interpreter has as a module
            assert compose["services"][name]["command"][0] in ("mlflow", "prefect"), name


def test_the_local_stack_runs_the_compose_commands_made_local(tmp_path):
    """A flag added to a service's compose command reaches the local process; host, port and the container-only
    flags are the local stack's; defaults and pools come from the file."""
    text = COMPOSE.read_text()
    text = text.replace('"--workers", "2"]', '"--workers", "2", "--gunicorn-opts", "--timeout=90"]')
    text = text.replace('"--pool", "gpu"', '"--pool", "accel"')
    text = text.replace("${MLFLOW_PORT:-5000}:5000", "${MLFLOW_PORT:-5123}:5000")
    (tmp_path / "infra").mkdir()
    (tmp_path / "infra" / "docker-compose.yml").write_text(text)
    mlflow = local.local_command("mlflow", {}, tmp_path, port="5100")
    assert mlflow[1:] == ["-m", "mlflow", "server", "--host", "127.0.0.1", "--port", "5100", "--workers", "1",
                          "--gunicorn-opts", "--timeout=90"]
    worker = local.local_command(local.worker_service("cpu", tmp_path), {"CPU_WORKER_LIMIT": "7"}, tmp_path)
    assert worker[1:] == ["-m", "prefect", "worker", "start", "--pool", "cpu", "--type", "process",
                          "--name", "cpu-worker"]  # no --limit 7, no --with-healthcheck
    assert local.pools(tmp_path) == ("cpu", "accel")
    assert local.published_port("mlflow", {}, tmp_path) == 5123
    assert local.published_port("mlflow", {"MLFLOW_PORT": "5200"}, tmp_path) == 5200
    with pytest.raises(local.StackError, match="names no host port"):
        local.published_port("mlflow", {"MLFLOW_PORT": "five"}, tmp_path)
    assert local.quiet_env(tmp_path)["DO_NOT_TRACK"] == "1"


def test_the_local_pools_are_the_deployments_pools():
    prefect = yaml.safe_load((REPO / "prefect.yaml").read_text())
    assert set(local.pools()) == {p["name"] for p in prefect["definitions"]["work_pools"].values()}


def test_a_broken_compose_file_is_one_error_naming_it(tmp_path):
    (tmp_path / "infra").mkdir()
    (tmp_path / "infra" / "docker-compose.yml").write_text("services: [\n")
    with pytest.raises(local.StackError, match="docker-compose.yml: cannot read"):
        local.compose(tmp_path)
    with pytest.raises(local.StackError, match="has no Prefect worker for pool 'tpu'"):
        local.worker_service("tpu")


def test_docker_compose_config_accepts_the_file(tmp_path):
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker binary: the YAML-level checks above stand in for `docker compose config`")
    if subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30).returncode != 0:
        pytest.skip("docker is installed without the compose plugin: `docker compose config` cannot run")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("POSTGRES_", "MINIO_"))}
    base = [docker, "compose", "-f", str(COMPOSE), "--profile", "gpu"]
    ok = subprocess.run(base + ["--env-file", str(ENV_EXAMPLE), "config", "--quiet"], env=env, capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    empty = tmp_path / "empty.env"
    empty.write_text("")
    # a missing secret stops compose with the file's own message, which says where to set it
    missing = subprocess.run(base + ["--env-file", str(empty), "config", "--quiet"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "in infra/.env" in missing.stderr


# ── Dockerfile ────────────────────────────────────────────────────────────────────────────────────────────────────

VALUE_OPTIONS = {"--index-url", "-i", "--extra-index-url", "-c", "--constraint", "-r", "--requirement", "--python"}
HOW_ONLY = {"--quiet", "-q", "--no-compile", "--compile", "--compile-bytecode", "-e", "--editable", "--no-cache-dir", "--python"}


def _pip_installs(text: str) -> list[tuple[set[str], list[str]]]:
    """(options, targets) of every ``pip install`` (or ``uv pip install``) in a Makefile or Dockerfile, in order."""
    out = []
    for line in text.splitlines():
        if "pip install" not in line or line.lstrip().startswith("#"):
            continue
        tokens = shlex.split(line.split("pip install", 1)[1].split("&&")[0])
        options, targets, skip = set(), [], False
        for i, token in enumerate(tokens):
            if skip:
                skip = False
            elif token.startswith("-"):
                options.add(token)
                skip = token in VALUE_OPTIONS
            else:
                targets.append(token)
        out.append((options, targets))
    return out


def test_dockerfile_installs_torch_first_then_the_project_as_the_makefile_does():
    make = _pip_installs((REPO / "Makefile").read_text())
    docker = _pip_installs(DOCKERFILE.read_text())
    make_torch = next(i for i, (_, t) in enumerate(make) if any(x.startswith("torch==") for x in t))
    make_project = next(i for i, (_, t) in enumerate(make) if any(x.split("[")[0] == "." for x in t))
    docker_torch = next(i for i, (_, t) in enumerate(docker) if any(x.startswith("torch==") for x in t))
    docker_project = next(i for i, (_, t) in enumerate(docker) if "." in t)
    assert make_torch < make_project and docker_torch < docker_project
    torch_pin = [x for x in make[make_torch][1] if x.startswith("torch==")]
    assert docker[docker_torch][1] == torch_pin  # the same pin, e.g. torch==2.13.0 (the Makefile adds uv beside it)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"{torch_pin[0]}"' in pyproject
    # the project line is the Makefile's, except for options that change only how, not what, is installed:
    # no editable install (an image has no checkout to edit), bytecode compiled (its user cannot write it later)
    assert docker[docker_project][0] - HOW_ONLY == make[make_project][0] - HOW_ONLY
    assert docker[docker_project][1] == ["."]


def test_dockerfile_base_and_build_context():
    text = DOCKERFILE.read_text()
    base = re.search(r"^FROM\s+(\S+)", text, re.M).group(1)
    assert base.startswith("python:3.11") and "slim" in base
    assert 'requires-python = ">=3.11,<3.12"' in (REPO / "pyproject.toml").read_text()
    before_install = text.split("pip install --quiet .")[0]
    copied = {p for line in re.findall(r"^COPY\s+(.+)$", before_install, re.M) for p in line.split()[:-1]}
    for package in re.search(r"include = \[([^\]]+)\]", (REPO / "pyproject.toml").read_text()).group(1).split(","):
        assert package.strip().strip('"').rstrip("*") in copied, f"{package} is not copied before `pip install .`"
    ignored = (INFRA / "Dockerfile.dockerignore").read_text().split()
    for path in (".venv/", "mlflow.db", "infra/.env", ".faceops/", "data/"):
        assert path in ignored
    compose = yaml.safe_load(COMPOSE.read_text())
    args = set(re.findall(r"^ARG\s+(\w+)", text, re.M))
    for service in compose["services"].values():
        build = service.get("build") or {}
        assert set(build.get("args") or {}) <= args
        if build:
            assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE


# ── k8s/gpu-work-pool.json ────────────────────────────────────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def template() -> dict:
    return json.loads(TEMPLATE.read_text())


def test_work_pool_template_is_a_base_job_template(template):
    import jsonschema

    assert set(template) == {"job_configuration", "variables"}
    variables = template["variables"]
    assert variables["type"] == "object" and variables["properties"]
    jsonschema.Draft202012Validator.check_schema(variables)
    for name, schema in variables["properties"].items():
        if "default" in schema:
            jsonschema.validate(schema["default"], schema)  # every default fits its own schema
    used = {m.group(1) for m in re.finditer(r"{{\s*([\w.\-\[\]$]+)\s*}}", json.dumps(template["job_configuration"]))}
    assert used and used <= set(variables["properties"]), f"undeclared: {used - set(variables['properties'])}"
    from prefect.server.schemas.actions import validate_base_job_template

    validate_base_job_template(template)  # what the server runs on `prefect work-pool create --base-job-template`


def test_work_pool_jobs_request_nvidia_gpus(template):
    from prefect.utilities.templating import apply_values

    defaults = {k: v["default"] for k, v in template["variables"]["properties"].items() if "default" in v}
    for gpus in (None, 4):
        values = defaults if gpus is None else {**defaults, "gpu_count": gpus}
        job = apply_values(template["job_configuration"], values)["job_manifest"]
        assert job["kind"] == "Job" and job["metadata"]["namespace"] == "faceops"
        pod = job["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == (gpus or 1)
        assert container["image"] == defaults["image"]
        assert container["envFrom"][0]["secretRef"]["name"] == "faceops-credentials"
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
