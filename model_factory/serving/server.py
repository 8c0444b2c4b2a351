"""``serve``'s public names, from the modules that hold each concern.

- :mod:`.triton_process`: find, start, load into, drain and stop ``tritonserver``;
- :mod:`.verified_start`: verify, check on this machine, then start serving only what passed;
- :mod:`.digests`: the verified-digests table the backend checks its loads against;
- :mod:`.queue_bound`: the queue bound derived on the serving machine;
- :mod:`.metrics_scrape`: what the backends report on the metrics port.
"""

from model_factory.serving.digests import VerifiedDigests, reverify_model
from model_factory.serving.triton_process import (ADMIN_HEADER, ADMIN_KEY_ENV, COST_CACHE_ENV, GPU_PRODUCT_ENV,
                                                  GRPC_ADMIN_HEADER, RESTRICTED_APIS, VERIFIED_DIGESTS_ENV,
                                                  ServerOptions, TritonInstallation, TritonServer, admin_key_from,
                                                  default_cost_cache, discover_models, find_tritonserver, free_port,
                                                  free_ports)
from model_factory.serving.verified_start import ServeReport, start_verified_server

__all__ = ["ADMIN_HEADER", "ADMIN_KEY_ENV", "COST_CACHE_ENV", "GPU_PRODUCT_ENV", "GRPC_ADMIN_HEADER",
           "RESTRICTED_APIS", "VERIFIED_DIGESTS_ENV", "ServeReport", "ServerOptions", "TritonInstallation",
           "TritonServer", "VerifiedDigests", "admin_key_from", "default_cost_cache", "discover_models",
           "find_tritonserver", "free_port", "free_ports", "reverify_model", "start_verified_server"]
