"""Render the Helm chart with the real Helm engine (helm-python-sdk embeds Helm v4's library), once per values set.

Also: validation of rendered objects (built-in kinds with kubernetes-validate --strict, custom
resources against the CRD schemas vendored in ``schemas/``), and the documented values sets.
"""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "model-factory"
KSERVE = ROOT / "deploy" / "kserve"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
RELEASE, NAMESPACE = "mf", "models"
FULLNAME = "mf-model-factory"

# At least two Kubernetes minor versions (OCI image volumes need 1.33 or later).
KUBE_VERSIONS = ("1.33.0", "1.35.0")

# Custom resources -> their published schema (datreeio/CRDs-catalog, see schemas/SOURCES.md).
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitor_v1.json.gz",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitor_v1.json.gz",
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobject_v1alpha1.json.gz",
    ("serving.kserve.io/v1beta1", "InferenceService"): "serving.kserve.io_inferenceservice_v1beta1.json.gz",
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "serving.kserve.io_servingruntime_v1alpha1.json.gz",
    ("serving.kserve.io/v1alpha1", "ClusterStorageContainer"): "serving.kserve.io_clusterstoragecontainer_v1alpha1.json.gz",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "gateway.networking.k8s.io_httproute_v1.json.gz",
    ("gateway.networking.k8s.io/v1", "GRPCRoute"): "gateway.networking.k8s.io_grpcroute_v1.json.gz",
    # The Gateway API Inference Extension (schemas/SOURCES.md: its v1.6.0 release, llm-d-router v0.10.0).
    ("inference.networking.k8s.io/v1", "InferencePool"): "inference.networking.k8s.io_inferencepool_v1.json.gz",
    ("llm-d.ai/v1alpha2", "InferenceObjective"): "llm-d.ai_inferenceobjective_v1alpha2.json.gz",
    ("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective"):
        "inference.networking.x-k8s.io_inferenceobjective_v1alpha2.json.gz",
}

