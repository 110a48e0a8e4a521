"""`tidal dev`'s local control plane: an emulated API server, a local kubelet and a kubeconfig.

No torch, no cluster: everything runs on loopback. See docs/dev-control-plane.md.
"""

from .apiserver import ApiServer, ApiServerHandle, ApiServerThread, start_apiserver
from .kubeconfig import kubeconfig_dict, write_kubeconfig
from .kubelet import LocalKubelet

__all__ = [
    "ApiServer", "ApiServerHandle", "ApiServerThread", "LocalKubelet", "kubeconfig_dict", "start_apiserver",
    "write_kubeconfig",
]
