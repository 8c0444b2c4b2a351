"""The chart's canary track (docs/fleet.md, "Canary upgrades"), rendered and checked offline.

Rendered by the real Helm engine (the values sets ``canary*`` of helm_render.py; test_helm.py validates every
object of them with kubernetes-validate --strict for both KUBE_VERSIONS, the routes against the vendored Gateway
API schemas). Here: the canary is the stable pod with another release of the same repository; each selector
picks the pods it should (the Service both tracks, each Deployment, PDB and autoscaler one track); the weighted
Gateway API split; wrong values refused. The canary's rendered verify command is run against a signed repository
laid out as its claim holds it. No cluster ran any of this.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from .helm_render import FULLNAME, KSERVE, KUBE_VERSIONS, NAMESPACE, find, objects, render, schema_errors, validate_object
from .test_helm_verify import materialize_volumes, run_container, signed  # noqa: F401  (signed: a fixture)

pytest.importorskip("helm_python", reason="pip install 'model-factory[test]' (helm-python-sdk renders the chart)")

CANARY = f"{FULLNAME}-canary"
TRACK = "model-factory.io/track"
CANARY_SETS = ["canary", "canary-image-keda", "canary-s3-fixed", "canary-oci", "canary-gateway",
               "canary-gateway-http-only"]


def deployments(name: str) -> tuple[dict, dict]:
    """(stable, canary) Deployments of one values set."""
    docs = objects(name)
    return find(docs, "Deployment", FULLNAME), find(docs, "Deployment", CANARY)


def selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels + matchExpressions) against an object's labels, as the API server reads it."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def pod_labels(dep: dict) -> dict:
    return dep["spec"]["template"]["metadata"]["labels"]


def test_the_selector_reader_reads_expressions() -> None:
    """The helper above, on the chart's two kinds of selector (so the selector tests below mean something)."""
    stable = {"matchLabels": {"a": "1"}, "matchExpressions": [{"key": TRACK, "operator": "NotIn", "values": ["canary"]}]}
    assert selects(stable, {"a": "1", TRACK: "stable"}) and selects(stable, {"a": "1"})
    assert not selects(stable, {"a": "1", TRACK: "canary"}) and not selects(stable, {"a": "2"})
    assert selects({"matchExpressions": [{"key": "b", "operator": "In", "values": ["x"]}]}, {"b": "x"})
    assert not selects({"matchExpressions": [{"key": "b", "operator": "Exists"}]}, {})


# --------------------------------------------------------------------------- off by default


def test_the_canary_is_off_by_default_and_the_stable_pods_carry_their_track() -> None:
    docs = objects("default")
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"] == [FULLNAME]
    assert not [d for d in docs if d["metadata"]["name"].startswith(CANARY)]
    assert not [d for d in docs if d["apiVersion"].startswith("gateway.networking.k8s.io/")]
    stable = find(docs, "Deployment")
    assert pod_labels(stable)[TRACK] == "stable" and stable["metadata"]["labels"][TRACK] == "stable"
    # The Service selects the serving pool (no track): what the canary joins when it is on.
    assert TRACK not in find(docs, "Service")["spec"]["selector"]
    assert "replicas" not in stable["spec"]  # the HPA owns it


# --------------------------------------------------------------------------- the same pod, another release


def _without_release(dep: dict, source: str) -> dict:
    """The pod template with what names the served release, the track and the selectors taken out."""
    tmpl = copy.deepcopy(dep["spec"]["template"])
    tmpl["metadata"]["labels"].pop(TRACK)
    spec = tmpl["spec"]
    spec["topologySpreadConstraints"][0].pop("labelSelector")
    for c in spec.get("initContainers", []) + spec["containers"]:
        for m in c.get("volumeMounts", []):
            if m["name"] == "models" and source in ("pvc", "image"):
                m.pop("subPath", None)
        if c["name"] == "fetch":
            c["command"][-2] = "<release>"
        if c["name"].startswith("pull-"):
            c["command"][2] = "<release>"
    for v in spec["volumes"]:
        if v["name"] == "models" and "image" in v:
            v["image"]["reference"] = "<release>"
        if v["name"] == "release-state":
            v.clear()
    return tmpl


