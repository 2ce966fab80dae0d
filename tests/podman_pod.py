"""Run a container of a Kubernetes manifest under podman, the way the manifest declares it.

There is no cluster here: the end-to-end tests run the DaemonSets' containers (and a workload's) with podman,
from the manifests themselves, so that what is tested and what is deployed cannot drift apart.
`podman_run(manifests, "ckptfs", "ckptfs")` reads the object and its pod template and returns a PodmanRun:
`args`, everything that follows `podman run` (options, image, arguments), and, apart, what `podman run` has
no option for: the preStop command (run it with `podman exec` before `podman stop`), the host directories that
hostPath volumes of type DirectoryOrCreate create, the files of configMap and secret volumes, and the host
paths whose propagation needs a shared mount. Every field the pod spec has is either expressed or has no
effect on one node's container (scheduling, API access: listed in _CLUSTER_ONLY_*); anything else raises
Unsupported, never silently dropped.

What Kubernetes maps how:
- image (or `image=`), imagePullPolicy -> --pull; command -> --entrypoint (JSON), args after the image
  (as in Kubernetes, a command without args drops the image's CMD, and podman does the same);
- env (values only) and envFrom (configMapRef and secretRef resolved from the same manifests; a missing
  optional one is skipped, a missing required one raises) -> -e, with Kubernetes' precedence (env over
  envFrom, a later envFrom over an earlier one);
- securityContext: privileged -> --privileged (and --device /dev/fuse), capabilities -> --cap-add/--cap-drop,
  runAsUser/runAsGroup -> --user, readOnlyRootFilesystem -> --read-only, allowPrivilegeEscalation false ->
  no-new-privileges, appArmorProfile/seccompProfile Unconfined -> --security-opt ...=unconfined;
- hostPath volumes -> -v HOST_PREFIX+PATH:MOUNTPATH[:ro][,rshared|rslave] (Bidirectional -> rshared,
  HostToContainer -> rslave), a CharDevice -> --device PATH:MOUNTPATH (devices are never relocated);
  configMap and secret volumes -> -v FILES_DIR/VOLUME:MOUNTPATH:ro with PodmanRun.files to write there;
- hostNetwork -> --network host, hostPID -> --pid host, hostIPC -> --ipc host, ports with a hostPort -> -p;
- resources: limits.memory -> --memory, limits.cpu -> --cpus, requests.cpu -> --cpu-shares (what the kubelet
  sets); requests.memory has no effect on a running container;
- readinessProbe exec -> --health-cmd and its timing; terminationGracePeriodSeconds -> --stop-timeout;
  restartPolicy (Always unless said) -> --restart.

A hostPath with Bidirectional or HostToContainer propagation must be on a shared mount on the host
(`mount --bind D D && mount --make-rshared D`, shared/containers.md): PodmanRun.propagated lists them.
The restart policy is kept (--restart=always for a DaemonSet: podman restarts a killed container as the kubelet
would), so `--rm` cannot be added; remove containers with `podman rm -f`.
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Manifest = Mapping[str, Any]

WORKLOAD_KINDS = ("DaemonSet", "Deployment", "StatefulSet", "ReplicaSet", "Job", "Pod")

# Pod and container fields that act on scheduling, the API or the cluster's network, not on the container
# a node runs: nothing to express for one container under podman.
_CLUSTER_ONLY_POD = frozenset({
    "serviceAccountName", "serviceAccount", "automountServiceAccountToken", "priorityClassName", "priority",
    "nodeSelector", "tolerations", "affinity", "topologySpreadConstraints", "schedulerName", "imagePullSecrets",
    "dnsPolicy", "enableServiceLinks", "preemptionPolicy",
})
_CLUSTER_ONLY_CONTAINER = frozenset({"name", "terminationMessagePath", "terminationMessagePolicy"})
_HOST_DIR_TYPES = frozenset({"", "Directory", "DirectoryOrCreate"})
_PROPAGATION = {None: None, "None": None, "HostToContainer": "rslave", "Bidirectional": "rshared"}
_PULL = {"Always": "always", "IfNotPresent": "missing", "Never": "never"}
_RESTART = {"Always": "always", "OnFailure": "on-failure", "Never": "no"}
_MEMORY_UNITS = {
    "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
}


class Unsupported(ValueError):
    """The manifest asks for something this module cannot run under podman as Kubernetes would."""


def _choice(table: Mapping[Any, str | None], value: Any, what: str) -> str | None:
    if value not in table:
        raise Unsupported(f"{what} {value!r}: cannot express under podman")
    return table[value]


@dataclass
class PodmanRun:
    """How to run one container of a manifest under podman; `args` follow `podman run`."""

    args: list[str]
    # The preStop exec command: `podman exec NAME *pre_stop` before `podman stop NAME`.
    pre_stop: list[str] | None = None
    # terminationGracePeriodSeconds (also in args as --stop-timeout): preStop and SIGTERM together get this long.
    stop_timeout: int = 30
    # hostPath directories (with the prefix) of type DirectoryOrCreate: the kubelet creates them.
    host_dirs: list[Path] = field(default_factory=list)
    # Files of configMap and secret volumes, under files_dir, mounted read-only.
    files: dict[Path, bytes] = field(default_factory=dict)
    # Host paths (with the prefix) mounted with rshared or rslave propagation: they must be on a shared mount.
    propagated: list[Path] = field(default_factory=list)
    # The readinessProbe's exec command (also in args as --health-cmd).
    readiness: list[str] | None = None

    def prepare(self) -> None:
        """Create the host directories (mode 0755, as the kubelet does) and write the volumes' files."""
        for path in self.host_dirs:
            path.mkdir(mode=0o755, parents=True, exist_ok=True)
        for path, data in self.files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)


