"""A GPU-share group whose members ask for a GPU shares one ResourceClaim (docs/gpu-sharing.md):
the pure manifests (validated against Kubernetes' own schemas), and the operator's reconcile
against the in-process emulated API server creating it, naming it in each Pod, keeping its owners
and leaving it to the garbage collector; a cluster without resource.k8s.io/v1 gets a condition."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, AsyncIterator

import kubernetes_validate
import pytest

from tidal_operator import labels as L
from tidal_operator.api.types import OperatorConfig
from tidal_operator.controller import llmservice as H
from tidal_operator.dev import start_apiserver, write_kubeconfig
from tidal_operator.dev.apiserver import ApiServerHandle
from tidal_operator.kube import Kube
from tidal_operator.reconcile.gpu_claim import claim_name, group_members, gpu_claim_manifest
from tidal_operator.reconcile.manifests import pod_manifest

CRDS = Path(__file__).resolve().parents[2] / "crds"
CONFIG = OperatorConfig()
NS = "default"
DRA_VERSION = "1.34"  # the first release that serves resource.k8s.io/v1
CLAIMS = f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims"


def member(name: str, uid: str = "", gpu: int = 1, group: str = "pair") -> dict[str, Any]:
    spec = {"model": {"uri": "bundled://smollm2-135m"}, "replicas": 1,
            "gpuShare": {"group": group, "memoryFraction": 0.6}, "engine": {"resources": {"gpu": gpu}}}
    meta = {"name": name, "namespace": NS, **({"uid": uid} if uid else {})}
    return {"apiVersion": L.API_VERSION, "kind": L.KIND, "metadata": meta, "spec": spec}


# --- the pure manifests -----------------------------------------------------------------------

def test_the_claim_asks_for_one_device_and_every_member_owns_it_without_controlling_it() -> None:
    a, b = member("a", "ua"), member("b", "ub")
    others = [b, member("cpu", "uc", gpu=0), member("elsewhere", "ud", group="other")]
    members = group_members(a, others)
    assert [m["metadata"]["name"] for m in members] == ["a", "b"]
    claim = gpu_claim_manifest(NS, "pair", members, replace(CONFIG, gpu_share_device_class="gpu.example.com"))
    kubernetes_validate.validate(claim, DRA_VERSION, strict=True)
    assert claim["metadata"]["name"] == claim_name("pair")
    (request,) = claim["spec"]["devices"]["requests"]
    assert request["exactly"] == {"deviceClassName": "gpu.example.com", "allocationMode": "ExactCount", "count": 1}
    owners = claim["metadata"]["ownerReferences"]
    assert [(o["uid"], o["controller"]) for o in owners] == [("ua", False), ("ub", False)]


def test_a_gpu_member_pod_names_the_claim_instead_of_an_extended_resource() -> None:
    pod = pod_manifest(member("a", "ua"), 0, CONFIG)
    kubernetes_validate.validate(pod, DRA_VERSION, strict=True)
    assert pod["spec"]["resourceClaims"] == [{"name": "gpu", "resourceClaimName": claim_name("pair")}]
    resources = pod["spec"]["containers"][0]["resources"]
    assert resources["claims"] == [{"name": "gpu"}]
    assert not any("gpu" in k for k in {**resources["limits"], **resources["requests"]})
    cpu = pod_manifest(member("c", "uc", gpu=0), 0, CONFIG)  # a CPU group: no claim
    assert "resourceClaims" not in cpu["spec"] and "claims" not in cpu["spec"]["containers"][0]["resources"]


# --- the operator --------------------------------------------------------------------------------

@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[Kube, ApiServerHandle]]:
    handle = await start_apiserver(crd_dir=CRDS)
    client = await Kube.connect(str(write_kubeconfig(tmp_path / "kubeconfig", handle.url)))
    try:
        yield client, handle
    finally:
        await client.close()
        await handle.stop()


async def create(kube: Kube, obj: dict[str, Any]) -> dict[str, Any]:
    return await kube.request("POST", f"/apis/{L.GROUP}/{L.VERSION}/namespaces/{NS}/{L.PLURAL}", body=obj)


async def delete(kube: Kube, name: str) -> None:
    await kube.request("DELETE", f"/apis/{L.GROUP}/{L.VERSION}/namespaces/{NS}/{L.PLURAL}/{name}")


def gpu_share_condition(llm: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in llm["status"]["conditions"] if c["type"] == "GPUShare")


async def test_two_members_share_one_claim_that_goes_with_the_last(cluster: tuple[Kube, ApiServerHandle]) -> None:
    kube, _ = cluster
    # The first member creates the claim; the second one's pass adds itself as an owner (apply).
    owners_seen = []
    for name in ("a", "b"):
        await create(kube, member(name))
        outcome = await H.reconcile(kube, CONFIG, NS, name)
        assert outcome is not None and outcome.valid and len(outcome.created) == 1
        claim = await kube.get_resource_claim(NS, claim_name("pair"))
        owners_seen.append([r["name"] for r in claim["metadata"]["ownerReferences"]])  # type: ignore[index]
    assert owners_seen == [["a"], ["a", "b"]]
    a, b = await kube.get_llmservice(NS, "a"), await kube.get_llmservice(NS, "b")

    claims = (await kube.request("GET", CLAIMS))["items"]
    assert [c["metadata"]["name"] for c in claims] == [claim_name("pair")]
    owners = {(r["uid"], r["controller"]) for r in claims[0]["metadata"]["ownerReferences"]}
    assert owners == {(a["metadata"]["uid"], False), (b["metadata"]["uid"], False)}  # type: ignore[index]
    for name in ("a", "b"):
        (pod,) = await kube.list_pods(NS, L.selector_string(name))
        assert pod["spec"]["resourceClaims"] == [{"name": "gpu", "resourceClaimName": claim_name("pair")}]
        llm = await kube.get_llmservice(NS, name)
        assert gpu_share_condition(llm)["status"] == "True"  # type: ignore[arg-type]

    await delete(kube, "a")  # the other member still holds the device
    assert await kube.get_resource_claim(NS, claim_name("pair")) is not None
    await delete(kube, "b")
    assert await kube.get_resource_claim(NS, claim_name("pair")) is None


async def test_without_the_resource_api_the_member_waits_with_a_condition(
        cluster: tuple[Kube, ApiServerHandle]) -> None:
    kube, handle = cluster
    handle.server.api.unregister_type(("resource.k8s.io", "resourceclaims"))
    await create(kube, member("a"))
    outcome = await H.reconcile(kube, CONFIG, NS, "a")
    assert outcome is not None and outcome.valid and not outcome.created and not outcome.converged
    assert await kube.list_pods(NS, L.selector_string("a")) == []
    condition = gpu_share_condition(await kube.get_llmservice(NS, "a"))  # type: ignore[arg-type]
    assert (condition["status"], condition["reason"]) == ("False", "ResourceClaimAPINotServed")


async def test_a_claim_of_that_name_made_by_someone_else_is_left_alone(cluster: tuple[Kube, ApiServerHandle]) -> None:
    kube, _ = cluster
    theirs = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
              "metadata": {"name": claim_name("pair"), "namespace": NS},
              "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x"}}]}}}
    await kube.create_resource_claim(NS, theirs)
    await create(kube, member("a"))
    outcome = await H.reconcile(kube, CONFIG, NS, "a")
    assert outcome is not None and not outcome.created
    condition = gpu_share_condition(await kube.get_llmservice(NS, "a"))  # type: ignore[arg-type]
    assert (condition["status"], condition["reason"]) == ("False", "ResourceClaimConflict")
    kept = await kube.get_resource_claim(NS, claim_name("pair"))
    assert "ownerReferences" not in kept["metadata"]  # type: ignore[index]
