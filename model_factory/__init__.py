"""model-factory: turn a model into a signed, fast Triton deployment, offline.

Layers, from the bottom up:

* ``model_factory.recipe`` parses one TOML recipe into frozen dataclasses; every
  stage receives the part it needs.
* ``model_factory.build_engines`` holds the artifact stages: export (HF / torch /
  ONNX to ONNX), quantize (FP16, INT8 Q/DQ), accuracy (report and gate) and
  tensorrt (strongly typed engine builds).
* ``model_factory.build.repository`` lays out a Triton model repository and writes
  ``config.pbtxt`` through Triton's protobuf schema.
* ``model_factory.signing`` signs and verifies repositories offline.
* ``model_factory.serving`` starts a real ``tritonserver`` on what verified (``serving.server`` names it).
* ``model_factory.backend`` is the code that runs inside Triton's Python backend.
* ``model_factory.cli`` is a thin click layer over all of the above.

Heavy dependencies (torch, onnxruntime, tensorrt, cuda) are imported where they
are used; the package itself imports without them.
"""

__version__ = "0.1.0"