@pytest.mark.parametrize("values_set, source", [("canary", "pvc"), ("canary-image-keda", "image"),
                                                 ("canary-s3-fixed", "s3"), ("canary-oci", "oci"),
                                                 ("canary-gateway", "pvc")])
def test_the_canary_runs_the_stable_pod_with_another_release_of_the_same_repository(values_set: str,
                                                                                     source: str) -> None:
    """Same fetch/pull, verify init container, policy, server, probes, security context; only the release differs."""
    stable, canary = deployments(values_set)
    assert _without_release(canary, source) == _without_release(stable, source)
    s_spec, c_spec = stable["spec"]["template"]["spec"], canary["spec"]["template"]["spec"]
    verify = [next(c for c in spec["initContainers"] if c["name"] == "verify") for spec in (s_spec, c_spec)]
    assert verify[0]["command"] == verify[1]["command"] == [
        "model-factory", "verify", "--policy", "/etc/model-factory/trust/policy.toml", "--json", "/models"]
    assert [c["name"] for c in c_spec["initContainers"]][-1] == "verify"
    # The same trust policy (the same checksum: a policy change rolls both tracks).
    assert (canary["spec"]["template"]["metadata"]["annotations"]["checksum/trust"]
            == stable["spec"]["template"]["metadata"]["annotations"]["checksum/trust"])
    assert canary["spec"]["strategy"] == stable["spec"]["strategy"]
    # ... and the release does differ.
    assert _release(canary, source) != _release(stable, source)


def _release(dep: dict, source: str) -> object:
    spec = dep["spec"]["template"]["spec"]
    if source == "pvc":
        return next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "models")["subPath"]
    if source == "image":
        return next(v for v in spec["volumes"] if v["name"] == "models")["image"]["reference"]
    if source == "s3":
        return next(c for c in spec["initContainers"] if c["name"] == "fetch")["command"][-2]
    return [c["command"][2] for c in spec["initContainers"] if c["name"].startswith("pull-")]


def test_the_canary_serves_what_canary_repository_names() -> None:
    assert _release(deployments("canary")[1], "pvc") == "releases/8/NVIDIA-H100-80GB-HBM3/trt-10.13"
    assert _release(deployments("canary")[0], "pvc") == "NVIDIA-H100-80GB-HBM3/trt-10.13"
    stable, canary = deployments("canary-image-keda")
    assert _release(canary, "image").endswith("@sha256:" + "cd" * 32)
    assert _release(stable, "image").endswith("@sha256:" + "ab" * 32)
    stable, canary = deployments("canary-s3-fixed")
    assert _release(canary, "s3") == "src/models/releases/8/NVIDIA-H100-80GB-HBM3/trt-10.13"
    assert _release(stable, "s3") == "src/models/NVIDIA-H100-80GB-HBM3/trt-10.13"
    stable, canary = deployments("canary-oci")
    assert _release(canary, "oci") == ["oci://registry.models.svc:5000/models/minilm:2"]
    assert _release(stable, "oci") == ["oci://registry.models.svc:5000/models/minilm:1"]


def test_the_canary_keeps_its_release_state_to_itself() -> None:
    """A shared release-state claim is the stable track's: the canary's newer release written there would make
    every stable pod that starts afterwards refuse the stable release as a rollback."""
    stable, canary = deployments("canary-image-keda")
    state = [next(v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == "release-state")
             for d in (stable, canary)]
    assert state[0] == {"name": "release-state", "persistentVolumeClaim": {"claimName": "release-state"}}
    assert state[1] == {"name": "release-state", "emptyDir": {}}
    server = next(c for c in canary["spec"]["template"]["spec"]["containers"] if c["name"] == "server")
    assert "/var/lib/model-factory/release" in {m["mountPath"] for m in server["volumeMounts"]}


