"""Tidal's Kubernetes operator: the LLMService API, its reconciliation into engine Pods,
the router, and the local control plane used for development and end-to-end tests.

This package must never import torch: the operator runs in a small image of its own.
"""

__version__ = "0.1.0"
