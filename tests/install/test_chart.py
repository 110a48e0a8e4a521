"""The Helm chart (charts/tidal), rendered offline through helm-python-sdk (no helm binary, no
cluster): it renders in every mode, each object passes kubernetes-validate, `helm lint` is clean,
its CRDs are crds/, its RBAC is exactly what the operator and router call (both ways), no Secret
value appears in plain text, and every container runs locked down."""

from __future__ import annotations

import ast
import base64
import functools
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import kubernetes_validate
import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk (requirements-test.txt)")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tidal"
OPERATOR_PKG = ROOT / "operator" / "tidal_operator"
K8S_VERSION = "1.33"
RELEASE, NAMESPACE = "tidal", "tidal-system"

# Everything optional on, so every template renders at least once.
ALL_ON: dict[str, Any] = {
    "imagePullSecrets": ["regcred"],
    "commonLabels": {"team": "ml-platform"},
    "operator": {"replicas": 2, "extraArgs": ["--dummy-extra"],
                 "extraEnv": [{"name": "EXTRA", "value": "1"}], "podLabels": {"a": "b"},
                 "podAnnotations": {"c": "d"}, "nodeSelector": {"kubernetes.io/os": "linux"},
                 "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}],
                 "priorityClassName": "system-cluster-critical"},
    "router": {"autoscaling": {"enabled": True}, "apiKey": {"generate": True},
               "service": {"annotations": {"x": "y"}},
               "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                              "whenUnsatisfiable": "ScheduleAnyway",
                                              "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "router"}}}]},
    "networkPolicy": {"enabled": True, "metricsNamespace": "monitoring",
                      "metricsPodSelector": {"app.kubernetes.io/name": "prometheus"}},
    "monitoring": {"labels": {"release": "kube-prometheus-stack"},
                   "podMonitor": {"enabled": True, "bearerTokenSecret": {"name": "engine-metrics", "key": "token"}},
                   "serviceMonitor": {"enabled": True}},
    "grafanaDashboard": {"enabled": True},
}

SCENARIOS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "cluster-all-on": ALL_ON,
    # The watched namespace differs from the release namespace: the router-key Role path.
    "namespaced-all-on": {**ALL_ON, "rbac": {"scope": "namespaced", "watchNamespaces": ["ml-models"]}},
    "namespaced-defaults": {"rbac": {"scope": "namespaced"}},
    "namespaced-no-scanning-standalone": {"rbac": {"scope": "namespaced", "kopfScanning": False}},
    "namespaced-operator-only": {"rbac": {"scope": "namespaced", "watchNamespaces": ["a"]},
                                 "router": {"enabled": False}, "operator": {"peering": {"enabled": True}}},
    "wake-lease-none": {"router": {"wakeLease": "none", "apiKey": {"existingSecret": "my-keys"}}},
}

# Groups kubernetes-validate has no schema for; their objects get a shape check instead.
CRD_GROUPS = {"monitoring.coreos.com", "kopf.dev"}


# --- rendering ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _chart() -> Any:
    return helm.Chart.load(str(CHART))


@functools.lru_cache(maxsize=None)
def _render_cached(key: str) -> tuple[dict[str, str], tuple[dict[str, Any], ...]]:
    values = json.loads(key)
    files = _chart().render(values, name=RELEASE, namespace=NAMESPACE)
    objs: list[dict[str, Any]] = []
    for path, text in sorted(files.items()):
        if path.endswith(".txt"):
            continue
        objs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return files, tuple(objs)


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    return list(_render_cached(json.dumps(values, sort_keys=True))[1])


def render_files(values: dict[str, Any]) -> dict[str, str]:
    return _render_cached(json.dumps(values, sort_keys=True))[0]


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container_args(objs: list[dict[str, Any]], deployment: str) -> list[str]:
    c = one(objs, "Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["tidal"]
    return list(c["args"])


# --- rendering, schema, lint -------------------------------------------------------------

@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_object_validates(scenario: str) -> None:
    objs = render(SCENARIOS[scenario])
    assert objs
    for obj in objs:
        group = obj["apiVersion"].rpartition("/")[0]
        where = f"{scenario}: {obj['kind']}/{obj['metadata']['name']}"
        if group in CRD_GROUPS:
            check_crd_object_shape(obj)
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where}: {exc.message} at {list(exc.path)}")
        # Namespaced kinds carry their namespace (GitOps tools apply without a default).
        if obj["kind"] not in {"ClusterRole", "ClusterRoleBinding"}:
            assert obj["metadata"].get("namespace"), where


