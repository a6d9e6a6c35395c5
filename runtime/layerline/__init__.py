"""layerline: one transformer split layer-wise across heterogeneous machines."""
from .errors import LayerlineError

__version__ = "0.1.0"
__all__ = ["LayerlineError", "Cluster", "ClusterError", "__version__"]


def __getattr__(name):
    # Cluster pulls in ansible-runner; load it only when asked for.
    if name in ("Cluster", "ClusterError"):
        from . import cluster
        return getattr(cluster, name)
    raise AttributeError(name)
