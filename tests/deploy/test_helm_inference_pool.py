"""The chart's InferencePool, its endpoint picker and objectives (docs/fleet.md, "LLM fleets behind an InferencePool").

Rendered by the real Helm engine (the values sets ``inference-pool*`` of helm_render.py; test_helm.py validates
every object of them with kubernetes-validate --strict for both KUBE_VERSIONS, the InferencePool and the
InferenceObjectives against the extension's CRD schemas vendored in schemas/). Here: the pool selects the serving
pods (both tracks, not the picker) on the OpenAI port; the picker is wired to the pool, its Service, its RBAC and
its configuration; one objective per entry; the HTTPRoute's backend is the pool; wrong values refused. No cluster
ran any of this.
"""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from .helm_render import (FULLNAME, KUBE_VERSIONS, NAMESPACE, VALUE_SETS, find, objects, render, schema_errors,
                          validate_object)
from .test_helm_canary import selects

pytest.importorskip("helm_python", reason="pip install 'model-factory[test]' (helm-python-sdk renders the chart)")

EPP = f"{FULLNAME}-epp"
POOL_GROUP = "inference.networking.k8s.io"
SETS = ["inference-pool", "inference-pool-legacy-ha"]
# What llm-d-router v0.10.0's picker scrapes from a pod of its default engine, "vllm"
# (pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go, defaultEngineConfigs).
PICKER_VLLM_METRICS = {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                       "vllm:lora_requests_info"}


def kinds(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def server_pods(docs: list[dict]) -> list[dict]:
    """The pod templates of the serving Deployments (stable, canary) and of the picker."""
    return [d["spec"]["template"] for d in docs if d["kind"] == "Deployment"]


# --------------------------------------------------------------------------- off by default


@pytest.mark.parametrize("values_set", ["default", "text-generation", "canary-gateway"])
def test_nothing_of_the_extension_renders_unless_asked(values_set: str) -> None:
    docs = objects(values_set)
    assert not [d for d in docs if d["kind"] in ("InferencePool", "InferenceObjective")]
    assert not [d for d in docs if d["metadata"]["name"].startswith(EPP)]


# --------------------------------------------------------------------------- the pool


@pytest.mark.parametrize("values_set", SETS)
def test_the_pool_selects_every_serving_pod_and_not_the_picker_on_the_openai_port(values_set: str) -> None:
    docs = objects(values_set)
    pool = find(docs, "InferencePool", FULLNAME)
    assert pool["apiVersion"] == f"{POOL_GROUP}/v1"
    selector = pool["spec"]["selector"]
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    serving = [d for name, d in deployments.items() if name != EPP]
    assert len(serving) == (2 if VALUE_SETS[values_set].get("canary", {}).get("enabled") else 1)
    for dep in serving:  # stable and canary alike: the picker balances the tracks by their load
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert selects(selector, labels), dep["metadata"]["name"]
        server = next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "server")
        openai = next(p for p in server["ports"] if p["name"] == "openai")
        assert pool["spec"]["targetPorts"] == [{"number": openai["containerPort"]}]
        # The pod serves what the pool targets: serve --openai-port on that port.
        args = server.get("command", []) + server.get("args", [])
        assert args[args.index("--openai-port") + 1] == str(openai["containerPort"])
    assert not selects(selector, deployments[EPP]["spec"]["template"]["metadata"]["labels"])
    assert pool["spec"]["appProtocol"] == "http"
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == VALUE_SETS[values_set]["inferencePool"].get(
        "failureMode", "FailClose")


@pytest.mark.parametrize("values_set", SETS)
def test_the_pool_names_its_picker_service_and_the_service_reaches_the_picker(values_set: str) -> None:
    docs = objects(values_set)
    ref = find(docs, "InferencePool")["spec"]["endpointPickerRef"]
    service = find(docs, "Service", ref["name"])
    assert "kind" not in ref or ref["kind"] == "Service"
    port = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert port["appProtocol"] == "kubernetes.io/h2c"  # the gateway's ext_proc speaks gRPC
    picker = find(docs, "Deployment", EPP)
    assert selects({"matchLabels": service["spec"]["selector"]}, picker["spec"]["template"]["metadata"]["labels"])
    container = picker["spec"]["template"]["spec"]["containers"][0]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named[port["targetPort"]] == ref["port"]["number"] == int(_flags(container)["grpc-port"])
    # The Service selects no serving pod.
    for dep in (d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] != EPP):
        assert not selects({"matchLabels": service["spec"]["selector"]}, dep["spec"]["template"]["metadata"]["labels"])