def test_the_canary_has_a_fixed_size_and_the_autoscaler_scales_the_stable_track() -> None:
    stable, canary = deployments("canary")
    assert canary["spec"]["replicas"] == 1 and "replicas" not in stable["spec"]
    hpa = find(objects("canary"), "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == FULLNAME
    stable, canary = deployments("canary-s3-fixed")
    assert (stable["spec"]["replicas"], canary["spec"]["replicas"]) == (4, 2)
    scaled = find(objects("canary-image-keda"), "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == FULLNAME
    assert len([d for d in objects("canary-image-keda") if d["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")]) == 1


# --------------------------------------------------------------------------- selectors


@pytest.mark.parametrize("values_set", CANARY_SETS)
def test_each_selector_picks_the_pods_it_should(values_set: str) -> None:
    docs = objects(values_set)
    stable, canary = deployments(values_set)
    s_pod, c_pod = pod_labels(stable), pod_labels(canary)
    assert (s_pod[TRACK], c_pod[TRACK]) == ("stable", "canary")
    # A pod of a ReplicaSet made by the chart before the track label (the migration in docs/fleet.md).
    legacy = {k: v for k, v in s_pod.items() if k != TRACK}
    legacy["pod-template-hash"] = "5d8f7c9b4"

    # Each Deployment selects its own track only (selectors that do not overlap), and its template matches it.
    assert selects(stable["spec"]["selector"], s_pod) and not selects(stable["spec"]["selector"], c_pod)
    assert selects(canary["spec"]["selector"], c_pod) and not selects(canary["spec"]["selector"], s_pod)
    assert selects(stable["spec"]["selector"], legacy) and not selects(canary["spec"]["selector"], legacy)
    for dep, pod in ((stable, s_pod), (canary, c_pod)):
        spread = dep["spec"]["template"]["spec"]["topologySpreadConstraints"][0]["labelSelector"]
        assert spread == dep["spec"]["selector"]

    # The PDBs: one per track (a canary that never gets ready cannot use up the stable's budget).
    pdbs = {d["metadata"]["name"]: d["spec"]["selector"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert set(pdbs) == {FULLNAME, CANARY}
    assert pdbs[FULLNAME] == stable["spec"]["selector"] and pdbs[CANARY] == canary["spec"]["selector"]

    # The pool: NetworkPolicy (the same ingress for both) and the PodMonitor select both tracks.
    policy = find(docs, "NetworkPolicy", FULLNAME)["spec"]["podSelector"]
    assert selects(policy, s_pod) and selects(policy, c_pod)
    for monitor in (d for d in docs if d["kind"] == "PodMonitor"):
        assert selects(monitor["spec"]["selector"], s_pod) and selects(monitor["spec"]["selector"], c_pod)

    # The Services: with split=replicas the release's Service selects both tracks (the share follows the
    # ready pods); with split=gateway the release's Service the stable track, <fullname>-canary the canary.
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    main = {"matchLabels": services[FULLNAME]["spec"]["selector"]}
    gateway = find(docs, "Deployment", CANARY) and values_set.startswith("canary-gateway")
    if gateway:
        assert set(services) == {FULLNAME, CANARY}
        assert selects(main, s_pod) and not selects(main, c_pod)
        own = {"matchLabels": services[CANARY]["spec"]["selector"]}
        assert selects(own, c_pod) and not selects(own, s_pod)
    else:
        assert set(services) == {FULLNAME}
        assert selects(main, s_pod) and selects(main, c_pod) and selects(main, legacy)

    # The ServiceMonitor selects Services by their labels: every serving pod sits behind exactly one of the
    # Services it selects (scraped once), whatever the split.
    for monitor in (d for d in docs if d["kind"] == "ServiceMonitor"):
        scraped = [s for s in services.values() if selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
        assert scraped
        for pod in (s_pod, c_pod):
            assert len([s for s in scraped if selects({"matchLabels": s["spec"]["selector"]}, pod)]) == 1


def test_the_service_monitor_selects_the_release_service() -> None:
    """The Service carries the pods' selector labels, so the ServiceMonitor's selector finds it."""
    docs = objects("default")
    monitor = find(docs, "ServiceMonitor")
    assert selects(monitor["spec"]["selector"], find(docs, "Service")["metadata"]["labels"])


def test_monitors_label_each_series_with_its_track() -> None:
    """prometheus-operator copies the pod label onto the series as model_factory_io_track."""
    assert find(objects("canary"), "ServiceMonitor")["spec"]["podTargetLabels"] == [TRACK]
    assert find(objects("canary-image-keda"), "PodMonitor")["spec"]["podTargetLabels"] == [TRACK]
    assert find(objects("default"), "ServiceMonitor")["spec"]["podTargetLabels"] == [TRACK]


def _prom_matchers(query: str) -> list[tuple[str, str, str]]:
    inner = re.search(r"nv_inference_queue_duration_us\{([^}]*)\}", query).group(1)
    return re.findall(r'(\w+)(=~|!~|!=|=)"([^"]*)"', inner)


def _prom_selects(matchers: list[tuple[str, str, str]], labels: dict[str, str]) -> bool:
    """PromQL label matchers (regexes anchored at both ends, as Prometheus reads them)."""
    for name, op, value in matchers:
        got = labels.get(name, "")
        ok = {"=": got == value, "!=": got != value, "=~": re.fullmatch(value, got) is not None,
              "!~": re.fullmatch(value, got) is None}[op]
        if not ok:
            return False
    return True


def test_the_keda_queries_leave_the_canary_pods_out() -> None:
    """The ScaledObject's pod regex <fullname>-.* also matches <fullname>-canary-...: the query excludes them."""
    triggers = find(objects("canary-image-keda"), "ScaledObject")["spec"]["triggers"]
    assert len(triggers) == 2
    stable_pod = {"namespace": NAMESPACE, "pod": f"{FULLNAME}-7d9f8c6b5-x2x4z"}
    canary_pod = {"namespace": NAMESPACE, "pod": f"{CANARY}-5c6d7f8b9-abcde"}
    for trigger in triggers:
        matchers = _prom_matchers(trigger["metadata"]["query"])
        assert _prom_selects(matchers, stable_pod) and not _prom_selects(matchers, canary_pod)
    # Without a canary the query is the one the autoscaling tests know.
    plain = _prom_matchers(find(objects("keda"), "ScaledObject")["spec"]["triggers"][0]["metadata"]["query"])
    assert plain == [("namespace", "=", NAMESPACE), ("pod", "=~", f"{FULLNAME}-.*")]


# --------------------------------------------------------------------------- the Gateway API split


def test_the_gateway_routes_split_by_weight_between_the_tracks() -> None:
    docs = objects("canary-gateway")
    route = find(docs, "HTTPRoute", FULLNAME)
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [{"name": "inference", "namespace": "gateways", "sectionName": "http"}]
    assert route["spec"]["hostnames"] == ["models.example.internal"]
    openai_rule, triton_rule = route["spec"]["rules"]
    assert openai_rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}},  # and TEI's encoder routes
                                      {"path": {"type": "Exact", "value": "/embed"}},
                                      {"path": {"type": "Exact", "value": "/rerank"}},
                                      {"path": {"type": "Exact", "value": "/predict"}}]
    assert openai_rule["backendRefs"] == [{"name": FULLNAME, "port": 9100, "weight": 80},
                                          {"name": CANARY, "port": 9100, "weight": 20}]
    assert "matches" not in triton_rule
    assert triton_rule["backendRefs"] == [{"name": FULLNAME, "port": 8000, "weight": 80},
                                          {"name": CANARY, "port": 8000, "weight": 20}]
    grpc = find(docs, "GRPCRoute", FULLNAME)
    assert grpc["spec"]["parentRefs"] == [{"name": "inference", "namespace": "gateways", "sectionName": "grpc"}]
    assert grpc["spec"]["rules"] == [{"backendRefs": [{"name": FULLNAME, "port": 8001, "weight": 80},
                                                      {"name": CANARY, "port": 8001, "weight": 20}]}]
    # Every backend is a Service of this release, on one of its ports (the CRD's CEL rule "Must have port for
    # Service reference", which the JSON Schema does not carry).
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for r in (route, grpc):
        for rule in r["spec"]["rules"]:
            for ref in rule["backendRefs"]:
                assert ref["port"] in {p["port"] for p in services[ref["name"]]["spec"]["ports"]}
    # The gRPC ports say HTTP/2 cleartext, for the gateway's connection to the pods.
    for svc in services.values():
        grpc_port = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
        assert grpc_port["appProtocol"] == "kubernetes.io/h2c"
    # Weight 0 (start the canary dark, reach it through its own Service) and no gRPC route.
    dark = objects("canary-gateway-http-only")
    weights = [ref["weight"] for ref in find(dark, "HTTPRoute")["spec"]["rules"][0]["backendRefs"]]
    assert weights == [100, 0]
    assert not [d for d in dark if d["kind"] == "GRPCRoute"]
    assert "appProtocol" not in next(p for p in find(dark, "Service", FULLNAME)["spec"]["ports"] if p["name"] == "grpc")


def test_the_routes_validate_against_the_gateway_api_schema_and_it_refuses_a_wrong_weight() -> None:
    route = find(objects("canary-gateway"), "HTTPRoute")
    for version in KUBE_VERSIONS:
        validate_object(route, version)
    jsonschema = pytest.importorskip("jsonschema")
    bad = copy.deepcopy(route)
    bad["spec"]["rules"][1]["backendRefs"][1]["weight"] = 1_000_001
    with pytest.raises(jsonschema.ValidationError, match="1000001"):
        validate_object(bad, KUBE_VERSIONS[0])
    bad = copy.deepcopy(route)
    bad["spec"]["rules"][1]["backendRefs"][1]["wieght"] = 1
    with pytest.raises(jsonschema.ValidationError, match="wieght"):
        validate_object(bad, KUBE_VERSIONS[0])


# --------------------------------------------------------------------------- wrong values


@pytest.mark.parametrize("values, path", [
    ({"canary": {"replicas": 0}}, "/canary/replicas"),
    ({"canary": {"enabled": "yes"}}, "/canary/enabled"),
    ({"canary": {"traffic": {"split": "istio"}}}, "/canary/traffic/split"),
    ({"canary": {"traffic": {"gateway": {"weight": 101}}}}, "/canary/traffic/gateway/weight"),
    ({"canary": {"traffic": {"gateway": {"weight": -1}}}}, "/canary/traffic/gateway/weight"),
    ({"canary": {"traffic": {"gateway": {"weight": "10%"}}}}, "/canary/traffic/gateway/weight"),
    ({"canary": {"traffic": {"split": "gateway"}}}, "/canary/traffic/gateway/parentRefs"),
    ({"canary": {"traffic": {"gateway": {"parentRefs": [{"namespace": "gateways"}]}}}},
     "/canary/traffic/gateway/parentRefs/0"),
    ({"canary": {"traffic": {"gateway": {"hostnames": ["Models.Example"]}}}}, "/canary/traffic/gateway/hostnames/0"),
    ({"canary": {"repository": {"subPath": "../other-tenant"}}}, "/canary/repository/subPath"),
    ({"canary": {"repository": {"s3": {"prefix": "/releases/8"}}}}, "/canary/repository/s3/prefix"),
    ({"canary": {"repository": {"image": {"reference": "registry.example.internal/repo:8"}}}},
     "/canary/repository/image/reference"),
    ({"canary": {"repository": {"oci": {"references": ["https://registry/models/minilm:2"]}}}},
     "/canary/repository/oci/references/0"),
    ({"canary": {"repository": {"source": "image"}}}, "'source' not allowed"),
    ({"canary": {"version": 8}}, "'version' not allowed"),
])
def test_wrong_canary_values_are_refused_with_their_path(values: dict, path: str) -> None:
    errors = schema_errors(values)
    assert errors and path in errors, errors


@pytest.mark.parametrize("values, message", [
    ({"canary": {"enabled": True}}, "set canary.repository.subPath"),
    ({"repository": {"source": "image"}, "canary": {"enabled": True, "repository": {"subPath": "x"}}},
     "set canary.repository.image.reference"),
    ({"repository": {"source": "s3"}, "canary": {"enabled": True}}, "set canary.repository.s3.prefix"),
    ({"repository": {"source": "oci", "oci": {"references": ["oci://r.svc:5000/m/a:1"]}}, "canary": {"enabled": True}},
     "set canary.repository.oci.references"),
    ({"canary": {"enabled": True, "replicas": 3, "repository": {"subPath": "x"}}},
     "canary.replicas 3 is more than the stable track's 2 (autoscaling.minReplicas)"),
    ({"autoscaling": {"mode": "none"}, "replicaCount": 1,
      "canary": {"enabled": True, "replicas": 2, "repository": {"subPath": "x"}}},
     "canary.replicas 2 is more than the stable track's 1 (replicaCount)"),
])
def test_a_canary_that_names_no_release_or_outgrows_the_stable_track_is_refused(values: dict, message: str) -> None:
    with pytest.raises(Exception, match=re.escape(message)):
        render(values)


def test_the_canary_sets_pass_the_schema() -> None:
    from .helm_render import VALUE_SETS

    for name in CANARY_SETS:
        assert schema_errors(VALUE_SETS[name]) == "", name


# --------------------------------------------------------------------------- KServe


def _kserve_canary() -> tuple[dict, dict]:
    docs = {p.stem: yaml.safe_load(p.read_text()) for p in sorted((KSERVE / "canary").glob("*.yaml"))}
    assert set(docs) == {"stable", "canary"}
    return docs["stable"], docs["canary"]


def test_the_kserve_canary_examples_validate_and_differ_only_in_the_release_and_the_percent() -> None:
    stable, canary = _kserve_canary()
    for doc in (stable, canary):
        validate_object(doc, KUBE_VERSIONS[0])
        assert doc["kind"] == "InferenceService"
        # canaryTrafficPercent works in KServe's Serverless (Knative) mode only, not in RawDeployment.
        assert doc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Serverless"
        assert doc["metadata"]["annotations"]["serving.kserve.io/enable-tag-routing"] == "true"
        # Verified on arrival by the model-factory storage container, then again by `serve`.
        assert doc["spec"]["predictor"]["model"]["storageUri"].startswith("model-factory+https://")
        assert doc["spec"]["predictor"]["model"]["runtime"] == "model-factory-triton"
    assert stable["metadata"]["name"] == canary["metadata"]["name"]
    assert "canaryTrafficPercent" not in stable["spec"]["predictor"]
    percent = canary["spec"]["predictor"]["canaryTrafficPercent"]
    assert isinstance(percent, int) and 0 < percent < 100
    # A new revision needs a changed spec: the release has its own storage URI.
    assert stable["spec"]["predictor"]["model"]["storageUri"] != canary["spec"]["predictor"]["model"]["storageUri"]
    same = copy.deepcopy(canary)
    del same["spec"]["predictor"]["canaryTrafficPercent"]
    same["spec"]["predictor"]["model"]["storageUri"] = stable["spec"]["predictor"]["model"]["storageUri"]
    assert same == stable
    # The runtime those examples name exists in deploy/kserve (the verified Triton of servingruntime.yaml).
    runtime = yaml.safe_load((KSERVE / "servingruntime.yaml").read_text())
    assert runtime["metadata"]["name"] == "model-factory-triton"


def test_the_kserve_schema_refuses_a_misspelt_canary_field() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    _, canary = _kserve_canary()
    bad = copy.deepcopy(canary)
    bad["spec"]["predictor"]["canaryTrafficPercentage"] = bad["spec"]["predictor"].pop("canaryTrafficPercent")
    with pytest.raises(jsonschema.ValidationError, match="canaryTrafficPercentage"):
        validate_object(bad, KUBE_VERSIONS[0])


# --------------------------------------------------------------------------- the canary's verify step, run


@pytest.mark.slow
def test_the_canary_init_container_verifies_its_release_with_the_stable_policy(signed, tmp_path: Path) -> None:
    """The canary's rendered verify command, run on the claim as it would hold the canary's release: a good
    signed repository passes, one changed byte fails (the canary never serves what the policy refuses)."""
    repo, name, public_pem = signed
    values = {"trust": {"files": {"release.pub": public_pem}},
              "canary": {"enabled": True, "repository": {"subPath": "releases/8/NVIDIA-H100-80GB-HBM3/trt-10.13"}}}
    docs = [d for text in render(values).values() for d in yaml.safe_load_all(text) if d]
    pod = find(docs, "Deployment", CANARY)["spec"]["template"]["spec"]
    verify = next(c for c in pod["initContainers"] if c["name"] == "verify")
    volumes = materialize_volumes(docs, pod, tmp_path, repo, name)
    assert (volumes["models"] / "releases/8/NVIDIA-H100-80GB-HBM3/trt-10.13" / name).is_dir()

    good = run_container(verify, volumes, tmp_path)
    assert good.returncode == 0, good.stdout + good.stderr
    assert '"ok": true' in good.stdout

    onnx = next(volumes["models"].rglob("1/model.onnx"))
    data = bytearray(onnx.read_bytes())
    data[len(data) // 2] ^= 0x01
    onnx.write_bytes(bytes(data))
    bad = run_container(verify, volumes, tmp_path)
    assert bad.returncode != 0 and '"ok": false' in bad.stdout
