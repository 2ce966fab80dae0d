"""deploy/kubernetes/: the Helm chart, the plain manifests rendered from it, and the example workload.

No cluster here: the chart is rendered with helm (scripts/install.sh test puts helm 3 in .venv/bin), every object
is linted (yamllint, deploy/kubernetes/.yamllint) and checked against Kubernetes' own schemas
(kubernetes-validate, strict: unknown fields fail), and the design is asserted field by field (the holder,
the daemon, their shared host paths, the grace period, the credentials), so that a change of the chart that
breaks what docs/KUBERNETES.md promises fails here. tests/podman_pod.py, which runs these containers under
podman, is tested on the same rendered manifests.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from podman_pod import PodmanRun, Unsupported, find, podman_run
from yamllint import config as yamllint_config
from yamllint import linter

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "kubernetes"
CHART = K8S / "chart" / "ckptfs"
MANIFESTS = K8S / "manifests"
EXAMPLE_JOB = K8S / "examples" / "checkpoint-job.yaml"
NAMESPACE = "ckptfs-system"

Obj = dict[str, Any]

# Kubernetes 1.34 (the brief's floor) and the newest the installed kubernetes-validate ships schemas for.
K8S_VERSIONS = sorted({"1.34.0", kubernetes_validate.latest_version()})

# Values that turn on each optional part of the chart; each rendering is linted, validated and checked.
VARIANTS: dict[str, list[str]] = {
    "default": [],
    "capabilities": ["daemon.privileged=false"],
    "irsa": ["credentials.awsRoleArn=arn:aws:iam::123456789012:role/ckptfs"],
    "gke": ["credentials.gcpServiceAccount=ckptfs@my-project.iam.gserviceaccount.com"],
    "azure": ["credentials.azureClientId=00000000-0000-0000-0000-000000000000",
              "config.env.AZURE_STORAGE_ACCOUNT=myaccount", "source=az://checkpoints/run-1"],
    "secret": ["credentials.secretName=ckptfs-credentials"],
    "gcp-key": ["credentials.gcpKeySecret.name=ckptfs-gcp-key", "source=gs://my-bucket/run-1"],
    "toml": ["config.toml=keep_last = 3\ncommit_markers = [\"latest\", \"*.done\"]\n",
             "config.env.CKPTFS_CACHE_SIZE=200G"],
    "monitoring": ["metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=prometheus",
                   "criticalPodsQuota.enabled=true"],
    "gpu-nodes": ["nodeSelector.nvidia\\.com/gpu\\.present=true"],
}
# Every credential at once: the holder must still get none of them.
ALL_CREDENTIALS = [*VARIANTS["irsa"], *VARIANTS["gke"], *VARIANTS["azure"], *VARIANTS["secret"],
                   *VARIANTS["gcp-key"]]

PRIORITY_VALUES = {"system-node-critical": 2000001000, "system-cluster-critical": 2000000000}


# -- rendering -------------------------------------------------------------------------------------------------

def _helm() -> str:
    for candidate in (os.environ.get("HELM"), str(REPO / ".venv" / "bin" / "helm"), shutil.which("helm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail("no helm: `bash scripts/install-helm.sh` installs helm 3.18.0 as .venv/bin/helm "
                "(scripts/install.sh test does it)")


def _set_args(values: Sequence[str]) -> list[str]:
    args = []
    for value in values:
        key, _, text = value.partition("=")
        # The TOML file's newlines and commas need --set-literal; maps of strings (environment, labels, node
        # selector) --set-string, so that "true" stays a string; the rest is typed as values.schema.json says.
        if "\n" in text or "," in text:
            flag = "--set-literal"
        elif key.startswith(("config.env.", "nodeSelector.")) or ".labels." in key:
            flag = "--set-string"
        else:
            flag = "--set"
        args += [flag, f"{key}={text}"]
    return args


@functools.cache
def render_text(*values: str) -> str:
    result = subprocess.run(
        [_helm(), "template", "ckptfs", str(CHART), "--namespace", NAMESPACE, *_set_args(values)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def render(*values: str) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(render_text(*values)) if doc]


def render_error(*values: str) -> str:
    result = subprocess.run(
        [_helm(), "template", "ckptfs", str(CHART), "--namespace", NAMESPACE, *_set_args(values)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0, f"helm rendered {values} without an error"
    return result.stderr


def render_notes(tmp_path: Path, *values: str) -> str:
    """NOTES.txt as `helm install` prints it (which needs a cluster): rendered through tpl in a copy of the chart."""
    chart = tmp_path / "notes-chart"
    shutil.rmtree(chart, ignore_errors=True)
    shutil.copytree(CHART, chart)
    (chart / "NOTES.txt").write_text((chart / "templates" / "NOTES.txt").read_text())
    (chart / "templates" / "notes.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n'
        '  notes: {{ tpl (.Files.Get "NOTES.txt") . | quote }}\n')
    result = subprocess.run([_helm(), "template", "ckptfs", str(chart), "--namespace", NAMESPACE,
                             "--show-only", "templates/notes.yaml", *_set_args(values)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    notes: str = yaml.safe_load(result.stdout)["data"]["notes"]
    return notes


def plain_manifests() -> list[Obj]:
    docs: list[Obj] = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def example_job() -> Obj:
    [job] = [doc for doc in yaml.safe_load_all(EXAMPLE_JOB.read_text()) if doc]
    return job


# -- accessors -------------------------------------------------------------------------------------------------

def get(objs: Sequence[Obj], kind: str, name: str) -> Obj:
    obj = find(objs, kind, name)
    assert obj is not None, f"no {kind}/{name}"
    return dict(obj)


def pod_spec(workload: Obj) -> Obj:
    spec: Obj = workload["spec"]["template"]["spec"]
    return spec


def container(workload: Obj, name: str | None = None) -> Obj:
    containers = pod_spec(workload)["containers"]
    if name is None:
        assert len(containers) == 1
        return dict(containers[0])
    [found] = [c for c in containers if c["name"] == name]
    return dict(found)


def volume(workload: Obj, name: str) -> Obj:
    [found] = [v for v in pod_spec(workload).get("volumes", []) if v["name"] == name]
    return dict(found)


def mount_of(workload: Obj, c: Obj, host_path: str) -> Obj:
    """The volumeMount of container c whose volume is the hostPath host_path."""
    names = {v["name"] for v in pod_spec(workload).get("volumes", []) if v.get("hostPath", {}).get("path") == host_path}
    [found] = [m for m in c.get("volumeMounts", []) if m["name"] in names]
    return dict(found)


def holder(objs: Sequence[Obj]) -> Obj:
    return get(objs, "DaemonSet", "ckptfs-holder")


def daemon(objs: Sequence[Obj]) -> Obj:
    return get(objs, "DaemonSet", "ckptfs")


def daemon_env(objs: Sequence[Obj]) -> dict[str, str]:
    """The daemon container's environment from its ConfigMap(s) and env (Kubernetes' precedence)."""
    c = container(daemon(objs), "ckptfs")
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        if "configMapRef" in source:
            env.update(get(objs, "ConfigMap", source["configMapRef"]["name"])["data"])
    env.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
    return env


def all_containers(obj: Obj) -> Iterator[tuple[Obj, Obj]]:
    if obj.get("kind") in ("DaemonSet", "Deployment", "StatefulSet", "Job"):
        for c in pod_spec(obj).get("containers", []) + pod_spec(obj).get("initContainers", []):
            yield pod_spec(obj), c


# -- helm, lint, schemas ---------------------------------------------------------------------------------------

def test_helm_is_helm_3() -> None:
    version = subprocess.run([_helm(), "version", "--short"], capture_output=True, text=True, check=True).stdout
    assert version.startswith("v3."), version


@pytest.mark.parametrize("variant", VARIANTS)
def test_chart_passes_helm_lint_strict(variant: str) -> None:
    result = subprocess.run([_helm(), "lint", "--strict", str(CHART), "--namespace", NAMESPACE,
                             *_set_args(VARIANTS[variant])], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_plain_manifests_are_the_chart_rendered_with_defaults(tmp_path: Path) -> None:
    """deploy/kubernetes/manifests/ is exactly what scripts/render-manifests.sh makes of the chart now."""
    result = subprocess.run(["bash", str(REPO / "scripts" / "render-manifests.sh"), str(tmp_path)],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "HELM": _helm()})
    assert result.returncode == 0, result.stderr
    rendered = {p.name: p.read_text() for p in tmp_path.glob("*.yaml")}
    committed = {p.name: p.read_text() for p in MANIFESTS.glob("*.yaml")}
    assert sorted(committed) == sorted(rendered), "run scripts/render-manifests.sh"
    for name in rendered:
        assert committed[name] == rendered[name], f"{name} differs from the chart: run scripts/render-manifests.sh"
    # and, as objects, the chart's default rendering plus the namespace
    assert [o for o in plain_manifests() if o["kind"] != "Namespace"] == render()
    assert get(plain_manifests(), "Namespace", NAMESPACE)


def _yamllint(text: str, name: str) -> list[str]:
    conf = yamllint_config.YamlLintConfig(file=str(K8S / ".yamllint"))
    return [f"{name}:{p.line}:{p.column}: {p.desc} ({p.rule})" for p in linter.run(text, conf)]


def test_yaml_files_pass_yamllint() -> None:
    files = [*MANIFESTS.glob("*.yaml"), EXAMPLE_JOB, CHART / "Chart.yaml", CHART / "values.yaml",
             K8S / ".yamllint"]
    problems = [p for f in files for p in _yamllint(f.read_text(), str(f.relative_to(REPO)))]
    assert problems == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_chart_passes_yamllint(variant: str) -> None:
    assert _yamllint(render_text(*VARIANTS[variant]), f"helm template ({variant})") == []


def _validate(obj: Obj, version: str) -> None:
    if obj["apiVersion"].startswith("monitoring.coreos.com/"):
        _check_service_monitor(obj)
        return
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} at {path}: {e.message}")


def _check_service_monitor(obj: Obj) -> None:
    """No schema ships for the Prometheus Operator's CRDs: the fields it needs, by hand."""
    assert obj["apiVersion"] == "monitoring.coreos.com/v1" and obj["kind"] == "ServiceMonitor"
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}
    spec = obj["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels", "podTargetLabels"}
    assert isinstance(spec["selector"]["matchLabels"], dict) and spec["selector"]["matchLabels"]
    assert spec["namespaceSelector"] == {"matchNames": [obj["metadata"]["namespace"]]}
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "relabelings", "scheme"}
        assert isinstance(endpoint["port"], str)
        for relabeling in endpoint.get("relabelings", []):
            assert set(relabeling) <= {"sourceLabels", "targetLabel", "action", "regex", "replacement"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_chart_matches_kubernetes_schemas(variant: str, version: str) -> None:
    for obj in render(*VARIANTS[variant]):
        _validate(obj, version)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_plain_manifests_and_example_match_kubernetes_schemas(version: str) -> None:
    for obj in [*plain_manifests(), example_job()]:
        _validate(obj, version)


# -- the design ------------------------------------------------------------------------------------------------

def test_plain_manifests_are_the_two_daemonsets_in_their_namespace() -> None:
    objs = plain_manifests()
    assert {(o["kind"], o["metadata"]["name"]) for o in objs} == {
        ("Namespace", NAMESPACE), ("ServiceAccount", "ckptfs"), ("ServiceAccount", "ckptfs-holder"),
        ("ConfigMap", "ckptfs-env"), ("Service", "ckptfs-metrics"), ("DaemonSet", "ckptfs-holder"),
        ("DaemonSet", "ckptfs"),
    }
    assert all(o["metadata"].get("namespace") == NAMESPACE for o in objs if o["kind"] != "Namespace")
    # kubectl apply -f takes files in name order: the namespace first, the pods' dependencies before them.
    names = sorted(p.name for p in MANIFESTS.glob("*.yaml"))
    assert names[0] == "00-namespace.yaml"
    assert names.index("40-daemonset-holder.yaml") > names.index("10-serviceaccount.yaml")
    assert names.index("50-daemonset.yaml") > names.index("20-configmap.yaml")


def test_holder_is_the_design() -> None:
    objs = render()
    h = holder(objs)
    spec, c = pod_spec(h), container(h, "holder")
    assert h["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert c["command"] == ["ckptfs", "holder"]
    # the mountpoint guarded until the daemon mounts it (a node's boot)
    assert c["args"] == ["--guard", daemon_env(objs)["CKPTFS_MOUNTPOINT"]]
    assert c["image"] == container(daemon(objs), "ckptfs")["image"]
    assert c["env"] == [{"name": "CKPTFS_RUNTIME_DIR", "value": "/run/ckptfs"}]
    assert c["securityContext"] == {"privileged": True}
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["terminationGracePeriodSeconds"] <= 60
    assert c["resources"]["requests"] == {"cpu": "10m", "memory": "32Mi"}
    assert c["resources"]["limits"] == {"memory": "128Mi"}
    # No probe may restart it: a restarted holder ends the mounts it holds.
    assert not {"livenessProbe", "readinessProbe", "startupProbe", "lifecycle"} & set(c)
    assert spec["serviceAccountName"] == "ckptfs-holder" and spec["automountServiceAccountToken"] is False
    account = get(objs, "ServiceAccount", "ckptfs-holder")
    assert account["automountServiceAccountToken"] is False and "annotations" not in account["metadata"]
    runtime = mount_of(h, c, "/run/ckptfs")
    assert runtime["mountPath"] == "/run/ckptfs"
    assert volume(h, runtime["name"])["hostPath"] == {"path": "/run/ckptfs", "type": "DirectoryOrCreate"}
    root = mount_of(h, c, "/mnt/ckptfs")
    assert root["mountPath"] == "/mnt/ckptfs" and root["mountPropagation"] == "Bidirectional"


@pytest.mark.parametrize("variant", [*VARIANTS, "all-credentials"])
def test_holder_never_gets_credentials(variant: str) -> None:
    objs = render(*(ALL_CREDENTIALS if variant == "all-credentials" else VARIANTS[variant]))
    h = holder(objs)
    spec, c = pod_spec(h), container(h, "holder")
    assert "envFrom" not in c
    assert [e["name"] for e in c["env"]] == ["CKPTFS_RUNTIME_DIR"]
    assert all(set(v) == {"name", "hostPath"} for v in spec["volumes"]), "only host paths: no Secret, no token"
    assert spec["serviceAccountName"] != pod_spec(daemon(objs))["serviceAccountName"]
    assert "annotations" not in get(objs, "ServiceAccount", spec["serviceAccountName"])["metadata"]
    assert not any(k.startswith("azure.workload.identity") for k in h["spec"]["template"]["metadata"]["labels"])


def test_daemon_is_the_design() -> None:
    objs = render()
    d = daemon(objs)
    spec, c = pod_spec(d), container(d, "ckptfs")
    rolling = {"maxUnavailable": 1, "maxSurge": 0}
    assert d["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": rolling}
    assert c["args"] == ["mount"] and "command" not in c
    assert c["securityContext"] == {"privileged": True}
    env = daemon_env(objs)
    assert env["CKPTFS_SOURCE"] == "s3://my-bucket/checkpoints"
    assert env["CKPTFS_MOUNTPOINT"] == "/mnt/ckptfs/checkpoints"
    assert env["CKPTFS_CACHE_DIR"] == "/var/cache/ckptfs/cache"
    assert env["CKPTFS_METRICS_ADDR"] == "0.0.0.0:9477"
    assert env["CKPTFS_KEEP_MOUNT_ON_STOP"] == "true"
    assert env["CKPTFS_RUNTIME_DIR"] == "/run/ckptfs"
    assert float(env["CKPTFS_DRAIN_TIMEOUT"]) > 0
    # the mount root, Bidirectional, same path inside and out; the mountpoint is below it
    root = mount_of(d, c, "/mnt/ckptfs")
    assert root["mountPath"] == "/mnt/ckptfs" and root["mountPropagation"] == "Bidirectional"
    assert volume(d, root["name"])["hostPath"]["type"] == "DirectoryOrCreate"
    assert env["CKPTFS_MOUNTPOINT"].startswith(root["mountPath"] + "/")
    # the cache on the node's disk, surviving the pod
    cache = mount_of(d, c, "/var/cache/ckptfs")
    assert volume(d, cache["name"])["hostPath"] == {"path": "/var/cache/ckptfs", "type": "DirectoryOrCreate"}
    assert env["CKPTFS_CACHE_DIR"].startswith(cache["mountPath"] + "/")
    # metrics
    assert c["ports"] == [{"name": "metrics", "containerPort": 9477, "protocol": "TCP"}]
    # readiness: the daemon answers on its control socket
    assert c["readinessProbe"]["exec"]["command"] == ["ckptfs", "status", env["CKPTFS_MOUNTPOINT"], "--json"]
    assert c["readinessProbe"]["timeoutSeconds"] > 10, "status waits up to 10 s for a daemon taking over"
    assert "livenessProbe" not in c, "a liveness probe would kill a daemon that is draining"
    assert spec["priorityClassName"] in PRIORITY_VALUES


def test_daemon_stop_is_flush_then_drain_within_the_grace_period() -> None:
    for values in ([], ["drain.preStopFlushTimeout=600", "drain.timeout=900", "drain.terminationMarginSeconds=5"]):
        objs = render(*values)
        d = daemon(objs)
        c = container(d, "ckptfs")
        command = c["lifecycle"]["preStop"]["exec"]["command"]
        mountpoint = daemon_env(objs)["CKPTFS_MOUNTPOINT"]
        assert command[:3] == ["ckptfs", "flush", mountpoint] and command[3] == "--timeout"
        flush_timeout = int(command[4])
        drain_timeout = float(daemon_env(objs)["CKPTFS_DRAIN_TIMEOUT"])
        grace = pod_spec(d)["terminationGracePeriodSeconds"]
        assert grace > flush_timeout + drain_timeout
    assert flush_timeout == 600 and drain_timeout == 900 and grace == 1505


@pytest.mark.parametrize("variant", VARIANTS)
def test_holder_and_daemon_share_host_paths_nodes_and_runtime_dir(variant: str) -> None:
    objs = render(*VARIANTS[variant])
    h, d = holder(objs), daemon(objs)
    hc, dc = container(h, "holder"), container(d, "ckptfs")
    runtime = daemon_env(objs)["CKPTFS_RUNTIME_DIR"]
    assert {e["name"]: e["value"] for e in hc["env"]}["CKPTFS_RUNTIME_DIR"] == runtime
    for w, c in ((h, hc), (d, dc)):
        mount = mount_of(w, c, runtime)
        assert mount["mountPath"] == runtime
        assert volume(w, mount["name"])["hostPath"]["type"] == "DirectoryOrCreate"
        assert mount_of(w, c, "/mnt/ckptfs")["mountPath"] == "/mnt/ckptfs"
    for key in ("nodeSelector", "tolerations", "affinity"):
        assert pod_spec(h).get(key) == pod_spec(d).get(key)
    # the holder outranks the daemon: never evicted or preempted first
    assert PRIORITY_VALUES[pod_spec(h)["priorityClassName"]] > PRIORITY_VALUES[pod_spec(d)["priorityClassName"]]
    # neither DaemonSet's selector takes the other's pods
    for a, b in ((h, d), (d, h)):
        selector = a["spec"]["selector"]["matchLabels"]
        assert selector.items() <= a["spec"]["template"]["metadata"]["labels"].items()
        assert not selector.items() <= b["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("variant", VARIANTS)
def test_kubernetes_admission_rules_hold(variant: str) -> None:
    """What the API server checks beyond the schemas: Bidirectional only in privileged containers, and exec
    hooks and probes without $(VAR), which Kubernetes does not expand there."""
    for obj in render(*VARIANTS[variant]):
        for _spec, c in all_containers(obj):
            for mount in c.get("volumeMounts", []):
                if mount.get("mountPropagation") == "Bidirectional":
                    assert c.get("securityContext", {}).get("privileged") is True, (obj["metadata"]["name"], mount)
            execs = [c.get(p, {}).get("exec", {}).get("command", []) for p in
                     ("readinessProbe", "livenessProbe", "startupProbe")]
            execs += [h.get("exec", {}).get("command", []) for h in c.get("lifecycle", {}).values()]
            assert not any("$(" in word for command in execs for word in command)


def test_metrics_service_selects_the_daemon_pods() -> None:
    objs = render(*VARIANTS["monitoring"])
    d, service = daemon(objs), get(objs, "Service", "ckptfs-metrics")
    assert service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    [port] = service["spec"]["ports"]
    assert port["targetPort"] == container(d, "ckptfs")["ports"][0]["name"] and port["port"] == 9477
    monitor = get(objs, "ServiceMonitor", "ckptfs")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [port["name"]]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    quota = get(objs, "ResourceQuota", "ckptfs-critical-pods")
    [expression] = quota["spec"]["scopeSelector"]["matchExpressions"]
    assert set(expression["values"]) == {pod_spec(holder(objs))["priorityClassName"],
                                         pod_spec(daemon(objs))["priorityClassName"]}
    assert find(render(), "ServiceMonitor", "ckptfs") is None, "the ServiceMonitor is off by default"


def test_credentials_reach_only_the_daemon_as_each_cloud_expects() -> None:
    account = get(render(*VARIANTS["irsa"]), "ServiceAccount", "ckptfs")
    assert account["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/ckptfs"}
    account = get(render(*VARIANTS["gke"]), "ServiceAccount", "ckptfs")
    assert account["metadata"]["annotations"] == {
        "iam.gke.io/gcp-service-account": "ckptfs@my-project.iam.gserviceaccount.com"}
    objs = render(*VARIANTS["azure"])
    assert get(objs, "ServiceAccount", "ckptfs")["metadata"]["annotations"] == {
        "azure.workload.identity/client-id": "00000000-0000-0000-0000-000000000000"}
    assert daemon(objs)["spec"]["template"]["metadata"]["labels"]["azure.workload.identity/use"] == "true"
    assert daemon_env(objs)["AZURE_STORAGE_ACCOUNT"] == "myaccount"
    objs = render(*VARIANTS["secret"])
    assert container(daemon(objs), "ckptfs")["envFrom"][1] == {"secretRef": {"name": "ckptfs-credentials"}}
    objs = render(*VARIANTS["gcp-key"])
    d = daemon(objs)
    c = container(d, "ckptfs")
    [key_mount] = [m for m in c["volumeMounts"] if m["name"] == "gcp-key"]
    assert key_mount["readOnly"] is True
    assert volume(d, "gcp-key")["secret"]["secretName"] == "ckptfs-gcp-key"
    assert daemon_env(objs)["GOOGLE_APPLICATION_CREDENTIALS"] == key_mount["mountPath"] + "/key.json"
    # none of it by default: the SDKs' own chain (node role, EKS Pod Identity)
    objs = render()
    assert "annotations" not in get(objs, "ServiceAccount", "ckptfs")["metadata"]
    assert container(daemon(objs), "ckptfs")["envFrom"] == [{"configMapRef": {"name": "ckptfs-env"}}]


def test_capabilities_variant_mounts_fuse_without_privileges(tmp_path: Path) -> None:
    objs = render(*VARIANTS["capabilities"])
    d = daemon(objs)
    c = container(d, "ckptfs")
    assert c["securityContext"] == {"capabilities": {"add": ["SYS_ADMIN"]}, "appArmorProfile": {"type": "Unconfined"}}
    fuse = mount_of(d, c, "/dev/fuse")
    assert fuse["mountPath"] == "/dev/fuse" and volume(d, fuse["name"])["hostPath"]["type"] == "CharDevice"
    assert mount_of(d, c, "/mnt/ckptfs")["mountPropagation"] == "HostToContainer"
    assert "WARNING: daemon.privileged=false" in render_notes(tmp_path, *VARIANTS["capabilities"])
    assert "WARNING" not in render_notes(tmp_path)


def test_toml_config_is_mounted_and_settings_are_environment() -> None:
    objs = render(*VARIANTS["toml"])
    d = daemon(objs)
    c = container(d, "ckptfs")
    [config] = [m for m in c["volumeMounts"] if m["name"] == "config"]
    assert config == {"name": "config", "mountPath": "/etc/ckptfs", "readOnly": True}
    toml = get(objs, "ConfigMap", volume(d, "config")["configMap"]["name"])["data"]["ckptfs.toml"]
    assert toml == 'keep_last = 3\ncommit_markers = ["latest", "*.done"]\n'
    assert daemon_env(objs)["CKPTFS_CACHE_SIZE"] == "200G"
    # a settings change rolls the daemon out, not the holder
    assert (daemon(objs)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
            != daemon(render())["spec"]["template"]["metadata"]["annotations"]["checksum/config"])
    assert holder(objs) == holder(render())


@pytest.mark.parametrize(("values", "message"), [
    (["config.env.CKPTFS_SOURCE=s3://other"], "the chart sets this one"),
    (["config.env.AWS_SECRET_ACCESS_KEY=x"], "looks like a credential"),
    (["config.env.AZURE_STORAGE_CONNECTION_STRING=x"], "looks like a credential"),
    (["source="], "source is required"),
    (["mount.name=a/b"], "mount.name must be one directory name"),
    (["mount.root=relative"], "mount.root must be an absolute host path"),
    (["metrics.serviceMonitor.enabled=true", "metrics.service.enabled=false"], "needs metrics.service.enabled"),
    # values.schema.json: a misspelt or mistyped value fails instead of being ignored
    (["daemon.privilegd=false"], "Additional property privilegd is not allowed"),
    (["drain.timeout=soon"], "drain.timeout: Invalid type"),
    (["image.pullPolicy=Sometimes"], "image.pullPolicy must be one of"),
    (["source=http://bucket"], "source: Does not match pattern"),
    (["credentials.awsRoleArn=my-role"], "credentials.awsRoleArn: Does not match pattern"),
])
def test_chart_refuses_values_that_break_the_design(values: list[str], message: str) -> None:
    assert message in render_error(*values)


def test_example_workload_is_unprivileged_and_sees_the_mount() -> None:
    job = example_job()
    objs = render()
    spec, c = pod_spec(job), container(job)
    mount = mount_of(job, c, "/mnt/ckptfs")
    assert mount["mountPath"] == "/mnt/ckptfs" and mount["mountPropagation"] == "HostToContainer"
    assert volume(job, mount["name"])["hostPath"]["type"] == "Directory"
    context = c.get("securityContext", {})
    assert not context.get("privileged") and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert not spec.get("hostNetwork") and not spec.get("hostPID")
    assert daemon_env(objs)["CKPTFS_MOUNTPOINT"] in c["command"][-1]
    assert spec["tolerations"] == pod_spec(daemon(objs))["tolerations"]


# -- podman_pod --------------------------------------------------------------------------------------------------

def _run(objs: Sequence[Obj], name: str, container_in_pod: str, **kwargs: Any) -> PodmanRun:
    return podman_run(objs, name, container_in_pod, **kwargs)


def test_podman_holder_runs_as_declared(tmp_path: Path) -> None:
    run = _run(plain_manifests(), "ckptfs-holder", "holder", host_prefix=tmp_path, image="localhost/ckptfs:test",
               container_name="holder", extra_options=["-d"])
    assert run.args == [
        "--name", "holder",
        "--restart=always", "--stop-timeout", "30",
        "--privileged", "--device", "/dev/fuse",
        "-e", "CKPTFS_RUNTIME_DIR=/run/ckptfs",
        "-v", f"{tmp_path}/run/ckptfs:/run/ckptfs",
        "-v", f"{tmp_path}/mnt/ckptfs:/mnt/ckptfs:rshared",
        "--memory", str(128 << 20), "--cpu-shares", "10",
        "--pull=missing",
        "--entrypoint", '["ckptfs", "holder"]',
        "-d", "localhost/ckptfs:test", "--guard", "/mnt/ckptfs/checkpoints",
    ]
    assert run.pre_stop is None and run.readiness is None and run.stop_timeout == 30
    assert run.host_dirs == [tmp_path / "run/ckptfs", tmp_path / "mnt/ckptfs"]
    assert run.propagated == [tmp_path / "mnt/ckptfs"]
    run.prepare()
    assert all(d.is_dir() for d in run.host_dirs)


def test_podman_daemon_runs_as_declared(tmp_path: Path) -> None:
    objs = plain_manifests()
    run = _run(objs, "ckptfs", "ckptfs", host_prefix=tmp_path)
    args = run.args
    assert args[-2:] == ["localhost/ckptfs:0.1.0", "mount"] and "--entrypoint" not in args
    assert args[args.index("--privileged"):args.index("--privileged") + 3] == ["--privileged", "--device", "/dev/fuse"]
    env = dict(a.split("=", 1) for a, flag in zip(args[1:], args, strict=False) if flag == "-e")
    assert env == daemon_env(objs)
    volumes = [a for a, flag in zip(args[1:], args, strict=False) if flag == "-v"]
    assert volumes == [f"{tmp_path}/mnt/ckptfs:/mnt/ckptfs:rshared",
                       f"{tmp_path}/var/cache/ckptfs:/var/cache/ckptfs",
                       f"{tmp_path}/run/ckptfs:/run/ckptfs"]
    assert run.pre_stop == ["ckptfs", "flush", "/mnt/ckptfs/checkpoints", "--timeout", "300"]
    assert run.readiness == ["ckptfs", "status", "/mnt/ckptfs/checkpoints", "--json"]
    assert args[args.index("--health-cmd") + 1] == json.dumps(run.readiness)
    assert run.stop_timeout == 450 and args[args.index("--stop-timeout") + 1] == "450"
    assert args[args.index("--memory") + 1] == str(4 << 30) and args[args.index("--cpu-shares") + 1] == "512"
    assert "-p" not in args and "--network" not in args, "a containerPort alone publishes nothing"
    # the holder and the daemon meet in the same relocated runtime dir
    holder_run = _run(objs, "ckptfs-holder", "holder", host_prefix=tmp_path)
    assert tmp_path / "run/ckptfs" in set(run.host_dirs) & set(holder_run.host_dirs)


def test_podman_runs_the_variants_and_the_workload(tmp_path: Path) -> None:
    run = _run(render(*VARIANTS["capabilities"]), "ckptfs", "ckptfs", host_prefix=tmp_path)
    assert "--privileged" not in run.args
    assert run.args[run.args.index("--cap-add"):run.args.index("--cap-add") + 2] == ["--cap-add", "SYS_ADMIN"]
    assert run.args[run.args.index("--device"):run.args.index("--device") + 2] == ["--device", "/dev/fuse"]
    assert run.args[run.args.index("--security-opt"):][:2] == ["--security-opt", "apparmor=unconfined"]
    assert f"{tmp_path}/mnt/ckptfs:/mnt/ckptfs:rslave" in run.args
    # the TOML file needs somewhere to be written
    objs = render(*VARIANTS["toml"])
    with pytest.raises(Unsupported, match="files_dir"):
        _run(objs, "ckptfs", "ckptfs")
    run = _run(objs, "ckptfs", "ckptfs", files_dir=tmp_path / "files")
    toml = b'keep_last = 3\ncommit_markers = ["latest", "*.done"]\n'
    assert run.files == {tmp_path / "files/config/ckptfs.toml": toml}
    assert f"{tmp_path}/files/config:/etc/ckptfs:ro" in run.args
    run.prepare()
    assert (tmp_path / "files/config/ckptfs.toml").read_bytes().startswith(b"keep_last")
    # a Secret of the same manifests becomes environment; a missing one is an error
    objs = render(*VARIANTS["secret"])
    with pytest.raises(Unsupported, match="Secret ckptfs-credentials is not in the manifests"):
        _run(objs, "ckptfs", "ckptfs")
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "ckptfs-credentials", "namespace": NAMESPACE},
              "data": {"AWS_ACCESS_KEY_ID": base64.b64encode(b"AKIA").decode()}, "stringData": {"X": "y"}}
    run = _run([*objs, secret], "ckptfs", "ckptfs")
    assert "AWS_ACCESS_KEY_ID=AKIA" in run.args and "X=y" in run.args
    # the example workload: a Job, unprivileged, seeing the mount with rslave propagation
    run = _run([example_job()], "ckptfs-example-save", "save", kind="Job", host_prefix=tmp_path)
    assert "--privileged" not in run.args and "--restart=no" in run.args
    assert f"{tmp_path}/mnt/ckptfs:/mnt/ckptfs:rslave" in run.args
    hardening = ["--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
    assert [a for a in run.args if a in hardening] == hardening
    assert run.host_dirs == [], "type Directory: it must exist already"


def _patched(objs: Sequence[Obj], change: Mapping[str, Any], where: str = "container") -> list[Obj]:
    patched = json.loads(json.dumps(list(objs)))
    d = get(patched, "DaemonSet", "ckptfs")
    target = container(d, "ckptfs") if where == "container" else pod_spec(d)
    target.update(change)
    if where == "container":
        pod_spec(d)["containers"] = [target]
    return patched


@pytest.mark.parametrize(("change", "where", "message"), [
    ({"env": [{"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]}, "container",
     "only plain values"),
    ({"args": ["mount", "$(CKPTFS_MOUNTPOINT)"]}, "container", "expansion"),
    ({"livenessProbe": {"exec": {"command": ["true"]}}}, "container", "livenessProbe"),
    ({"lifecycle": {"postStart": {"exec": {"command": ["true"]}}}}, "container", "lifecycle"),
    ({"lifecycle": {"preStop": {"exec": {"command": ["ckptfs", "flush", "$(CKPTFS_MOUNTPOINT)"]}}}}, "container",
     "does not expand"),
    ({"readinessProbe": {"httpGet": {"path": "/", "port": 9477}}}, "container", "only exec probes"),
    ({"stdin": True}, "container", "stdin"),
    ({"resources": {"limits": {"nvidia.com/gpu": 1}}}, "container", "nvidia.com/gpu"),
    ({"envFrom": [{"configMapRef": {"name": "elsewhere"}}]}, "container", "ConfigMap elsewhere is not in"),
    ({"initContainers": [{"name": "x", "image": "x"}]}, "pod", "initContainers"),
    ({"volumes": [{"name": "mount-root", "emptyDir": {}}, {"name": "cache", "hostPath": {"path": "/c"}},
                  {"name": "runtime", "hostPath": {"path": "/r"}}]}, "pod", "emptyDir"),
    ({"volumes": [{"name": "mount-root", "hostPath": {"path": "/m", "type": "Socket"}},
                  {"name": "cache", "hostPath": {"path": "/c"}}, {"name": "runtime", "hostPath": {"path": "/r"}}]},
     "pod", "type Socket"),
    ({"securityContext": {"fsGroup": 1000}}, "pod", "fsGroup"),
    ({"securityContext": {"privileged": True, "seLinuxOptions": {"level": "s0"}}}, "container", "seLinuxOptions"),
    ({"restartPolicy": "Sometimes"}, "pod", "restartPolicy"),
])
def test_podman_refuses_what_it_cannot_express(change: Mapping[str, Any], where: str, message: str) -> None:
    with pytest.raises(Unsupported, match=message):
        _run(_patched(plain_manifests(), change, where), "ckptfs", "ckptfs")


def test_podman_expresses_host_network_ports_and_environment_precedence() -> None:
    objs = _patched(plain_manifests(), {"hostNetwork": True, "hostPID": True}, "pod")
    args = _run(objs, "ckptfs", "ckptfs").args
    assert args[args.index("--network") + 1] == "host" and args[args.index("--pid") + 1] == "host"
    objs = _patched(plain_manifests(), {
        "ports": [{"name": "metrics", "containerPort": 9477, "hostPort": 19477, "protocol": "TCP"}],
        "env": [{"name": "CKPTFS_DRAIN_TIMEOUT", "value": "5"}],
        "envFrom": [{"configMapRef": {"name": "ckptfs-env"}}, {"prefix": "X_", "configMapRef": {"name": "ckptfs-env"}}],
    })
    args = _run(objs, "ckptfs", "ckptfs").args
    assert args[args.index("-p") + 1] == "19477:9477/tcp"
    env = [a for a, flag in zip(args[1:], args, strict=False) if flag == "-e"]
    # env wins over envFrom, whatever the order; a prefix makes other names
    assert [e for e in env if e.startswith("CKPTFS_DRAIN_TIMEOUT=")] == ["CKPTFS_DRAIN_TIMEOUT=5"]
    assert "X_CKPTFS_DRAIN_TIMEOUT=120" in env


def test_podman_refuses_unknown_objects() -> None:
    objs = plain_manifests()
    with pytest.raises(Unsupported, match="no DaemonSet named nothing"):
        _run(objs, "nothing", "ckptfs")
    with pytest.raises(Unsupported, match="has no container sidecar"):
        _run(objs, "ckptfs", "sidecar")
    optional = _patched(objs, {"envFrom": [{"configMapRef": {"name": "ckptfs-env"}},
                                           {"secretRef": {"name": "absent", "optional": True}}]})
    assert "-e" in _run(optional, "ckptfs", "ckptfs").args


def test_podman_accepts_the_arguments(tmp_path: Path) -> None:
    """podman itself parses each container's arguments (podman create, never started), where it is here."""
    podman = shutil.which("podman")
    if podman is None:
        pytest.skip("no podman")
    base = "localhost/bookworm-base:latest"
    if subprocess.run([podman, "image", "exists", base]).returncode != 0:
        pytest.skip(f"no local image {base} (shared/containers.md makes one)")
    runs = [_run(plain_manifests(), "ckptfs-holder", "holder", host_prefix=tmp_path, image=base),
            _run(plain_manifests(), "ckptfs", "ckptfs", host_prefix=tmp_path, image=base),
            _run(render(*VARIANTS["capabilities"]), "ckptfs", "ckptfs", host_prefix=tmp_path, image=base),
            _run([example_job()], "ckptfs-example-save", "save", kind="Job", host_prefix=tmp_path, image=base,
                 extra_options=["--pull=never"])]
    (tmp_path / "mnt/ckptfs").mkdir(parents=True)
    for run in runs:
        run.prepare()
        created = subprocess.run([podman, "create", *run.args], capture_output=True, text=True, timeout=120)
        assert created.returncode == 0, created.stderr
        subprocess.run([podman, "rm", "-f", created.stdout.strip()], capture_output=True, timeout=120)
