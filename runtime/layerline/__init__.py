"""layerline: one transformer split layer-wise across heterogeneous machines."""
from .errors import LayerlineError
from .version import package_version

# the version is decided in one place, the package metadata (pyproject.toml's [project] version);
# layerline.version reads it, and reads pyproject.toml itself in a source checkout that was never installed
__version__ = package_version()
__all__ = ["LayerlineError", "Cluster", "ClusterError", "__version__"]


def __getattr__(name):
    # Cluster pulls in ansible-runner; load it only when asked for.
    if name in ("Cluster", "ClusterError"):
        from . import cluster
        return getattr(cluster, name)
    raise AttributeError(name)