def _flags(container: dict) -> dict[str, str]:
    """--name value and --name=value arguments."""
    out, args = {}, container["args"]
    for i, a in enumerate(args):
        if a.startswith("--") and "=" in a:
            k, v = a[2:].split("=", 1)
            out[k] = v
        elif a.startswith("--"):
            out[a[2:]] = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else "true"
    return out


@pytest.mark.parametrize("values_set", SETS)
def test_the_picker_watches_this_pool_with_the_configuration_it_mounts(values_set: str) -> None:
    docs = objects(values_set)
    picker = find(docs, "Deployment", EPP)
    spec = picker["spec"]["template"]["spec"]
    container = spec["containers"][0]
    flags = _flags(container)
    assert (flags["pool-name"], flags["pool-namespace"], flags["pool-group"]) == (FULLNAME, NAMESPACE, POOL_GROUP)
    health = int(flags["grpc-health-port"])
    assert container["readinessProbe"]["grpc"]["port"] == container["livenessProbe"]["grpc"]["port"] == health
    # --config-file is in the ConfigMap mounted at its folder.
    config = flags["config-file"]
    mount = next(m for m in container["volumeMounts"] if config.startswith(m["mountPath"] + "/"))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    data = find(docs, "ConfigMap", volume["configMap"]["name"])["data"]
    text = data[config.rsplit("/", 1)[1]]
    plugins = yaml.safe_load(text)
    assert plugins["kind"] == "EndpointPickerConfig" and plugins["apiVersion"] == "llm-d.ai/v1alpha1"
    types = {p["type"]: p for p in plugins["plugins"]}
    # Scrapes /metrics on the pool's target port, read as the default engine's (vLLM's) names.
    assert types["metrics-data-source"].get("parameters", {}).get("path", "/metrics") == "/metrics"
    assert "defaultEngine" not in types["core-metrics-extractor"].get("parameters", {})
    refs = {p["pluginRef"] for prof in plugins["schedulingProfiles"] for p in prof["plugins"]}
    assert "queue-scorer" in refs and refs <= set(types)
    own = VALUE_SETS[values_set]["inferencePool"].get("endpointPicker", {}).get("pluginsConfig")
    if own:  # one's own configuration, whole
        assert text == own
    else:  # by queue and KV cache; no prefix affinity (the server reuses no prefixes)
        assert refs == {"queue-scorer", "kv-cache-utilization-scorer"} and "prefix-cache-scorer" not in types
    # Hardened like the serving pods, by digest, air-gapped registry by default.
    assert container["image"].startswith("registry.example.internal/") and "@sha256:" in container["image"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    replicas = VALUE_SETS[values_set]["inferencePool"].get("endpointPicker", {}).get("replicas", 1)
    assert picker["spec"]["replicas"] == replicas and picker["spec"]["strategy"] == {"type": "Recreate"}
    assert ("ha-enable-leader-election" in flags) == (replicas > 1)
    if values_set == "inference-pool-legacy-ha":
        assert flags["v"] == "2"


def test_the_server_writes_the_names_the_picker_reads() -> None:
    """The picker's default engine is vLLM's (no defaultEngine above): the OpenAI port's /metrics writes those names."""
    from model_factory.serving import pool_metrics

    assert PICKER_VLLM_METRICS <= set(pool_metrics.PROTOCOL_NAMES)


@pytest.mark.parametrize("values_set", SETS)
def test_the_picker_may_read_what_it_watches_and_nothing_else(values_set: str) -> None:
    docs = objects(values_set)
    spec = find(docs, "Deployment", EPP)["spec"]["template"]["spec"]
    account = spec["serviceAccountName"]
    assert find(docs, "ServiceAccount", account)
    binding = find(docs, "RoleBinding", EPP)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    role = find(docs, "Role", binding["roleRef"]["name"])
    granted = {(g, r): set(rule["verbs"])
               for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    api_version = VALUE_SETS[values_set]["inferencePool"].get("objectiveApiVersion", "llm-d.ai/v1alpha2")
    for need in (("", "pods"), (POOL_GROUP, "inferencepools"), (api_version.split("/")[0], "inferenceobjectives")):
        assert {"get", "watch", "list"} <= granted[need], need
    # It writes nothing but, with more than one replica, its leader election's leases and events.
    writes = {k for k, verbs in granted.items() if verbs & {"create", "update", "patch", "delete"}}
    assert writes <= {("coordination.k8s.io", "leases"), ("", "events")}
    assert bool(writes) == (find(docs, "Deployment", EPP)["spec"]["replicas"] > 1)
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]


# --------------------------------------------------------------------------- objectives and the route


@pytest.mark.parametrize("values_set", SETS)
def test_one_objective_per_entry_on_this_pool(values_set: str) -> None:
    docs = objects(values_set)
    pool = VALUE_SETS[values_set]["inferencePool"]
    objectives = kinds(docs)["InferenceObjective"]
    assert [o["metadata"]["name"] for o in objectives] == [e["name"] for e in pool["objectives"]]
    for o, entry in zip(objectives, pool["objectives"]):
        assert o["apiVersion"] == pool.get("objectiveApiVersion", "llm-d.ai/v1alpha2")
        assert o["spec"]["poolRef"] == {"group": POOL_GROUP, "kind": "InferencePool", "name": FULLNAME}
        assert o["spec"].get("priority") == entry.get("priority")


@pytest.mark.parametrize("values_set", SETS)
def test_the_route_sends_the_openai_api_to_the_pool(values_set: str) -> None:
    docs = objects(values_set)
    pool = VALUE_SETS[values_set]["inferencePool"]
    route = find(docs, "HTTPRoute", f"{FULLNAME}-inference")
    assert route["spec"]["parentRefs"] == pool["httpRoute"]["parentRefs"]
    assert route["spec"].get("hostnames") == pool["httpRoute"].get("hostnames")
    [rule] = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": POOL_GROUP, "kind": "InferencePool", "name": FULLNAME}]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]  # /metrics and /health stay inside
    timeout = pool["httpRoute"].get("requestTimeout", "300s")
    assert rule.get("timeouts", {}).get("request", "") == timeout


def test_a_restricted_network_policy_still_lets_the_picker_read_the_metrics() -> None:
    docs = objects("inference-pool-legacy-ha")
    policy = find(docs, "NetworkPolicy")
    picker = find(docs, "Deployment", EPP)["spec"]["template"]["metadata"]["labels"]
    port = find(docs, "InferencePool")["spec"]["targetPorts"][0]["number"]
    allowed = [r for r in policy["spec"]["ingress"] if {"port": port, "protocol": "TCP"} in r["ports"]
               and any("podSelector" in f and selects(f["podSelector"], picker) for f in r.get("from", []))]
    assert allowed
    # ... and the clients' rule is the one they configured.
    clients = [r for r in policy["spec"]["ingress"] if r.get("from") == VALUE_SETS["inference-pool-legacy-ha"]
               ["networkPolicy"]["clients"]]
    assert clients and {"port": port, "protocol": "TCP"} in clients[0]["ports"]


@pytest.mark.parametrize("values_set", ["text-generation", *SETS])
def test_prometheus_scrapes_the_protocol_metrics_only_when_asked(values_set: str) -> None:
    """metrics.openaiPort: the ServiceMonitor / PodMonitor also scrape the OpenAI port's /metrics (vllm:* series for
    dashboards made for vLLM), and the NetworkPolicy opens that port to the scrapers; off, neither."""
    docs = objects(values_set)
    on = VALUE_SETS[values_set].get("metrics", {}).get("openaiPort", False)
    monitors = [d for d in docs if d["kind"] in ("ServiceMonitor", "PodMonitor")]
    assert monitors
    openai_port = VALUE_SETS[values_set]["openai"].get("port", 9000)
    for monitor in monitors:
        endpoints = monitor["spec"].get("endpoints") or monitor["spec"]["podMetricsEndpoints"]
        assert ({"port": "openai", "path": "/metrics"} in [{"port": e["port"], "path": e["path"]} for e in endpoints]) == on
        if monitor["kind"] == "ServiceMonitor":  # the Service names that port
            service = find(docs, "Service", FULLNAME)
            assert {"name": "openai", "port": openai_port} in [{"name": p["name"], "port": p["port"]}
                                                               for p in service["spec"]["ports"]]
        else:
            pod = find(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
            assert "openai" in {p["name"] for c in pod["containers"] for p in c.get("ports", [])}
    policy = find(docs, "NetworkPolicy")
    scrapers = [r for r in policy["spec"]["ingress"] if r.get("from") == [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]]
    assert len(scrapers) == 1
    assert ({"port": openai_port, "protocol": "TCP"} in scrapers[0]["ports"]) == on


# --------------------------------------------------------------------------- the vendored schemas refuse


def test_the_vendored_schemas_refuse_what_the_api_server_would() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    docs = objects("inference-pool")
    pool, objective = find(docs, "InferencePool"), kinds(docs)["InferenceObjective"][0]
    for obj, edit, match in (
        (pool, lambda o: o["spec"]["selector"].update(matchExpressions=[]), "matchExpressions"),  # v1: labels only
        (pool, lambda o: o["spec"].update(targetPortNumber=9000), "targetPortNumber"),  # v1alpha2's field
        (pool, lambda o: o["spec"]["endpointPickerRef"].update(failureMode="Retry"), "Retry"),
        (objective, lambda o: o["spec"].update(modelName="tiny_llm"), "modelName"),  # InferenceModel's field
        (objective, lambda o: o["spec"].pop("poolRef"), "poolRef"),
    ):
        bad = copy.deepcopy(obj)
        edit(bad)
        with pytest.raises(jsonschema.ValidationError, match=match):
            validate_object(bad, KUBE_VERSIONS[0])


# --------------------------------------------------------------------------- wrong values


ON = {"openai": {"enabled": True}, "inferencePool": {"enabled": True, "httpRoute": {"parentRefs": [{"name": "gw"}]}}}


def _with(*more: dict) -> dict:
    out = copy.deepcopy(ON)
    for m in more:
        for k, v in m.items():
            out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) else v
    return out


@pytest.mark.parametrize("values, message", [
    (_with({"openai": {"enabled": False}}), "inferencePool.enabled needs openai.enabled"),
    (_with({"inferencePool": {**ON["inferencePool"], "httpRoute": {"parentRefs": []}}}),
     "inferencePool.httpRoute.parentRefs is empty"),
    (_with({"inferencePool": {**ON["inferencePool"], "objectives": [{"name": "a"}, {"name": "a"}]}}),
     'inferencePool.objectives: "a" is listed twice'),
    (_with({"canary": {"enabled": True, "repository": {"subPath": "x"},
                       "traffic": {"split": "gateway", "gateway": {"parentRefs": [{"name": "gw"}]}}}}),
     "two routes would claim /v1"),
    ({"metrics": {"openaiPort": True}}, "metrics.openaiPort needs openai.enabled"),
])
def test_values_the_pool_cannot_work_with_are_refused(values: dict, message: str) -> None:
    with pytest.raises(Exception, match=re.escape(message)):
        render(values)


@pytest.mark.parametrize("values, path", [
    ({"inferencePool": {"objectives": [{"name": "tiny_llm"}]}}, "/inferencePool/objectives/0/name"),
    ({"inferencePool": {"objectiveApiVersion": "inference.networking.x-k8s.io/v1alpha1"}},
     "/inferencePool/objectiveApiVersion"),
    ({"inferencePool": {"failureMode": "Open"}}, "/inferencePool/failureMode"),
    ({"inferencePool": {"endpointPicker": {"image": {"repository": "ghcr.io/llm-d/llm-d-router-endpoint-picker",
                                                     "digest": "v0.10.0"}}}}, "/inferencePool/endpointPicker/image/digest"),
    ({"inferencePool": {"httpRoute": {"requestTimeout": "5 minutes"}}}, "/inferencePool/httpRoute/requestTimeout"),
])
def test_wrong_pool_values_are_refused_with_their_path(values: dict, path: str) -> None:
    errors = schema_errors(values)
    assert errors and path in errors, errors