def find(manifests: Iterable[Manifest], kind: str, name: str, namespace: str | None = None) -> Manifest | None:
    """The object of this kind and name (in this namespace, when given), or None."""
    found = [m for m in manifests if m.get("kind") == kind and m.get("metadata", {}).get("name") == name
             and (namespace is None or m.get("metadata", {}).get("namespace", "default") == namespace)]
    if len(found) > 1:
        raise Unsupported(f"{len(found)} objects {kind}/{name} in the manifests")
    return found[0] if found else None


def podman_run(
    manifests: Sequence[Manifest],
    name: str,
    container: str,
    *,
    kind: str = "DaemonSet",
    image: str | None = None,
    host_prefix: str | os.PathLike[str] | None = None,
    files_dir: str | os.PathLike[str] | None = None,
    container_name: str | None = None,
    extra_options: Sequence[str] = (),
) -> PodmanRun:
    """How to run container `container` of the `kind` named `name` under podman.

    image: run this image instead of the manifest's. host_prefix: prepended to every hostPath except devices
    (so /mnt/ckptfs becomes HOST_PREFIX/mnt/ckptfs). files_dir: where the files of configMap and secret
    volumes go (required when there are any). container_name: --name. extra_options: more `podman run`
    options, placed before the image (--rm, -d, --ulimit ...).
    """
    obj = find(manifests, kind, name)
    if obj is None:
        raise Unsupported(f"no {kind} named {name} in the manifests")
    if kind not in WORKLOAD_KINDS:
        raise Unsupported(f"{kind} has no pod template")
    namespace = obj.get("metadata", {}).get("namespace", "default")
    pod = obj["spec"] if kind == "Pod" else obj["spec"]["template"]["spec"]
    specs = [c for c in pod.get("containers", []) if c.get("name") == container]
    if not specs:
        raise Unsupported(f"{kind}/{name} has no container {container}")
    spec = specs[0]
    prefix = Path(host_prefix) if host_prefix is not None else None
    result = PodmanRun(args=[])
    options: list[str] = []
    if container_name:
        options += ["--name", container_name]
    _pod_options(pod, options, result)
    _security(pod.get("securityContext", {}), spec.get("securityContext", {}), options)
    _environment(manifests, namespace, spec, options)
    _volumes(manifests, namespace, pod, spec, prefix, Path(files_dir) if files_dir else None, options, result)
    _resources(spec.get("resources", {}), options)
    _ports(spec.get("ports", []), bool(pod.get("hostNetwork")), options)
    _probes_and_hooks(spec, options, result)

    handled = {"image", "imagePullPolicy", "command", "args", "env", "envFrom", "securityContext", "volumeMounts",
               "resources", "ports", "readinessProbe", "lifecycle", "workingDir"}
    unknown = set(spec) - handled - _CLUSTER_ONLY_CONTAINER
    if unknown:
        raise Unsupported(f"container {container}: cannot express {sorted(unknown)} under podman")
    if "workingDir" in spec:
        options += ["--workdir", spec["workingDir"]]
    if "imagePullPolicy" in spec:
        options += [f"--pull={_choice(_PULL, spec['imagePullPolicy'], 'imagePullPolicy')}"]
    command, arguments = spec.get("command"), spec.get("args")
    for word in [*(command or []), *(arguments or [])]:
        if "$(" in word:
            raise Unsupported(f"container {container}: $(VAR) expansion in {word!r} is not done here")
    if command is not None:
        options += ["--entrypoint", json.dumps(command)]
    the_image = image or spec.get("image")
    if not the_image:
        raise Unsupported(f"container {container} has no image")
    result.args = [*options, *extra_options, the_image, *(arguments or [])]
    return result


