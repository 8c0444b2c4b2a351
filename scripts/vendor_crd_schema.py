#!/usr/bin/env python3
"""Turn a CustomResourceDefinition into the JSON Schema the chart tests validate against (tests/deploy/schemas).

The same transformation as datreeio/CRDs-catalog's openapi2jsonschema: the served version's ``openAPIV3Schema``,
with ``additionalProperties: false`` on every object that lists its ``properties`` and says nothing of
``additionalProperties`` (so an unknown field is refused), written gzipped (``gzip -9n``: byte-stable).

    git -C <mirror> show v1.6.0:config/crd/bases/inference.networking.k8s.io_inferencepools.yaml \\
      | scripts/vendor_crd_schema.py v1 tests/deploy/schemas/inference.networking.k8s.io_inferencepool_v1.json.gz
"""

from __future__ import annotations

import gzip
import json
import sys

import yaml


def strict(node: object) -> object:
    if isinstance(node, dict):
        out = {k: strict(v) for k, v in node.items()}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [strict(v) for v in node]
    return node


def main(version: str, out: str) -> None:
    crd = yaml.safe_load(sys.stdin)
    served = [v for v in crd["spec"]["versions"] if v["name"] == version and v.get("served")]
    if not served:
        raise SystemExit(f"{crd['metadata']['name']} serves no version {version}")
    schema = strict(served[0]["schema"]["openAPIV3Schema"])
    with open(out, "wb") as f:
        f.write(gzip.compress(json.dumps(schema, indent=2, sort_keys=True).encode() + b"\n", 9, mtime=0))


if __name__ == "__main__":
    main(*sys.argv[1:3])
