"""The Helm chart (deploy/helm/model-factory) and the KServe examples, rendered and validated offline.

Rendered by the real Helm engine for the default values and every documented option; every
object validated by kubernetes-validate --strict against two Kubernetes minor versions, custom
resources against their vendored schemas; wrong values refused by values.schema.json with their
path; then the promises of docs/fleet.md checked on the rendered objects.
"""

from __future__ import annotations

import re

import pytest
import yaml

from .helm_render import (CHART, FULLNAME, KSERVE, KUBE_VERSIONS, NAMESPACE, VALUE_SETS, find, objects,
                          schema_errors, validate_object)

pytest.importorskip("helm_python", reason="pip install 'model-factory[test]' (helm-python-sdk renders the chart)")

DIGEST_IMAGE = re.compile(r"^[^@:]+(:[0-9]+)?(/[^@:]+)*@sha256:[a-f0-9]{64}$")


def deployment(name: str = "default") -> dict:
    return find(objects(name), "Deployment")


def pod(name: str = "default") -> dict:
    return deployment(name)["spec"]["template"]["spec"]


def container(spec: dict, name: str, init: bool = False) -> dict:
    return next(c for c in spec["initContainers" if init else "containers"] if c["name"] == name)


def mounts(c: dict) -> dict[str, dict]:
    return {m["mountPath"]: m for m in c.get("volumeMounts", [])}


# --------------------------------------------------------------------------- the engine and the validators


@pytest.mark.parametrize("values_set", ["default", "factory", "s3", "canary-gateway", "inference-pool"])
def test_helm_lint_passes_strictly(values_set: str) -> None:
    from helm_python import chart

    result = chart.lint(CHART, VALUE_SETS[values_set], strict=True, kube_version=KUBE_VERSIONS[0])
    assert result["errors"] == [] and not [m for m in result["messages"] if m["severity"] > 1], result


def test_the_pod_extras_reach_the_pod() -> None:
    docs = objects("pod-extras")
    dep = find(docs, "Deployment")
    spec = dep["spec"]["template"]["spec"]
    assert dep["metadata"]["name"] == "encoders"
    assert spec["imagePullSecrets"] == [{"name": "registry-internal"}]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "pool": "inference"}
    assert dep["spec"]["template"]["metadata"]["labels"]["team"] == "search"
    assert spec["affinity"]["nodeAffinity"] and spec["topologySpreadConstraints"][0]["whenUnsatisfiable"] == "DoNotSchedule"
    server = container(spec, "server")
    assert {"name": "OMP_NUM_THREADS", "value": "4"} in server["env"]
    assert server["startupProbe"]["periodSeconds"] == 15
    assert {v["name"]: v for v in spec["volumes"]}["shm"]["emptyDir"]["sizeLimit"] == "4Gi"
    assert find(docs, "Service")["spec"]["type"] == "LoadBalancer"
    assert find(docs, "PersistentVolumeClaim")["spec"]["storageClassName"] == "nfs-ro"
    assert not [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("adapter-rules")]


@pytest.mark.parametrize("values_set", sorted(VALUE_SETS))
def test_every_rendered_object_validates_strictly(values_set: str) -> None:
    docs = objects(values_set)
    assert docs, values_set
    for doc in docs:
        assert doc["metadata"].get("namespace") in (None, NAMESPACE)
        for version in KUBE_VERSIONS:
            validate_object(doc, version)