def _pod_options(pod: Manifest, options: list[str], result: PodmanRun) -> None:
    handled = {"containers", "volumes", "securityContext", "hostNetwork", "hostPID", "hostIPC", "restartPolicy",
               "terminationGracePeriodSeconds"}
    unknown = set(pod) - handled - _CLUSTER_ONLY_POD
    if unknown:
        raise Unsupported(f"pod spec: cannot express {sorted(unknown)} under podman")
    if pod.get("hostNetwork"):
        options += ["--network", "host"]
    if pod.get("hostPID"):
        options += ["--pid", "host"]
    if pod.get("hostIPC"):
        options += ["--ipc", "host"]
    options += [f"--restart={_choice(_RESTART, pod.get('restartPolicy', 'Always'), 'restartPolicy')}"]
    result.stop_timeout = int(pod.get("terminationGracePeriodSeconds", 30))
    options += ["--stop-timeout", str(result.stop_timeout)]


def _security(pod_context: Manifest, context: Manifest, options: list[str]) -> None:
    pod_handled = {"runAsUser", "runAsGroup", "seccompProfile", "appArmorProfile"}
    unknown = set(pod_context) - pod_handled
    if unknown:
        raise Unsupported(f"pod securityContext: cannot express {sorted(unknown)} under podman")
    handled = {"privileged", "capabilities", "runAsUser", "runAsGroup", "readOnlyRootFilesystem",
               "allowPrivilegeEscalation", "seccompProfile", "appArmorProfile"}
    unknown = set(context) - handled
    if unknown:
        raise Unsupported(f"securityContext: cannot express {sorted(unknown)} under podman")
    merged = {**pod_context, **context}
    if merged.get("privileged"):
        # A privileged container sees every device; name /dev/fuse as the recipe does (shared/containers.md).
        options += ["--privileged", "--device", "/dev/fuse"]
    capabilities = merged.get("capabilities", {})
    if set(capabilities) - {"add", "drop"}:
        raise Unsupported(f"capabilities: cannot express {sorted(set(capabilities) - {'add', 'drop'})}")
    for capability in capabilities.get("drop", []):
        options += ["--cap-drop", capability]
    for capability in capabilities.get("add", []):
        options += ["--cap-add", capability]
    if "runAsUser" in merged:
        user = str(merged["runAsUser"])
        options += ["--user", f"{user}:{merged['runAsGroup']}" if "runAsGroup" in merged else user]
    elif "runAsGroup" in merged:
        raise Unsupported("runAsGroup without runAsUser")
    if merged.get("readOnlyRootFilesystem"):
        options += ["--read-only"]
    if merged.get("allowPrivilegeEscalation") is False:
        options += ["--security-opt", "no-new-privileges"]
    for key, option in (("seccompProfile", "seccomp"), ("appArmorProfile", "apparmor")):
        profile = merged.get(key)
        if profile is None or profile.get("type") == "RuntimeDefault":
            continue
        if profile.get("type") == "Unconfined":
            options += ["--security-opt", f"{option}=unconfined"]
        else:
            raise Unsupported(f"{key} {profile}: cannot express under podman")


def _config_data(manifests: Sequence[Manifest], kind: str, name: str, namespace: str) -> dict[str, bytes] | None:
    obj = find(manifests, kind, name, namespace)
    if obj is None:
        return None
    data: dict[str, bytes] = {}
    if kind == "ConfigMap":
        data.update({k: str(v).encode() for k, v in (obj.get("data") or {}).items()})
        data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    else:
        data.update({k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()})
        data.update({k: str(v).encode() for k, v in (obj.get("stringData") or {}).items()})
    return data


