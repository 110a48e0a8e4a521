"""An emulated Kubernetes API server on aiohttp, for `tidal dev` and tests.

Plain HTTP on loopback, no auth. Serves discovery, CRUD, the four patch types, /status,
watches with resourceVersion/bookmarks/timeouts, selectors, finalizers, garbage collection,
CRD registration and pod logs. See docs/dev-control-plane.md for what it does not emulate.

    python -m tidal_operator.dev.apiserver --port 8001 --crds crds/ --kubeconfig .tidal/kubeconfig
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import re
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Awaitable, Callable

from aiohttp import web

from . import protobuf
from .objects import CRD_KEY, ApiError, ObjectApi
from .store import Obj, ResourceType, Selector, SelectorError, Store, Watcher

log = logging.getLogger(__name__)

SERVER_VERSION = {
    "major": "1", "minor": "32", "gitVersion": "v1.32.0-tidal-dev", "gitCommit": "0" * 40,
    "gitTreeState": "clean", "buildDate": "2025-01-01T00:00:00Z", "goVersion": "go1.23",
    "compiler": "gc", "platform": "linux/amd64",
}


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(data), status=status, content_type="application/json")


def _truthy(value: str | None) -> bool:
    return value is not None and value.lower() in ("1", "true", "yes")


# --- Table output (kubectl's `Accept: application/json;as=Table;v=v1;g=meta.k8s.io`) ---------------
# kubectl prints whatever cells the server sends; without Tables it falls back to NAME/AGE.

def wants_table(accept: str) -> bool:
    """True when the client accepts a meta.k8s.io Table (it lists plain JSON as a fallback)."""
    return any("as=Table" in part and "g=meta.k8s.io" in part for part in accept.split(","))


def human_age(timestamp: str | None, now: datetime | None = None) -> str:
    """A short age as kubectl shows it: 42s, 5m10s, 3h, 2d5h, 12d, 2y."""
    if not timestamp:
        return "<unknown>"
    try:
        then = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return "<invalid>"
    seconds = int(((now or datetime.now(timezone.utc)) - then).total_seconds())
    if seconds < 0:
        return "0s"
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if seconds < 120:
        return f"{seconds}s"
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if hours < 3:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if days < 2:
        return f"{hours}h"
    if days < 8:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    if days < 365 * 2:
        return f"{days}d"
    return f"{days // 365}y"


_JSONPATH_TOKEN = re.compile(r"\.([A-Za-z0-9_$-]+)|\[(\d+)\]|\[\?\(@\.([A-Za-z0-9_.]+)\s*==\s*[\"']([^\"']*)[\"']\)\]")


def jsonpath_values(obj: Any, path: str) -> list[Any]:
    """The simple JSONPath subset printer columns use: `.a.b`, `[0]`, and `[?(@.k=="v")]`.
    Returns every match (a filter may match several)."""
    current = [obj]
    pos = 0
    path = path.strip().removeprefix("{").removesuffix("}").removeprefix("$")
    while pos < len(path):
        match = _JSONPATH_TOKEN.match(path, pos)
        if match is None:
            return []
        key, index, filter_key, filter_value = match.groups()
        nxt: list[Any] = []
        for value in current:
            if key is not None and isinstance(value, dict) and key in value:
                nxt.append(value[key])
            elif index is not None and isinstance(value, list) and int(index) < len(value):
                nxt.append(value[int(index)])
            elif filter_key is not None and isinstance(value, list):
                for item in value:
                    found = jsonpath_values(item, "." + filter_key)
                    if found and str(found[0]) == filter_value:
                        nxt.append(item)
        current, pos = nxt, match.end()
    return current


def _cell(values: list[Any], type_: str) -> Any:
    if not values or values[0] is None:
        return None
    if type_ == "date":
        return human_age(str(values[0]))
    if len(values) > 1 or isinstance(values[0], (dict, list)):
        return ",".join(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in values)
    return values[0]


def _column(name: str, type_: str = "string", description: str = "", priority: int = 0,
            format_: str = "") -> Obj:
    return {"name": name, "type": type_, "format": format_, "description": description, "priority": priority}


def _pod_cells(pod: Obj) -> list[Any]:
    status = pod.get("status") or {}
    containers = (pod.get("spec") or {}).get("containers") or []
    statuses = status.get("containerStatuses") or []
    ready = sum(1 for c in statuses if c.get("ready"))
    restarts = sum(int(c.get("restartCount") or 0) for c in statuses)
    reason = status.get("reason") or status.get("phase") or "Pending"
    for c in statuses:  # a waiting or failed container explains more than the phase
        state = c.get("state") or {}
        if (state.get("waiting") or {}).get("reason"):
            reason = state["waiting"]["reason"]
        elif (state.get("terminated") or {}).get("reason") and reason == "Running":
            reason = state["terminated"]["reason"]
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        reason = "Terminating"
    return [f"{ready}/{len(containers)}", reason, restarts, human_age(pod["metadata"].get("creationTimestamp")),
            status.get("podIP") or "<none>", (pod.get("spec") or {}).get("nodeName") or "<none>"]


def _service_cells(svc: Obj) -> list[Any]:
    spec = svc.get("spec") or {}
    ports = ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in spec.get("ports") or []) or "<none>"
    selector = ",".join(f"{k}={v}" for k, v in (spec.get("selector") or {}).items()) or "<none>"
    return [spec.get("type", "ClusterIP"), spec.get("clusterIP") or "<none>", "<none>", ports,
            human_age(svc["metadata"].get("creationTimestamp")), selector]


def _event_cells(event: Obj) -> list[Any]:
    involved = event.get("involvedObject") or {}
    last = event.get("lastTimestamp") or event.get("eventTime") or event["metadata"].get("creationTimestamp")
    return [human_age(last), event.get("type", ""), event.get("reason", ""),
            f"{str(involved.get('kind', '')).lower()}/{involved.get('name', '')}", event.get("message", "")]


# Built-in kinds with columns of their own (as kubectl shows them); others get NAME and AGE.
_BUILTIN_COLUMNS: dict[tuple[str, str], tuple[list[Obj], Callable[[Obj], list[Any]]]] = {
    ("", "pods"): ([_column("Ready"), _column("Status"), _column("Restarts", "integer"), _column("Age"),
                    _column("IP", priority=1), _column("Node", priority=1)], _pod_cells),
    ("", "services"): ([_column("Type"), _column("Cluster-IP"), _column("External-IP"), _column("Port(s)"),
                        _column("Age"), _column("Selector", priority=1)], _service_cells),
    ("", "events"): ([_column("Last Seen"), _column("Type"), _column("Reason"), _column("Object"),
                      _column("Message")], _event_cells),
}


@web.middleware
async def _errors_as_status(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                            ) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return _json(exc.status(), exc.code)
    except SelectorError as exc:
        return _json(ApiError(400, "BadRequest", str(exc)).status(), 400)
    except web.HTTPException:
        raise
    except Exception as exc:  # a bug here must still answer like an API server
        log.exception("internal error on %s %s", request.method, request.path)
        return _json(ApiError(500, "InternalError", f"{type(exc).__name__}: {exc}").status(), 500)


class ApiServer:
    """The aiohttp application around an `ObjectApi`. Build with `start_apiserver()`."""

    def __init__(self, *, history_size: int = 10_000, bookmark_interval_s: float = 30.0,
                 log_dir: str | Path | None = None, auto_create_namespaces: bool = True) -> None:
        self.store = Store(history_size)
        self.api = ObjectApi(self.store, auto_create_namespaces=auto_create_namespaces)
        self.bookmark_interval_s = bookmark_interval_s
        self.log_dir = Path(log_dir) if log_dir else None
        self.address = "127.0.0.1:0"
        self._watchers: set[Watcher] = set()
        self.app = web.Application(middlewares=[_errors_as_status], client_max_size=64 * 1024 * 1024)
        r = self.app.router
        r.add_get("/version", self._version)
        for probe in ("/healthz", "/readyz", "/livez"):
            r.add_get(probe, self._healthy)
        r.add_get("/openapi/v3", self._openapi_index)
        r.add_get("/openapi/v3/{path:.*}", self._openapi_group_version)
        r.add_get("/api", self._core_versions)
        r.add_get("/apis", self._group_list)
        r.add_route("*", "/api/v1", self._core_discovery)
        r.add_route("*", "/api/v1/{tail:.*}", self._core_resource)
        r.add_get("/apis/{group}", self._group)
        r.add_route("*", "/apis/{group}/{version}", self._group_discovery)
        r.add_route("*", "/apis/{group}/{version}/{tail:.*}", self._group_resource)

    def register_crds_from_dir(self, path: str | Path) -> list[str]:
        return self.api.register_crds_from_dir(path)

    async def _version(self, _: web.Request) -> web.Response:
        return _json(SERVER_VERSION)

    async def _healthy(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    # --- discovery -------------------------------------------------------------------------------
    # Plain (non-aggregated) JSON whatever the Accept header asks: kubectl falls back to it.

    async def _core_versions(self, _: web.Request) -> web.Response:
        return _json({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
            {"clientCIDR": "0.0.0.0/0", "serverAddress": self.address}]})

    def _group_entry(self, group: str) -> Obj:
        versions = [v for (g, v) in self.api.by_group_version if g == group]
        preferred = next((rt.versions[0] for rt in self.api.types.values() if rt.group == group), versions[0])
        versions.sort(key=lambda v: v != preferred)
        entries = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {"name": group, "versions": entries, "preferredVersion": entries[0]}

    async def _group_list(self, _: web.Request) -> web.Response:
        groups = sorted({g for (g, _) in self.api.by_group_version if g})
        return _json({"kind": "APIGroupList", "apiVersion": "v1", "groups": [self._group_entry(g) for g in groups]})

    async def _group(self, request: web.Request) -> web.Response:
        group = request.match_info["group"]
        if not any(g == group for (g, _) in self.api.by_group_version):
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({group})")
        return _json({"kind": "APIGroup", "apiVersion": "v1", **self._group_entry(group)})

    def _resource_list(self, group: str, version: str) -> Obj:
        resources = []
        for rt in self.api.by_group_version.get((group, version), {}).values():
            entry: Obj = {"name": rt.plural, "singularName": rt.singular, "namespaced": rt.namespaced,
                          "kind": rt.kind, "verbs": rt.verbs}
            if rt.short_names:
                entry["shortNames"] = rt.short_names
            if rt.categories:
                entry["categories"] = rt.categories
            resources.append(entry)
            if rt.has_status:
                resources.append({"name": f"{rt.plural}/status", "singularName": "", "namespaced": rt.namespaced,
                                  "kind": rt.kind, "verbs": ["get", "patch", "update"]})
            if rt.scale is not None:
                resources.append({"name": f"{rt.plural}/scale", "singularName": "", "namespaced": rt.namespaced,
                                  "group": "autoscaling", "version": "v1", "kind": "Scale",
                                  "verbs": ["get", "patch", "update"]})
            if rt.key == ("", "pods"):
                resources.append({"name": "pods/log", "singularName": "", "namespaced": True, "kind": "Pod",
                                  "verbs": ["get"]})
        group_version = f"{group}/{version}" if group else version
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": resources}

    async def _core_discovery(self, request: web.Request) -> web.Response:
        return _json(self._resource_list("", "v1"))

    async def _group_discovery(self, request: web.Request) -> web.Response:
        group, version = request.match_info["group"], request.match_info["version"]
        if (group, version) not in self.api.by_group_version:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({group}/{version})")
        return _json(self._resource_list(group, version))

    # --- OpenAPI v3 -----------------------------------------------------------------------------
    # No schemas: only PATCH operations that declare the `fieldValidation` query parameter. kubectl
    # then leaves validation to the server (which does none) instead of failing to download
    # OpenAPI, and computes strategic patches for built-in kinds from its compiled-in types.

    async def _openapi_index(self, _: web.Request) -> web.Response:
        paths = {}
        for (group, version) in self.api.by_group_version:
            path = f"apis/{group}/{version}" if group else f"api/{version}"
            paths[path] = {"serverRelativeURL": f"/openapi/v3/{path}?hash={self.store.rv}"}
        return _json({"paths": paths})

    async def _openapi_group_version(self, request: web.Request) -> web.Response:
        parts = request.match_info["path"].split("/")
        if parts[0] == "api" and len(parts) == 2:
            group, version = "", parts[1]
        elif parts[0] == "apis" and len(parts) == 3:
            group, version = parts[1], parts[2]
        else:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if (group, version) not in self.api.by_group_version:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
        paths = {}
        for rt in self.api.by_group_version[(group, version)].values():
            scope = "/namespaces/{namespace}" if rt.namespaced else ""
            paths[f"{prefix}{scope}/{rt.plural}/{{name}}"] = {"patch": {
                "x-kubernetes-group-version-kind": {"group": group, "version": version, "kind": rt.kind},
                "parameters": [{"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}],
                "responses": {"200": {"description": "OK"}},
            }}
        return _json({"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.32.0"},
                      "paths": paths, "components": {"schemas": {}}})

    # --- resources -------------------------------------------------------------------------------

    async def _core_resource(self, request: web.Request) -> web.StreamResponse:
        return await self._resource(request, "", "v1", request.match_info["tail"])

    async def _group_resource(self, request: web.Request) -> web.StreamResponse:
        info = request.match_info
        return await self._resource(request, info["group"], info["version"], info["tail"])

    def _route(self, group: str, version: str, tail: str
               ) -> tuple[ResourceType, str | None, str | None, str | None]:
        """Split a path tail into (resource, namespace, name, subresource)."""
        parts = [p for p in tail.split("/") if p]
        namespace = None
        if len(parts) >= 3 and parts[0] == "namespaces":
            candidate = self.api.lookup(group, version, parts[2])
            if candidate is not None and candidate.namespaced:
                namespace, parts = parts[1], parts[2:]
        plural = parts[0] if parts else ""
        rt = self.api.lookup(group, version, plural)
        if rt is None or len(parts) > 3:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        name = parts[1] if len(parts) > 1 else None
        sub = parts[2] if len(parts) > 2 else None
        if name and rt.namespaced and namespace is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if sub not in (None, "status", "log", "scale") or (sub == "status" and not rt.has_status) or (
                sub == "log" and rt.key != ("", "pods")) or (sub == "scale" and rt.scale is None):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return rt, namespace, name, sub

    async def _resource(self, request: web.Request, group: str, version: str, tail: str) -> web.StreamResponse:
        rt, namespace, name, sub = self._route(group, version, tail)
        query = request.query
        dry_run = bool(query.get("dryRun"))
        method = request.method
        if method == "GET":
            table = sub is None and wants_table(request.headers.get("Accept", ""))
            include = query.get("includeObject", "PartialObjectMetadata")
            if name is None:
                selector = Selector.parse(query.get("labelSelector"), query.get("fieldSelector"))
                if _truthy(query.get("watch")):
                    return await self._watch(request, rt, version, namespace, selector,
                                             table_include=include if table else None)
                listing = self._list(rt, version, namespace, selector)
                if table:
                    return _json(self.table(rt, version, listing["items"], include,
                                            listing["metadata"]["resourceVersion"]))
                return _json(listing)
            if sub == "log":
                if _truthy(query.get("follow")):
                    return await self._follow_pod_log(request, namespace or "", name)
                return self._pod_log(namespace or "", name, query)
            if sub == "scale":
                return _json(self.api.get_scale(rt, namespace, name))
            obj = self.api.present(self.api.get(rt, namespace, name), rt, version)
            if table:
                return _json(self.table(rt, version, [obj], include, obj["metadata"].get("resourceVersion", "")))
            return _json(obj)
        if method == "POST" and name is None:
            obj = self.api.create(rt, namespace, await self._body(request), version=version, dry_run=dry_run)
            return _json(self.api.present(obj, rt, version), 201)
        if method in ("PUT", "PATCH") and name is not None and sub == "scale":
            raw = await request.read()
            return _json(self.api.write_scale(rt, namespace, name, request.content_type if method == "PATCH" else None,
                                              raw, dry_run=dry_run))
        if method == "PUT" and name is not None and sub != "log":
            obj = self.api.update(rt, namespace, name, await self._body(request), subresource=sub, version=version,
                                  dry_run=dry_run)
            return _json(self.api.present(obj, rt, version))
        if method == "PATCH" and name is not None and sub != "log":
            code, obj = self.api.patch(rt, namespace, name, request.content_type, await request.read(),
                                       subresource=sub, version=version, dry_run=dry_run,
                                       field_manager=query.get("fieldManager"), force=_truthy(query.get("force")))
            return _json(self.api.present(obj, rt, version), code)
        if method == "DELETE" and sub is None:
            options = await self._delete_options(request)
            if name is not None:
                obj = self.api.delete(rt, namespace, name, options, dry_run=dry_run)
                return _json(self.api.present(obj, rt, version))
            selector = Selector.parse(query.get("labelSelector"), query.get("fieldSelector"))
            listing = self._list(rt, version, namespace, selector)
            for item in listing["items"]:
                meta = item["metadata"]
                try:
                    self.api.delete(rt, meta.get("namespace"), meta["name"], options, dry_run=dry_run)
                except ApiError:
                    pass
            return _json(listing)
        raise ApiError(405, "MethodNotAllowed", f"the server does not allow this method on the requested resource")

    @staticmethod
    async def _body(request: web.Request) -> Any:
        if "protobuf" in request.content_type:
            try:  # kubectl's imperative generators: create secret, configmap, namespace
                return protobuf.decode(await request.read())
            except protobuf.ProtobufError as exc:
                raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format "
                                                            f"({exc}) - accepted media types include: "
                                                            "application/json") from exc
        try:
            return json.loads(await request.read() or b"null")
        except json.JSONDecodeError as exc:
            raise ApiError(400, "BadRequest", f"the body is not JSON: {exc}") from exc

    async def _delete_options(self, request: web.Request) -> dict[str, Any]:
        options: dict[str, Any] = {}
        raw = await request.read()
        if raw:
            body = await self._body(request)
            options.update(body if isinstance(body, dict) else {})
        if "gracePeriodSeconds" in request.query:
            options["gracePeriodSeconds"] = int(request.query["gracePeriodSeconds"])
        if "propagationPolicy" in request.query:
            options["propagationPolicy"] = request.query["propagationPolicy"]
        return options

    def _list(self, rt: ResourceType, version: str, namespace: str | None, selector: Selector) -> Obj:
        items = [self.api.present(obj, rt, version) for obj in self.store.items(rt.key, namespace)
                 if selector.matches(obj)]
        return {"kind": f"{rt.kind}List", "apiVersion": rt.api_version(version),
                "metadata": {"resourceVersion": str(self.store.rv)}, "items": items}

    def _printer_columns(self, rt: ResourceType, version: str) -> list[Obj] | None:
        """A CRD version's additionalPrinterColumns (None for built-ins and CRDs without)."""
        crd = self.store.get(CRD_KEY, None, f"{rt.plural}.{rt.group}") if rt.group else None
        for v in ((crd or {}).get("spec") or {}).get("versions") or []:
            if v.get("name") == version and v.get("additionalPrinterColumns"):
                return list(v["additionalPrinterColumns"])
        return None

    def table(self, rt: ResourceType, version: str, objs: list[Obj], include: str = "PartialObjectMetadata",
              resource_version: str = "") -> Obj:
        """A meta.k8s.io/v1 Table of `objs`: the CRD's printer columns, a built-in's usual
        columns, or NAME and AGE."""
        name_column = _column("Name", format_="name", description="Name must be unique within a namespace.")
        printer = self._printer_columns(rt, version)
        builtin = _BUILTIN_COLUMNS.get(rt.key) if printer is None else None
        if printer is not None:
            columns = [name_column] + [_column(c["name"], c.get("type", "string"), c.get("description", ""),
                                               int(c.get("priority", 0)), c.get("format", "")) for c in printer]
        elif builtin is not None:
            columns = [name_column] + builtin[0]
        else:
            columns = [name_column, _column("Age", "date")]
        rows = []
        for obj in objs:
            meta = obj.get("metadata") or {}
            if printer is not None:
                cells = [meta.get("name")] + [_cell(jsonpath_values(obj, c.get("jsonPath", "")),
                                                    c.get("type", "string")) for c in printer]
            elif builtin is not None:
                cells = [meta.get("name")] + builtin[1](obj)
            else:
                cells = [meta.get("name"), human_age(meta.get("creationTimestamp"))]
            row: Obj = {"cells": cells}
            if include == "Object":
                row["object"] = obj
            elif include != "None":
                row["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": meta}
            rows.append(row)
        return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": resource_version},
                "columnDefinitions": columns, "rows": rows}

    def _log_path(self, namespace: str, name: str, query: Any) -> Path | None:
        pod = self.api.get(self.api.types[("", "pods")], namespace, name)
        containers = [c.get("name") for c in pod.get("spec", {}).get("containers", [])]
        container = query.get("container") or (containers[0] if containers else "")
        if container not in containers:
            raise ApiError(400, "BadRequest", f"container {container} is not valid for pod {name}")
        return self.log_dir / namespace / name / f"{container}.log" if self.log_dir else None

    async def _follow_pod_log(self, request: web.Request, namespace: str, name: str) -> web.StreamResponse:
        """`kubectl logs -f`: what the file holds, then what the kubelet appends, until the Pod
        is gone or finished, or the client leaves."""
        path = self._log_path(namespace, name, request.query)
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        offset = 0
        pods = self.api.types[("", "pods")]
        try:
            while True:
                if path is not None and path.exists():
                    with path.open("rb") as f:
                        f.seek(offset)
                        chunk = f.read()
                    if chunk:
                        offset += len(chunk)
                        await response.write(chunk)
                pod = self.store.get(pods.key, namespace, name)
                if pod is None or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    break
                await asyncio.sleep(0.2)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return response

    def _pod_log(self, namespace: str, name: str, query: Any) -> web.Response:
        path = self._log_path(namespace, name, query)
        text = path.read_text(errors="replace") if path and path.exists() else ""
        if "tailLines" in query:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-int(query["tailLines"]):]) if int(query["tailLines"]) > 0 else ""
        return web.Response(text=text, content_type="text/plain")

    # --- watch -----------------------------------------------------------------------------------

    async def _watch(self, request: web.Request, rt: ResourceType, version: str, namespace: str | None,
                     selector: Selector, table_include: str | None = None) -> web.StreamResponse:
        query = request.query
        watcher = Watcher(rt.key, namespace, selector, asyncio.Queue())
        since = query.get("resourceVersion")
        backlog: list[tuple[str, Obj]] = []
        gone = False
        # Snapshot and registration with no await between them, so no change falls in a gap.
        if since in (None, "", "0"):
            backlog = [("ADDED", obj) for obj in self.store.items(rt.key, namespace) if selector.matches(obj)]
        else:
            try:
                changes = self.store.changes_since(int(since))
            except ValueError as exc:
                raise ApiError(400, "BadRequest", f"invalid resourceVersion {since!r}") from exc
            if changes is None:
                gone = True
            else:
                for change in changes:
                    event = watcher.translate(change)
                    if event is not None:
                        backlog.append(event)
        self.store.watchers[rt.key].add(watcher)
        self._watchers.add(watcher)
        response = web.StreamResponse(headers={"Content-Type": "application/json",
                                               "Transfer-Encoding": "chunked"})
        try:
            await response.prepare(request)
            if gone:
                status = ApiError(410, "Expired", f"too old resource version: {since} ({self.store.compacted_rv})")
                await self._send(response, "ERROR", status.status())
                return response
            send = self._sender(response, rt, version, table_include)
            for event, obj in backlog:
                await send(event, obj)
            await self._stream(request, response, watcher, rt, version, send)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.store.watchers[rt.key].discard(watcher)
            self._watchers.discard(watcher)
        return response

    def _sender(self, response: web.StreamResponse, rt: ResourceType, version: str, table_include: str | None
                ) -> Callable[[str, Obj], Awaitable[None]]:
        """Sends one watch event; as a one-row Table when the client asked for Tables."""
        async def send(event: str, obj: Obj) -> None:
            presented = self.api.present(obj, rt, version)
            if table_include is not None:
                presented = self.table(rt, version, [presented], table_include,
                                       presented["metadata"].get("resourceVersion", ""))
            await self._send(response, event, presented)
        return send

    async def _stream(self, request: web.Request, response: web.StreamResponse, watcher: Watcher,
                      rt: ResourceType, version: str, send: Callable[[str, Obj], Awaitable[None]]) -> None:
        loop = asyncio.get_running_loop()
        timeout = request.query.get("timeoutSeconds")
        deadline = loop.time() + float(timeout) if timeout else None
        bookmarks = _truthy(request.query.get("allowWatchBookmarks"))
        next_bookmark = loop.time() + self.bookmark_interval_s
        while True:
            wake_at = min(t for t in (deadline, next_bookmark if bookmarks else None, loop.time() + 5.0) if t)
            try:
                item = await asyncio.wait_for(watcher.queue.get(), max(0.0, wake_at - loop.time()))
            except asyncio.TimeoutError:
                now = loop.time()
                if deadline is not None and now >= deadline:
                    return
                if request.transport is None or request.transport.is_closing():
                    return  # the client went away; aiohttp does not cancel us for it
                if bookmarks and now >= next_bookmark:
                    # The queue is empty, so every change up to store.rv has been sent.
                    await self._send(response, "BOOKMARK", {
                        "kind": rt.kind, "apiVersion": rt.api_version(version),
                        "metadata": {"resourceVersion": str(self.store.rv)}})
                    next_bookmark = now + self.bookmark_interval_s
                continue
            if item is None:  # the server is stopping
                return
            event, obj = item
            await send(event, obj)

    @staticmethod
    async def _send(response: web.StreamResponse, event: str, obj: Obj) -> None:
        await response.write(json.dumps({"type": event, "object": obj}).encode() + b"\n")

    def close_watches(self) -> None:
        for watcher in list(self._watchers):
            watcher.queue.put_nowait(None)


