"""The lighthouse (``rallypoint lighthouse``): where replica groups get each step's quorum;
torchft's ``LighthouseServer`` with the same arguments, and ``store=`` for etcd."""

from rallypoint.ft._lighthouse import LighthouseServer

__all__ = ["LighthouseServer"]
