"""examples/kubernetes/: the PyTorchJob and the JobSet, parsed and checked field by field
against what they drive: the ``PET_*`` names ``elastic run`` reads, the health endpoint's
routes, the elastic policy against ``--nnodes``, and a dry run of ``elastic run`` with
each pod's environment (the PyTorchJob's with what the training operator adds)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from elastic.cli.run import run_command
from elastic.core.watchdog.health import HealthServer, Readiness
from elastic.harness.commands import REPO, run_elastic, write_script
from elastic.testing.ports import free_port

MANIFESTS = REPO / "examples" / "kubernetes"
DEFAULT_PREEMPTION_GRACE = 25.0


def load(name: str) -> dict[str, Any]:
    (doc,) = list(yaml.safe_load_all((MANIFESTS / name).read_text()))
    assert isinstance(doc, dict)
    return doc


def cli_envvars() -> set[str]:
    names: set[str] = set()
    for param in run_command.params:
        envvar = getattr(param, "envvar", None)
        names.update([envvar] if isinstance(envvar, str) else envvar or [])
    return names


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    if doc["kind"] == "PyTorchJob":
        spec: dict[str, Any] = doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
        return spec
    (rjob,) = doc["spec"]["replicatedJobs"]
    spec = rjob["template"]["spec"]["template"]["spec"]
    return spec


def launcher(doc: dict[str, Any]) -> dict[str, Any]:
    (container,) = [
        c for c in pod_spec(doc)["containers"] if c["command"][:2] == ["elastic", "run"]
    ]
    return container


def env_of(container: dict[str, Any]) -> dict[str, str]:
    """The container's variables; a downward-API one reads as ``<fieldRef>``."""
    return {e["name"]: e.get("value", "<fieldRef>") for e in container.get("env", [])}


def operator_env(doc: dict[str, Any]) -> dict[str, str]:
    """What the training operator adds from elasticPolicy (training-operator v1.8's
    ElasticEnvVarGenerator) to a PyTorchJob's pods; a JobSet adds nothing."""
    if doc["kind"] != "PyTorchJob":
        return {}
    policy = doc["spec"]["elasticPolicy"]
    name = doc["metadata"]["name"]
    return {
        "PET_RDZV_ENDPOINT": f"{policy.get('rdzvHost', f'{name}-worker-0')}:{policy['rdzvPort']}",
        "PET_RDZV_BACKEND": policy.get("rdzvBackend", "c10d"),
        "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
        "PET_MAX_RESTARTS": str(policy["maxRestarts"]),
        "PET_RDZV_ID": policy["rdzvId"],
        "PET_NPROC_PER_NODE": doc["spec"]["nprocPerNode"],
    }


MANIFEST_NAMES = ["pytorchjob.yaml", "jobset.yaml"]


def test_the_resources_are_the_ones_the_operators_serve() -> None:
    job, jobset = load("pytorchjob.yaml"), load("jobset.yaml")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    # The training operator finds its container by this name.
    assert launcher(job)["name"] == "pytorch"


@pytest.mark.parametrize("name", MANIFEST_NAMES)
def test_every_pet_variable_is_one_elastic_run_reads(name: str) -> None:
    doc = load(name)
    known = cli_envvars()
    assert "PET_NNODES" in known and "PET_HEALTH_PORT" in known  # the reader works
    env = {**env_of(launcher(doc)), **operator_env(doc)}
    unknown = sorted(n for n in env if n.startswith("PET_") and n not in known)
    assert unknown == [], f"{name}: elastic run reads no {unknown}"
    duplicated = set(env_of(launcher(doc))) & set(operator_env(doc))
    assert not duplicated, f"{name}: set by the operator already: {duplicated}"


@pytest.mark.parametrize("name", MANIFEST_NAMES)
def test_the_probes_ask_our_endpoint_on_our_port(name: str) -> None:
    container = launcher(load(name))
    port = int(env_of(container)["PET_HEALTH_PORT"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    server = HealthServer(
        free_port(),
        lambda: Readiness(False, "x"),
        lambda: [],
        liveness=lambda: Readiness(True, "y"),
    )
    try:
        probes = {kind: container[kind]["httpGet"] for kind in ("livenessProbe", "readinessProbe")}
        assert probes["livenessProbe"]["path"] == "/healthz"
        assert probes["readinessProbe"]["path"] == "/readyz"  # never blocks the rendezvous
        for probe in probes.values():
            probe_port = probe["port"]
            assert ports.get(probe_port, probe_port) == port, probe
            assert server.respond(probe["path"])[0] == 200, probe["path"]  # a route we serve
    finally:
        server.stop()


@pytest.mark.parametrize("name", MANIFEST_NAMES)
def test_the_grace_period_outlasts_the_checkpoint_on_notice(name: str) -> None:
    doc = load(name)
    grace = float(env_of(launcher(doc)).get("PET_PREEMPTION_GRACE", DEFAULT_PREEMPTION_GRACE))
    assert pod_spec(doc)["terminationGracePeriodSeconds"] > grace


def test_the_elastic_policy_holds_the_replicas() -> None:
    job = load("pytorchjob.yaml")
    policy = job["spec"]["elasticPolicy"]
    replicas = job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]
    assert policy["rdzvBackend"] == "c10d"
    assert 1 <= policy["minReplicas"] <= replicas <= policy["maxReplicas"]
    assert not any(a.startswith("--nnodes") for a in launcher(job)["command"])


def test_the_jobset_pods_match_nnodes_and_the_endpoint() -> None:
    jobset = load("jobset.yaml")
    assert jobset["spec"]["network"]["publishNotReadyAddresses"] is True
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True
    (rjob,) = jobset["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    env = env_of(launcher(jobset))
    nodes = int(env["PET_NNODES"]) * rjob["replicas"]
    assert job["parallelism"] == job["completions"] == nodes
    # The first pod's DNS name through the JobSet's headless Service (subdomain: its name).
    name = jobset["metadata"]["name"]
    host, _, port = env["PET_RDZV_ENDPOINT"].rpartition(":")
    assert host == f"{name}-{rjob['name']}-0-0.{name}"
    c10d = {p["name"]: p["containerPort"] for p in launcher(jobset)["ports"]}["c10d"]
    assert int(port) == c10d


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", MANIFEST_NAMES)
def test_elastic_run_takes_the_pods_environment(name: str, tmp_path: Path) -> None:
    doc = load(name)
    container = launcher(doc)
    env = {**env_of(container), **operator_env(doc)}
    env = {k: (doc["metadata"]["name"] if v == "<fieldRef>" else v) for k, v in env.items()}
    env["PET_HEALTH_PORT"] = str(free_port())  # a dry run binds nothing, but stay clear
    script = write_script(tmp_path, "train.py", "pass\n")
    args = [str(script) if a == "train.py" else a for a in container["command"][2:]]
    clean = {k: "" for k in os.environ if k.startswith("PET_")}
    proc = run_elastic("run", "--dry-run", *args, env={**clean, **env})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"nodes:          {env['PET_NNODES']}" in out, out
    assert f"endpoint:       {env['PET_RDZV_ENDPOINT']}" in out, out
    assert f"run id:         {doc['metadata']['name']}" in out, out
