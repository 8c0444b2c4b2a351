"""Build: the pipeline that composes the stages (export → quantize → engines → package), and packaging
into a Triton repository (config.pbtxt through Triton's protobuf, metadata.json, the version folder)."""