DIGEST = "sha256:" + "ab" * 32
# An EndpointPickerConfig of one's own (inferencePool.endpointPicker.pluginsConfig).
PICKER_CONFIG = """apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: metrics-data-source
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
"""
# Every documented option (values.yaml, docs/fleet.md), each rendered once per test session.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "keda": {"autoscaling": {"mode": "keda"}},
    "queue-time": {"autoscaling": {"targetMeanQueueMicroseconds": "50000", "targetQueueComputeRatio": "0.8"}},
    "keda-queue-time": {"autoscaling": {"mode": "keda", "targetMeanQueueMicroseconds": "50000"}},
    "ratio-only": {"autoscaling": {"targetMeanQueueMicroseconds": ""}},
    "fixed-replicas": {"autoscaling": {"mode": "none"}, "replicaCount": 3, "podDisruptionBudget": {"enabled": False}},
    "pod-monitor": {"metrics": {"serviceMonitor": {"enabled": False}, "podMonitor": {"enabled": True,
                                                                                      "labels": {"release": "prom"}}}},
    "image-volume": {"repository": {"source": "image", "image": {
        "reference": f"registry.example.internal/model-factory/repository@{DIGEST}"}}},
    "s3": {"repository": {"source": "s3", "s3": {"endpoint": "https://minio.models.svc:9000", "bucket": "models"}}},
    "oci": {"repository": {"source": "oci", "oci": {
        "references": ["oci://registry.models.svc:5000/models/minilm:1", "oci://registry.models.svc:5000/models/bge:3"],
        "caSecret": "registry-ca", "credentialsSecret": "registry-pull"}}},
    "existing-claim": {"repository": {"pvc": {"existingClaim": "shared-models"}, "subPath": "fleet/a"},
                       "trust": {"existingConfigMap": "corp-policy", "existingSecret": "corp-trust"}},
    "trust-files": {"trust": {"files": {"release.pub": "-----BEGIN PUBLIC KEY-----\nMFkw\n-----END PUBLIC KEY-----\n"}}},
    "admin-and-accept": {"serve": {"accept": True, "adminKey": {"enabled": True, "value": "0123456789abcdef-admin"},
                                   "extraArgs": ["--log-verbose", "1"]}},
    "admin-existing-secret": {"serve": {"adminKey": {"enabled": True, "existingSecret": "triton-admin"}}},
    "cpu-only": {"gpu": {"count": 0}, "networkPolicy": {"enabled": False}},
    # A text-generation fleet: the OpenAI API beside Triton (docs/fleet.md, docs/generation.md).
    "text-generation": {"openai": {"enabled": True, "port": 9100}, "serve": {"accept": True}},
    "clients-only": {"networkPolicy": {"clients": [{"podSelector": {"matchLabels": {"role": "frontend"}}}]},
                     "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
    "pod-extras": {"imagePullSecrets": [{"name": "registry-internal"}], "podLabels": {"team": "search"},
                   "podAnnotations": {"example.com/owner": "search"}, "nodeSelector": {"pool": "inference"},
                   "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1,
                       "preference": {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}}]}},
                   "service": {"type": "LoadBalancer", "annotations": {"example.com/internal": "true"}},
                   "serve": {"env": [{"name": "OMP_NUM_THREADS", "value": "4"}], "logVerbose": 1, "shmSize": "4Gi"},
                   "repository": {"pvc": {"storageClassName": "nfs-ro", "size": "200Gi"}},
                   "autoscaling": {"adapterRules": False, "minReplicas": 3, "maxReplicas": 3},
                   "topologySpread": {"whenUnsatisfiable": "DoNotSchedule", "topologyKey": "topology.kubernetes.io/zone"},
                   "probes": {"startup": {"periodSeconds": 15, "failureThreshold": 80}},
                   "podDisruptionBudget": {"maxUnavailable": "25%"}, "fullnameOverride": "encoders"},
    "factory": {"factory": {"enabled": True, "recipes": ["minilm.toml", "bge-small.toml"],
                            "gpuProducts": ["NVIDIA-H100-80GB-HBM3", "NVIDIA-L4"]}},
    "factory-certificates": {"factory": {"enabled": True, "recipes": ["minilm.toml"], "certificateMode": True}},
    "release-emptydir": {"release": {"enabled": True, "root": '{"signed": {"_type": "root"}}', "minVersion": 3}},
    "oci-release": {"repository": {"source": "oci", "oci": {"references": ["oci://registry.models.svc:5000/models/minilm:2"]}},
                    "release": {"enabled": True, "root": '{"signed": {"_type": "root"}}'}},
    "release-shared-claim": {"release": {"enabled": True, "root": '{"signed": {"_type": "root"}}',
                                         "state": {"type": "persistentVolumeClaim", "existingClaim": "release-state"}},
                             "factory": {"enabled": True, "recipes": ["minilm.toml"]}},
    "factory-rollback": {"factory": {"enabled": True, "recipes": ["minilm.toml", "bge-small.toml"],
                                     "action": "rollback"}},
    # Canary upgrades (docs/fleet.md, "Canary upgrades"): one set per repository source, and the Gateway API split.
    "canary": {"canary": {"enabled": True, "repository": {"subPath": "releases/8/NVIDIA-H100-80GB-HBM3/trt-10.13"}}},
    "canary-image-keda": {"repository": {"source": "image", "image": {
                              "reference": f"registry.example.internal/model-factory/repository@{DIGEST}"}},
                          "canary": {"enabled": True, "repository": {"image": {
                              "reference": f"registry.example.internal/model-factory/repository@sha256:{'cd' * 32}"}}},
                          "autoscaling": {"mode": "keda"},
                          "metrics": {"serviceMonitor": {"enabled": False}, "podMonitor": {"enabled": True}},
                          "release": {"enabled": True, "root": '{"signed": {"_type": "root"}}',
                                      "state": {"type": "persistentVolumeClaim", "existingClaim": "release-state"}}},
    "canary-s3-fixed": {"repository": {"source": "s3", "s3": {"endpoint": "https://minio.models.svc:9000",
                                                               "bucket": "models"}},
                        "canary": {"enabled": True, "replicas": 2,
                                   "repository": {"s3": {"prefix": "releases/8/NVIDIA-H100-80GB-HBM3/trt-10.13"}}},
                        "autoscaling": {"mode": "none"}, "replicaCount": 4},
    "canary-oci": {"repository": {"source": "oci", "oci": {"references": ["oci://registry.models.svc:5000/models/minilm:1"]}},
                   "canary": {"enabled": True, "repository": {"oci": {
                       "references": ["oci://registry.models.svc:5000/models/minilm:2"]}}}},
    "canary-gateway": {"canary": {"enabled": True, "replicas": 3,
                                  "repository": {"subPath": "releases/8/NVIDIA-H100-80GB-HBM3/trt-10.13"},
                                  "traffic": {"split": "gateway", "gateway": {
                                      "weight": 20, "hostnames": ["models.example.internal"],
                                      "parentRefs": [{"name": "inference", "namespace": "gateways", "sectionName": "http"}],
                                      "grpc": {"parentRefs": [{"name": "inference", "namespace": "gateways",
                                                               "sectionName": "grpc"}]}}}},
                       "openai": {"enabled": True, "port": 9100}},
    # LLM fleets behind the Gateway API Inference Extension (docs/fleet.md, "LLM fleets behind an InferencePool").
    "inference-pool": {"openai": {"enabled": True, "port": 9100}, "metrics": {"openaiPort": True},
                       "inferencePool": {"enabled": True,
                                         "objectives": [{"name": "llama-3-8b", "priority": 0},
                                                        {"name": "contract-review", "priority": 10}],
                                         "httpRoute": {"parentRefs": [{"name": "inference", "namespace": "gateways",
                                                                       "sectionName": "http"}],
                                                       "hostnames": ["llm.example.internal"]}}},
    "inference-pool-legacy-ha": {"openai": {"enabled": True},
                                 "metrics": {"openaiPort": True, "serviceMonitor": {"enabled": False},
                                             "podMonitor": {"enabled": True}},
                                 "networkPolicy": {"clients": [{"podSelector": {"matchLabels": {"role": "gateway"}}}]},
                                 "canary": {"enabled": True, "repository": {"subPath": "releases/8/x"}},
                                 "inferencePool": {"enabled": True, "failureMode": "FailOpen",
                                                   "objectiveApiVersion": "inference.networking.x-k8s.io/v1alpha2",
                                                   "objectives": [{"name": "tiny-llm"}],
                                                   "httpRoute": {"parentRefs": [{"name": "inference"}],
                                                                 "requestTimeout": ""},
                                                   "endpointPicker": {"replicas": 2, "flags": {"v": 2},
                                                                      "pluginsConfig": PICKER_CONFIG}}},
    "canary-gateway-http-only": {"canary": {"enabled": True, "repository": {"subPath": "releases/8/x"},
                                            "traffic": {"split": "gateway", "gateway": {
                                                "weight": 0, "parentRefs": [{"name": "inference"}]}}}},
}


