"""Pooling models: embeddings, classification and cross-encoder scores from one prefill-only forward."""

from tidal_engine.pooling.params import PoolingParams, PoolingTask

__all__ = ["PoolingParams", "PoolingTask"]