_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


def _environment(manifests: Sequence[Manifest], namespace: str, spec: Manifest, options: list[str]) -> None:
    environment: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        prefix = source.get("prefix", "")
        refs = [(kind, source[key]) for key, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret"))
                if key in source]
        if len(refs) != 1 or set(source) - {"prefix", "configMapRef", "secretRef"}:
            raise Unsupported(f"envFrom entry {source}: cannot express under podman")
        kind, ref = refs[0]
        data = _config_data(manifests, kind, ref["name"], namespace)
        if data is None:
            if ref.get("optional"):
                continue
            raise Unsupported(f"envFrom: {kind} {ref['name']} is not in the manifests")
        for key, content in data.items():
            if _ENV_NAME.match(prefix + key):  # Kubernetes skips the keys that are no variable names
                environment[prefix + key] = content.decode()
    for variable in spec.get("env", []):
        if set(variable) != {"name", "value"}:
            raise Unsupported(f"env {variable.get('name')}: only plain values can be expressed under podman")
        if "$(" in str(variable["value"]):
            raise Unsupported(f"env {variable['name']}: $(VAR) expansion is not done here")
        environment[variable["name"]] = str(variable["value"])
    for key, value in environment.items():
        options += ["-e", f"{key}={value}"]


def _host(prefix: Path | None, path: str) -> Path:
    if not path.startswith("/"):
        raise Unsupported(f"hostPath {path} is not absolute")
    return prefix / path.lstrip("/") if prefix is not None else Path(path)


def _volumes(manifests: Sequence[Manifest], namespace: str, pod: Manifest, spec: Manifest, prefix: Path | None,
             files_dir: Path | None, options: list[str], result: PodmanRun) -> None:
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in spec.get("volumeMounts", []):
        unknown = set(mount) - {"name", "mountPath", "readOnly", "mountPropagation", "subPath"}
        if unknown:
            raise Unsupported(f"volumeMount {mount['name']}: cannot express {sorted(unknown)} under podman")
        volume = volumes.get(mount["name"])
        if volume is None:
            raise Unsupported(f"volumeMount {mount['name']} names no volume of the pod")
        source_kinds = set(volume) - {"name"}
        if source_kinds == {"hostPath"}:
            _host_path_mount(volume["hostPath"], mount, prefix, options, result)
        elif source_kinds in ({"configMap"}, {"secret"}):
            _file_mount(manifests, namespace, volume, mount, files_dir, options, result)
        else:
            raise Unsupported(f"volume {mount['name']}: {sorted(source_kinds)} cannot be expressed under podman")


def _host_path_mount(host_path: Manifest, mount: Manifest, prefix: Path | None, options: list[str],
                     result: PodmanRun) -> None:
    kind = host_path.get("type", "")
    path = host_path["path"]
    propagation = mount.get("mountPropagation")
    propagation_flag = _choice(_PROPAGATION, propagation, "mountPropagation")
    if kind == "CharDevice":
        if propagation or mount.get("subPath") or mount.get("readOnly"):
            raise Unsupported(f"device {path}: propagation, subPath or readOnly cannot be expressed")
        options += ["--device", path if path == mount["mountPath"] else f"{path}:{mount['mountPath']}"]
        return
    if kind not in _HOST_DIR_TYPES:
        raise Unsupported(f"hostPath {path} of type {kind}: cannot express under podman")
    host = _host(prefix, path)
    if kind == "DirectoryOrCreate":
        result.host_dirs.append(host)
    if mount.get("subPath"):
        host = host / mount["subPath"]
    flags = []
    if mount.get("readOnly"):
        flags.append("ro")
    if propagation_flag:
        flags.append(propagation_flag)
        result.propagated.append(host)
    options += ["-v", f"{host}:{mount['mountPath']}" + (f":{','.join(flags)}" if flags else "")]