def test_kserve_examples_validate_against_their_schemas() -> None:
    kinds = []
    for path in sorted(KSERVE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            validate_object(doc, KUBE_VERSIONS[0])
            kinds.append(doc["kind"])
    assert sorted(kinds) == ["ClusterStorageContainer", "InferenceService", "ServingRuntime"]


def test_a_validator_refuses_an_unknown_field() -> None:
    """The validators are strict: a misspelt field fails (so the passes above mean something)."""
    bad = deployment()
    bad["spec"]["template"]["spec"]["containers"][0]["readOnlyRootFS"] = True
    with pytest.raises(Exception, match="readOnlyRootFS"):
        validate_object(bad, KUBE_VERSIONS[0])
    monitor = find(objects("default"), "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["intervall"] = "1s"
    with pytest.raises(Exception, match="intervall"):
        validate_object(monitor, KUBE_VERSIONS[0])


@pytest.mark.parametrize("values, path", [
    ({"images": {"server": {"repository": "nvcr.io/nvidia/tritonserver", "digest": "25.10-py3"}}}, "/images/server/digest"),
    ({"gpu": {"count": -1}}, "/gpu/count"),
    ({"gpu": {"product": "NVIDIA H100 80GB HBM3"}}, "/gpu/product"),
    ({"autoscaling": {"mode": "vpa"}}, "/autoscaling/mode"),
    ({"autoscaling": {"targetQueueComputeRatio": "high"}}, "/autoscaling/targetQueueComputeRatio"),
    ({"autoscaling": {"targetQueueComputeRatio": "500m"}}, "/autoscaling/targetQueueComputeRatio"),
    ({"autoscaling": {"targetMeanQueueMicroseconds": "50ms"}}, "/autoscaling/targetMeanQueueMicroseconds"),
    ({"podSecurity": {"runAsUser": 0}}, "/podSecurity/runAsUser"),
    ({"repository": {"source": "nfs"}}, "/repository/source"),
    ({"repository": {"subPath": "../other-tenant"}}, "/repository/subPath"),
    ({"repository": {"image": {"reference": "registry.example.internal/repo:latest"}}}, "/repository/image/reference"),
    ({"ports": {"http": 70000}}, "/ports/http"),
    ({"factory": {"recipes": ["minilm.yaml"]}}, "/factory/recipes/0"),
    ({"serve": {"accept": "yes"}}, "/serve/accept"),
    ({"factory": {"action": "delete"}}, "/factory/action"),
    ({"serve": {"adminKey": {"enabled": True, "value": "short"}}}, "/serve/adminKey/value"),
    ({"openai": {"enabled": "yes"}}, "/openai/enabled"),
    ({"openai": {"port": 0}}, "/openai/port"),
    ({"replicas": 3}, "'replicas' not allowed"),
])
def test_wrong_values_are_refused_with_their_path(values: dict, path: str) -> None:
    errors = schema_errors(values)
    assert errors and path in errors, errors


def test_the_default_values_pass_the_schema() -> None:
    assert schema_errors({}) == ""
    for values in VALUE_SETS.values():
        assert schema_errors(values) == ""


# --------------------------------------------------------------------------- serving pods


def test_every_image_is_pinned_by_digest() -> None:
    for path in sorted(KSERVE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = doc["spec"]
            for c in spec.get("containers", []) + [spec.get("container", {})]:
                assert not c or DIGEST_IMAGE.match(c["image"]), (path.name, c["image"])
    for name in VALUE_SETS:
        for doc in objects(name):
            spec = doc.get("spec", {}).get("template", {}).get("spec")
            if doc["kind"] in ("Deployment", "Job"):
                for c in spec.get("initContainers", []) + spec["containers"]:
                    assert DIGEST_IMAGE.match(c["image"]), (name, c["name"], c["image"])


def test_the_init_container_verifies_the_read_only_repository_with_the_policy_from_the_release() -> None:
    spec = pod()
    verify = container(spec, "verify", init=True)
    assert [c["name"] for c in spec["initContainers"]] == ["verify"]
    assert verify["command"] == ["model-factory", "verify", "--policy", "/etc/model-factory/trust/policy.toml",
                                 "--json", "/models"]
    m = mounts(verify)
    assert m["/models"]["readOnly"] is True and m["/models"]["subPath"] == "NVIDIA-H100-80GB-HBM3/trt-10.13"
    assert m["/etc/model-factory/trust"]["readOnly"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    # The policy comes from the release's ConfigMap, never from the model volume.
    assert volumes["trust"]["projected"]["sources"] == [
        {"configMap": {"name": f"{FULLNAME}-trust-policy", "items": [{"key": "policy.toml", "path": "policy.toml"}]}}]
    assert volumes["models"] == {"name": "models", "persistentVolumeClaim": {
        "claimName": f"{FULLNAME}-repository", "readOnly": True}}
    policy = find(objects("default"), "ConfigMap", f"{FULLNAME}-trust-policy")["data"]["policy.toml"]
    assert 'path = "release.pub"' in policy and "required = true" in policy


def test_trust_files_come_from_a_secret_beside_the_policy() -> None:
    docs = objects("trust-files")
    secret = find(docs, "Secret", f"{FULLNAME}-trust")
    assert list(secret["stringData"]) == ["release.pub"]
    sources = {v["name"]: v for v in find(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]}["trust"]
    assert sources["projected"]["sources"][1] == {"secret": {"name": f"{FULLNAME}-trust"}}
    existing = {v["name"]: v for v in pod("existing-claim")["volumes"]}
    assert existing["trust"]["projected"]["sources"][0]["configMap"]["name"] == "corp-policy"
    assert existing["trust"]["projected"]["sources"][1] == {"secret": {"name": "corp-trust"}}
    assert existing["models"]["persistentVolumeClaim"]["claimName"] == "shared-models"
    assert mounts(container(pod("existing-claim"), "server"))["/models"]["subPath"] == "fleet/a"
    assert not [d for d in objects("existing-claim") if d["kind"] == "PersistentVolumeClaim"
                or d["metadata"]["name"] == f"{FULLNAME}-trust-policy"]


def test_the_server_runs_serve_with_the_same_policy_on_its_gpu_product() -> None:
    server = container(pod(), "server")
    assert server["command"] == [
        "model-factory", "serve", "--host", "0.0.0.0", "--policy", "/etc/model-factory/trust/policy.toml",
        "--http-port", "8000", "--grpc-port", "8001", "--metrics-port", "8002", "--log-verbose", "0",
        "--gpu-product", "NVIDIA-H100-80GB-HBM3", "/models"]
    assert mounts(server)["/models"]["readOnly"] is True
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod()["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    cpu = pod("cpu-only")
    assert "nodeSelector" not in cpu and "--gpu-product" not in container(cpu, "server")["command"]
    assert "nvidia.com/gpu" not in container(cpu, "server")["resources"]["limits"]
    assert "subPath" not in mounts(container(cpu, "server"))["/models"]


def test_accept_and_the_admin_key_switches() -> None:
    spec = pod("admin-and-accept")
    command = container(spec, "server")["command"]
    assert command[-6:] == ["--accept", "--admin-key-file", "/etc/model-factory/admin/admin-key",
                            "--log-verbose", "1", "/models"]
    assert mounts(container(spec, "server"))["/etc/model-factory/admin"]["readOnly"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["admin-key"]["secret"]["secretName"] == f"{FULLNAME}-admin-key"
    assert find(objects("admin-and-accept"), "Secret", f"{FULLNAME}-admin-key")["stringData"] == {"admin-key": "0123456789abcdef-admin"}
    other = {v["name"]: v for v in pod("admin-existing-secret")["volumes"]}
    assert other["admin-key"]["secret"]["secretName"] == "triton-admin"
    assert "--accept" not in container(pod(), "server")["command"]
    # The admin key is a secret: a change rolls the pods like a policy change.
    assert (deployment("admin-and-accept")["spec"]["template"]["metadata"]["annotations"]["checksum/trust"]
            != deployment()["spec"]["template"]["metadata"]["annotations"]["checksum/trust"])


def test_admin_key_enabled_without_a_key_is_refused() -> None:
    from .helm_render import render

    with pytest.raises(Exception, match="serve.adminKey.value"):
        render({"serve": {"adminKey": {"enabled": True}}})


def test_pods_are_non_root_with_a_read_only_root_filesystem_and_memory_shm() -> None:
    for name in ("default", "s3", "factory"):
        for doc in objects(name):
            if doc["kind"] not in ("Deployment", "Job"):
                continue
            spec = doc["spec"]["template"]["spec"]
            assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] > 0
            assert spec["automountServiceAccountToken"] is False
            for c in spec.get("initContainers", []) + spec["containers"]:
                sc = c["securityContext"]
                assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
                assert sc["capabilities"] == {"drop": ["ALL"]}
            volumes = {v["name"]: v for v in spec["volumes"]}
            assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
            assert "/dev/shm" in mounts(spec["containers"][0])


def test_probes_use_triton_health_and_the_startup_probe_covers_verify_load_and_warm_up() -> None:
    server = container(pod(), "server")
    assert server["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert server["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    startup = server["startupProbe"]
    assert startup["httpGet"]["path"] == "/v2/health/ready"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_text_generation_serves_the_openai_api_on_its_own_port_and_probes_it() -> None:
    docs = objects("text-generation")
    spec = find(docs, "Deployment")["spec"]["template"]["spec"]
    server = container(spec, "server")
    command = server["command"]
    assert command[command.index("--openai-port") + 1] == "9100" and command[-1] == "/models"
    factory_cli = pytest.importorskip("model_factory.cli.factory")
    assert "--openai-port" in {o for p in factory_cli.serve.params for o in p.opts}  # an option serve has
    assert {"name": "openai", "containerPort": 9100, "protocol": "TCP"} in server["ports"]
    # Traffic waits for the OpenAI frontend, whose /health is 200 only while Triton is ready; liveness stays
    # Triton's own.
    for probe in ("startupProbe", "readinessProbe"):
        assert server[probe]["httpGet"] == {"path": "/health", "port": "openai"}
    assert server["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    service_ports = {p["name"]: p for p in find(docs, "Service")["spec"]["ports"]}
    assert service_ports["openai"]["port"] == 9100 and service_ports["openai"]["targetPort"] == "openai"
    client = find(docs, "NetworkPolicy")["spec"]["ingress"][0]
    assert [p["port"] for p in client["ports"]] == [8000, 8001, 9100]
    # Off by default: no port, no option.
    default = container(pod(), "server")
    assert "--openai-port" not in default["command"] and "openai" not in {p["name"] for p in default["ports"]}
    assert "openai" not in {p["name"] for p in find(objects("default"), "Service")["spec"]["ports"]}


def test_an_openai_port_shared_with_triton_is_refused() -> None:
    from .helm_render import render

    with pytest.raises(Exception, match="openai.port 8002 is already one of ports"):
        render({"openai": {"enabled": True, "port": 8002}})


def test_topology_spread_pdb_and_rolling_update_keep_capacity() -> None:
    spec = pod()
    spread = spec["topologySpreadConstraints"][0]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["labelSelector"]["matchLabels"] == deployment()["spec"]["selector"]["matchLabels"]
    pdb = find(objects("default"), "PodDisruptionBudget")
    assert pdb["spec"]["selector"] == deployment()["spec"]["selector"] and pdb["spec"]["maxUnavailable"] == 1
    assert deployment()["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert "replicas" not in deployment()["spec"]  # the HPA owns it
    assert deployment("fixed-replicas")["spec"]["replicas"] == 3
    assert not [d for d in objects("fixed-replicas") if d["kind"] in ("PodDisruptionBudget", "HorizontalPodAutoscaler")]


def test_network_policy_allows_client_ports_and_metrics_and_no_egress() -> None:
    policy = find(objects("default"), "NetworkPolicy")
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress", "Egress"] and spec["egress"] == []
    assert spec["podSelector"]["matchLabels"] == deployment()["spec"]["selector"]["matchLabels"]
    client, scrape = spec["ingress"]
    assert [p["port"] for p in client["ports"]] == [8000, 8001] and "from" not in client
    assert [p["port"] for p in scrape["ports"]] == [8002]
    assert scrape["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    only = find(objects("clients-only"), "NetworkPolicy")["spec"]["ingress"][0]
    assert only["from"] == [{"podSelector": {"matchLabels": {"role": "frontend"}}}]
    assert not [d for d in objects("cpu-only") if d["kind"] == "NetworkPolicy"]


def test_s3_source_fetches_into_an_empty_dir_then_verifies() -> None:
    spec = pod("s3")
    assert [c["name"] for c in spec["initContainers"]] == ["fetch", "verify"]
    fetch = container(spec, "fetch", init=True)
    assert fetch["command"] == ["mc", "mirror", "--overwrite", "--remove",
                                "src/models/NVIDIA-H100-80GB-HBM3/trt-10.13", "/models"]
    env = {e["name"]: e for e in fetch["env"]}
    assert env["MC_HOST_src"]["value"] == "https://$(S3_ACCESS_KEY):$(S3_SECRET_KEY)@minio.models.svc:9000"
    assert env["S3_SECRET_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "minio-readonly", "key": "secretKey"}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes["models"]
    assert mounts(container(spec, "verify", init=True))["/models"]["readOnly"] is True
    assert "subPath" not in mounts(container(spec, "server"))["/models"]
    egress = find(objects("s3"), "NetworkPolicy")["spec"]["egress"]
    assert [[p["port"] for p in rule["ports"]] for rule in egress] == [[9000], [53, 53]]


def test_oci_image_volume_source() -> None:
    volumes = {v["name"]: v for v in pod("image-volume")["volumes"]}
    assert volumes["models"]["image"]["reference"].endswith("@sha256:" + "ab" * 32)
    assert not [d for d in objects("image-volume") if d["kind"] == "PersistentVolumeClaim"]


def test_the_repository_claim_is_read_only_many() -> None:
    pvc = find(objects("default"), "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]


# --------------------------------------------------------------------------- autoscaling and monitoring


def test_hpa_targets_the_queue_to_compute_ratio_served_by_the_shipped_adapter_rule() -> None:
    docs = objects("default")
    hpa = find(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}
    metric = hpa["spec"]["metrics"][0]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "triton_queue_compute_ratio"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    rules = yaml.safe_load(find(docs, "ConfigMap", f"{FULLNAME}-prometheus-adapter-rules")["data"]["config.yaml"])
    rule = rules["rules"][0]
    assert rule["name"]["as"] == "triton_queue_compute_ratio"
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    assert "nv_inference_queue_duration_us" in rule["metricsQuery"]
    assert "nv_inference_compute_infer_duration_us" in rule["metricsQuery"]
    assert not [d for d in objects("keda") if d["kind"] == "HorizontalPodAutoscaler"]


def test_the_mean_queue_time_metric_is_on_by_default_and_can_be_turned_off() -> None:
    docs = objects("queue-time")
    metrics = find(docs, "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert [(m["pods"]["metric"]["name"], m["pods"]["target"]["averageValue"]) for m in metrics] == [
        ("triton_queue_compute_ratio", "0.8"), ("triton_mean_queue_us", "50000")]
    rules = yaml.safe_load(find(docs, "ConfigMap", f"{FULLNAME}-prometheus-adapter-rules")["data"]["config.yaml"])
    assert [r["name"]["as"] for r in rules["rules"]] == ["triton_queue_compute_ratio", "triton_mean_queue_us"]
    assert "nv_inference_request_success" in rules["rules"][1]["metricsQuery"]
    triggers = find(objects("keda-queue-time"), "ScaledObject")["spec"]["triggers"]
    assert [t["metadata"]["threshold"] for t in triggers] == ["1", "50000"]
    assert "nv_inference_request_success" in triggers[1]["metadata"]["query"]
    # On by default at half the 300 ms of work models' queues are bounded to; "" turns it off.
    default = find(objects("default"), "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert [(m["pods"]["metric"]["name"], m["pods"]["target"]["averageValue"]) for m in default] == [
        ("triton_queue_compute_ratio", "1"), ("triton_mean_queue_us", "150000")]
    assert len(find(objects("ratio-only"), "HorizontalPodAutoscaler")["spec"]["metrics"]) == 1


def test_keda_scaled_object_queries_the_same_ratio() -> None:
    scaled = find(objects("keda"), "ScaledObject")
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "1"
    query = trigger["metadata"]["query"]
    assert f'namespace="{NAMESPACE}",pod=~"{FULLNAME}-.*"' in query
    assert "nv_inference_queue_duration_us" in query and "nv_inference_compute_infer_duration_us" in query
    assert scaled["spec"]["scaleTargetRef"]["name"] == FULLNAME


def test_service_and_pod_monitors_scrape_the_metrics_port() -> None:
    monitor = find(objects("default"), "ServiceMonitor")
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    service = find(objects("default"), "Service")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"http": 8000, "grpc": 8001, "metrics": 8002}
    docs = objects("pod-monitor")
    assert not [d for d in docs if d["kind"] == "ServiceMonitor"]
    podmon = find(docs, "PodMonitor")
    assert podmon["metadata"]["labels"]["release"] == "prom"
    assert podmon["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


# --------------------------------------------------------------------------- factory Jobs


def test_factory_jobs_are_indexed_over_recipes_one_per_gpu_product() -> None:
    docs = objects("factory")
    jobs = [d for d in docs if d["kind"] == "Job"]
    assert len(jobs) == 2
    products = []
    for job in jobs:
        spec = job["spec"]
        assert spec["completionMode"] == "Indexed" and spec["completions"] == 2
        podspec = spec["template"]["spec"]
        product = podspec["nodeSelector"]["nvidia.com/gpu.product"]
        products.append(product)
        build = podspec["containers"][0]
        env = {e["name"]: e.get("value") for e in build["env"]}
        assert env["FACTORY_RECIPES"] == "minilm.toml bge-small.toml" and env["FACTORY_ACTION"] == "build"
        assert env["FACTORY_GPU_PRODUCT"] == product and env["FACTORY_TENSORRT_VERSION"] == "10.13"
        assert env["FACTORY_POLICY"] == "/etc/model-factory/trust/policy.toml"
        assert "FACTORY_CERT_CHAIN" not in env
        assert build["resources"]["limits"]["nvidia.com/gpu"] == 1
        m = mounts(build)
        assert m["/run/secrets/model-factory"]["readOnly"] is True
        assert m["/workspace/recipes"]["readOnly"] is True and m["/workspace/sources"]["readOnly"] is True
        assert not m["/workspace/repository"].get("readOnly")
        volumes = {v["name"]: v for v in podspec["volumes"]}
        assert volumes["signing-key"]["secret"]["secretName"] == "model-factory-signing-key"
        assert volumes["repository"]["persistentVolumeClaim"]["claimName"] == "model-repository-rw"
        assert len(job["metadata"]["name"]) <= 63
    assert sorted(products) == ["NVIDIA-H100-80GB-HBM3", "NVIDIA-L4"]
    deny = find(docs, "NetworkPolicy", f"{FULLNAME}-factory-deny-all")["spec"]
    assert deny["policyTypes"] == ["Ingress", "Egress"] and deny["ingress"] == [] and deny["egress"] == []
    labels = jobs[0]["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in deny["podSelector"]["matchLabels"].items())
    script = find(docs, "ConfigMap", f"{FULLNAME}-factory-job")["data"]["factory-job.sh"]
    assert script == (CHART / "files" / "factory-job.sh").read_text()
    cert = {e["name"]: e.get("value") for e in find(objects("factory-certificates"), "Job")["spec"]["template"]["spec"]
            ["containers"][0]["env"]}
    assert cert["FACTORY_CERT_CHAIN"] == "/run/secrets/model-factory/cert-chain.pem"
    rollback = [d for d in objects("factory-rollback") if d["kind"] == "Job"]
    assert [j["spec"]["completions"] for j in rollback] == [1]
    assert rollback[0]["metadata"]["name"].startswith(f"{FULLNAME}-rollback-")
    assert {e["name"]: e.get("value") for e in rollback[0]["spec"]["template"]["spec"]["containers"][0]["env"]}[
        "FACTORY_ACTION"] == "rollback"


def test_factory_needs_recipes() -> None:
    from .helm_render import render

    with pytest.raises(Exception, match="factory.recipes"):
        render({"factory": {"enabled": True}})


def test_max_replicas_below_min_is_refused() -> None:
    from .helm_render import render

    with pytest.raises(Exception, match="autoscaling.maxReplicas must be at least autoscaling.minReplicas"):
        render({"autoscaling": {"minReplicas": 4, "maxReplicas": 2}})


def test_the_kubernetes_validate_command_accepts_the_default_rendering(tmp_path) -> None:
    """The CLI itself (``kubernetes-validate --strict -k VERSION``) on the built-in kinds of the default rendering."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from .helm_render import CRD_SCHEMAS

    cli = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent))
    if cli is None:
        pytest.skip("pip install 'model-factory[test]' (kubernetes-validate)")
    docs = [d for d in objects("default") if (d["apiVersion"], d["kind"]) not in CRD_SCHEMAS]
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    for version in KUBE_VERSIONS:
        proc = subprocess.run([cli, "--strict", "-k", version, str(manifest)], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.count("INFO") == len(docs), proc.stdout
    bad = [*docs, {**docs[0], "spek": {}}]
    manifest.write_text(yaml.safe_dump_all(bad))
    proc = subprocess.run([cli, "--strict", "-k", KUBE_VERSIONS[0], str(manifest)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "spek" in proc.stdout + proc.stderr