@dataclasses.dataclass
class ApiServerHandle:
    server: ApiServer
    host: str
    port: int
    _runner: web.AppRunner

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        self.server.close_watches()
        await self._runner.cleanup()


async def start_apiserver(host: str = "127.0.0.1", port: int = 0, crd_dir: str | Path | None = None, *,
                          history_size: int = 10_000, bookmark_interval_s: float = 30.0,
                          log_dir: str | Path | None = None, auto_create_namespaces: bool = True
                          ) -> ApiServerHandle:
    """Start the emulated API server on the running loop; port 0 picks a free one."""
    server = ApiServer(history_size=history_size, bookmark_interval_s=bookmark_interval_s, log_dir=log_dir,
                       auto_create_namespaces=auto_create_namespaces)
    if crd_dir is not None:
        server.register_crds_from_dir(crd_dir)
    runner = web.AppRunner(server.app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    server.address = f"{host}:{bound_port}"
    return ApiServerHandle(server, host, bound_port, runner)


class ApiServerThread:
    """The API server on its own thread and loop, for synchronous callers (tests, kubectl drivers).

        with ApiServerThread(crd_dir="crds") as handle:
            print(handle.url)
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, crd_dir: str | Path | None = None,
                 **options: Any) -> None:
        self._args = (host, port, crd_dir)
        self._options = options
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tidal-dev-apiserver", daemon=True)
        self.handle: ApiServerHandle | None = None

    def start(self) -> ApiServerHandle:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(start_apiserver(*self._args, **self._options), self._loop)
        self.handle = future.result(timeout=30)
        return self.handle

    def call(self, func: Callable[[], Any]) -> Any:
        """Run `func` on the server's loop (the store is not thread-safe) and return its result."""
        async def run() -> Any:
            return func()
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def stop(self) -> None:
        if self.handle is not None:
            asyncio.run_coroutine_threadsafe(self.handle.stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    def __enter__(self) -> ApiServerHandle:
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Tidal's emulated Kubernetes API server (dev only).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--crds", help="directory of CustomResourceDefinition YAML files to register")
    parser.add_argument("--kubeconfig", help="write a kubeconfig for this server at this path")
    parser.add_argument("--log-dir", help="directory the local kubelet writes pod logs into")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def serve() -> None:
        handle = await start_apiserver(args.host, args.port, args.crds, log_dir=args.log_dir)
        if args.kubeconfig:
            from .kubeconfig import write_kubeconfig
            write_kubeconfig(args.kubeconfig, handle.url)
        log.info("emulated API server on %s", handle.url)
        try:
            await asyncio.Event().wait()
        finally:
            await handle.stop()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