@functools.lru_cache(maxsize=None)
def _chart():
    helm = pytest.importorskip("helm_python.chart", reason="pip install 'model-factory[test]' (helm-python-sdk)")
    return helm, helm.Chart.load(CHART)


def render(values: dict[str, Any]) -> dict[str, str]:
    """template path -> rendered YAML, by the real Helm engine (values are checked against values.schema.json)."""
    _helm, chart = _chart()
    return chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)


@functools.lru_cache(maxsize=None)
def _render_set(name: str) -> str:
    return json.dumps(render(VALUE_SETS[name]))


def objects(name: str) -> list[dict]:
    """Every object rendered for one values set (a fresh copy: tests may edit it)."""
    out = []
    for text in json.loads(_render_set(name)).values():
        out += [d for d in yaml.safe_load_all(text) if d]
    return out


def find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    hits = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(hits) == 1, f"{len(hits)} {kind} objects named {name}"
    return hits[0]


def write_projected(docs: list[dict], vol: dict, folder: Path) -> None:
    """Write a projected volume's ConfigMap items and Secret entries into ``folder``, as the kubelet would."""
    for source in vol.get("projected", {}).get("sources", []):
        if "configMap" in source:
            data = find(docs, "ConfigMap", source["configMap"]["name"])["data"]
            for item in source["configMap"]["items"]:
                (folder / item["path"]).write_text(data[item["key"]])
        if "secret" in source:
            for name, text in find(docs, "Secret", source["secret"]["name"])["stringData"].items():
                (folder / name).write_text(text)


def schema_errors(values: dict[str, Any]) -> str:
    """Helm's values.schema.json verdict on ``values`` merged over the defaults ('' when accepted)."""
    helm, chart = _chart()
    try:
        chart.validate_schema(values)
    except Exception as exc:  # HelmValuesError, from the native library
        return str(exc)
    return ""


@functools.lru_cache(maxsize=None)
def crd_schema(file: str) -> dict:
    return json.loads(gzip.decompress((SCHEMAS / file).read_bytes()))


def validate_object(doc: dict, kube_version: str) -> None:
    """kubernetes-validate --strict for built-in kinds; the vendored CRD schema for custom resources."""
    key = (doc["apiVersion"], doc["kind"])
    if key in CRD_SCHEMAS:
        jsonschema = pytest.importorskip("jsonschema")
        jsonschema.validate(doc, crd_schema(CRD_SCHEMAS[key]))
        return
    kv = pytest.importorskip("kubernetes_validate", reason="pip install 'model-factory[test]' (kubernetes-validate)")
    kv.validate(doc, kube_version, strict=True)
