"""layerline: one transformer split layer-wise across heterogeneous machines."""
from .errors import LayerlineError

__all__ = ["LayerlineError", "Cluster", "ClusterError", "__version__"]


def __getattr__(name):
    # Cluster pulls in ansible-runner, and the version importlib.metadata and tomllib (0.1 s of every
    # module run on a host that imports this package): each loads only when asked for.
    if name in ("Cluster", "ClusterError"):
        from . import cluster
        return getattr(cluster, name)
    # the version is decided in one place, the package metadata (pyproject.toml's [project] version);
    # layerline.version reads it, and reads pyproject.toml itself in a source checkout never installed
    if name == "__version__":
        from .version import package_version
        return package_version()
    raise AttributeError(name)