def check_crd_object_shape(obj: dict[str, Any]) -> None:
    """The fields Prometheus Operator and kopf need, since no schema is at hand offline."""
    kind, meta = obj["kind"], obj["metadata"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", meta["name"]) and len(meta["name"]) <= 63
    if kind in {"PodMonitor", "ServiceMonitor"}:
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        spec = obj["spec"]
        assert spec["selector"]["matchLabels"]
        assert "any" in spec["namespaceSelector"] or spec["namespaceSelector"]["matchNames"]
        endpoints = spec["podMetricsEndpoints" if kind == "PodMonitor" else "endpoints"]
        for ep in endpoints:
            assert set(ep) <= {"port", "path", "interval", "relabelings", "authorization"}, ep
            assert ep["path"] == "/metrics" and isinstance(ep["port"], str)
            if "authorization" in ep:
                assert ep["authorization"]["type"] == "Bearer"
                assert set(ep["authorization"]["credentials"]) == {"name", "key"}
    elif kind in {"KopfPeering", "ClusterKopfPeering"}:
        assert obj["apiVersion"] == "kopf.dev/v1"
        assert set(obj) == {"apiVersion", "kind", "metadata"}  # kopf writes only status
        assert ("namespace" in meta) == (kind == "KopfPeering")
    else:
        pytest.fail(f"no shape check for {kind}")


@pytest.mark.parametrize("scenario", ["defaults", "cluster-all-on", "namespaced-all-on"])
def test_helm_lint_is_clean(scenario: str) -> None:
    report = helm.lint(str(CHART), SCENARIOS[scenario], strict=True, namespace=NAMESPACE, kube_version="v1.33.0")
    assert report["errors"] == []
    # Severity 1 is informational ("icon is recommended"); warnings and errors fail.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values, message", [
    ({"rbac": {"scope": "namespaced", "watchNamespaces": ["a", "b"]}}, "watch one namespace or all"),
    ({"rbac": {"scope": "everywhere"}}, "rbac.scope must be"),
    ({"router": {"wakeLease": "etcd"}}, "router.wakeLease must be"),
    ({"router": {"apiKey": {"generate": True, "existingSecret": "x"}}}, "not both"),
])
def test_bad_values_fail_with_a_message(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        _chart().render(values, name=RELEASE, namespace=NAMESPACE)


# --- CRDs ---------------------------------------------------------------------------------

def test_chart_crds_are_the_repository_crds() -> None:
    # Byte-for-byte: crds/ is the single source of truth, the chart holds a copy.
    # To update: cp crds/*.yaml charts/tidal/crds/
    for src in sorted((ROOT / "crds").glob("*.yaml")):
        copy = CHART / "crds" / src.name
        assert copy.exists(), f"charts/tidal/crds/{src.name} is missing: cp crds/*.yaml charts/tidal/crds/"
        assert copy.read_bytes() == src.read_bytes(), f"charts/tidal/crds/{src.name} differs from crds/: copy it again"
    # Nothing else: kopf's peering CRDs live in crds/ too.
    extra = {p.name for p in (CHART / "crds").iterdir()} - {p.name for p in (ROOT / "crds").iterdir()}
    assert extra == set()


def test_chart_crds_validate() -> None:
    for path in sorted((CHART / "crds").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _strip_extensions(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _strip_extensions(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if isinstance(schema, list):
        return [_strip_extensions(x) for x in schema]
    return schema


def test_examples_validate_against_the_chart_crd() -> None:
    crd = yaml.safe_load((CHART / "crds" / "tidal.dev_llmservices.yaml").read_text())
    schema = _strip_extensions(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    assert examples
    seen = 0
    for path in examples:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == crd["spec"]["names"]["kind"]:
                assert doc["apiVersion"] == f"{crd['spec']['group']}/{crd['spec']['versions'][0]['name']}"
                # OpenAPI v3.0 schemas are Draft 4 (boolean exclusiveMinimum).
                jsonschema.Draft4Validator(schema).validate(doc)
                seen += 1
    assert seen >= len(examples)


# --- RBAC: exactly what the code calls -----------------------------------------------------

Perm = tuple[str, str, str, str, str]  # (namespace or "*", apiGroup, resource, verb, resourceName or "")

# Kubernetes-client method → (apiGroup, resource) and verb, for the calls the code makes.
_VERB_PREFIXES = {"list": "list", "read": "get", "create": "create", "patch": "patch", "replace": "update",
                  "delete": "delete"}
_CORE_KINDS = {"pod": "pods", "secret": "secrets", "service": "services", "event": "events",
               "namespace": "namespaces", "config_map": "configmaps"}
_GROUP_KINDS = {"lease": ("coordination.k8s.io", "leases")}
# The routers' held-demand Leases live in the release namespace only (router writes, operator lists).
DEMAND_LEASES = "leases"
# Secrets beyond a get by name (the router's key copies: operator writes, router lists/watches):
# release namespace only.
def _release_namespace_only(call: tuple[str, str, str]) -> bool:
    return call[1] == DEMAND_LEASES or (call[1] == "secrets" and call[2] != "get")


def _method_to_perms(name: str, plural_hint: str | None) -> set[tuple[str, str, str]]:
    verb_word, _, rest = name.partition("_")
    verb = _VERB_PREFIXES.get(verb_word)
    if verb is None:
        return set()
    rest = rest.removeprefix("namespaced_").removeprefix("cluster_").removesuffix("_for_all_namespaces")
    subresource = ""
    for suffix in ("_status", "_scale"):
        if rest.endswith(suffix):
            rest, subresource = rest[: -len(suffix)], "/" + suffix[1:]
    if rest == "custom_object":
        # Only LLMServices are custom objects the operator/router touch (plural=L.PLURAL).
        assert plural_hint in {"PLURAL", "llmservices"}, f"{name}: unknown custom resource {plural_hint}"
        return {("tidal.dev", "llmservices" + subresource, verb)}
    if rest in _CORE_KINDS:
        return {("", _CORE_KINDS[rest] + subresource, verb)}
    if rest in _GROUP_KINDS:
        group, resource = _GROUP_KINDS[rest]
        return {(group, resource + subresource, verb)}
    return set()


def calls_in_code(paths: list[Path]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) for every kubernetes(-asyncio) client call in these files.
    A module that streams with `watch.Watch()` watches what it lists."""
    found: set[tuple[str, str, str]] = set()
    for path in paths:
        source = path.read_text()
        lines = source.splitlines()
        module_calls: set[tuple[str, str, str]] = set()
        watches = False
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Attribute):
                continue
            if node.attr == "Watch":
                watches = True
            plural_hint: str | None = None
            if "custom_object" in node.attr:
                # The plural sits in the call or the kwargs dict beside it (same or next lines).
                m = re.search(r"plural=(?:L\.)?\"?(\w+)", " ".join(lines[node.lineno - 1: node.lineno + 2]))
                plural_hint = m.group(1) if m else None
            module_calls |= _method_to_perms(node.attr, plural_hint)
        if watches:
            module_calls |= {(g, r, "watch") for g, r, v in module_calls if v == "list"}
        found |= module_calls
    return found


def router_calls() -> set[tuple[str, str, str]]:
    return calls_in_code(sorted((OPERATOR_PKG / "router").glob("*.py")))


_HTTP_VERBS = {"POST": "create", "PATCH": "patch", "DELETE": "delete", "PUT": "update"}


def _path_templates(node: ast.AST, func: ast.AST, labels: dict[str, str]) -> list[str]:
    """The URL path(s) an expression builds, with "{}" for every variable part."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        out = [""]
        for part in node.values:
            if isinstance(part, ast.Constant):
                out = [o + part.value for o in out]
            elif isinstance(part.value, ast.Attribute) and part.value.attr in labels:  # L.GROUP etc.
                out = [o + labels[part.value.attr] for o in out]
            else:
                out = [o + "{}" for o in out]
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return [a + b for a in _path_templates(node.left, func, labels) for b in _path_templates(node.right, func, labels)]
    if isinstance(node, ast.IfExp):
        return _path_templates(node.body, func, labels) + _path_templates(node.orelse, func, labels)
    if isinstance(node, ast.Name):  # a local assigned once in the same function
        for stmt in ast.walk(func):
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == node.id for t in stmt.targets):
                return _path_templates(stmt.value, func, labels)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "_llm_path":
        # Kube._llm_path(namespace[, name]): the LLMService collection or one object.
        base = f"/apis/{labels['GROUP']}/{labels['VERSION']}/namespaces/{{}}/{labels['PLURAL']}"
        return [base + "/{}" if len(node.args) > 1 else base]
    return []


def _path_to_perm(method: str, path: str) -> tuple[str, str, str]:
    m = re.fullmatch(r"/api/v1(?:/namespaces/\{\})?/(\w+)(/\{\})?(/\w+)?", path) or \
        re.fullmatch(r"/apis/([\w.]+)/\w+(?:/namespaces/\{\})?/(\w+)(/\{\})?(/\w+)?", path)
    assert m, f"unrecognised API path {path}"
    if path.startswith("/api/v1"):
        group, (resource, named, sub) = "", m.groups()
    else:
        group, resource, named, sub = m.groups()
    verb = ("get" if named else "list") if method == "GET" else _HTTP_VERBS[method]
    return group, resource + (sub or ""), verb


def operator_rest_calls() -> set[tuple[str, str, str]]:
    """Every `request("VERB", path)` the operator makes (kube.py and its callers)."""
    from tidal_operator import labels as L

    labels = {k: v for k, v in vars(L).items() if k.isupper() and isinstance(v, str)}
    found: set[tuple[str, str, str]] = set()
    for path in operator_sources():
        tree = ast.parse(path.read_text())
        for func in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for call in (n for n in ast.walk(func) if isinstance(n, ast.Call)):
                if not (isinstance(call.func, ast.Attribute) and call.func.attr == "request" and len(call.args) >= 2):
                    continue
                method = call.args[0]
                if not (isinstance(method, ast.Constant) and method.value in {"GET", *_HTTP_VERBS}):
                    continue  # e.g. the engine HTTP client's request(method, url)
                paths = _path_templates(call.args[1], func, labels)
                assert paths, f"{path.name}:{call.lineno}: can't tell which API path this request uses"
                found |= {_path_to_perm(method.value, p) for p in paths}
    return found


def operator_sources() -> list[Path]:
    # The operator package minus the router and the local control plane (dev/ is not deployed).
    return [p for p in OPERATOR_PKG.rglob("*.py") if not ({"router", "dev"} & set(p.relative_to(OPERATOR_PKG).parts))]


def kopf_calls() -> set[tuple[str, str, str]]:
    """What kopf itself does for the handlers registered in handlers.py (read from kopf 1.45's
    source): it lists and watches every resource with an on.* handler, and patches the ones with
    on.create/update/resume (its last-handled-configuration and progress annotations). Its
    posted Events are core/v1 creates. Peering and scanning are in PEERING_VERBS and KOPF_SCANNING."""
    from tidal_operator import labels as L

    tree = ast.parse((OPERATOR_PKG / "handlers.py").read_text())
    found: set[tuple[str, str, str]] = {("", "events", "create")}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "on"):
            continue
        kind = node.func.attr
        if kind in {"login", "startup", "cleanup", "probe"}:
            continue
        group, _, plural = (a.value if isinstance(a, ast.Constant) else getattr(L, a.attr) for a in node.args[:3])
        found |= {(group, plural, "list"), (group, plural, "watch")}
        if kind in {"create", "update", "resume", "delete", "field"}:
            found.add((group, plural, "patch"))
    return found


KOPF_SCANNING = {("apiextensions.k8s.io", "customresourcedefinitions", "list"),
                 ("apiextensions.k8s.io", "customresourcedefinitions", "watch")}
KOPF_NAMESPACES = {("", "namespaces", "list"), ("", "namespaces", "watch")}  # namespaced kopf only
PEERING_VERBS = ("list", "watch", "patch")  # kopf: watch the peering object, patch heartbeats


def owner_reference_calls() -> set[tuple[str, str, str]]:
    """What the operator's ownerReferences need beyond its own calls: setting
    `blockOwnerDeletion: true` on a dependent requires `update` on the owner's `finalizers`
    subresource under the OwnerReferencesPermissionEnforcement admission plugin (OpenShift's
    default), read from the ownerReference the operator actually writes."""
    from tidal_operator import labels as L
    from tidal_operator.reconcile.manifests import owner_reference

    ref = owner_reference({"metadata": {"name": "m", "uid": "u"}})
    return {(L.GROUP, f"{L.PLURAL}/finalizers", "update")} if ref.get("blockOwnerDeletion") else set()


def operator_calls() -> set[tuple[str, str, str]]:
    return operator_rest_calls() | kopf_calls() | owner_reference_calls()


def effective_permissions(objs: list[dict[str, Any]], service_account: str) -> set[Perm]:
    """What the bindings give this ServiceAccount, flattened."""
    roles = {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o
             for o in objs if o["kind"] in {"Role", "ClusterRole"}}
    perms: set[Perm] = set()
    for b in objs:
        if b["kind"] not in {"RoleBinding", "ClusterRoleBinding"}:
            continue
        if not any(s["kind"] == "ServiceAccount" and s["name"] == service_account and s["namespace"] == NAMESPACE
                   for s in b["subjects"]):
            continue
        ns = b["metadata"].get("namespace", "")
        ref = b["roleRef"]
        role = roles[(ref["kind"], ns if ref["kind"] == "Role" else "", ref["name"])]
        scope = ns if b["kind"] == "RoleBinding" else "*"
        for rule in role["rules"]:
            for g in rule["apiGroups"]:
                for r in rule["resources"]:
                    for v in rule["verbs"]:
                        for rn in rule.get("resourceNames") or [""]:
                            perms.add((scope, g, r, v, rn))
    return perms


def scoped(scope: str, triples: set[tuple[str, str, str]]) -> set[Perm]:
    return {(scope, g, r, v, "") for g, r, v in triples}


def expected_operator(values: dict[str, Any]) -> set[Perm]:
    op = values.get("operator", {})
    rbac = values.get("rbac", {})
    cluster = rbac.get("scope", "cluster") == "cluster"
    peering = op.get("peering", {}).get("enabled") or op.get("replicas", 1) > 1
    calls = operator_calls()
    demand = {c for c in calls if _release_namespace_only(c)}
    calls -= demand
    # Secrets are listed in the served namespaces too, read-only: the tenants' client-key
    # Secrets, found by label (controller/router_secrets.py); writes stay in the release namespace.
    calls |= {("", "secrets", "list")}
    release_ns = scoped(NAMESPACE, demand) if values.get("router", {}).get("enabled", True) else set()
    # The peering gate's get of the peering object is found in the code; kopf adds the rest.
    peer_calls = {c for c in calls if c[0] == "kopf.dev"}
    ns_rules = {c for c in calls if c[0] != "kopf.dev"}
    if cluster:
        out = scoped("*", ns_rules | KOPF_SCANNING)
        if peering:
            out |= scoped("*", {(g, r, v) for g, r, v in peer_calls if r == "clusterkopfpeerings"}
                          | {("kopf.dev", "clusterkopfpeerings", v) for v in PEERING_VERBS})
        return out | release_ns
    if peering:
        ns_rules |= {(g, r, v) for g, r, v in peer_calls if r == "kopfpeerings"}
        ns_rules |= {("kopf.dev", "kopfpeerings", v) for v in PEERING_VERBS}
    out: set[Perm] = set()
    for ns in rbac.get("watchNamespaces") or [NAMESPACE]:
        out |= scoped(ns, ns_rules)
    if rbac.get("kopfScanning", True):
        out |= scoped("*", KOPF_SCANNING | KOPF_NAMESPACES)
    return out | release_ns


def expected_router(values: dict[str, Any]) -> set[Perm]:
    router = values.get("router", {})
    if router.get("enabled") is False:
        return set()
    calls = router_calls()
    if router.get("wakeLease") == "none":
        # --wake-lease none: the lease (pods get/patch) is never constructed.
        calls -= {("", "pods", "get"), ("", "pods", "patch")}
    demand = {c for c in calls if _release_namespace_only(c)}
    calls -= demand | {("", "secrets", "get")}
    # The router reads no Secret outside the release namespace: there, the operator's key
    # copies (list/watch) and its own client-key Secret (get, that name only).
    secret = router.get("apiKey", {}).get("existingSecret") or f"{RELEASE}-router-api-key"
    demand_perms = scoped(NAMESPACE, demand) | {(NAMESPACE, "", "secrets", "get", secret)}
    rbac = values.get("rbac", {})
    if rbac.get("scope", "cluster") == "cluster":
        return scoped("*", calls) | demand_perms
    watched = rbac.get("watchNamespaces") or [NAMESPACE]
    out: set[Perm] = set()
    for ns in watched:
        out |= scoped(ns, calls)
    if NAMESPACE not in watched:
        secret = router.get("apiKey", {}).get("existingSecret") or f"{RELEASE}-router-api-key"
        out.add((NAMESPACE, "", "secrets", "get", secret))  # its client-key Secret, that one only
    return out | demand_perms


def test_router_calls_found_in_code() -> None:
    # The scan itself: if the router's client calls change, this and docs/router.md change too.
    assert router_calls() == {
        ("tidal.dev", "llmservices", "list"), ("tidal.dev", "llmservices", "watch"),
        ("", "pods", "list"), ("", "pods", "watch"), ("", "pods", "get"), ("", "pods", "patch"),
        ("", "secrets", "get"), ("", "secrets", "list"), ("", "secrets", "watch"),
        ("coordination.k8s.io", "leases", "create"), ("coordination.k8s.io", "leases", "patch"),
        ("coordination.k8s.io", "leases", "delete"),
    }


def test_operator_calls_found_in_code() -> None:
    # The scan itself, pinned: a new API call in the operator shows up here and in the chart.
    assert operator_rest_calls() == {
        ("tidal.dev", "llmservices", "get"), ("tidal.dev", "llmservices", "list"),
        ("tidal.dev", "llmservices/status", "patch"),
        ("", "pods", "get"), ("", "pods", "list"), ("", "pods", "create"), ("", "pods", "delete"),
        ("", "pods", "patch"), ("", "services", "get"),
        ("policy", "poddisruptionbudgets", "get"), ("policy", "poddisruptionbudgets", "create"),
        ("policy", "poddisruptionbudgets", "patch"),
        *{("autoscaling", "horizontalpodautoscalers", v) for v in ("get", "create", "patch", "delete")},
        *{("keda.sh", "scaledobjects", v) for v in ("get", "create", "patch", "delete")}, ("", "services", "create"), ("", "services", "patch"),
        *{("resource.k8s.io", "resourceclaims", v) for v in ("get", "create", "patch")},
        ("", "secrets", "get"), ("", "events", "create"),
        ("kopf.dev", "kopfpeerings", "get"), ("kopf.dev", "clusterkopfpeerings", "get"),
        ("coordination.k8s.io", "leases", "list"),
        ("", "secrets", "list"), ("", "secrets", "create"), ("", "secrets", "patch"), ("", "secrets", "delete"),
    }
    assert owner_reference_calls() == {("tidal.dev", "llmservices/finalizers", "update")}
    assert kopf_calls() == {
        ("", "events", "create"),
        ("tidal.dev", "llmservices", "list"), ("tidal.dev", "llmservices", "watch"),
        ("tidal.dev", "llmservices", "patch"), ("", "pods", "list"), ("", "pods", "watch"),
    }


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rbac_is_exactly_what_the_code_calls(scenario: str) -> None:
    values = SCENARIOS[scenario]
    objs = render(values)
    for component, expected in (("operator", expected_operator(values)), ("router", expected_router(values))):
        got = effective_permissions(objs, f"{RELEASE}-{component}")
        assert got - expected == set(), f"{component}: extra permissions"
        assert expected - got == set(), f"{component}: missing permissions"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_router_reads_secrets_only_in_its_own_namespace(scenario: str) -> None:
    # Issue 21: it used to get every Secret in the cluster (engine keys). Now the operator
    # copies the keys it needs into the release namespace, and only there may it read.
    perms = effective_permissions(render(SCENARIOS[scenario]), f"{RELEASE}-router")
    secrets = {p for p in perms if p[2] == "secrets"}
    assert all(scope == NAMESPACE for scope, *_ in secrets), secrets
    assert {(v, rn) for _, _, _, v, rn in secrets if v == "get"} <= {("get", rn) for *_, rn in secrets if rn}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rbac_has_no_wildcards_and_secrets_are_read_only(scenario: str) -> None:
    for role in (o for o in render(SCENARIOS[scenario]) if o["kind"] in {"Role", "ClusterRole"}):
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field], (role["metadata"]["name"], rule)
            if "secrets" in rule["resources"] and not set(rule["verbs"]) <= {"get", "list"}:
                # Only the key copies in the release namespace: the router lists/watches them,
                # the operator writes them. Everywhere else Secrets are read-only.
                assert role["kind"] == "Role" and role["metadata"]["namespace"] == NAMESPACE, (role, rule)
                assert role["metadata"]["name"].endswith("-router-demand"), role["metadata"]["name"]


def test_namespaced_mode_has_no_namespaced_cluster_grants() -> None:
    # In namespaced mode the only ClusterRole is kopf's scanning: cluster-scoped kinds only.
    objs = render(SCENARIOS["namespaced-all-on"])
    for role in by_kind(objs, "ClusterRole"):
        assert role["metadata"]["name"].endswith("-kopf-scanning")
        kinds = {r for rule in role["rules"] for r in rule["resources"]}
        assert kinds <= {"customresourcedefinitions", "namespaces"}
    assert not by_kind(render(SCENARIOS["namespaced-no-scanning-standalone"]), "ClusterRole")


# --- the flags the chart passes --------------------------------------------------------------

@pytest.mark.parametrize("scenario", SCENARIOS)
def test_router_args_parse_with_the_routers_own_parser(scenario: str) -> None:
    from tidal_operator.router.app import build_arg_parser

    values = SCENARIOS[scenario]
    objs = render(values)
    if values.get("router", {}).get("enabled") is False:
        assert not [d for d in by_kind(objs, "Deployment") if d["metadata"]["name"].endswith("-router")]
        return
    args = container_args(objs, f"{RELEASE}-router")
    assert args[0] == "router"
    parsed = build_arg_parser().parse_args(args[1:])
    assert parsed.in_cluster and parsed.host == "0.0.0.0"
    assert not parsed.api_key, "client keys must never be command-line arguments"
    secret = values.get("router", {}).get("apiKey", {}).get("existingSecret") or f"{RELEASE}-router-api-key"
    assert parsed.api_keys_secret == f"{NAMESPACE}/{secret}"
    cluster = values.get("rbac", {}).get("scope", "cluster") == "cluster"
    assert parsed.namespace == (None if cluster else (values["rbac"].get("watchNamespaces") or [NAMESPACE])[0])


def operator_flags(args: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def test_operator_args() -> None:
    default = container_args(render({}), f"{RELEASE}-operator")
    assert default[0] == "operator"
    assert "--all-namespaces" in default and "--standalone" in default
    assert "--liveness=http://0.0.0.0:8080/healthz" in default
    namespaced = container_args(render(SCENARIOS["namespaced-operator-only"]), f"{RELEASE}-operator")
    assert [a for a in namespaced if a.startswith("--namespace")] == ["--namespace=a"]
    assert "--peering=tidal" in namespaced and "--standalone" not in namespaced


def test_operator_flags_exist_in_the_cli() -> None:
    # `tidal operator` is wired in tidal_operator/cli.py: every flag the chart passes must exist.
    if not (OPERATOR_PKG / "cli.py").exists():
        pytest.skip("tidal_operator/cli.py is not there yet")
    flags = set()
    for scenario in SCENARIOS.values():
        flags |= operator_flags(container_args(render(scenario), f"{RELEASE}-operator"))
    flags.discard("--dummy-extra")  # operator.extraArgs in ALL_ON
    out = subprocess.run([sys.executable, "-c", "import sys; from tidal_operator.cli import main; sys.exit(main())",
                          "operator", "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    missing = sorted(f for f in flags if f not in out.stdout)
    assert not missing, f"`tidal operator` lacks {missing}"


def test_peering_follows_replicas() -> None:
    one_replica = render({})
    dep = one(one_replica, "Deployment", f"{RELEASE}-operator")
    assert dep["spec"]["strategy"]["type"] == "Recreate"  # never two standalone operators at once
    assert not by_kind(one_replica, "ClusterKopfPeering")
    ha = render(SCENARIOS["cluster-all-on"])
    dep = one(ha, "Deployment", f"{RELEASE}-operator")
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
    assert "--peering=tidal" in container_args(ha, f"{RELEASE}-operator")
    assert [o["metadata"]["name"] for o in by_kind(ha, "ClusterKopfPeering")] == ["tidal"]
    env = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"  # kopf's identity
    ns = render(SCENARIOS["namespaced-operator-only"])
    assert [o["metadata"]["namespace"] for o in by_kind(ns, "KopfPeering")] == ["a"]


# --- security --------------------------------------------------------------------------------

def pod_specs(objs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for o in objs:
        if o["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job"}:
            yield o["metadata"]["name"], o["spec"]["template"]["spec"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_container_is_locked_down(scenario: str) -> None:
    specs = list(pod_specs(render(SCENARIOS[scenario])))
    assert specs
    for name, spec in specs:
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] > 0, name
        assert psc["seccompProfile"]["type"] == "RuntimeDefault", name
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec.get("initContainers", []) + spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert sc["runAsNonRoot"] is True, (name, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), (name, c["name"])
            assert "privileged" not in sc or sc["privileged"] is False
            # A read-only root needs a writable /tmp.
            tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert tmp and "emptyDir" in volumes[tmp[0]["name"]], (name, c["name"])
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], (name, c["name"])
            assert c["livenessProbe"]["httpGet"] and c["readinessProbe"]["httpGet"], (name, c["name"])
        assert not spec.get("hostNetwork") and not spec.get("hostPID")


SECRETISH = re.compile(r"(KEY|TOKEN|PASSWORD|SECRET)", re.I)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_no_secret_values_in_plain_text(scenario: str) -> None:
    values = SCENARIOS[scenario]
    objs = render(values)
    secrets = by_kind(objs, "Secret")
    if values.get("router", {}).get("apiKey", {}).get("generate"):
        # The one exception, asked for explicitly: a generated key, base64 as Secrets always are.
        assert len(secrets) == 1 and "stringData" not in secrets[0]
        (key, value), = secrets[0]["data"].items()
        assert key == "api-key" and len(base64.b64decode(value)) >= 40
        assert secrets[0]["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    else:
        assert secrets == []
    for name, spec in pod_specs(objs):
        for c in spec["containers"]:
            for env in c.get("env", []):
                if SECRETISH.search(env["name"]):
                    assert "value" not in env and "secretKeyRef" in env["valueFrom"], (name, env["name"])
            assert not [a for a in c.get("args", []) if a.startswith(("--api-key=", "--api-key "))]
    for cm in by_kind(objs, "ConfigMap"):
        assert not SECRETISH.search(" ".join(cm["data"])), cm["metadata"]["name"]


def test_generated_key_differs_per_render_but_is_never_in_defaults() -> None:
    # Randomness is why docs/gitops.md says: use existingSecret under Argo CD / Flux.
    files = _chart().render({"router": {"apiKey": {"generate": True}}}, name=RELEASE, namespace=NAMESPACE)
    again = _chart().render({"router": {"apiKey": {"generate": True}}}, name=RELEASE, namespace=NAMESPACE)
    assert files["tidal/templates/router/secret.yaml"] != again["tidal/templates/router/secret.yaml"]
    assert "kind: Secret" not in "".join(render_files({}).values())


# --- router, options -------------------------------------------------------------------------

def test_router_hpa_leaves_replicas_out() -> None:
    objs = render(SCENARIOS["cluster-all-on"])
    assert "replicas" not in one(objs, "Deployment", f"{RELEASE}-router")["spec"]
    hpa = one(objs, "HorizontalPodAutoscaler", f"{RELEASE}-router")
    assert hpa["spec"]["scaleTargetRef"]["name"] == f"{RELEASE}-router"
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert one(render({}), "Deployment", f"{RELEASE}-router")["spec"]["replicas"] == 2
    pdb = one(objs, "PodDisruptionBudget", f"{RELEASE}-router")
    router_labels = one(objs, "Deployment", f"{RELEASE}-router")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= router_labels.items()


def test_router_service_reaches_the_router_pods() -> None:
    objs = render({})
    svc = one(objs, "Service", f"{RELEASE}-router")
    pod = one(objs, "Deployment", f"{RELEASE}-router")["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["targetPort"] == pod["spec"]["containers"][0]["ports"][0]["name"] == "http"
    container = pod["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"  # after the first lists, not while draining
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"


def test_router_shutdown_fits_in_its_grace_period() -> None:
    # preStop pause, then --shutdown-grace for in-flight requests, within terminationGracePeriodSeconds.
    pod = one(render({}), "Deployment", f"{RELEASE}-router")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = int(next(a for a in container["args"] if a.startswith("--shutdown-grace=")).split("=", 1)[1])
    assert pause > 0 and grace > 0
    assert pause + grace < pod["terminationGracePeriodSeconds"]


def test_network_policy_admits_exactly_router_operator_and_metrics() -> None:
    objs = render(SCENARIOS["namespaced-all-on"])
    (np,) = by_kind(objs, "NetworkPolicy")
    assert np["metadata"]["namespace"] == "ml-models"  # where the engines are
    assert np["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "tidal-engine"}
    assert np["spec"]["policyTypes"] == ["Ingress"]
    peers, metrics = np["spec"]["ingress"]
    for rule in (peers, metrics):
        assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    pod_labels = [one(objs, "Deployment", f"{RELEASE}-{c}")["spec"]["template"]["metadata"]["labels"]
                  for c in ("router", "operator")]
    assert len(peers["from"]) == 2
    for peer, labels in zip(peers["from"], pod_labels):
        assert peer["podSelector"]["matchLabels"].items() <= labels.items()
        assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": NAMESPACE}
    assert metrics["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}


def test_monitors_select_engines_and_router() -> None:
    objs = render(SCENARIOS["cluster-all-on"])
    pm = one(objs, "PodMonitor", f"{RELEASE}-engines")
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "tidal-engine"}
    assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    sm = one(objs, "ServiceMonitor", f"{RELEASE}-router")
    svc = one(objs, "Service", f"{RELEASE}-router")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["authorization"]["credentials"]["name"] == f"{RELEASE}-router-api-key"
    ns = one(render(SCENARIOS["namespaced-all-on"]), "PodMonitor", f"{RELEASE}-engines")
    assert ns["spec"]["namespaceSelector"] == {"matchNames": ["ml-models"]}
    # Without the ServiceMonitor, the PodMonitor option scrapes every router Pod too (with its key).
    alone = render({"monitoring": {"podMonitor": {"enabled": True}}})
    pm = one(alone, "PodMonitor", f"{RELEASE}-router")
    router_pod = one(alone, "Deployment", f"{RELEASE}-router")["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= router_pod.items()
    assert pm["spec"]["podMetricsEndpoints"][0]["authorization"]["credentials"]["name"] == f"{RELEASE}-router-api-key"
    assert not [o for o in objs if o["kind"] == "PodMonitor" and o["metadata"]["name"].endswith("-router")]


def test_grafana_dashboard_queries_the_engine_metrics() -> None:
    objs = render(SCENARIOS["cluster-all-on"])
    cm = one(objs, "ConfigMap", f"{RELEASE}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["tidal.json"])
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in dash["panels"]}
    everything = " ".join(exprs.values())
    # Every engine query matches both --metrics-prefix choices (tidal: and vllm:).
    for name in ("generation_tokens_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "num_requests_waiting", "kv_cache_usage_perc",
                 "engine_sleep_state"):
        assert f'{{__name__=~"(tidal|vllm):{name}"' in everything, name
    assert "tidal:" not in everything.replace("(tidal|vllm):", "")
    assert "tidal_router_held_requests" in everything
    assert sum("histogram_quantile" in e for e in exprs.values()) == 2
    assert any("replica" in title.lower() for title in exprs)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_notes_tell_how_to_reach_the_endpoint() -> None:
    notes = render_files({})["tidal/templates/NOTES.txt"]
    assert f"http://{RELEASE}-router.{NAMESPACE}.svc.cluster.local:80/v1" in notes
    assert "curl" in notes and "Authorization: Bearer $TIDAL_API_KEY" in notes
    assert f"create secret generic {RELEASE}-router-api-key" in notes  # nothing generated by default
    generated = render_files({"router": {"apiKey": {"generate": True}}})["tidal/templates/NOTES.txt"]
    assert "create secret generic" not in generated


def operator_env(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    c = one(objs, "Deployment", f"{RELEASE}-operator")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e for e in c["env"]}


def test_operator_configuration_reaches_what_the_handlers_read() -> None:
    from tidal_operator.controller import env as handlers
    from tidal_operator.scaling import controller

    env = operator_env(render({"engine": {"image": {"repository": "registry.local/tidal-engine", "tag": "cu128"}}}))
    config = handlers.config_from_env({k: v["value"] for k, v in env.items() if "value" in v})
    assert config.default_engine_image == "registry.local/tidal-engine:cu128" and config.namespace is None
    scaling = controller.scaling_config_from_env({k: v["value"] for k, v in env.items() if "value" in v})
    # Held demand from every router replica's Lease, not from one URL (one replica per tick).
    assert scaling.router_demand_namespace == NAMESPACE and scaling.router_urls == ()
    router_args = container_args(render({}), f"{RELEASE}-router")
    assert f"--demand-leases={NAMESPACE}" in router_args
    namespaced = operator_env(render(SCENARIOS["namespaced-all-on"]))
    assert namespaced[handlers.ENV_NAMESPACE]["value"] == "ml-models"
    dra = operator_env(render({"operator": {"gpuShare": {"deviceClassName": "gpu.example.com"}}}))
    assert handlers.config_from_env({k: v["value"] for k, v in dra.items() if "value" in v}
                                    ).gpu_share_device_class == "gpu.example.com"


# --- the values table ------------------------------------------------------------------------

def leaf_keys(tree: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in tree.items():
        path = f"{prefix}{key}"
        # A map that is itself a default (resources, securityContext) is documented as one row.
        if isinstance(value, dict) and value and not _is_documented_as_a_whole(path):
            yield from leaf_keys(value, path + ".")
        else:
            yield path


def _is_documented_as_a_whole(path: str) -> bool:
    return path.rsplit(".", 1)[-1] in {"resources", "podSecurityContext", "securityContext", "labels"}


def test_every_value_is_documented_in_the_chart_readme() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text().split("\n## Values\n", 1)[1]
    rows = set(re.findall(r"^\| `([^`]+)` \|", readme, re.M))
    keys = set(leaf_keys(values))
    assert keys - rows == set(), "values missing from the README table"
    assert rows - keys == set(), "README rows for values that don't exist"