def _file_mount(manifests: Sequence[Manifest], namespace: str, volume: Manifest, mount: Manifest,
                files_dir: Path | None, options: list[str], result: PodmanRun) -> None:
    kind, source = ("ConfigMap", volume["configMap"]) if "configMap" in volume else ("Secret", volume["secret"])
    name = source.get("name") if kind == "ConfigMap" else source.get("secretName")
    unknown = set(source) - {"name", "secretName", "items", "optional", "defaultMode"}
    if unknown or mount.get("subPath") or mount.get("mountPropagation"):
        raise Unsupported(f"volume {volume['name']}: cannot express {sorted(unknown)} or subPath/propagation")
    if files_dir is None:
        raise Unsupported(f"volume {volume['name']} ({kind} {name}) needs files_dir for its files")
    data = _config_data(manifests, kind, name, namespace)
    if data is None:
        if source.get("optional"):
            return
        raise Unsupported(f"volume {volume['name']}: {kind} {name} is not in the manifests")
    items = source.get("items")
    chosen = {item["path"]: data[item["key"]] for item in items} if items else data
    directory = files_dir / volume["name"]
    for path, content in chosen.items():
        result.files[directory / path] = content
    # A configMap or secret volume is read-only in Kubernetes whatever readOnly says.
    options += ["-v", f"{directory}:{mount['mountPath']}:ro"]


def _quantity(value: str | int | float, units: Mapping[str, int]) -> int:
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value))
    if not match or match.group(2) not in units:
        raise Unsupported(f"quantity {value!r}")
    return int(float(match.group(1)) * units[match.group(2)])


def _millicpu(value: str | int | float) -> int:
    text = str(value)
    return int(text[:-1]) if text.endswith("m") else int(float(text) * 1000)


def _resources(resources: Manifest, options: list[str]) -> None:
    if set(resources) - {"requests", "limits"}:
        raise Unsupported(f"resources: cannot express {sorted(set(resources) - {'requests', 'limits'})}")
    limits, requests = resources.get("limits", {}), resources.get("requests", {})
    for part, values in (("limits", limits), ("requests", requests)):
        if set(values) - {"cpu", "memory"}:
            raise Unsupported(f"resources.{part}: cannot express {sorted(set(values) - {'cpu', 'memory'})}")
    if "memory" in limits:
        options += ["--memory", str(_quantity(limits["memory"], _MEMORY_UNITS))]
    if "cpu" in limits:
        options += ["--cpus", f"{_millicpu(limits['cpu']) / 1000:g}"]
    if "cpu" in requests:
        # The kubelet's own conversion of a CPU request to cgroup shares (at least 2).
        options += ["--cpu-shares", str(max(2, _millicpu(requests["cpu"]) * 1024 // 1000))]


def _ports(ports: Sequence[Manifest], host_network: bool, options: list[str]) -> None:
    for port in ports:
        if set(port) - {"name", "containerPort", "protocol", "hostPort"}:
            raise Unsupported(f"port {port}: cannot express under podman")
        # A containerPort alone publishes nothing in Kubernetes (it is reached on the pod's own IP).
        if "hostPort" in port and not host_network:
            protocol = port.get("protocol", "TCP").lower()
            options += ["-p", f"{port['hostPort']}:{port['containerPort']}/{protocol}"]


def _probes_and_hooks(spec: Manifest, options: list[str], result: PodmanRun) -> None:
    probe = spec.get("readinessProbe")
    if probe is not None:
        timing = {"initialDelaySeconds", "periodSeconds", "timeoutSeconds", "failureThreshold", "successThreshold"}
        if set(probe) - timing - {"exec"} or "exec" not in probe or set(probe["exec"]) != {"command"}:
            raise Unsupported(f"readinessProbe {probe}: only exec probes can be expressed under podman")
        result.readiness = list(probe["exec"]["command"])
        options += [
            "--health-cmd", json.dumps(result.readiness),
            "--health-interval", f"{probe.get('periodSeconds', 10)}s",
            "--health-timeout", f"{probe.get('timeoutSeconds', 1)}s",
            "--health-retries", str(probe.get("failureThreshold", 3)),
            "--health-start-period", f"{probe.get('initialDelaySeconds', 0)}s",
        ]
    lifecycle = spec.get("lifecycle")
    if lifecycle is not None:
        if set(lifecycle) != {"preStop"} or set(lifecycle["preStop"]) != {"exec"}:
            raise Unsupported(f"lifecycle {lifecycle}: only an exec preStop can be expressed (as PodmanRun.pre_stop)")
        result.pre_stop = list(lifecycle["preStop"]["exec"]["command"])
        if any("$(" in word for word in result.pre_stop):
            raise Unsupported("preStop: Kubernetes does not expand $(VAR) in hooks; the command would not work")
